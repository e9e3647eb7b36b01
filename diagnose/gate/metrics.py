"""One metric of two records, and the verdict on it: :class:`MetricComparison`, and the
judgement of a timing metric from its raw per-step samples (:func:`compare_samples`, against
several baselines :func:`compare_runs`).

How a timing metric (s/it, each phase) is judged, on the raw per-step samples of each record:

- **Significance**: a two-sided Mann–Whitney U test (exact distribution when there are no ties
  and both sides have at most :data:`EXACT_MAX_SAMPLES` steps; otherwise the normal approximation
  with tie and continuity corrections). It is rank based, so the slow outlier steps that shared
  runners produce move it far less than they move a t-test, and it assumes no distribution shape.
  This is asv's test (asv uses p < 0.002 on its many repeats; we default to 0.01 because a CI run
  has 8-50 steps, not hundreds of repeats: see :data:`DEFAULT_SIGNIFICANCE`).
- **Confidence interval** of the ratio current / baseline: the Hodges–Lehmann interval that
  inverts the same U test (order statistics of all pairwise log-ratios), at confidence
  ``1 - significance``.
- **Size**: ``threshold`` (10% by default, as CodSpeed and asv's 1.1 factor; TorchBench flags 7%)
  is the slowdown the gate is built to catch. A change is a regression when it is significant AND
  could be that large: the ratio of medians or the upper end of its interval reaches
  ``1 + threshold``. Judging by the point estimate alone (asv's rule) catches a slowdown of exactly
  the threshold only half the time, since its estimate lands under it half the time; with the
  interval, a true +10% is caught in >= 99% of trials at the default 30 steps on recorded quiet
  noise, and a real change that the data pins under the threshold (interval wholly inside it)
  passes as *same*. A big but noisy change is not a failure: when the test is not significant
  and the interval still reaches beyond the threshold, the data cannot rule a regression in or
  out, and the verdict is *inconclusive (too much spread)*.
- **Too few samples**: when even total separation of the two samples could not reach the
  significance level (the exact test's smallest p-value, ``2 / C(m+n, m)``, is not below it), the
  verdict is *inconclusive (too few samples)* and says how many steps each side needs.

Phases are judged the same way, at ``significance / number of phases`` (Bonferroni: nine phases
tested at 1% each would false-alarm about nine times as often as one), and a phase change must
also be worth at least ``phase_floor`` of the baseline step time: 60 µs of host-device copy
growing by half is noise, not a regression.

Peak memory and device time per kernel class are single numbers per record: they are judged by
the threshold alone, and every output says so.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from diagnose.stats import (
    mann_whitney_u,
    minimum_samples,
    ratio_interval,
    shift_interval,
    smallest_p_value,
)
from diagnose.units import pct_change, seconds_significant

Verdict = Literal[
    "faster", "same", "slower", "larger", "smaller", "lower", "higher", "inconclusive"
]
MetricKind = Literal["step", "phase", "memory", "kernel_class", "utilisation"]
Unit = Literal["seconds", "bytes", "fraction"]


@dataclass(frozen=True)
class MetricComparison:
    """One metric of the two records, and the verdict on it."""

    #: Stable key: "step", "phase.forward", "memory.peak_rss_bytes", "kernel_class.gemm",
    #: "utilisation.mfu".
    key: str
    kind: MetricKind
    #: "s/it", "forward", "peak host memory (RSS)", "kernel class gemm".
    label: str
    unit: Unit
    verdict: Verdict
    #: One line: why this verdict (the numbers that decided it).
    reason: str
    #: Baseline and current medians (samples) or values (single numbers); None = not measured.
    baseline: float | None = None
    current: float | None = None
    #: current / baseline, None when the baseline is zero or missing.
    ratio: float | None = None
    n_baseline: int = 0
    n_current: int = 0
    #: Mann–Whitney p-value (None for single numbers and too few samples).
    p_value: float | None = None
    #: The significance level this metric was tested at (phases: Bonferroni-corrected).
    significance: float | None = None
    #: Confidence interval of the ratio at 1 - significance, None when not finite.
    ci_low: float | None = None
    ci_high: float | None = None
    #: "Mann–Whitney U (exact)", "single number: threshold only".
    method: str = ""
    #: IQR / median of each side's samples (None for single numbers).
    baseline_spread: float | None = None
    current_spread: float | None = None

    @property
    def regressed(self) -> bool:
        return self.verdict in ("slower", "larger", "lower")

    @property
    def change(self) -> float | None:
        """Relative change (ratio - 1), or None."""
        return None if self.ratio is None else self.ratio - 1.0


def _drift(medians: Sequence[float | None]) -> float | None:
    """Slowest / fastest - 1 of the measured medians; None with fewer than two."""
    measured = [m for m in medians if m is not None]
    if len(measured) < 2 or min(measured) <= 0:
        return None
    return max(measured) / min(measured) - 1


def _spread(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    median = statistics.median(values)
    return (q3 - q1) / median if median > 0 else None


def _p(p: float) -> str:
    return f"p={p:.2g}" if p >= 1e-4 else "p<0.0001"


def compare_samples(
    baseline: Sequence[float],
    current: Sequence[float],
    *,
    key: str,
    kind: MetricKind,
    label: str,
    threshold: float,
    significance: float,
    floor_seconds: float | None = None,
) -> MetricComparison:
    """Judge one timing metric from its raw per-step samples (see the module docstring)."""
    m, n = len(baseline), len(current)
    base = dict(key=key, kind=kind, label=label, unit="seconds", n_baseline=m, n_current=n)
    if not m or not n:
        missing = " and ".join(
            side for side, count in (("baseline", m), ("current", n)) if not count
        )
        return MetricComparison(
            **base,  # type: ignore[arg-type]
            verdict="inconclusive",
            reason=f"not measured in the {missing} record",
            baseline=statistics.median(baseline) if m else None,
            current=statistics.median(current) if n else None,
            significance=significance,
        )
    med_a, med_b = statistics.median(baseline), statistics.median(current)
    ratio = med_b / med_a if med_a > 0 else None
    common = dict(
        base,
        baseline=med_a,
        current=med_b,
        ratio=ratio,
        significance=significance,
        baseline_spread=_spread(baseline),
        current_spread=_spread(current),
    )
    if smallest_p_value(m, n) >= significance:
        need = minimum_samples(significance)
        return MetricComparison(
            **common,  # type: ignore[arg-type]
            verdict="inconclusive",
            reason=(
                f"too few samples ({m} baseline, {n} current steps): at significance "
                f"{significance:.2g} no difference could be significant; need at least {need} "
                "steps on each side"
            ),
            method="Mann–Whitney U",
        )
    test = mann_whitney_u(baseline, current)
    interval = ratio_interval(baseline, current, significance)
    ci_low, ci_high = interval if interval is not None else (None, None)
    upper, lower = 1 + threshold, 1 / (1 + threshold)
    significant = test.p_value < significance
    delta = med_b - med_a
    material_up = floor_seconds is None or delta >= floor_seconds
    material_down = floor_seconds is None or -delta >= floor_seconds
    beyond_up = ratio >= upper if ratio is not None else delta > 0
    beyond_down = ratio <= lower if ratio is not None else delta < 0
    # The threshold is the change the gate must catch, so a significant change counts when its
    # interval reaches the threshold, not only when its point estimate does: with the estimate
    # alone, a true slowdown of exactly the threshold would be caught half the time.
    reaches_up = beyond_up or (ci_high is not None and ci_high >= upper and delta > 0)
    reaches_down = beyond_down or (ci_low is not None and ci_low <= lower and delta < 0)
    change = (
        pct_change(ratio - 1)
        if ratio is not None
        else f"{'+' if delta >= 0 else ''}{seconds_significant(delta)}"
    )
    ci_text = (
        f", CI {pct_change(ci_low - 1)}…{pct_change(ci_high - 1)}"
        if ci_low is not None and ci_high is not None
        else ""
    )
    stats_text = f"{change} ({_p(test.p_value)}{ci_text})"
    within_band = (
        ci_low is not None and ci_high is not None and lower <= ci_low and ci_high <= upper
    )
    # A phase whose whole interval is worth less than the floor is immaterial either way.
    shift = shift_interval(baseline, current, significance) if floor_seconds is not None else None
    negligible = (
        floor_seconds is not None
        and shift is not None
        and max(abs(shift[0]), abs(shift[1])) < floor_seconds
    )
    identical = min(baseline) == max(baseline) == min(current) == max(current)
    method = f"Mann–Whitney U ({test.method})"
    verdict: Verdict
    if significant and reaches_up and material_up:
        verdict = "slower"
        reason = (
            f"{stats_text}: significant and beyond +{threshold:.0%}"
            if beyond_up
            else f"{stats_text}: significantly slower, and the interval reaches +{threshold:.0%}"
            " (a slowdown of the threshold is not ruled out)"
        )
    elif significant and reaches_down and material_down:
        verdict = "faster"
        reason = (
            f"{stats_text}: significant and beyond −{threshold:.0%}"
            if beyond_down
            else f"{stats_text}: significantly faster, and the interval reaches −{threshold:.0%}"
        )
    elif identical:
        verdict, reason = "same", f"{stats_text}: every step took the same time on both sides"
    elif within_band:
        verdict = "same"
        if significant:
            reason = f"{stats_text}: a real change, under the ±{threshold:.0%} threshold"
        else:
            reason = f"{stats_text}: within ±{threshold:.0%}"
    elif negligible:
        verdict = "same"
        reason = (
            f"{stats_text}: under the floor of {seconds_significant(floor_seconds or 0.0)} per step"
        )
    elif significant:
        verdict = "same"
        if beyond_up or beyond_down:
            reason = (
                f"{stats_text}: significant but {seconds_significant(abs(delta))} per step is "
                "under the "
                f"floor of {seconds_significant(floor_seconds or 0.0)}"
            )
        else:
            reason = f"{stats_text}: a real change, under the ±{threshold:.0%} threshold"
    else:
        spreads = ", ".join(
            f"{side} IQR {value:.0%} of median"
            for side, value in (
                ("baseline", common["baseline_spread"]),
                ("current", common["current_spread"]),
            )
            if isinstance(value, float)
        )
        verdict = "inconclusive"
        reason = (
            f"too much spread: {stats_text} reaches beyond ±{threshold:.0%} and is not "
            f"significant at {significance:.2g} ({spreads}); rerun with more steps on a quieter "
            "machine"
        )
    return MetricComparison(
        **common,  # type: ignore[arg-type]
        verdict=verdict,
        reason=reason,
        p_value=test.p_value,
        ci_low=ci_low,
        ci_high=ci_high,
        method=method,
    )


def compare_runs(
    baseline_runs: Sequence[Sequence[float]],
    current: Sequence[float],
    *,
    baseline_labels: Sequence[str],
    key: str,
    kind: MetricKind,
    label: str,
    threshold: float,
    significance: float,
    floor_seconds: float | None = None,
) -> MetricComparison:
    """Judge a timing metric against one or several baseline runs (see :func:`compare_records`).

    The baseline runs' samples are pooled for the test. With several runs, a *slower* (*faster*)
    verdict must hold against the slowest (fastest) baseline run alone as well; otherwise the
    change is within the drift between the baselines and the verdict is *inconclusive*.
    """
    pooled = [x for run in baseline_runs for x in run]
    judge = functools.partial(
        compare_samples,
        key=key,
        kind=kind,
        label=label,
        threshold=threshold,
        significance=significance,
        floor_seconds=floor_seconds,
    )
    metric = judge(pooled, current)
    measured = [
        (name, run) for name, run in zip(baseline_labels, baseline_runs, strict=True) if run
    ]
    if len(measured) < 2 or metric.verdict not in ("slower", "faster"):
        return metric
    slower = metric.verdict == "slower"
    pick = (max if slower else min)(measured, key=lambda item: statistics.median(item[1]))
    alone = judge(pick[1], current)
    extreme = "slowest" if slower else "fastest"
    change = pct_change(alone.ratio - 1) if alone.ratio is not None else "—"
    p_text = f", {_p(alone.p_value)}" if alone.p_value is not None else ""
    versus = f"the {extreme} baseline alone ({pick[0]}: {alone.verdict}, {change}{p_text})"
    if alone.verdict == metric.verdict:
        return replace(metric, reason=f"{metric.reason}; also against {versus}")
    spread = _drift([statistics.median(run) for _, run in measured])
    between = f" ({pct_change(spread)} between them)" if spread is not None else ""
    return replace(
        metric,
        verdict="inconclusive",
        reason=(
            f"{metric.verdict} than the pooled baselines ({metric.reason}), but not against "
            f"{versus}: within the run-to-run drift the baselines show{between}"
        ),
    )


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
