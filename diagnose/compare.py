"""The CI gate: compare two RunRecords and say, per metric, faster / same / slower / inconclusive.

Pure functions of two saved records (no torch, no GPU, no files): the command and the renderers
only read the :class:`Comparison` this module returns.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import PHASE_LABELS, PHASES, SEVERITIES, Finding, RunRecord, StepSample
from diagnose.stats import (
    UTest,
    mann_whitney_u,
    minimum_samples,
    ratio_interval,
    shift_interval,
    smallest_p_value,
)

Verdict = Literal["faster", "same", "slower", "larger", "smaller", "inconclusive"]
MetricKind = Literal["step", "phase", "memory", "kernel_class"]
Unit = Literal["seconds", "bytes"]
FindingChangeKind = Literal["new", "gone", "escalated", "deescalated"]
#: What can fail the job (``--fail-on``). The first five are the ones the brief names; ``kernel``
#: (a kernel class slower) and ``inconclusive`` (the s/it could not be judged) are stricter extras.
FailOn = Literal["slower", "phase", "new-critical", "new-warn", "memory", "kernel", "inconclusive"]

FAIL_ON_CHOICES: tuple[str, ...] = get_args(FailOn)
DEFAULT_FAIL_ON: frozenset[str] = frozenset({"slower", "new-critical"})
#: The relative change a metric must exceed to count (10%: CodSpeed's default, asv's 1.1 factor).
DEFAULT_THRESHOLD = 0.10
#: The Mann–Whitney p-value below which a change counts as real. With the default 8 steps per
#: run, 0.01 is reachable (the exact test's smallest two-sided p at 8 vs 8 is 1.6e-4, at 5 vs 5 it
#: is 7.9e-3), while asv's 0.002 would need 7 steps on each side before anything could fail.
DEFAULT_SIGNIFICANCE = 0.01
#: A phase or kernel-class change must be at least this share of the baseline step time.
DEFAULT_PHASE_FLOOR = 0.02

#: Config keys that change what a step costs: records that differ in one are not comparable.
#: Not compared: steps/warmup/profiled_steps (sample counts), seed, learning_rate and alpha (same
#: cost per step), device ("cuda:0" vs "cuda:1": the device itself is compared by kind and name),
#: data_dir and model_dir paths (they differ between CI workspaces; the data and the model are
#: compared by what they hold), skip_probes (changes the findings, not the step).
COMPARED_CONFIG_KEYS: tuple[str, ...] = (
    "preset",
    "size",
    "precision",
    "optimizer",
    "batch",
    "resolution",
    "rank",
    "target_modules",
    "grad_checkpointing",
    "workers",
    "attention",
    "cache_latents",
    "cache_text_embeddings",
    "strategy",
)

#: Inventory packages whose version changes are listed (informational, never refused).
_PACKAGE_VERSION_LIMIT = 30
_SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}


# --------------------------------------------------------------------------------------------
# The comparison


@dataclass(frozen=True)
class CompareOptions:
    """How the gate decides. ``fail_on`` is carried so every output can say what failed the job."""

    threshold: float = DEFAULT_THRESHOLD
    significance: float = DEFAULT_SIGNIFICANCE
    phase_floor: float = DEFAULT_PHASE_FLOOR
    fail_on: frozenset[str] = DEFAULT_FAIL_ON
    #: Compare records of different devices or configs (every output then says so loudly).
    allow_different: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 10:
            raise DiagnoseError(f"threshold {self.threshold} must be above 0", ExitCode.USAGE)
        if not 0 < self.significance < 1:
            raise DiagnoseError(
                f"significance {self.significance} must be between 0 and 1", ExitCode.USAGE
            )
        if not 0 <= self.phase_floor < 1:
            raise DiagnoseError(
                f"phase floor {self.phase_floor} must be between 0 and 1", ExitCode.USAGE
            )
        unknown = sorted(set(self.fail_on) - set(FAIL_ON_CHOICES))
        if unknown:
            raise DiagnoseError(
                f"--fail-on {unknown[0]}: unknown; choose from {', '.join(FAIL_ON_CHOICES)}",
                ExitCode.USAGE,
            )


@dataclass(frozen=True)
class MetricComparison:
    """One metric of the two records, and the verdict on it."""

    #: Stable key: "step", "phase.forward", "memory.peak_rss_bytes", "kernel_class.gemm".
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
        return self.verdict in ("slower", "larger")

    @property
    def change(self) -> float | None:
        """Relative change (ratio - 1), or None."""
        return None if self.ratio is None else self.ratio - 1.0


@dataclass(frozen=True)
class FindingChange:
    """A finding that appeared, disappeared or changed severity between the records."""

    id: str
    change: FindingChangeKind
    title: str
    category: str
    baseline_severity: str | None
    current_severity: str | None
    #: The current finding's estimated saving (or the baseline's, for a gone one).
    est_seconds_saved_per_it: float | None = None

    @property
    def severity(self) -> str:
        """The severity that matters now: the current one, else the baseline's."""
        return self.current_severity or self.baseline_severity or "info"


@dataclass(frozen=True)
class RecordSide:
    """What the outputs say about one compared record (a baseline or the current one)."""

    label: str
    created: str
    tool_version: str
    command: str
    setup: str
    #: "unprofiled" or "profiled": which steps were compared.
    samples_kind: str
    n_samples: int
    #: Median s/it of the compared steps, None when there are none.
    median_seconds: float | None = None
    #: The compared steps' seconds, in run order (for the report's chart).
    step_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class GateFailure:
    """One reason the gate fails the job."""

    #: The --fail-on criterion that fired.
    criterion: str
    #: The metric key or finding id it fired on.
    subject: str
    message: str


@dataclass(frozen=True)
class Comparison:
    #: One or more baselines (e.g. the last green runs), in the order given.
    baselines: tuple[RecordSide, ...]
    current: RecordSide
    options: CompareOptions
    metrics: tuple[MetricComparison, ...]
    findings: tuple[FindingChange, ...]
    #: Device/config differences the records were compared despite (only with allow_different).
    differences: tuple[str, ...] = ()
    #: Other changes between the records (package versions, driver, data): never refused, listed
    #: because they are usually the cause of a regression.
    environment_changes: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def baseline_drift(self) -> float | None:
        """With several baselines: how far apart their s/it medians are (slowest / fastest - 1),
        the runner's own run-to-run drift. None with fewer than two measured baselines."""
        return _drift([side.median_seconds for side in self.baselines])

    def metric(self, key: str) -> MetricComparison | None:
        return next((m for m in self.metrics if m.key == key), None)

    @property
    def step(self) -> MetricComparison | None:
        return self.metric("step")

    @property
    def different(self) -> bool:
        """Whether records that differ in device or config were compared (--allow-different)."""
        return bool(self.differences)

    @property
    def different_warning(self) -> str:
        if not self.differences:
            return ""
        return (
            "NOT LIKE FOR LIKE (--allow-different): the records differ in "
            + "; ".join(self.differences)
            + ". A change below may come from that difference."
        )


def compare_records(
    baseline: RunRecord | Sequence[RunRecord],
    current: RunRecord,
    options: CompareOptions | None = None,
    *,
    labels: Sequence[str] = (),
) -> Comparison:
    """Compare ``current`` against one baseline record or several.

    ``labels`` names the baselines, then the current record (default: "baseline", "baseline 2",
    ..., "current").

    Several baselines (the last few green runs of a CI job) show the runner's run-to-run drift,
    which no single run can: their samples are pooled, and a timing metric is only *slower* when
    it is also slower than the slowest baseline alone (*faster*: than the fastest), a single
    number only when it is beyond every baseline's value, and a finding only new or re-graded
    when its severity is outside the range the baselines showed. A change within what the
    baselines already disagree on is not a regression.

    Raises DiagnoseError(BAD_INPUT) naming the first device or config difference, unless
    ``options.allow_different``.
    """
    baselines = [baseline] if isinstance(baseline, RunRecord) else list(baseline)
    if not baselines:
        raise ValueError("compare_records needs at least one baseline record")
    names = _labels(labels, len(baselines))
    base_names = names[:-1]
    _refuse_repeated_runs(baselines, base_names)
    options = options or CompareOptions()
    several = len(baselines) > 1
    differences: list[str] = []
    for name, record in zip(base_names, baselines, strict=True):
        prefix = f"{name}: " if several else ""
        differences.extend(prefix + d for d in record_differences(record, current))
    if differences and not options.allow_different:
        raise DiagnoseError(
            f"records are not comparable: {differences[0]}; compare like with like, "
            "or add --allow-different",
            ExitCode.BAD_INPUT,
        )
    notes: list[str] = []
    base_runs, cur_samples, samples_kind, sample_note = _comparable_samples(baselines, current)
    if sample_note:
        notes.append(sample_note)

    metrics: list[MetricComparison] = []
    step = _compare_step(base_runs, cur_samples, samples_kind, options, base_names)
    metrics.append(step)
    pooled = [s.seconds for run in base_runs for s in run]
    base_step = statistics.median(pooled) if pooled else None
    metrics.extend(_compare_phases(base_runs, cur_samples, base_step, options, base_names))
    memory = _compare_memory(baselines, current, options)
    metrics.extend(memory)
    profiled = sorted({str(b.config.get("profiled_steps")) for b in baselines})
    prof_b = str(current.config.get("profiled_steps"))
    if memory and profiled != [prof_b] and all(r.mode == "run" for r in (*baselines, current)):
        notes.append(
            f"The records profiled different numbers of steps ({', '.join(profiled)} and "
            f"{prof_b}): peak host memory includes the profiler's buffers, so its change is "
            "partly that."
        )
    metrics.extend(_compare_kernel_classes(baselines, current, base_step, options, notes))

    sides = tuple(
        _side(record, name, samples_kind, run)
        for record, name, run in zip(baselines, base_names, base_runs, strict=True)
    )
    drift = _drift([side.median_seconds for side in sides])
    if drift is not None and drift > options.threshold:
        measured = sum(side.median_seconds is not None for side in sides)
        notes.append(
            f"The {measured} baselines' s/it medians differ by {_pct(drift)} among "
            f"themselves, more than the {options.threshold:.0%} threshold: this runner drifts "
            "between runs by more than the change the gate is asked to catch, so a slowdown "
            "counts only beyond the slowest baseline. Steady the runner (pinned clocks, no "
            "other jobs) or raise --threshold."
        )
    environment: list[str] = []
    for record in baselines:
        environment.extend(c for c in environment_changes(record, current) if c not in environment)
    return Comparison(
        baselines=sides,
        current=_side(current, names[-1], samples_kind, cur_samples),
        options=options,
        metrics=tuple(metrics),
        findings=diff_findings(baselines, current),
        differences=tuple(differences),
        environment_changes=tuple(environment),
        notes=tuple(notes),
    )


def _drift(medians: Sequence[float | None]) -> float | None:
    """Slowest / fastest - 1 of the measured medians; None with fewer than two."""
    measured = [m for m in medians if m is not None]
    if len(measured) < 2 or min(measured) <= 0:
        return None
    return max(measured) / min(measured) - 1


def _refuse_repeated_runs(records: Sequence[RunRecord], names: Sequence[str]) -> None:
    """A baseline run given twice would count its steps twice and hide the drift between runs.
    (The current record may be a baseline too: comparing a run with itself is a sanity check.)"""
    seen: dict[tuple[object, ...], str] = {}
    for record, name in zip(records, names, strict=True):
        identity = (record.created, record.command, tuple(s.seconds for s in record.timing.samples))
        if identity in seen:
            raise DiagnoseError(
                f"{name} is the same run as {seen[identity]} (created {record.created}): give "
                "each run once",
                ExitCode.BAD_INPUT,
            )
        seen[identity] = name


def _labels(labels: Sequence[str], n_baselines: int) -> list[str]:
    """One label per baseline, then the current record's."""
    if labels:
        if len(labels) != n_baselines + 1:
            raise ValueError(f"{len(labels)} labels for {n_baselines} baselines and one current")
        return list(labels)
    return [*(baseline_name(i) for i in range(n_baselines)), "current"]


def baseline_name(index: int) -> str:
    """The generic name of the index-th baseline (0-based): "baseline", "baseline 2", ..."""
    return "baseline" if index == 0 else f"baseline {index + 1}"


def _side(
    record: RunRecord, label: str, samples_kind: str, samples: Sequence[StepSample]
) -> RecordSide:
    from diagnose.reports.view import describe_setup  # light: the view imports no torch

    return RecordSide(
        label=label,
        created=record.created,
        tool_version=record.tool_version,
        command=record.command,
        setup=describe_setup(record),
        samples_kind=samples_kind,
        n_samples=len(samples),
        median_seconds=statistics.median([s.seconds for s in samples]) if samples else None,
        step_seconds=tuple(s.seconds for s in samples),
    )


# --------------------------------------------------------------------------------------------
# Comparability


def _display(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)


def record_differences(baseline: RunRecord, current: RunRecord) -> list[str]:
    """Device, mode, config and model differences that make the step times incomparable, in the
    order the refusal names them (the first one is the message)."""
    from diagnose.config import RunConfig

    out: list[str] = []

    def differ(what: str, a: Any, b: Any) -> None:
        out.append(f"{what} differs (baseline {_display(a)}, current {_display(b)})")

    if baseline.mode != current.mode:
        differ("mode", baseline.mode, current.mode)
    if baseline.device.kind != current.device.kind:
        differ("device kind", baseline.device.kind, current.device.kind)
    if baseline.device.name != current.device.name:
        differ("device name", baseline.device.name, current.device.name)
    # The s/it of a multi-rank record is its pacing rank's: only a job of as many ranks compares.
    base_ranks, cur_ranks = max(len(baseline.ranks), 1), max(len(current.ranks), 1)
    if base_ranks != cur_ranks:
        differ("number of ranks", base_ranks, cur_ranks)
    defaults = RunConfig().to_dict()
    for key in COMPARED_CONFIG_KEYS:
        # A key an older record lacks reads as the default it ran with.
        a = baseline.config.get(key, defaults.get(key))
        b = current.config.get(key, defaults.get(key))
        if a != b:
            differ(f"config {key}", a, b)
    a_model, b_model = baseline.config.get("model_dir"), current.config.get("model_dir")
    if (a_model is None) != (b_model is None) or (
        a_model is not None and Path(str(a_model)).name != Path(str(b_model)).name
    ):
        differ("config model_dir", a_model, b_model)
    for name in ("class_name", "parameters", "trainable_parameters"):
        a, b = getattr(baseline.model, name), getattr(current.model, name)
        if a and b and a != b:  # empty/zero = not recorded (a trace), not a difference
            differ(f"model {name}", a, b)
    return out


def environment_changes(baseline: RunRecord, current: RunRecord) -> list[str]:
    """What else changed (tool, runtime, driver, package versions, data): listed, never refused."""
    out: list[str] = []

    def note(what: str, a: Any, b: Any) -> None:
        if a != b and (a not in (None, "") or b not in (None, "")):
            out.append(
                f"{what}: {a if a not in (None, '') else '—'} → {b if b not in (None, '') else '—'}"
            )

    note("diagnose", baseline.tool_version, current.tool_version)
    note("device runtime", baseline.device.runtime, current.device.runtime)
    note("device driver", baseline.device.driver, current.device.driver)
    note("device arch", baseline.device.arch, current.device.arch)
    note(
        "torch threads",
        baseline.device.extra.get("torch_threads"),
        current.device.extra.get("torch_threads"),
    )
    note(
        "torch",
        _dig(baseline.inventory, "torch", "version"),
        _dig(current.inventory, "torch", "version"),
    )
    packages_a = _dig(baseline.inventory, "packages") or {}
    packages_b = _dig(current.inventory, "packages") or {}
    if isinstance(packages_a, Mapping) and isinstance(packages_b, Mapping):
        names = sorted(set(packages_a) | set(packages_b))[:_PACKAGE_VERSION_LIMIT]
        for name in names:
            note(name, _dig(packages_a, name, "version"), _dig(packages_b, name, "version"))
    env_a = _dig(baseline.inventory, "env") or {}
    env_b = _dig(current.inventory, "env") or {}
    if isinstance(env_a, Mapping) and isinstance(env_b, Mapping):
        for name in sorted(set(env_a) | set(env_b)):
            note(f"${name}", env_a.get(name), env_b.get(name))
    for key in ("seed", "learning_rate", "alpha", "device", "skip_probes"):
        note(f"config {key}", baseline.config.get(key), current.config.get(key))
    data_a, data_b = baseline.config.get("data"), current.config.get("data")
    if isinstance(data_a, Mapping) and isinstance(data_b, Mapping):
        note("data images", data_a.get("images"), data_b.get("images"))
        note(
            "data median megapixels",
            _dig(data_a, "pixel_sizes", "megapixels_median"),
            _dig(data_b, "pixel_sizes", "megapixels_median"),
        )
        note("data bytes", data_a.get("total_bytes"), data_b.get("total_bytes"))
        note("data generated", data_a.get("generated"), data_b.get("generated"))
    return out


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


# --------------------------------------------------------------------------------------------
# Timing metrics (samples)


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
        samples = [s for s in record.timing.samples if _finite(s.seconds) and s.seconds >= 0]
        invalid += len(record.timing.samples) - len(samples)
        return [s for s in samples if not s.profiled], [s for s in samples if s.profiled]

    base_split = [split(record) for record in baselines]
    cur_plain, cur_prof = split(current)
    empty: list[list[StepSample]] = [[] for _ in baselines]
    dropped = (
        f"{invalid} step{'s' if invalid != 1 else ''} with no valid time (not a finite, "
        "non-negative number of seconds) left out. "
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


def _spread(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    median = statistics.median(values)
    return (q3 - q1) / median if median > 0 else None


def _pct(fraction: float) -> str:
    return f"{fraction * 100:+.1f}%"


def _p(p: float) -> str:
    return f"p={p:.2g}" if p >= 1e-4 else "p<0.0001"


def _seconds(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 1 or magnitude == 0:
        return f"{value:.3g} s"
    if magnitude >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


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
        _pct(ratio - 1) if ratio is not None else f"{'+' if delta >= 0 else ''}{_seconds(delta)}"
    )
    ci_text = (
        f", CI {_pct(ci_low - 1)}…{_pct(ci_high - 1)}"
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
        reason = f"{stats_text}: under the floor of {_seconds(floor_seconds or 0.0)} per step"
    elif significant:
        verdict = "same"
        if beyond_up or beyond_down:
            reason = (
                f"{stats_text}: significant but {_seconds(abs(delta))} per step is under the "
                f"floor of {_seconds(floor_seconds or 0.0)}"
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
    change = _pct(alone.ratio - 1) if alone.ratio is not None else "—"
    p_text = f", {_p(alone.p_value)}" if alone.p_value is not None else ""
    versus = f"the {extreme} baseline alone ({pick[0]}: {alone.verdict}, {change}{p_text})"
    if alone.verdict == metric.verdict:
        return replace(metric, reason=f"{metric.reason}; also against {versus}")
    spread = _drift([statistics.median(run) for _, run in measured])
    between = f" ({_pct(spread)} between them)" if spread is not None else ""
    return replace(
        metric,
        verdict="inconclusive",
        reason=(
            f"{metric.verdict} than the pooled baselines ({metric.reason}), but not against "
            f"{versus}: within the run-to-run drift the baselines show{between}"
        ),
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


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------
# Single numbers: memory and kernel classes


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
    worse: Verdict,
    better: Verdict,
    floor: float | None = None,
) -> MetricComparison:
    """Judge a single number per record by the threshold alone. With several baselines the
    median is shown, and a change counts only beyond every baseline's value."""
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
    change = _pct(ratio - 1) if ratio is not None else ("new" if b > 0 else "0 → 0")
    verdict: Verdict
    if up and material_up:
        verdict = worse
        reason = f"{change}: beyond +{threshold:.0%}{every} (single number, no test)"
    elif down and material_down:
        verdict = better
        reason = f"{change}: beyond −{threshold:.0%}{every} (single number, no test)"
    elif (up or down) and floor is not None:
        verdict = "same"
        reason = (
            f"{change}: {_seconds(abs(delta))} per step is under the floor of {_seconds(floor)}"
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
                worse="larger",
                better="smaller",
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
                worse="slower",
                better="faster",
                floor=floor,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Findings


def diff_findings(
    baseline: RunRecord | Sequence[RunRecord], current: RunRecord
) -> tuple[FindingChange, ...]:
    """New, gone and re-graded findings by id: new and escalated first, most severe first.

    With several baselines, a finding changes only when its current severity is outside the
    range the baselines showed (absent counting below info): a finding that some baselines had
    as info and others as warn is not "escalated" when it is warn now.
    """
    baselines = [baseline] if isinstance(baseline, RunRecord) else list(baseline)
    before = [{f.id: f for f in record.findings} for record in baselines]
    after = {f.id: f for f in current.findings}
    absent = -1

    def rank(finding: Finding | None) -> int:
        return absent if finding is None else _SEVERITY_RANK.get(finding.severity, 0)

    ids = list(after) + [fid for found in before for fid in found if fid not in after]
    out: list[FindingChange] = []
    for fid in dict.fromkeys(ids):
        olds = [found.get(fid) for found in before]
        ranks = [rank(old) for old in olds]
        low, high = min(ranks), max(ranks)
        now = after.get(fid)
        current_rank = rank(now)
        kind: FindingChangeKind
        if current_rank > high:
            kind, bound = ("new" if high == absent else "escalated"), high
        elif current_rank < low:
            kind, bound = ("gone" if now is None else "deescalated"), low
        else:
            continue
        latest = next((old for old in reversed(olds) if old is not None), None)
        shown = now or latest
        assert shown is not None  # the id came from the current record or a baseline
        out.append(
            FindingChange(
                id=fid,
                change=kind,
                title=shown.title,
                category=shown.category,
                baseline_severity=SEVERITIES[bound] if bound != absent else None,
                current_severity=now.severity if now else None,
                est_seconds_saved_per_it=shown.est_seconds_saved_per_it,
            )
        )
    order = {"new": 0, "escalated": 1, "deescalated": 2, "gone": 3}
    out.sort(key=lambda c: (order[c.change], -_SEVERITY_RANK.get(c.severity, 0), c.id))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# The gate


def parse_fail_on(text: str) -> frozenset[str]:
    """``"slower,new-critical"`` -> the criteria; DiagnoseError(USAGE) on an unknown one."""
    items = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(items - set(FAIL_ON_CHOICES))
    if unknown:
        raise DiagnoseError(
            f"--fail-on {unknown[0]}: unknown; choose from {', '.join(FAIL_ON_CHOICES)}",
            ExitCode.USAGE,
        )
    return items


def _raises_to(change: FindingChange, severity: str) -> bool:
    """A finding that is new, or more severe than before, and now at least ``severity``."""
    if change.change not in ("new", "escalated") or change.current_severity is None:
        return False
    return _SEVERITY_RANK.get(change.current_severity, 0) >= _SEVERITY_RANK[severity]


def gate_failures(
    comparison: Comparison, fail_on: Iterable[str] | None = None
) -> tuple[GateFailure, ...]:
    """Every reason the job fails under ``fail_on`` (default: the comparison's options)."""
    criteria = frozenset(comparison.options.fail_on if fail_on is None else fail_on)
    out: list[GateFailure] = []
    for metric in comparison.metrics:
        criterion = {
            "step": "slower",
            "phase": "phase",
            "memory": "memory",
            "kernel_class": "kernel",
        }[metric.kind]
        if metric.regressed and criterion in criteria:
            message = f"{metric.label} {metric.verdict}: {metric.reason}"
            if metric.kind == "step":
                message += _where_slower(comparison)
            out.append(GateFailure(criterion, metric.key, message))
        if (
            metric.kind == "step"
            and metric.verdict == "inconclusive"
            and "inconclusive" in criteria
        ):
            out.append(
                GateFailure(
                    "inconclusive", metric.key, f"{metric.label} inconclusive: {metric.reason}"
                )
            )
    for change in comparison.findings:
        for criterion, severity in (("new-critical", "critical"), ("new-warn", "warn")):
            if criterion in criteria and _raises_to(change, severity):
                was = f" (was {change.baseline_severity})" if change.baseline_severity else ""
                out.append(
                    GateFailure(
                        criterion,
                        change.id,
                        f"{change.change} {change.current_severity} finding {change.id}{was}: "
                        f"{change.title}",
                    )
                )
                break  # one failure per finding, under the strictest criterion that fired
    return tuple(out)


def _where_slower(comparison: Comparison) -> str:
    """Which phases the slower step went into (they are judged at a stricter level; see the
    module docstring), for the s/it failure message."""
    phases = [m for m in comparison.metrics if m.kind == "phase" and m.verdict == "slower"]
    if not phases:
        return "; no single phase is significantly slower"
    parts = [f"{m.label} {_pct(m.change)}" if m.change is not None else m.label for m in phases]
    return "; slower phases: " + ", ".join(parts)


def gate_exit_code(comparison: Comparison, fail_on: Iterable[str] | None = None) -> int:
    """ExitCode.REGRESSION when anything in ``fail_on`` fired, else ExitCode.OK."""
    return int(ExitCode.REGRESSION if gate_failures(comparison, fail_on) else ExitCode.OK)


__all__ = [
    "COMPARED_CONFIG_KEYS",
    "DEFAULT_FAIL_ON",
    "DEFAULT_PHASE_FLOOR",
    "DEFAULT_SIGNIFICANCE",
    "DEFAULT_THRESHOLD",
    "FAIL_ON_CHOICES",
    "CompareOptions",
    "Comparison",
    "FindingChange",
    "GateFailure",
    "MetricComparison",
    "RecordSide",
    "UTest",
    "baseline_name",
    "compare_records",
    "compare_runs",
    "compare_samples",
    "diff_findings",
    "environment_changes",
    "gate_exit_code",
    "gate_failures",
    "mann_whitney_u",
    "minimum_samples",
    "parse_fail_on",
    "ratio_interval",
    "record_differences",
    "shift_interval",
    "smallest_p_value",
]
