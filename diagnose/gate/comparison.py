"""The comparison of a current record against one baseline record or several:
:func:`compare_records` and the :class:`Comparison` every output reads."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate.comparability import environment_changes, record_differences
from diagnose.gate.finding_changes import FindingChange, diff_findings
from diagnose.gate.metrics import MetricComparison, _drift
from diagnose.gate.options import CompareOptions
from diagnose.gate.record_metrics import (
    _comparable_samples,
    _compare_kernel_classes,
    _compare_memory,
    _compare_phases,
    _compare_step,
    _compare_utilisation,
    judged_against_load,
)
from diagnose.record import RunRecord, StepSample
from diagnose.record_io import is_valid_step_time
from diagnose.units import pct_change


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
    for name, record in zip(names, [*baselines, current], strict=True):
        _refuse_unmeasured(record, name)
    itself = [n for b, n in zip(baselines, base_names, strict=True) if _run(b) == _run(current)]
    if itself:
        notes.append(
            f"{names[-1]} is the same run as {itself[0]} (created {current.created}): this "
            "checks the gate against itself, and compares no two runs."
        )
    base_runs, cur_samples, samples_kind, sample_note = _comparable_samples(baselines, current)
    if sample_note:
        notes.append(sample_note)

    metrics: list[MetricComparison] = []
    step = _compare_step(base_runs, cur_samples, samples_kind, options, base_names)
    pooled = [s.seconds for run in base_runs for s in run]
    base_step = statistics.median(pooled) if pooled else None
    timings = [step, *_compare_phases(base_runs, cur_samples, base_step, options, base_names)]
    metrics.extend(judged_against_load(m, baselines, current) for m in timings)
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
    metrics.extend(_compare_utilisation(baselines, current, options, notes))

    sides = tuple(
        _side(record, name, samples_kind, run)
        for record, name, run in zip(baselines, base_names, base_runs, strict=True)
    )
    drift = _drift([side.median_seconds for side in sides])
    if drift is not None and drift > options.threshold:
        measured = sum(side.median_seconds is not None for side in sides)
        notes.append(
            f"The {measured} baselines' s/it medians differ by {pct_change(drift)} among "
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


def _refuse_unmeasured(record: RunRecord, name: str) -> None:
    """A record without one valid timed step has nothing to gate on: passing it would call an
    unmeasured run as fast as its baseline (ExitCode.BAD_INPUT)."""
    valid = [s for s in record.timing.samples if is_valid_step_time(s.seconds)]
    if not valid:
        had = len(record.timing.samples)
        why = f"none of its {had} steps has a valid time" if had else "it holds no timed step"
        raise DiagnoseError(
            f"{name}: {why} (a positive, finite number of seconds); nothing to compare",
            ExitCode.BAD_INPUT,
        )


def _refuse_repeated_runs(records: Sequence[RunRecord], names: Sequence[str]) -> None:
    """A baseline run given twice would count its steps twice and hide the drift between runs.
    (The current record may be a baseline too: comparing a run with itself is a sanity check.)"""
    seen: dict[tuple[object, ...], str] = {}
    for record, name in zip(records, names, strict=True):
        identity = _run(record)
        if identity in seen:
            raise DiagnoseError(
                f"{name} is the same run as {seen[identity]} (created {record.created}): give "
                "each run once",
                ExitCode.BAD_INPUT,
            )
        seen[identity] = name


def _run(record: RunRecord) -> tuple[object, ...]:
    """What tells one run from another: when it was made, by what command, its steps' times."""
    return (record.created, record.command, tuple(s.seconds for s in record.timing.samples))


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
    from diagnose.reports.headline import describe_setup  # light: imports no torch

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
