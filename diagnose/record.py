"""The RunRecord: the versioned JSON document that every stage after the measurement reads.

Reports and the CI gate only ever read a saved record, so re-rendering never needs a GPU (or torch).
This module must therefore import nothing heavy.

A leaf: the data model alone (and the step a record's savings are shares of). Reading and writing
a record file, its checks and the upgrades of older schema versions are :mod:`diagnose.record_io`.
"""

# Why one file: it is the schema of record.json. Every dataclass a record holds is here, so the
# schema reads top to bottom in one place, and record_io builds each of them from its type hints.

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from diagnose import __version__
from diagnose.errors import ExitCode
from diagnose.roofline.model import Utilisation

#: Bump when a field changes meaning or is removed, and add a migration for the previous version.
#: Adding an optional field with a default needs no bump: older readers ignore it, newer readers
#: default it.
SCHEMA_VERSION = 3

#: "run": diagnose's own workload; "trace": a trace from any trainer; "profile": the user's own
#: command, captured by ``diagnose profile``.
Mode = Literal["run", "trace", "profile"]
Severity = Literal["info", "warn", "critical"]
Category = Literal[
    "precision",
    "attention",
    "optimizer",
    "dataloader",
    "triton",
    "environment",
    "memory",
    "compute",
    "distributed",
    "quantization",
]
ProbeStatus = Literal["ok", "skipped", "error"]
#: The answer to one question a probe or a trace rule asked: a finding (time is lost here), ok
#: (checked and found fine), or not judged (could not be checked here, and why).
Outcome = Literal["finding", "ok", "not_judged"]
#: How a number was obtained; every number in the report says which.
Basis = Literal["measured", "estimated", "trace", "none"]

SEVERITIES: tuple[Severity, ...] = get_args(Severity)
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
CATEGORIES: tuple[Category, ...] = get_args(Category)

#: The phases of a training step, in the order the report draws them.
PHASES: tuple[str, ...] = (
    "data_wait",  # blocked in next(dataloader iterator)
    "h2d",  # host-to-device copy of the batch
    "encode",  # VAE encode of the images and text-encoder pass of the captions
    "forward",  # denoiser forward and loss
    "backward",
    "optimizer",  # optimizer.step() and zero_grad()
    "communication",  # collectives (all-reduce...) with no compute beside them: transfer and the
    # wait for other ranks
    "sync",  # host-device synchronisation not attributed to a phase above
    "allocator",  # device idle while the host is in cudaMalloc/cudaFree/hipMalloc...
    "device_work",  # device work whose launching code is not in the trace (from a trace)
    "host_code",  # the training thread between ops: Python, untraced native code (CPU traces)
    "idle",  # device idle while the host ran nothing traced: nothing else to blame (from a trace)
    "other",  # step time not covered by the phases above
)

PHASE_LABELS: dict[str, str] = {
    "data_wait": "data wait",
    "h2d": "host→device copy",
    "encode": "VAE / text encode",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "communication": "communication",
    "sync": "host-device sync",
    "allocator": "allocator calls",
    "device_work": "GPU work, phase unknown",
    "host_code": "host code between ops",
    "idle": "idle, no host activity",
    "other": "other",
}


@dataclass
class Stats:
    """Summary of a list of samples (seconds). Always derived from the samples, never edited."""

    n: int = 0
    median: float = math.nan
    q1: float = math.nan
    q3: float = math.nan
    min: float = math.nan
    max: float = math.nan
    mean: float = math.nan

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def relative_spread(self) -> float:
        """IQR divided by the median: how noisy the measurement is."""
        if not self.n or self.median == 0:
            return math.nan
        return self.iqr / self.median

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        values = sorted(float(v) for v in samples)
        if not values:
            return cls()
        if len(values) == 1:
            q1 = q3 = values[0]
        else:
            # "inclusive" keeps the quartiles inside the observed range for small n.
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(
            n=len(values),
            median=statistics.median(values),
            q1=q1,
            q3=q3,
            min=values[0],
            max=values[-1],
            mean=statistics.fmean(values),
        )


@dataclass
class DeviceInfo:
    """The device the step ran on (or the trace was captured on)."""

    #: "cuda" (NVIDIA), "rocm" (AMD through HIP), "cpu", or "unknown" for a trace without metadata.
    kind: str = "unknown"
    vendor: str = ""
    name: str = ""
    #: Compute capability ("sm_90"), gfx target ("gfx1100"), or the CPU machine ("x86_64").
    arch: str = ""
    memory_bytes: int | None = None
    #: "CUDA 12.8", "HIP 6.4.43482", ... (empty on the CPU).
    runtime: str = ""
    driver: str = ""
    #: The torch device string used ("cuda:0", "cpu").
    torch_device: str = ""
    #: Anything else worth recording (multiprocessor count, cores, ISA flags).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class HostLoad:
    """How busy the machine was with work that is not ours while something was measured.

    Measured as CPU time: the cores this process may run on, what our process tree used of them,
    and what other processes (and, in a VM, the hypervisor's steal) took in the same window. Made
    by :mod:`diagnose.contention`; a record keeps one per timed window (the steps, each probe).
    """

    #: What the numbers were read from ("psutil"), or why they could not be read.
    basis: str = ""
    seconds: float = 0.0
    #: Cores this process may run on (its CPU affinity).
    cpus: int = 0
    #: Mean cores busy with our process and its children (DataLoader workers) over the window.
    own_cores: float = 0.0
    #: Mean cores other processes and VM steal took from ours over the window.
    others_cores: float = 0.0
    #: The most cores others took in the busiest tenth of the window.
    others_cores_high: float = 0.0
    #: The 1-minute load average at the end of the window, when the OS has one.
    load_average: float | None = None
    #: The share of the cores others held while ours were busy (their busiest tenth; 0 on a
    #: quiet machine): how much of a time measured in this window the load could explain.
    competing_share: float = 0.0
    #: How much of a time the load's swings could explain (its busiest tenth against its
    #: quietest): an interleaved A/B made in the window is not sure of a difference smaller than
    #: this share of its slower side. A steady load slows both sides alike.
    allowance: float = 0.0
    #: Comparisons in the window whose verdict the load set aside (sure on a quiet machine,
    #: not sure with the allowance).
    comparisons_set_aside: int = 0

    @property
    def contended(self) -> bool:
        return self.competing_share > 0


@dataclass
class StepSample:
    """One timed training step. Warm-up steps are not recorded as samples."""

    index: int = 0
    seconds: float = 0.0
    profiled: bool = False
    #: Seconds per phase (keys from :data:`PHASES`), device-synchronised at phase boundaries.
    phases: dict[str, float] = field(default_factory=dict)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    loss: float | None = None
    #: The shape of the step's input, "HxW" pixels (with "Bx" in front for a batch of more than
    #: one): the resolution bucket the step trained. Empty when not known.
    bucket: str = ""


@dataclass
class Timing:
    """Every per-step sample, plus summaries derived from them."""

    warmup_steps: int = 0
    samples: list[StepSample] = field(default_factory=list)
    #: Summary of the unprofiled steps: the number the report leads with.
    unprofiled: Stats = field(default_factory=Stats)
    #: Summary of the profiled steps; the ratio to ``unprofiled`` is the profiler's overhead.
    profiled: Stats = field(default_factory=Stats)
    #: Seconds from the start of the first step until its first batch arrived.
    first_batch_seconds: float | None = None
    #: Seconds taken by each warm-up step (kept to show compile/autotune warm-up cost).
    warmup_seconds: list[float] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    #: The machine's load from other work while the timed steps ran.
    host_load: HostLoad | None = None
    #: Seconds after which the timed steps ended before the most a run takes (no --steps given,
    #: slow steps); None when every planned step ran.
    step_budget_s: float | None = None

    def summarize(self) -> None:
        """Recompute the summaries from the samples (the samples are the truth)."""
        self.unprofiled = Stats.of(s.seconds for s in self.samples if not s.profiled)
        self.profiled = Stats.of(s.seconds for s in self.samples if s.profiled)

    @property
    def headline(self) -> Stats:
        """The s/it to lead with: unprofiled if there are any, else profiled."""
        return self.unprofiled if self.unprofiled.n else self.profiled

    def buckets(self) -> dict[str, Stats]:
        """Step time per input shape (of the headline's samples), largest share of steps first;
        empty when the steps did not record one, or all had the same."""
        profiled = not self.unprofiled.n
        by_bucket: dict[str, list[float]] = {}
        for sample in self.samples:
            if sample.profiled == profiled and sample.bucket:
                by_bucket.setdefault(sample.bucket, []).append(sample.seconds)
        if len(by_bucket) < 2:
            return {}
        ordered = sorted(by_bucket.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        return {bucket: Stats.of(values) for bucket, values in ordered}

    @property
    def per_iteration(self) -> float:
        """The s/it to lead with. With several resolution buckets, the median of one bucket's
        steps says nothing about the run: each bucket's median, weighted by its share of the
        steps (the run's bucket mix). Otherwise the headline median."""
        buckets = self.buckets()
        if not buckets:
            return self.headline.median
        total = sum(stats.n for stats in buckets.values())
        return sum(stats.median * stats.n for stats in buckets.values()) / total

    @property
    def profiler_overhead(self) -> float | None:
        """Profiled median / unprofiled median - 1, or None without both.

        With several input shapes, a profiled step is compared with the unprofiled steps of its
        own shape (the median of those ratios): the pooled medians would mostly measure which
        buckets the few profiled steps happened to draw. None when no shape has both."""
        if not (self.unprofiled.n and self.profiled.n) or self.unprofiled.median <= 0:
            return None
        if not self.buckets():
            return self.profiled.median / self.unprofiled.median - 1.0
        plain: dict[str, list[float]] = {}
        for sample in self.samples:
            if not sample.profiled and sample.bucket:
                plain.setdefault(sample.bucket, []).append(sample.seconds)
        medians = {bucket: statistics.median(values) for bucket, values in plain.items()}
        ratios = [
            s.seconds / medians[s.bucket] - 1.0
            for s in self.samples
            if s.profiled and medians.get(s.bucket, 0.0) > 0
        ]
        return statistics.median(ratios) if ratios else None


@dataclass
class Breakdown:
    """Seconds per step spent in each phase (median over steps)."""

    seconds: dict[str, float] = field(default_factory=dict)
    #: How the phase seconds were obtained: "measured" (synchronised timers) or "trace".
    basis: Basis = "measured"
    #: Device time per kernel class (GEMM, attention, ...) per step, when a device trace was read:
    #: counted once (where classes overlap, the instant goes to one, in the stated precedence), so
    #: the classes add up to ``device_busy_seconds``. Mean over the traced steps.
    device_seconds_by_kernel_class: dict[str, float] = field(default_factory=dict)
    #: Summed kernel durations per class per step (overlapping streams both count): the time
    #: each class's kernels ran, which may add up to more than the step. Mean over the steps.
    kernel_seconds_summed_by_class: dict[str, float] = field(default_factory=dict)
    #: Per step, the time the device ran any kernel, copy or memset on any stream, and the time
    #: it ran none (together the step); mean over the traced steps. None without a device trace.
    device_busy_seconds: float | None = None
    device_idle_seconds: float | None = None
    #: Micro-batches (forward and backward passes) per optimizer step: above 1 under gradient
    #: accumulation, where a step's seconds cover all of them.
    micro_batches_per_step: int = 1

    def take_device_time(self, traced: Breakdown) -> None:
        """Take the device's time (busy, idle, kernel classes) from a trace's breakdown, where
        it read a device; the phases stay as they were measured."""
        if traced.device_busy_seconds is None and not traced.kernel_seconds_summed_by_class:
            return
        self.device_seconds_by_kernel_class = dict(traced.device_seconds_by_kernel_class)
        self.kernel_seconds_summed_by_class = dict(traced.kernel_seconds_summed_by_class)
        self.device_busy_seconds = traced.device_busy_seconds
        self.device_idle_seconds = traced.device_idle_seconds

    @property
    def device_idle_share(self) -> float | None:
        """The share of the step the device sat idle, when a device trace was read."""
        busy, idle = self.device_busy_seconds, self.device_idle_seconds
        if busy is None or idle is None or not busy + idle > 0:
            return None
        return idle / (busy + idle)

    def ordered(self) -> list[tuple[str, float]]:
        """Phases in report order, known phases first, then any others by name."""
        known = [(p, self.seconds[p]) for p in PHASES if p in self.seconds]
        rest = sorted((k, v) for k, v in self.seconds.items() if k not in PHASES)
        return known + rest


@dataclass
class Borderline:
    """The value that decides a finding, when its interval straddles the line it is judged
    against: the finding is shown one severity below that line, and the CI gate reads a change
    across the line as no change (a rerun may land on either side)."""

    #: The severity the line gives ("warn", "critical"), or "" for a rule's own line, which
    #: decides whether the finding is raised at all: a finding borderline there is info.
    line_severity: str = ""
    #: For the reader: ``data wait 9%–12% of the step, at the 10% line``.
    text: str = ""
    value: float = math.nan
    line: float = math.nan
    low: float = math.nan
    high: float = math.nan


@dataclass
class Finding:
    """One cause of lost time: the unit the report ranks."""

    #: Stable dotted id, e.g. "attention.math_fallback"; the CI gate diffs findings by id.
    id: str = ""
    category: Category = "compute"
    severity: Severity = "info"
    title: str = ""
    #: What a skeptical engineer needs to believe it: numbers, op names, shapes.
    evidence: dict[str, Any] = field(default_factory=dict)
    #: Seconds per iteration this would save if fixed, or None when it cannot be said.
    est_seconds_saved_per_it: float | None = None
    #: Whether the saving was measured by an A/B run, estimated, or read off a trace.
    saving_basis: Basis = "none"
    #: The part of the saving the measurement is sure of (the low end of an A/B's interval), when
    #: it differs from the saving: severity is graded on it, so a saving that hovers at a
    #: boundary does not flip severity between reruns. None: the saving itself.
    sure_seconds_saved_per_it: float | None = None
    #: The high end of the saving's interval, when the saving came from samples (A/B rounds,
    #: timed steps). With the sure saving it is the interval severity is graded on: one that
    #: straddles a severity's line makes the finding borderline. None: the saving itself.
    high_seconds_saved_per_it: float | None = None
    #: Set when the deciding value straddles its line (see :class:`Borderline`).
    borderline: Borderline | None = None
    #: The phases of the step (keys of :data:`PHASES`) the saving lives in: it is never more than
    #: their time. Empty: bounded by the whole step only.
    phases: list[str] = field(default_factory=list)
    #: The concrete setting, flag or command that fixes it.
    fix: str = ""
    #: A longer explanation for the report (plain text).
    detail: str = ""
    #: The probe or trace rule that produced it.
    source: str = ""


@dataclass
class Check:
    """One question a probe or a trace rule asked, and its answer.

    The report's findings, its "checked and found fine" and its "could not be checked" lists are
    three views of the checks: a check id has one outcome in a record, so they cannot disagree.
    The id of a question that can end in a finding is that finding's id.
    """

    id: str = ""
    outcome: Outcome = "ok"
    #: One line for the reader: the finding's title, what was found fine, or why it could not be
    #: judged here.
    text: str = ""
    #: The probe or trace rule that asked ("optimizer", "trace:dataloader").
    source: str = ""


@dataclass
class ProbeResult:
    """What one probe (or the trace rules) reported: the one result type of every check.

    A probe never takes the run down: failures land here.
    """

    name: str = ""
    status: ProbeStatus = "ok"
    duration_seconds: float = 0.0
    #: Why it was skipped, or the one-line error.
    reason: str = ""
    traceback: str = ""
    #: What the probe found. Handed over to RunRecord.findings (deduplicated by id) when the record
    #: is assembled, so in a saved record this list is empty.
    findings: list[Finding] = field(default_factory=list)
    #: Probe-specific measurements for the report (tables, A/B numbers). JSON-serialisable.
    data: dict[str, Any] = field(default_factory=dict)
    #: Every question it asked and the answer (findings included, by id and title).
    checks: list[Check] = field(default_factory=list)
    #: The machine's load from other work while the probe ran (its A/B comparisons' window).
    host_load: HostLoad | None = None

    def add_ok(self, check_id: str, text: str, source: str = "") -> None:
        """Record a check that was made and found fine."""
        self.checks.append(Check(check_id, "ok", text, source))

    def add_not_judged(self, check_id: str, text: str, source: str = "") -> None:
        """Record a question that could not be judged here, and why."""
        self.checks.append(Check(check_id, "not_judged", text, source))

    def add_finding(self, finding: Finding) -> None:
        """Record a finding (its check is added when the result is settled)."""
        self.findings.append(finding)

    def settle_checks(self, source: str) -> None:
        """Every finding gets its check; every check names its source."""
        have = {(c.id, c.outcome) for c in self.checks}
        for finding in self.findings:
            finding.source = finding.source or source
            if (finding.id, "finding") not in have:
                self.checks.append(
                    Check(finding.id, "finding", finding.title or finding.id, finding.source)
                )
                have.add((finding.id, "finding"))
        for check in self.checks:
            check.source = check.source or source

    def checks_with(self, outcome: Outcome) -> list[Check]:
        return [c for c in self.checks if c.outcome == outcome]


@dataclass
class OpStat:
    """An operator's cost over the profiled steps, per step."""

    name: str = ""
    calls_per_step: float = 0.0
    self_cpu_seconds: float = 0.0
    self_device_seconds: float = 0.0
    cpu_total_seconds: float = 0.0
    #: Input shapes and dtypes of the most expensive call signature, when recorded.
    input_shapes: str = ""
    input_dtypes: str = ""


@dataclass
class ModelInfo:
    """The model that was trained (run mode)."""

    preset: str = ""
    size: str = ""
    class_name: str = ""
    source: str = ""  # "config (random weights)" or the --model folder
    parameters: int = 0
    trainable_parameters: int = 0
    lora_modules: int = 0
    text_encoders: list[str] = field(default_factory=list)
    vae: str = ""


@dataclass
class RankStat:
    """One rank of a multi-process (DDP/FSDP) run or of a folder of rank traces."""

    rank: int = 0
    world_size: int | None = None
    #: The trace file this rank was read from (its name), or "" for a run's own process.
    source: str = ""
    #: Seconds of each analysed step (profiled steps of a trace; timed steps of a run).
    step_seconds: list[float] = field(default_factory=list)
    #: Seconds per phase (median over the steps), as :attr:`Breakdown.seconds`.
    phases: dict[str, float] = field(default_factory=dict)
    #: Seconds per step inside collectives (all-reduce, all-gather, ...), overlaps counted once.
    comm_seconds: float = 0.0
    #: The part of ``comm_seconds`` during which this rank computed nothing else.
    exposed_comm_seconds: float = 0.0
    #: Seconds per step this rank spent in collectives beyond the least any rank spent in the
    #: same step's collectives: its wait for slower ranks (clock-independent).
    wait_seconds: float = 0.0
    #: Collective seconds per step by kind ("all_reduce", "all_gather", ...).
    comm_by_kind: dict[str, float] = field(default_factory=dict)
    #: True for the rank whose steps the record's ``timing`` holds: the one the job runs at the
    #: pace of (the straggler, else the slowest median step).
    paces: bool = False

    @property
    def median_seconds(self) -> float:
        return Stats.of(self.step_seconds).median


@dataclass
class RunRecord:
    """The contract between measuring and reporting."""

    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    created: str = ""
    mode: Mode = "run"
    device: DeviceInfo = field(default_factory=DeviceInfo)
    inventory: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    model: ModelInfo = field(default_factory=ModelInfo)
    timing: Timing = field(default_factory=Timing)
    breakdown: Breakdown = field(default_factory=Breakdown)
    findings: list[Finding] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    top_ops: list[OpStat] = field(default_factory=list)
    #: Path of the saved profiler trace, relative to the record's folder when it lies inside it.
    trace_path: str = ""
    #: The command line that reproduces this run.
    command: str = ""
    #: Things the reader should know that are not findings (e.g. "steps too few for a spread").
    notes: list[str] = field(default_factory=list)
    #: Per-rank data of a multi-process run or a folder of rank traces (empty for one process).
    #: ``timing`` then holds the slowest rank's steps: the job runs at that rank's pace.
    ranks: list[RankStat] = field(default_factory=list)
    #: Where the command's own wall time went, in order ("start-up", "inventory", "build",
    #: "warm-up steps", "timed steps", "profiled steps", "trace analysis", "probe <name>",
    #: "record and report"): seconds each.
    wall_seconds: dict[str, float] = field(default_factory=dict)
    #: The step's counted FLOPs against the device's peaks (MFU); None when the trace had no
    #: shapes to count from (see :mod:`diagnose.roofline`).
    utilisation: Utilisation | None = None

    def all_checks(self) -> list[Check]:
        """Every check of every probe and trace rule, in probe order."""
        return [c for p in self.probes for c in p.checks]

    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(dataclasses.asdict(self))  # type: ignore[no-any-return]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    def save(self, path: Path) -> None:
        from diagnose.output import write_text_atomic

        write_text_atomic(path, self.to_json() + "\n")


def step_seconds(record: RunRecord) -> float | None:
    """The step the savings are shares of: the s/it the report leads with, when there is one
    (with several resolution buckets, the s/it of the run's bucket mix)."""
    if not record.timing.headline.n:
        return None
    step = record.timing.per_iteration
    if math.isfinite(step) and step > 0:
        return step
    return None


def phase_bound(record: RunRecord, phases: Sequence[str]) -> float | None:
    """Seconds per step of ``phases`` as the report's phase bar shows them (scaled to the headline
    step when the bar was measured on other steps), or None when none of them was measured."""
    seconds = record.breakdown.seconds
    known = [seconds[p] for p in phases if p in seconds and math.isfinite(seconds[p])]
    if not known:
        return None
    total = sum(v for v in seconds.values() if math.isfinite(v))
    step = step_seconds(record)
    scale = step / total if step is not None and total > step else 1.0
    return sum(known) * scale


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _to_jsonable(value: Any) -> Any:
    """Replace non-finite floats (not valid JSON) by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    return value


def new_record(mode: Mode) -> RunRecord:
    return RunRecord(mode=mode, created=utc_now_iso())


__all__ = [
    "CATEGORIES",
    "OUTCOMES",
    "PHASES",
    "PHASE_LABELS",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "Borderline",
    "Breakdown",
    "Check",
    "DeviceInfo",
    "ExitCode",
    "Finding",
    "HostLoad",
    "ModelInfo",
    "OpStat",
    "ProbeResult",
    "RankStat",
    "RunRecord",
    "Stats",
    "StepSample",
    "Timing",
    "new_record",
    "utc_now_iso",
]
