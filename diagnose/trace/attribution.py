"""Step time beyond the training phases: collectives, allocator calls, and device work whose launch
is not in the trace.

The breakdown charges device work to the phase of the host code that launched it and device-idle
time to what the host was doing meanwhile. What that leaves is named here by what it is:

* **Collectives** (NCCL/RCCL/gloo/MPI/UCC). A collective kernel is communication whoever launched
  it; it counts as such only where no compute runs beside it (the exposed part: waiting for the
  other ranks, or transferring). On the host, the ``c10d::`` ops, ``record_param_comms`` and the
  ``nccl:``/``gloo:`` ranges the process group records; gloo runs the collective on its own
  threads, where it is "in flight" while the training thread waits.
* **Allocator calls** (``cudaMalloc``/``cudaFree``/``hipMalloc``..., the virtual-memory calls of
  expandable segments): the device idles while the caching allocator grows or frees its pool
  (``cudaFree`` also synchronises).
* **Device work without a launch in the trace** (queued before profiling started, or a trace
  captured with GPU activity only): its phase is read from the kernel's class and name where they
  say it (collective and optimizer kernels; torch's and the vendors' backward kernels name
  themselves ``*backward*``, ``*bwd*``, ``wgrad``/``dgrad``/``wrw``), else it is GPU work of
  unknown phase, listed by kernel class in a note.
"""

from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from diagnose.record import PHASE_LABELS, Breakdown
from diagnose.trace.intervals import EMPTY, Intervals, union
from diagnose.trace.kernel_classes import KERNEL_CLASSES
from diagnose.trace.kernels import KernelLabels, in_steps_mask
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.steps import StepSet
from diagnose.trace.structure import Structure
from diagnose.units import ms

if TYPE_CHECKING:
    from diagnose.trace.breakdown import PhaseModel

#: Phases a launch can carry (same names as diagnose.record.PHASES).
LAUNCH_PHASES: tuple[str, ...] = (
    "data_wait",
    "h2d",
    "encode",
    "forward",
    "backward",
    "optimizer",
    "communication",
    "sync",
    "device_work",
    "other",
)
#: Share of the step above which time the breakdown could not place gets a note of its own.
UNPLACED_NOTE_SHARE = 0.02

#: Host ranges that belong to a collective: the c10d op that issues it, the process group's own
#: ranges, and the host backends' work.
COLLECTIVE_HOST = re.compile(
    r"^(c10d::|nccl:|rccl:|gloo:|mpi:|ucc:|record_param_comms$|ProcessGroup\w*::)"
)
#: Runtime and driver calls of the device allocator (plain, async, host-pinned and the virtual
#: memory calls that expandable segments use).
ALLOCATOR_CALL = re.compile(
    r"^(cuda|hip|cu)(Ext)?(Malloc\w*|Free\w*|HostAlloc|HostMalloc\w*|HostFree"
    r"|Mem(Alloc|Free|Create|Map|Unmap|Release|AddressReserve|AddressFree|SetAccess)\w*)$"
)
#: Kernel names that say they compute gradients.
_BACKWARD_KERNEL = re.compile(r"backward|bwd|wgrad|dgrad|(^|[^a-z])wrw([^a-z]|$)", re.IGNORECASE)
#: Kernel names that say they run the forward pass.
_FORWARD_KERNEL = re.compile(r"forward|fwd|fprop", re.IGNORECASE)


def _name_ids(
    trace: ParsedTrace, table_names: npt.NDArray[np.int32], pattern: re.Pattern[str]
) -> npt.NDArray[np.bool_]:
    ids = [i for i in np.unique(table_names).tolist() if pattern.search(trace.names[i])]
    if not ids:
        return np.zeros(table_names.size, dtype=bool)
    return np.isin(table_names, np.asarray(ids, dtype=np.int32))


def collective_ranges(trace: ParsedTrace, structure: Structure) -> tuple[Intervals, Intervals]:
    """(ranges where the training or autograd thread is inside a collective op, ranges where a
    collective runs on another thread: gloo's, while the training thread waits or computes)."""
    host = trace.host
    if not len(host):
        return EMPTY, EMPTY
    mask = _name_ids(trace, host.name, COLLECTIVE_HOST)
    if not mask.any():
        return EMPTY, EMPTY
    training = np.asarray(
        sorted({structure.main_thread, *structure.backward_threads}), dtype=np.int32
    )
    on_training = np.isin(host.thread, training)
    ends = host.ts + host.dur
    own, elsewhere = mask & on_training, mask & ~on_training
    return union(host.ts[own], ends[own]), union(host.ts[elsewhere], ends[elsewhere])


def allocator_ranges(trace: ParsedTrace) -> Intervals:
    """Host time inside device-allocator calls."""
    runtime = trace.runtime
    if not len(runtime):
        return EMPTY
    mask = _name_ids(trace, runtime.name, ALLOCATOR_CALL)
    return union(runtime.ts[mask], runtime.ts[mask] + runtime.dur[mask]) if mask.any() else EMPTY


def phase_from_kernel(
    trace: ParsedTrace, labels: KernelLabels, activities: npt.NDArray[np.int64]
) -> list[str]:
    """For device activities whose launch phase is unknown: "communication", "optimizer",
    "backward" or "forward" where the kernel's class or name says so, else "device_work"."""
    comm = KERNEL_CLASSES.index("communication")
    optimizer = KERNEL_CLASSES.index("optimizer")
    out: list[str] = []
    by_name: dict[int, str] = {}
    for activity in activities.tolist():
        cls = int(labels.classes[activity])
        if cls == comm:
            out.append("communication")
            continue
        if cls == optimizer:
            out.append("optimizer")
            continue
        name_id = int(trace.device.name[activity])
        phase = by_name.get(name_id)
        if phase is None:
            name = trace.names[name_id]
            phase = (
                "backward"
                if _BACKWARD_KERNEL.search(name)
                else "forward"
                if _FORWARD_KERNEL.search(name)
                else "device_work"
            )
            by_name[name_id] = phase
        out.append(phase)
    return out


def fill_between(
    phase: npt.NDArray[np.int8],
    ts: npt.NDArray[np.float64],
    device: npt.NDArray[np.int32],
    unknown: int,
    fillable: tuple[int, ...],
) -> None:
    """Give work of ``unknown`` phase the phase of its neighbours when the work just before and
    just after it on the same device both have that phase (one of ``fillable``): the elementwise
    kernels between two backward kernels are backward. In place."""
    for dev in np.unique(device).tolist():
        order = np.flatnonzero(device == dev)
        order = order[np.argsort(ts[order], kind="stable")]
        seq = phase[order]
        is_unknown = seq == unknown
        if not is_unknown.any():
            continue
        known = np.isin(seq, np.asarray(fillable, dtype=np.int8))
        positions = np.arange(seq.size)
        previous = np.maximum.accumulate(np.where(known, positions, -1))
        following = np.minimum.accumulate(np.where(known, positions, seq.size)[::-1])[::-1]
        ok = is_unknown & (previous >= 0) & (following < seq.size)
        candidates = np.flatnonzero(ok)
        same = seq[previous[candidates]] == seq[following[candidates]]
        chosen = candidates[same]
        phase[order[chosen]] = seq[previous[chosen]]


def placement_notes(
    trace: ParsedTrace,
    kernels: KernelLabels,
    phases: PhaseModel,
    steps: StepSet,
    breakdown: Breakdown,
    primary_device: int,
    launched: npt.NDArray[np.bool_],
) -> list[str]:
    """What the breakdown placed without seeing the launch, and what it could not place at all."""
    notes: list[str] = []
    n_steps = max(len(steps.steps), 1)
    step = statistics.median(w.wall_seconds for w in steps.steps) if steps.steps else 0.0
    device = trace.device
    if len(device) and primary_device >= 0:
        chosen = (device.device == primary_device) & (in_steps_mask(device.ts, steps) >= 0)
        unlaunched = chosen & ~launched
        if unlaunched.any():
            by_phase: dict[str, float] = {}
            for index, seconds in zip(
                phases.device_phase[unlaunched].tolist(),
                (device.dur[unlaunched] / 1e6 / n_steps).tolist(),
                strict=True,
            ):
                name = LAUNCH_PHASES[index]
                by_phase[name] = by_phase.get(name, 0.0) + seconds
            told = ", ".join(
                f"{PHASE_LABELS.get(p, p)} {ms(v)}"
                for p, v in sorted(by_phase.items(), key=lambda kv: -kv[1])
            )
            notes.append(
                f"{int(unlaunched.sum())} device activities in the steps have no launch in the "
                "trace (queued before profiling started, or the trace holds GPU activity only): "
                "their phase is read from the kernel where its class or name says it "
                "(collective, optimizer, backward, forward kernels) or from the work around it "
                "(a kernel between two backward kernels is backward), else it is unknown. Kernel "
                f"time per step: {told}."
            )
        unknown = chosen & (phases.device_phase == LAUNCH_PHASES.index("device_work"))
        exposed = breakdown.seconds.get("device_work", 0.0)
        if unknown.any() and exposed > 0:
            classes = np.bincount(
                kernels.classes[unknown],
                weights=device.dur[unknown] / 1e6 / n_steps,
                minlength=len(KERNEL_CLASSES),
            )
            listed = ", ".join(
                f"{KERNEL_CLASSES[c]} {ms(float(classes[c]))}"
                for c in np.argsort(-classes).tolist()
                if classes[c] > 0
            )
            share = f" ({exposed / step:.0%} of the step)" if step > 0 else ""
            notes.append(
                f"GPU work of unknown phase: {ms(exposed)} per step{share} of device time whose "
                f"launching code is not in the trace. By kernel class: {listed}."
            )
    unplaced = breakdown.seconds.get("other", 0.0)
    if step > 0 and unplaced > UNPLACED_NOTE_SHARE * step:
        notes.append(
            f"{ms(unplaced)} per step ({unplaced / step:.0%} of the step) could not be placed in "
            "any phase and is shown as 'other'."
        )
    return notes


__all__ = [
    "ALLOCATOR_CALL",
    "COLLECTIVE_HOST",
    "allocator_ranges",
    "collective_ranges",
    "phase_from_kernel",
    "placement_notes",
]
