"""The metrics two records yield: which steps to compare, s/it and each phase (judged on their
samples), and the single numbers, peak memory and device time per kernel class (judged by the
threshold alone)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence

from diagnose.contention import describe
from diagnose.gate.metrics import (
    MetricComparison,
    MetricKind,
    Unit,
    Verdict,
    _finite,
    compare_runs,
)
from diagnose.gate.options import CompareOptions
from diagnose.record import PHASE_LABELS, PHASES, HostLoad, RunRecord, StepSample
from diagnose.record_io import is_valid_step_time
from diagnose.roofline.utilisation import mfu_against
from diagnose.units import pct_change, seconds_significant


def _comparable_samples(
    baselines: Sequence[RunRecord], current: RunRecord
) -> tuple[list[list[StepSample]], list[StepSample], str, str]:
    """The steps to compare (one list per baseline, and the current's): unprofiled on every side,
    else profiled on every side (with a note).

    Never one side profiled against another unprofiled: the profiler's overhead (often 10-50%)
    would read as a regression.
    """

    invalid = 0

    def split(record: RunRecord) -> tuple[list[StepSample], list[StepSample]]:
        nonlocal invalid
        samples = [s for s in record.timing.samples if is_valid_step_time(s.seconds)]
        invalid += len(record.timing.samples) - len(samples)
        return [s for s in samples if not s.profiled], [s for s in samples if s.profiled]

    base_split = [split(record) for record in baselines]
    cur_plain, cur_prof = split(current)
    empty: list[list[StepSample]] = [[] for _ in baselines]
    dropped = (
        f"{invalid} step{'s' if invalid != 1 else ''} with no valid time (not a finite, "
        "positive number of seconds) left out. "
        if invalid
        else ""
    )
    if cur_plain and all(plain for plain, _ in base_split):
        return [plain for plain, _ in base_split], cur_plain, "unprofiled", dropped.strip()
    if not cur_plain and not any(plain for plain, _ in base_split):
        if cur_prof and all(prof for _, prof in base_split):
            return (
                [prof for _, prof in base_split],
                cur_prof,
                "profiled",
                dropped + "No record has unprofiled steps: profiled steps are compared (all "
                "include the profiler's overhead).",
            )
        return empty, [], "unprofiled", dropped.strip()
    lacking = "the current record" if not cur_plain else "a baseline record"
    return (
        empty,
        [],
        "unprofiled",
        dropped + f"{lacking.capitalize()} has no unprofiled steps and another record has: "
        "profiled and unprofiled steps are not compared (the profiler's overhead would read as "
        "a change).",
    )


def _compare_step(
    base_runs: list[list[StepSample]],
    cur: list[StepSample],
    samples_kind: str,
    options: CompareOptions,
    names: Sequence[str],
) -> MetricComparison:
    return compare_runs(
        [[s.seconds for s in run] for run in base_runs],
        [s.seconds for s in cur],
        baseline_labels=names,
        key="step",
        kind="step",
        label="s/it" if samples_kind == "unprofiled" else "s/it (profiled steps)",
        threshold=options.threshold,
        significance=options.significance,
    )


def judged_against_load(
    metric: MetricComparison, baselines: Sequence[RunRecord], current: RunRecord
) -> MetricComparison:
    """A timing change the machine's load could explain is inconclusive, not a verdict; one
    beyond what the measured load allows stands.

    Two records are two runs, so the load on either side shifts its times directly. A slowdown
    is a regression when even its low end is beyond what the current run's load could add over
    the least the baselines' loads added: others holding a share ``s`` of the cores slow a run by
    up to ``1 / (1 - s)``, at the current run's busiest tenth against the baselines' quietest, so
    a load both sides carried alike explains nothing of the difference between them. A speed-up
    likewise, the busiest baseline's load against the current run's quietest. Quiet records are
    left as judged.
    """
    if metric.kind not in ("step", "phase") or metric.verdict not in ("slower", "faster"):
        return metric
    current_load = current.timing.host_load
    loads = [r.timing.host_load for r in baselines if r.timing.host_load is not None]
    if metric.verdict == "slower":
        load = current_load
        others = [_quietest_share(item) for item in loads] if len(loads) == len(baselines) else []
        slowed_least = min(others, default=0.0)
        sure_ratio, side = metric.ci_low, "current"
    else:
        load = max(loads, key=lambda item: item.competing_share, default=None)
        slowed_least = _quietest_share(current_load) if current_load is not None else 0.0
        sure_ratio = None if metric.ci_high is None else 1 / metric.ci_high
        side = "a baseline"
    if load is None or not load.contended:
        return metric
    explained = max(1.0, (1 - slowed_least) / (1 - load.competing_share))
    if sure_ratio is not None and sure_ratio > explained:
        return dataclasses.replace(
            metric,
            reason=(
                f"{metric.reason}; the {side} run's machine was busy ({describe(load)}), but "
                f"the load could explain at most {pct_change(explained - 1)} against the other "
                "side's"
            ),
        )
    return dataclasses.replace(
        metric,
        verdict="inconclusive",
        reason=(
            f"{metric.reason}; but the {side} run's machine was busy ({describe(load)}): a "
            f"change of up to {pct_change(explained - 1)} could be the load. Rerun on an idle "
            "machine"
        ),
    )


def _quietest_share(load: HostLoad) -> float:
    """The share of the cores others held in a window's quietest tenth: the least its load can
    have slowed what was timed in it."""
    return max(0.0, load.competing_share - load.allowance)


def _phase_keys(samples: Iterable[StepSample]) -> set[str]:
    return {k for s in samples for k in s.phases}


def _compare_phases(
    base_runs: list[list[StepSample]],
    cur: list[StepSample],
    base_step: float | None,
    options: CompareOptions,
    names: Sequence[str],
) -> list[MetricComparison]:
    keys = _phase_keys(s for run in base_runs for s in run) | _phase_keys(cur)
    ordered = [p for p in PHASES if p in keys] + sorted(keys - set(PHASES))
    if not ordered:
        return []
    significance = options.significance / len(ordered)  # Bonferroni over the phases
    floor = options.phase_floor * base_step if base_step else None
    out = []
    for phase in ordered:
        a = [[s.phases[phase] for s in run if _finite(s.phases.get(phase))] for run in base_runs]
        b = [s.phases[phase] for s in cur if _finite(s.phases.get(phase))]
        out.append(
            compare_runs(
                a,
                b,
                baseline_labels=names,
                key=f"phase.{phase}",
                kind="phase",
                label=PHASE_LABELS.get(phase, phase.replace("_", " ")),
                threshold=options.threshold,
                significance=significance,
                floor_seconds=floor,
            )
        )
    return out


_MEMORY: tuple[tuple[str, str], ...] = (
    ("peak_allocated_bytes", "peak device memory allocated"),
    ("peak_reserved_bytes", "peak device memory reserved"),
    ("peak_rss_bytes", "peak host memory (RSS)"),
)


def _single(
    baselines: Sequence[float | None],
    b: float | None,
    *,
    key: str,
    kind: MetricKind,
    label: str,
    unit: Unit,
    threshold: float,
    rise: Verdict,
    fall: Verdict,
    floor: float | None = None,
) -> MetricComparison:
    """Judge a single number per record by the threshold alone. With several baselines the
    median is shown, and a change counts only beyond every baseline's value. ``rise`` and
    ``fall`` name the verdicts of a rise and a fall ("larger"/"smaller" for memory,
    "higher"/"lower" for MFU)."""
    present = [v for v in baselines if v is not None]
    a = statistics.median(present) if present else None
    method = "single number: threshold only, no significance test"
    common = dict(key=key, kind=kind, label=label, unit=unit, baseline=a, current=b, method=method)
    if a is None or b is None:
        missing = " and ".join(side for side, v in (("baseline", a), ("current", b)) if v is None)
        return MetricComparison(
            **common,  # type: ignore[arg-type]
            verdict="inconclusive",
            reason=f"not measured in the {missing} record",
            n_baseline=len(present),
            n_current=int(b is not None),
        )
    high, low = max(present), min(present)
    ratio = b / a if a > 0 else None
    delta = b - a
    material_up = floor is None or b - high >= floor
    material_down = floor is None or low - b >= floor
    up = b >= high * (1 + threshold) if high > 0 else b > high
    down = b <= low / (1 + threshold) if low > 0 else b < low
    every = " of every baseline" if len(present) > 1 else ""
    change = pct_change(ratio - 1) if ratio is not None else ("new" if b > 0 else "0 → 0")
    verdict: Verdict
    if up and material_up:
        verdict = rise
        reason = f"{change}: beyond +{threshold:.0%}{every} (single number, no test)"
    elif down and material_down:
        verdict = fall
        reason = f"{change}: beyond −{threshold:.0%}{every} (single number, no test)"
    elif (up or down) and floor is not None:
        verdict = "same"
        reason = (
            f"{change}: {seconds_significant(abs(delta))} per step is under the floor of "
            f"{seconds_significant(floor)}"
        )
    elif len(present) > 1 and (ratio is None or not 1 / (1 + threshold) < ratio < 1 + threshold):
        # Beyond the threshold from the baselines' median, not from every baseline.
        verdict = "same"
        reason = f"{change}: within the range of the baselines' values (single number, no test)"
    else:
        verdict, reason = "same", f"{change}: within ±{threshold:.0%} (single number, no test)"
    return MetricComparison(
        **common,  # type: ignore[arg-type]
        verdict=verdict,
        reason=reason,
        ratio=ratio,
        n_baseline=len(present),
        n_current=1,
    )


def _compare_memory(
    baselines: Sequence[RunRecord], current: RunRecord, options: CompareOptions
) -> list[MetricComparison]:
    out = []
    for name, label in _MEMORY:
        a = [getattr(record.timing, name) for record in baselines]
        b = getattr(current.timing, name)
        if all(v is None for v in a) and b is None:
            continue  # not measured on this device kind (no device memory on a CPU)
        out.append(
            _single(
                a,
                b,
                key=f"memory.{name}",
                kind="memory",
                label=label,
                unit="bytes",
                threshold=options.threshold,
                rise="larger",
                fall="smaller",
            )
        )
    return out


def _compare_kernel_classes(
    baselines: Sequence[RunRecord],
    current: RunRecord,
    base_step: float | None,
    options: CompareOptions,
    notes: list[str],
) -> list[MetricComparison]:
    per_baseline = [record.breakdown.device_seconds_by_kernel_class for record in baselines]
    b = current.breakdown.device_seconds_by_kernel_class
    summed = "summed kernel time per class"
    if (not all(per_baseline) or not b) and all(
        r.breakdown.kernel_seconds_summed_by_class for r in [*baselines, current]
    ):
        # A record from before kernel time was counted once has only the sums: compare like
        # with like.
        per_baseline = [record.breakdown.kernel_seconds_summed_by_class for record in baselines]
        b = current.breakdown.kernel_seconds_summed_by_class
        notes.append(
            f"Kernel classes are compared by {summed} (overlapping streams both counted): "
            "not every record counts device time once."
        )
    if not any(per_baseline) and not b:
        return []
    if not all(per_baseline) or not b:
        lacking = "current record" if not b else "baseline"
        notes.append(
            f"Device time per kernel class is not in every record (the {lacking} read no device "
            "trace): not compared."
        )
        return []
    floor = options.phase_floor * base_step if base_step else None
    names = set(b).union(*per_baseline)

    def largest(k: str) -> float:
        return max(b.get(k, 0.0), *(a.get(k, 0.0) for a in per_baseline))

    out = []
    for name in sorted(names, key=lambda k: (-largest(k), k)):
        out.append(
            _single(
                [float(a.get(name, 0.0)) for a in per_baseline],
                float(b.get(name, 0.0)),
                key=f"kernel_class.{name}",
                kind="kernel_class",
                label=f"kernel class {name}",
                unit="seconds",
                threshold=options.threshold,
                rise="slower",
                fall="faster",
                floor=floor,
            )
        )
    return out


def _mfu_pair(
    baselines: Sequence[RunRecord], current: RunRecord
) -> tuple[str, list[float | None], float | None]:
    """Every record's MFU against ONE peak, the first baseline's: the vendor's spec when every
    record has one, else the peak measured for that baseline. A measured peak varies from run to
    run with the machine's noise; held against one, the MFU changes only with the step's work
    and time. ("", ...) when there is no common peak to hold them against."""
    records = [*baselines, current]
    utilisations = [r.utilisation for r in records]
    if any(u is None for u in utilisations):
        return "", [], None
    first = utilisations[0]
    assert first is not None
    peak = first.spec if all(u is not None and u.spec for u in utilisations) else first.measured
    if peak is None:
        return "", [], None
    values = [mfu_against(u, peak) for u in utilisations if u is not None]
    if any(v is None for v in values):
        return "", [], None
    return peak.basis, values[:-1], values[-1]


def _compare_utilisation(
    baselines: Sequence[RunRecord], current: RunRecord, options: CompareOptions, notes: list[str]
) -> list[MetricComparison]:
    """MFU, a single number per record: a fall beyond the threshold is "lower"."""
    if all(r.utilisation is None for r in [*baselines, current]):
        return []
    basis, a, b = _mfu_pair(baselines, current)
    if not basis:
        notes.append(
            "MFU is not in every record, or the first baseline's peak has no rate for a dtype "
            "another record computes in: not compared."
        )
        return []
    return [
        _single(
            a,
            b,
            key="utilisation.mfu",
            kind="utilisation",
            label=f"MFU (against the first baseline's {basis} peak)",
            unit="fraction",
            threshold=options.threshold,
            rise="higher",
            fall="lower",
        )
    ]
