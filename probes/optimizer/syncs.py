"""What the optimizer step waits for: host-device synchronisations inside ``optimizer.step()``.

The profiler records the runtime calls that block the host (``cudaDeviceSynchronize``, a
blocking ``hipMemcpy``, ...: :func:`diagnose.catalogs.compute_catalog.is_blocking_call`, the one
definition the trace reading uses too); :func:`count_step_syncs` counts those that start inside
an optimizer-step span (pure, so constructed events can test it), and
:func:`sync_in_step_finding` turns the count into ``optimizer.sync_in_step``, worded by the
catalog as the trace rule's, its cost measured by the A/B against torch AdamW (fused) where the
probe has one. A ``.item()`` is a sync only through such a call inside it: on the CPU, or a CPU
tensor, there is nothing to wait for, and reads are counted, never called stalls.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose import torch_compat
from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.catalogs.compute_catalog import is_blocking_call
from diagnose.errors import first_line
from diagnose.quiet import native_stderr_filtered
from diagnose.record import Finding
from diagnose.units import ms

#: around ``step`` ("Optimizer.step#AdamW.step"); syncs inside either are counted.
PROBE_STEP_SPAN = "diagnose::optimizer_probe.step"
STEP_SPAN_PREFIXES: tuple[str, ...] = ("Optimizer.step#", PROBE_STEP_SPAN)
#: aten ops that read a tensor's value into Python (``.item()``, ``float(t)``). On a GPU tensor
#: they block through a runtime call inside them; on a CPU tensor (torch AdamW's step counters)
#: they make none.
SCALAR_READ_OPS: tuple[str, str] = ("aten::_local_scalar_dense", "aten::item")
#: Names of CUDA/HIP runtime calls: any one of them shows the device tracer recorded the runtime.
RUNTIME_PREFIXES: tuple[str, str] = ("cuda", "hip")


@dataclass(frozen=True)
class MeasuredCost:
    """What the synchronising step costs, from the A/B of step() timed alone without the
    profiler: the configured optimizer against torch AdamW (fused) on the same tensors."""

    seconds: float
    #: The part the A/B is sure of (the low end of its interval).
    sure_seconds: float
    against: str


# --------------------------------------------------------------------------------------------
# Host syncs inside the step (pure)


@dataclass
class ProfiledEvent:
    """One profiler event, reduced to what the sync count needs (times in microseconds)."""

    name: str
    start_us: float
    end_us: float
    thread: int = 0


@dataclass
class StepSyncs:
    """What the profiled optimizer steps waited for."""

    #: Step spans found (top-level; nested Optimizer.step# spans count once).
    steps: int = 0
    #: Blocking runtime calls inside the steps, and the host time spent in them.
    host_syncs: int = 0
    host_sync_seconds: float = 0.0
    #: ``.item()``-style reads inside the steps (max of aten::item and _local_scalar_dense, as
    #: one nests in the other).
    scalar_reads: int = 0
    by_name: dict[str, int] = field(default_factory=dict)
    #: Whether the trace holds any CUDA/HIP runtime call at all (none on the CPU, or when the
    #: profiler's device tracer did not start).
    runtime_events_seen: bool = False

    def per_step(self, count: float) -> float:
        return count / self.steps if self.steps else 0.0


def _is_step_span(name: str) -> bool:
    return name.startswith(STEP_SPAN_PREFIXES)


def count_step_syncs(events: Sequence[ProfiledEvent]) -> StepSyncs:
    """Count host syncs and scalar reads that start inside optimizer-step spans."""
    spans = sorted((e for e in events if _is_step_span(e.name)), key=lambda e: e.start_us)
    merged: list[ProfiledEvent] = []
    for span in spans:
        last = next((m for m in reversed(merged) if m.thread == span.thread), None)
        if last is not None and span.start_us < last.end_us:
            last.end_us = max(last.end_us, span.end_us)  # nested or overlapping: one step
        else:
            merged.append(ProfiledEvent(span.name, span.start_us, span.end_us, span.thread))
    result = StepSyncs(steps=len(merged))
    result.runtime_events_seen = any(e.name.startswith(RUNTIME_PREFIXES) for e in events)
    reads: dict[str, int] = dict.fromkeys(SCALAR_READ_OPS, 0)
    for event in events:
        is_sync = is_blocking_call(event.name)
        if not is_sync and event.name not in reads:
            continue
        # Runtime calls carry the OS thread id, torch ops the profiler's own thread numbering,
        # so runtime calls are matched by time alone (nothing else launches work meanwhile).
        inside = any(
            m.start_us <= event.start_us < m.end_us and (is_sync or m.thread == event.thread)
            for m in merged
        )
        if not inside:
            continue
        result.by_name[event.name] = result.by_name.get(event.name, 0) + 1
        if is_sync:
            result.host_syncs += 1
            result.host_sync_seconds += max(0.0, event.end_us - event.start_us) * 1e-6
        else:
            reads[event.name] += 1
    result.scalar_reads = max(reads.values())
    return result


def sync_in_step_finding(
    syncs: StepSyncs,
    *,
    device_kind: str,
    running: str,
    running_label: str,
    alone_seconds: float | None = None,
    phase_seconds: float | None = None,
    debug_warnings: int = 0,
    measured: MeasuredCost | None = None,
) -> Finding | None:
    """``optimizer.sync_in_step`` when the step makes the host wait for a GPU.

    On the CPU nothing is a stall, and without any runtime call recorded (a device tracer that
    did not start) a blocking call cannot be told from a read of a CPU tensor: neither is judged
    here (see :func:`sync_question`). ``measured``: the A/B's cost of the synchronising step, the
    finding's saving; without one it claims none (the trace rule estimates it).
    """
    if device_kind == "cpu" or syncs.steps == 0 or not syncs.runtime_events_seen:
        return None
    if syncs.host_syncs == 0 and debug_warnings == 0:
        return None
    evidence: dict[str, Any] = {
        "optimizer": running_label,
        "host_syncs_per_step": round(syncs.per_step(syncs.host_syncs), 2),
        "host_wait_ms_per_step": round(syncs.per_step(syncs.host_sync_seconds) * 1e3, 3),
        "calls_by_name": dict(sorted(syncs.by_name.items())),
        "profiled_steps": syncs.steps,
        "sync_debug_warnings": debug_warnings,
    }
    if alone_seconds is not None:
        evidence["step_ms_timed_alone"] = round(alone_seconds * 1e3, 3)
    if phase_seconds is not None:
        evidence["optimizer_phase_ms_in_the_step"] = round(phase_seconds * 1e3, 3)
    cost_said = ""
    if measured is not None:
        evidence["saving_measured_against"] = measured.against
        cost_said = (
            f"≈{ms(measured.seconds)} per step, measured without the profiler against "
            f"{measured.against} (step() timed alone on the same tensors)"
        )
    calls = {name: syncs.per_step(n) for name, n in syncs.by_name.items() if is_blocking_call(name)}
    return catalog.sync_in_step(
        optimizers=[running_label],
        running=running,
        waits_per_step=syncs.per_step(syncs.host_syncs),
        flagged_by_debug_mode=debug_warnings,
        calls=calls,
        cost_said=cost_said,
        evidence=evidence,
        saving=measured.seconds if measured is not None else None,
        sure_saving=measured.sure_seconds if measured is not None else None,
        basis="measured" if measured is not None else "none",
        detail=(
            "While the host waits it launches nothing, so the device idles between the small "
            "per-tensor kernels of the step once the queue drains. bitsandbytes' 8-bit "
            "optimizers call torch.cuda.synchronize() after each parameter "
            "(bitsandbytes.utils.sync_gpu in Optimizer8bit.step): for a LoRA of hundreds of "
            "small tensors, hundreds of round trips per step. The calls are read from the "
            "profiler's runtime events inside Optimizer.step spans while the probe stepped the "
            "optimizer alone; torch.cuda.set_sync_debug_mode('warn') adds the synchronising torch "
            "operations (.item(), .cpu(), nonzero) with their stacks."
            + (
                " The cost is the A/B's: the same step() without the profiler, this optimizer "
                f"against {measured.against}."
                if measured is not None
                else ""
            )
        ),
    )


def sync_question(syncs: StepSyncs, device_kind: str, running_label: str) -> str | None:
    """Why the step's syncs cannot be judged here (None when they can)."""
    if device_kind == "cpu":
        reads = syncs.per_step(syncs.scalar_reads)
        return f"{running_label}: no device to wait for on the CPU" + (
            f"; its {reads:.0f} .item() reads per step are host reads, not stalls"
            if reads
            else "; no .item() reads in its step"
        )
    if syncs.steps and not syncs.runtime_events_seen:
        return (
            f"{running_label}: the profiler recorded no CUDA/HIP runtime call, so a blocking call "
            "cannot be told from a read of a CPU tensor"
        )
    return None


# --------------------------------------------------------------------------------------------
# Recording the step


def profile_steps(
    step: Callable[[], object], sync: Callable[[], None], device: torch.device, calls: int
) -> list[ProfiledEvent]:
    """The profiler's events over ``calls`` step calls, each inside :data:`PROBE_STEP_SPAN`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with native_stderr_filtered(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            with torch.profiler.record_function(PROBE_STEP_SPAN):
                step()
            sync()
    return _events_of(prof)


def _counted(name: str) -> bool:
    """Whether :func:`count_step_syncs` reads an event of this name (it reads no other)."""
    return (
        is_blocking_call(name)
        or name in SCALAR_READ_OPS
        or _is_step_span(name)
        or name.startswith(RUNTIME_PREFIXES)
    )


def _events_of(prof: Any) -> list[ProfiledEvent]:
    """The events :func:`count_step_syncs` reads, from the profiler's raw results when it can.

    ``prof.events()`` builds the full tree of FunctionEvents (parents, stacks, per-thread
    nesting) in Python: on a CPU-bound step that parse cost more than the steps themselves, and
    the count needs only the names, times and threads of a few kinds of event.
    """
    raw = torch_compat.raw_events(prof, keep=_counted)
    if raw is not None:
        return [
            ProfiledEvent(
                name=e.name, start_us=e.start_ns / 1000.0, end_us=e.end_ns / 1000.0, thread=e.thread
            )
            for e in raw
        ]
    return [
        ProfiledEvent(name=e.name, start_us=e.start_us, end_us=e.end_us, thread=e.thread)
        for e in torch_compat.function_ops(prof, device=False)
        if _counted(e.name)
    ]


def sync_debug_warnings(step: Callable[[], object], calls: int) -> list[dict[str, Any]]:
    """Warnings of ``torch.cuda.set_sync_debug_mode("warn")`` over ``calls`` steps, with stacks.

    GPU only. The previous mode is restored whatever happens.
    """
    caught: list[dict[str, Any]] = []

    def keep(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        caught.append(
            {
                "message": first_line(str(message)),
                "where": f"{filename}:{lineno}",
                "stack": traceback.format_stack(limit=10)[:-1],
            }
        )

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return caught


__all__ = [
    "PROBE_STEP_SPAN",
    "SCALAR_READ_OPS",
    "STEP_SPAN_PREFIXES",
    "MeasuredCost",
    "ProfiledEvent",
    "StepSyncs",
    "count_step_syncs",
    "profile_steps",
    "sync_debug_warnings",
    "sync_in_step_finding",
    "sync_question",
]
