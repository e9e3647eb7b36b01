"""Trace analysis: any torch.profiler (Kineto/Chrome) trace → steps, breakdown, kernels, findings.

One engine serves ``diagnose trace FILE`` (a user's own trainer) and ``diagnose run`` (the trace
it captures). Pure functions returning dataclasses; nothing here plots or prints.

    analysis = analyze_trace(Path("trace.json.gz"))
    record = analysis_to_record(analysis, Path("trace.json.gz"))
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diagnose.distributed.collectives import Communication, communication_of
from diagnose.record import (
    Breakdown,
    Check,
    DeviceInfo,
    Finding,
    OpStat,
    ProbeResult,
    RunRecord,
    StepSample,
    new_record,
)
from diagnose.roofline.utilisation import settle_utilisation
from diagnose.trace.attribution import placement_notes
from diagnose.trace.breakdown import (
    StepBreakdown,
    build_phases,
    step_breakdowns,
    summarize_breakdown,
    top_ops,
)
from diagnose.trace.buckets import step_buckets
from diagnose.trace.context import SAVING_ON_UNPROFILED_STEPS, TraceContext
from diagnose.trace.device import detect_device
from diagnose.trace.kernels import (
    KernelClassStat,
    KernelStat,
    KernelTables,
    kernel_tables,
    label_kernels,
    short_kernel_name,
)
from diagnose.trace.parallel_read import SecondReader
from diagnose.trace.reader import CHUNK_BYTES, ParsedTrace, read_trace
from diagnose.trace.rules import run_rules
from diagnose.trace.steps import StepWindow, backward_intervals, device_busy, find_steps
from diagnose.trace.structure import build_structure
from diagnose.trainers import SIGNS, speak_to_record, trainer_in_trace

__all__ = [
    "StepStat",
    "TraceAnalysis",
    "analysis_to_record",
    "analyze_parsed",
    "analyze_trace",
    "read_trace",
    "scale_savings",
]

#: How the trace breakdown was made, for the report's "how this was measured" line.
BREAKDOWN_METHOD = (
    "From the trace: device-busy time is charged to the phase of the host code that launched "
    "each kernel (a collective kernel to communication, where no compute runs beside it); "
    "device-idle time to what the host was doing meanwhile (waiting for data, blocked in a sync "
    "or an allocator call, inside a collective, running ops of a phase) and otherwise to 'idle'. "
    "Work launched outside the trace is placed by its kernel. Median over the profiled steps."
)
#: Kernel names classed "other" listed in the record (all are counted; the list is for reading).
_UNCLASSIFIED_LISTED = 100


@dataclass
class StepStat:
    """One analysed step."""

    number: int
    label: str
    wall_seconds: float
    device_busy_seconds: float
    device_idle_seconds: float
    #: Seconds per phase; sums to wall_seconds.
    phases: dict[str, float] = field(default_factory=dict)
    #: Device-idle part of ``phases`` by host activity (GPU traces).
    device_idle_by_phase: dict[str, float] = field(default_factory=dict)
    #: Device seconds per kernel class, counted once (they add up to device_busy_seconds).
    kernel_seconds_by_class: dict[str, float] = field(default_factory=dict)
    #: Summed kernel durations per class (overlapping streams both count).
    kernel_seconds_summed_by_class: dict[str, float] = field(default_factory=dict)
    #: The input shape the step trained ("2x4x64x64"), when the steps had several; else "".
    bucket: str = ""
    #: Where the step lies in the trace: its first and last instant in the trace's own clock
    #: (microseconds, as the trace's ``ts``), to find it in a trace viewer.
    start_us: float = 0.0
    end_us: float = 0.0


@dataclass
class TraceAnalysis:
    """Everything ``diagnose trace`` reports about one trace."""

    path: str
    device: DeviceInfo
    steps: list[StepStat]
    breakdown: Breakdown
    kernel_classes: list[KernelClassStat]
    top_kernels: list[KernelStat]
    #: Kernel names in class "other" with their total seconds (never dropped, only listed).
    unclassified_kernels: list[tuple[str, float]]
    top_ops: list[OpStat]
    findings: list[Finding]
    #: Every check of every rule (findings included), each sourced ``trace:<rule>``.
    checks: list[Check]
    notes: list[str]
    #: Trace facts: schema, versions, event counts, distributed info, analysis time.
    metadata: dict[str, Any]
    #: Per-rule tables (attention paths, dtype split, data-wait per step...).
    rule_data: dict[str, Any] = field(default_factory=dict)
    #: True when the trace had no ProfilerStep ranges and was analysed as one window.
    whole_trace_window: bool = False
    #: Time in collectives per step (DDP/FSDP traces); ``where`` is empty without collectives.
    communication: Communication = field(default_factory=lambda: Communication("", []))
    #: Rank, world size and backend from the trace's ``distributedInfo`` (None when absent).
    rank: int | None = None
    world_size: int | None = None


def analyze_trace(
    path: Path,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    parallel: bool | None = None,
    ahead: SecondReader | None = None,
    unprofiled_step_seconds: float | None = None,
) -> TraceAnalysis:
    """Read and analyse a trace file. Raises DiagnoseError(BAD_INPUT) on unusable input.
    ``parallel``, ``ahead``: as :func:`read_trace` (None: a second process reads along when it
    pays). ``unprofiled_step_seconds``: as :func:`analyze_parsed`."""
    started = time.perf_counter()
    parsed = read_trace(path, chunk_bytes=chunk_bytes, parallel=parallel, ahead=ahead)
    read_seconds = time.perf_counter() - started
    analysis = analyze_parsed(parsed, unprofiled_step_seconds=unprofiled_step_seconds)
    analysis.metadata["read_seconds"] = read_seconds
    analysis.metadata["read_processes"] = len(parsed.pieces_read)
    analysis.metadata["analysis_seconds"] = time.perf_counter() - started - read_seconds
    return analysis


def analyze_parsed(
    trace: ParsedTrace, *, unprofiled_step_seconds: float | None = None
) -> TraceAnalysis:
    """Analyse an already-read trace (what ``diagnose run`` calls on the trace it captured).

    ``unprofiled_step_seconds``: the median step the caller timed without the profiler (``diagnose
    run``, ``diagnose profile``); the rules that read host time then judge on that basis (the
    profiler's per-launch overhead taken out), else on the profiled steps, saying so."""
    structure = build_structure(trace)
    device = detect_device(trace)
    busy = device_busy(trace, device.primary_device)
    has_device = len(busy) > 0
    backward = backward_intervals(trace, structure)
    steps = find_steps(trace, structure, busy, backward)
    labels = label_kernels(trace, structure)
    tables = kernel_tables(trace, labels, steps, device.primary_device)
    phases = build_phases(trace, structure, device.primary_device, labels, backward)
    per_step = step_breakdowns(steps, phases, busy, has_device)
    breakdown = summarize_breakdown(per_step, tables, steps, has_device)
    ctx = TraceContext(
        trace=trace,
        structure=structure,
        device=device,
        steps=steps,
        busy=busy,
        has_device=has_device,
        kernels=labels,
        kernel_tables=tables,
        phases=phases,
        per_step=per_step,
        breakdown=breakdown,
        unprofiled_step_seconds=unprofiled_step_seconds,
    )
    results = run_rules(ctx)
    comm = communication_of(ctx)

    buckets, bucket_notes = step_buckets(trace, structure, steps, ctx.modules())
    notes = list(steps.notes)
    notes.extend(bucket_notes)
    notes.extend(_coverage_notes(ctx))
    findings = [f for r in results for f in r.findings]
    return TraceAnalysis(
        path=trace.path,
        device=device.info,
        steps=_step_stats(steps.steps, per_step, tables, buckets, trace.base_us),
        breakdown=breakdown,
        kernel_classes=tables.classes,
        top_kernels=tables.top,
        unclassified_kernels=tables.unclassified,
        top_ops=top_ops(trace, structure, steps, has_device),
        findings=findings,
        checks=[c for r in results for c in r.checks],
        notes=notes,
        metadata=_metadata(ctx),
        rule_data={r.name: r.data for r in results if r.data},
        whole_trace_window=steps.whole_trace,
        communication=comm,
        rank=device.rank,
        world_size=device.world_size,
    )


def _step_stats(
    windows: list[StepWindow],
    per_step: list[StepBreakdown],
    kernels: KernelTables,
    buckets: list[str],
    base_us: float,
) -> list[StepStat]:
    return [
        StepStat(
            number=w.number,
            label=w.label,
            wall_seconds=w.wall_seconds,
            device_busy_seconds=w.device_busy_seconds,
            device_idle_seconds=w.device_idle_seconds
            if b.device_idle or w.device_busy_seconds
            else 0.0,
            phases=b.seconds,
            device_idle_by_phase=b.device_idle,
            kernel_seconds_by_class=once,
            kernel_seconds_summed_by_class=summed,
            bucket=bucket,
            start_us=base_us + w.start_us,
            end_us=base_us + w.end_us,
        )
        for w, b, once, summed, bucket in zip(
            windows,
            per_step,
            kernels.once_per_step,
            kernels.summed_per_step,
            buckets,
            strict=True,
        )
    ]


def _coverage_notes(ctx: TraceContext) -> list[str]:
    """Say plainly what the trace lacks and therefore what could not be analysed."""
    notes: list[str] = []
    trace = ctx.trace
    if not ctx.has_device:
        notes.append(
            "No GPU kernels or copies in the trace (a CPU trace, or captured without "
            "ProfilerActivity.CUDA): device busy/idle time, kernel classes and sync rules are "
            "not available."
        )
    if not len(trace.host):
        notes.append(
            "No CPU ops in the trace (GPU activity only): the step cannot be split into data "
            "wait / forward / backward / optimizer by what launched the work, and op-level "
            "rules (precision, attention path, optimizer syncs) cannot run; device time is "
            "placed by kernel (see the note on GPU work of unknown phase)."
        )
    elif ctx.has_device and not len(trace.runtime):
        notes.append(
            "No CUDA/HIP runtime calls in the trace: kernels cannot be tied to the ops that "
            "launched them."
        )
    if ctx.device.other_devices:
        notes.append(
            "Device activity on several devices: the busiest one is analysed, the others "
            f"({', '.join(map(str, ctx.device.other_devices))}) are not."
        )
    if ctx.device.world_size and ctx.device.world_size > 1:
        notes.append(
            f"This is rank {ctx.device.rank} of {ctx.device.world_size} "
            f"({ctx.device.backend or 'distributed'}); other ranks may differ."
        )
    launched = ctx.structure.device_op >= 0
    launched |= ~np.isnan(ctx.structure.launch_ts)
    notes.extend(
        placement_notes(
            trace,
            ctx.kernels,
            ctx.phases,
            ctx.steps,
            ctx.breakdown,
            ctx.device.primary_device,
            launched,
        )
    )
    if ctx.kernel_tables.unclassified:
        names = ctx.kernel_tables.unclassified
        notes.append(
            f"{len(names)} kernel name(s) matched no class and are counted as 'other' "
            f"(e.g. {short_kernel_name(names[0][0], 60)})."
        )
    return notes


def _metadata(ctx: TraceContext) -> dict[str, Any]:
    trace = ctx.trace
    top = trace.top_level
    scalars = {
        k: v
        for k, v in top.items()
        if isinstance(v, (str, int, float, bool)) and k not in ("traceEvents",)
    }
    meta: dict[str, Any] = {
        "trace_fields": scalars,
        "events": trace.counts,
        "streamed_read": trace.streamed,
        "main_thread": list(trace.threads[ctx.structure.main_thread])
        if ctx.structure.main_thread >= 0
        else None,
        "autograd_threads": [
            list(trace.threads[t]) for t in sorted(ctx.structure.backward_threads)
        ],
        "device_evidence": ctx.device.evidence,
        "diagnose_phase_labels": ctx.phases.diagnose_labels,
        "steps_found": len(ctx.steps.steps),
        "trainer": trainer_in_trace(trace.names),
        "whole_trace_window": ctx.steps.whole_trace,
    }
    if ctx.device.rank is not None or ctx.device.world_size is not None:
        meta["distributed"] = {
            "rank": ctx.device.rank,
            "world_size": ctx.device.world_size,
            "backend": ctx.device.backend,
        }
    return meta


def analysis_to_record(analysis: TraceAnalysis, trace_path: Path) -> RunRecord:
    """A RunRecord (mode "trace") from an analysis; trace-only tables go in ProbeResult "trace"."""
    record = new_record("trace")
    record.device = analysis.device
    record.trace_path = str(trace_path)
    record.timing.samples = [
        StepSample(
            index=s.number,
            seconds=s.wall_seconds,
            profiled=True,
            phases=dict(s.phases),
            bucket=s.bucket,
        )
        for s in analysis.steps
    ]
    record.timing.summarize()
    record.breakdown = analysis.breakdown
    record.findings = list(analysis.findings)
    record.top_ops = list(analysis.top_ops)
    record.notes = list(analysis.notes)
    record.inventory = {"trace": analysis.metadata.get("trace_fields", {})}
    data: dict[str, Any] = {
        "steps": [dataclasses.asdict(s) for s in analysis.steps],
        "kernel_classes": [dataclasses.asdict(c) for c in analysis.kernel_classes],
        "top_kernels": [
            {**dataclasses.asdict(k), "short_name": short_kernel_name(k.name)}
            for k in analysis.top_kernels
        ],
        "unclassified_kernels": [
            {"name": name, "total_seconds": seconds}
            for name, seconds in analysis.unclassified_kernels[:_UNCLASSIFIED_LISTED]
        ],
        "unclassified_kernel_count": len(analysis.unclassified_kernels),
        "rules": analysis.rule_data,
        "metadata": analysis.metadata,
        "whole_trace_window": analysis.whole_trace_window,
        "breakdown_method": BREAKDOWN_METHOD,
    }
    record.probes = [
        ProbeResult(
            name="trace",
            status="ok",
            duration_seconds=float(analysis.metadata.get("read_seconds", 0.0))
            + float(analysis.metadata.get("analysis_seconds", 0.0)),
            data=_jsonable(data),
            checks=list(analysis.checks),
        )
    ]
    trainer = analysis.metadata.get("trainer")
    if trainer:
        speak_to_record(record, trainer, f"the trace holds {SIGNS[trainer].ranges_seen_as}")
    settle_utilisation(record)
    return record


def scale_savings(findings: list[Finding], scale: float) -> None:
    """Savings read off the profiled steps, as the same share of the unprofiled step (``scale``:
    unprofiled / profiled median), so none is larger than the step it is part of. A finding whose
    rule already judged on the unprofiled step keeps its saving."""
    for finding in findings:
        saving = finding.est_seconds_saved_per_it
        if saving is None or finding.evidence.get(SAVING_ON_UNPROFILED_STEPS):
            continue
        finding.evidence = {
            **finding.evidence,
            "saving_in_profiled_steps_seconds": saving,
            "saving_scaled_by": scale,
        }
        finding.est_seconds_saved_per_it = saving * scale
        if finding.sure_seconds_saved_per_it is not None:
            finding.sure_seconds_saved_per_it *= scale
        if finding.high_seconds_saved_per_it is not None:
            finding.high_seconds_saved_per_it *= scale


def _jsonable(value: Any) -> Any:
    """numpy scalars and tuples → plain JSON types (the record is written with json.dumps)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
