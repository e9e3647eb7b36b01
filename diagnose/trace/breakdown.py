"""Where each step's wall time went: data wait, forward, backward, optimizer, communication, sync,
allocator, idle, and what the trace cannot place.

How a step is split (basis "trace"):

1. Device busy time is charged to the phase that *launched* the work: each kernel/memcpy carries
   the phase of the host at its launch (the runtime call's time and thread). Launch phases, in
   order of precedence: a ``diagnose::<phase>`` range (what ``diagnose run`` emits), a DataLoader
   ``__next__`` range (data_wait), an ``Optimizer.step#``/``Optimizer.zero_grad#`` range
   (optimizer), autograd work (``autograd::engine::evaluate_function``, ``*Backward*`` ops, the
   autograd threads: backward), a blocking sync (sync), a top-level op that only copies host to
   device (h2d), any other op of the training thread (forward). A collective kernel is
   communication whoever launched it. Work whose launch is not in the trace gets its phase from
   the kernel (see :mod:`diagnose.trace.attribution`), else "device_work" (phase unknown).
2. Device idle time is charged to what the host was doing meanwhile, in this order: waiting for
   the next batch (data_wait), blocked in a sync (sync), in an allocator call (allocator), inside
   a collective op (communication), then optimizer, backward, h2d, forward (the host was busy
   launching: launch-bound time), then a collective running on another thread (communication).
   Idle time with none of these is "idle".
3. Without device activity (a CPU trace) the same host ranges split the wall time, and time in no
   range is "host_code": the training thread ran code between ops (Python, untraced native code).

Overlapping device work (two streams) counts once; its phase is the first of backward, forward,
optimizer, encode, h2d, data_wait, sync, device_work, communication that covers it, so a
collective counts only where no compute runs beside it (its exposed part).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnose.record import Breakdown, OpStat
from diagnose.trace.attribution import (
    LAUNCH_PHASES,
    allocator_ranges,
    collective_ranges,
    fill_between,
    phase_from_kernel,
)
from diagnose.trace.columns import MEMCPY
from diagnose.trace.intervals import (
    EMPTY,
    Intervals,
    complement,
    intersect,
    subtract,
    union,
    union_of,
)
from diagnose.trace.kernel_classes import KERNEL_CLASSES
from diagnose.trace.kernels import KernelLabels, KernelTables
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.steps import OPTIMIZER_STEP_RANGE, StepSet, cut_by_stop
from diagnose.trace.structure import Structure
from diagnose.trace.syncs import SyncPoints, find_syncs

_DEVICE_ORDER = (
    "backward",
    "forward",
    "optimizer",
    "encode",
    "h2d",
    "data_wait",
    "sync",
    "device_work",
    "communication",
    "other",
)
#: (host ranges, the phase device-idle time inside them is charged to), in precedence order.
_IDLE_ORDER: tuple[tuple[str, str], ...] = (
    ("data_wait", "data_wait"),
    ("sync", "sync"),
    ("allocator", "allocator"),
    ("collective", "communication"),
    ("optimizer", "optimizer"),
    ("backward", "backward"),
    ("h2d", "h2d"),
    ("encode", "encode"),
    ("forward", "forward"),
    ("collective_elsewhere", "communication"),
)
_DIAGNOSE_PHASES = ("data_wait", "h2d", "encode", "forward", "backward", "optimizer")

#: A DataLoader iterator's ``__next__`` range (torch's, or a trainer's own).
DATALOADER_RANGE = re.compile(r"enumerate\(DataLoader\)|DataLoader.*__next__|dataloader_next", re.I)
_OPTIMIZER = re.compile(r"^Optimizer\.(step|zero_grad)#|optimizer_step|optimizer_zero_grad", re.I)
_DIAGNOSE = re.compile(r"^diagnose::(\w+)$")


@dataclass
class PhaseModel:
    """Host phase intervals and the launch phase of each device activity."""

    host: dict[str, Intervals]
    #: Index into LAUNCH_PHASES per device activity.
    device_phase: npt.NDArray[np.int8]
    #: Union of activity intervals per launch phase (primary device only).
    device_union: dict[str, Intervals]
    syncs: SyncPoints
    #: True when diagnose::<phase> ranges were present (our own traces).
    diagnose_labels: bool
    #: Names of the DataLoader ranges (they name the iterator class), for the evidence.
    dataloader_names: list[str] = field(default_factory=list)


def _name_mask(trace: ParsedTrace, pattern: re.Pattern[str]) -> npt.NDArray[np.bool_]:
    ids = [i for i in np.unique(trace.host.name).tolist() if pattern.search(trace.names[i])]
    if not ids:
        return np.zeros(len(trace.host), dtype=bool)
    return np.isin(trace.host.name, np.asarray(ids, dtype=np.int32))


def _ranges(trace: ParsedTrace, mask: npt.NDArray[np.bool_]) -> Intervals:
    return union(trace.host.ts[mask], trace.host.ts[mask] + trace.host.dur[mask])


def build_phases(
    trace: ParsedTrace,
    structure: Structure,
    primary_device: int,
    kernels: KernelLabels,
    backward: Intervals,
) -> PhaseModel:
    """``backward``: the backward passes (:func:`diagnose.trace.steps.backward_intervals`)."""
    host = trace.host
    main = structure.main_thread
    on_main = host.thread == main
    not_ann = ~structure.is_annotation

    diagnose: dict[str, Intervals] = {}
    diag_mask = _name_mask(trace, _DIAGNOSE)
    if diag_mask.any():
        for index in np.flatnonzero(diag_mask).tolist():
            match = _DIAGNOSE.match(trace.names[int(host.name[index])])
            phase = match.group(1) if match else ""
            if phase in _DIAGNOSE_PHASES:
                diagnose.setdefault(phase, EMPTY)
        for phase in list(diagnose):
            ids = [i for i, n in enumerate(trace.names) if n == f"diagnose::{phase}"]
            diagnose[phase] = _ranges(trace, np.isin(host.name, np.asarray(ids, dtype=np.int32)))
    covered = union_of(diagnose.values())

    data_mask = _name_mask(trace, DATALOADER_RANGE)
    dataloader_names = sorted({trace.names[int(i)] for i in host.name[data_mask].tolist()})
    heuristic: dict[str, Intervals] = {
        "data_wait": _ranges(trace, data_mask),
        "optimizer": _optimizer_intervals(trace, backward),
        "backward": backward,
        "forward": _ranges(trace, on_main & not_ann & ~structure.in_backward),
        "h2d": _h2d_intervals(trace, structure),
        "encode": EMPTY,
    }
    syncs = find_syncs(trace, structure)
    heuristic["sync"] = union(syncs.ts, syncs.end)
    heuristic["allocator"] = allocator_ranges(trace)
    heuristic["collective"], heuristic["collective_elsewhere"] = collective_ranges(trace, structure)

    host_phases: dict[str, Intervals] = {}
    for phase, ranges in heuristic.items():
        own = diagnose.get(phase, EMPTY)
        rest = subtract(ranges, covered) if len(covered) else ranges
        host_phases[phase] = union_of([own, rest]) if len(own) else rest

    device_phase = _launch_phases(trace, structure, diagnose, heuristic, kernels)
    device_union: dict[str, Intervals] = {}
    if len(trace.device) and primary_device >= 0:
        on_device = trace.device.device == primary_device
        for index, phase in enumerate(LAUNCH_PHASES):
            mask = on_device & (device_phase == index)
            if mask.any():
                starts = trace.device.ts[mask]
                device_union[phase] = union(starts, starts + trace.device.dur[mask])
    return PhaseModel(
        host=host_phases,
        device_phase=device_phase,
        device_union=device_union,
        syncs=syncs,
        diagnose_labels=bool(diagnose),
        dataloader_names=dataloader_names,
    )


def _optimizer_intervals(trace: ParsedTrace, backward: Intervals) -> Intervals:
    """The optimizer's own work: its step and zero_grad ranges, less any closure run inside a
    step. ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs the
    forward and the backward inside the step's range: from the step's start to the end of the
    last backward inside it is the closure, and only what follows is the update."""
    host = trace.host
    steps = _name_mask(trace, OPTIMIZER_STEP_RANGE)
    ranges = _ranges(trace, _name_mask(trace, _OPTIMIZER))
    if not steps.any() or not len(backward):
        return ranges
    starts = host.ts[steps]
    ends = starts + host.dur[steps]
    # A step still open when the profiler stopped is cut off (a closure's forward recorded, not
    # its backward), so none of it is read as the update.
    cut = cut_by_stop(trace, ends)
    closure_ends = np.array(
        [
            b if was_cut else inside.ends[-1] if len(inside := backward.clip(a, b)) else a
            for a, b, was_cut in zip(starts.tolist(), ends.tolist(), cut.tolist(), strict=True)
        ],
        dtype=np.float64,
    )
    closures = union(starts, closure_ends)
    return subtract(ranges, closures) if len(closures) else ranges


def _h2d_intervals(trace: ParsedTrace, structure: Structure) -> Intervals:
    """Top-level ops on the main thread whose device work is only host-to-device copies."""
    device = trace.device
    if not len(device):
        return EMPTY
    htod_ids = [i for i, n in enumerate(trace.names) if n.startswith("Memcpy HtoD")]
    launched = np.flatnonzero(structure.device_op >= 0)
    if not launched.size:
        return EMPTY
    roots = structure.root_op[structure.device_op[launched]]
    valid = roots >= 0
    launched, roots = launched[valid], roots[valid]
    is_htod = (device.kind[launched] == MEMCPY) & np.isin(
        device.name[launched], np.asarray(htod_ids or [-1], dtype=np.int32)
    )
    n_host = len(trace.host)
    htod_count = np.bincount(roots[is_htod], minlength=n_host)
    other_count = np.bincount(roots[~is_htod], minlength=n_host)
    candidates = (
        (htod_count > 0)
        & (other_count == 0)
        & (trace.host.thread == structure.main_thread)
        & ~structure.in_backward
    )
    return _ranges(trace, candidates)


def _launch_phases(
    trace: ParsedTrace,
    structure: Structure,
    diagnose: dict[str, Intervals],
    heuristic: dict[str, Intervals],
    kernels: KernelLabels,
) -> npt.NDArray[np.int8]:
    device = trace.device
    n = len(device)
    phase = np.full(n, LAUNCH_PHASES.index("other"), dtype=np.int8)
    if not n:
        return phase
    launch_ts = structure.launch_ts
    known = ~np.isnan(launch_ts)
    safe_ts = np.where(known, launch_ts, -1.0)
    assigned = ~known
    has_ops = len(trace.host) > 0

    def assign(name: str, mask: npt.NDArray[np.bool_]) -> None:
        nonlocal assigned
        take = mask & ~assigned
        phase[take] = LAUNCH_PHASES.index(name)
        assigned |= take

    for name, ranges in diagnose.items():
        assign(name, ranges.contains(safe_ts))
    assign("data_wait", heuristic["data_wait"].contains(safe_ts))
    assign("optimizer", heuristic["optimizer"].contains(safe_ts))
    op = structure.device_op
    by_op = np.zeros(n, dtype=bool)
    by_op[op >= 0] = structure.in_backward[op[op >= 0]]
    backward_thread = (
        np.isin(structure.launch_thread, np.fromiter(structure.backward_threads, dtype=np.int64))
        if structure.backward_threads
        else np.zeros(n, dtype=bool)
    )
    assign("backward", by_op | backward_thread | heuristic["backward"].contains(safe_ts))
    assign("sync", heuristic["sync"].contains(safe_ts))
    assign("h2d", heuristic["h2d"].contains(safe_ts))
    if has_ops:
        assign("forward", (op >= 0) | heuristic["forward"].contains(safe_ts))
    # Whatever its launch, a collective kernel moves data between ranks (or waits for them).
    phase[kernels.classes == KERNEL_CLASSES.index("communication")] = LAUNCH_PHASES.index(
        "communication"
    )
    unplaced = np.flatnonzero(phase == LAUNCH_PHASES.index("other"))
    if unplaced.size:
        phase[unplaced] = [
            LAUNCH_PHASES.index(p) for p in phase_from_kernel(trace, kernels, unplaced)
        ]
        fill_between(
            phase,
            device.ts,
            device.device,
            LAUNCH_PHASES.index("device_work"),
            tuple(LAUNCH_PHASES.index(p) for p in ("forward", "backward", "optimizer")),
        )
    return phase


@dataclass
class StepBreakdown:
    """Seconds per phase of one step; ``seconds`` sums to the step's wall time."""

    number: int
    seconds: dict[str, float]
    #: The part of ``seconds`` that is device-idle time, by what the host was doing meanwhile
    #: ("idle" = nothing traced). Empty on CPU traces.
    device_idle: dict[str, float] = field(default_factory=dict)


def _add(into: dict[str, float], phase: str, micros: float) -> None:
    if micros > 0:
        into[phase] = into.get(phase, 0.0) + micros / 1e6


def step_breakdowns(
    steps: StepSet, phases: PhaseModel, busy: Intervals, has_device: bool
) -> list[StepBreakdown]:
    out: list[StepBreakdown] = []
    for step in steps.steps:
        s, e = step.start_us, step.end_us
        seconds: dict[str, float] = {}
        idle_seconds: dict[str, float] = {}
        step_busy = busy.clip(s, e)
        remaining = step_busy
        for phase in _DEVICE_ORDER:
            ranges = phases.device_union.get(phase)
            if ranges is None or not len(remaining):
                continue
            part = intersect(ranges.clip(s, e), remaining)
            _add(seconds, phase, part.total)
            remaining = subtract(remaining, part)
        _add(seconds, "other", remaining.total)

        idle = complement(step_busy, s, e)
        for key, phase in _IDLE_ORDER:
            ranges = phases.host.get(key, EMPTY)
            if not len(idle) or not len(ranges):
                continue
            part = intersect(ranges.clip(s, e), idle)
            _add(seconds, phase, part.total)
            if has_device:
                _add(idle_seconds, phase, part.total)
            idle = subtract(idle, part)
        leftover = "idle" if has_device else "host_code"
        _add(seconds, leftover, idle.total)
        if has_device:
            _add(idle_seconds, "idle", idle.total)
        out.append(StepBreakdown(step.number, seconds, idle_seconds))
    return out


def summarize_breakdown(
    per_step: list[StepBreakdown],
    kernels: KernelTables,
    steps: StepSet,
    has_device: bool,
) -> Breakdown:
    """Median over steps of each phase (basis "trace"); the device's time (busy, idle, kernel
    classes) as means over the steps, so that its parts add up."""
    phases = sorted({p for b in per_step for p in b.seconds})
    seconds = (
        {p: statistics.median(b.seconds.get(p, 0.0) for b in per_step) for p in phases}
        if per_step
        else {}
    )
    breakdown = Breakdown(
        seconds=seconds,
        basis="trace",
        device_seconds_by_kernel_class=_mean_per_class(kernels.once_per_step),
        kernel_seconds_summed_by_class=_mean_per_class(kernels.summed_per_step),
        micro_batches_per_step=steps.micro_batches,
    )
    if has_device and steps.steps:
        n = len(steps.steps)
        breakdown.device_busy_seconds = sum(w.device_busy_seconds for w in steps.steps) / n
        breakdown.device_idle_seconds = sum(w.device_idle_seconds for w in steps.steps) / n
    return breakdown


def _mean_per_class(per_step: list[dict[str, float]]) -> dict[str, float]:
    classes = sorted({c for d in per_step for c in d})
    return {c: sum(d.get(c, 0.0) for d in per_step) / len(per_step) for c in classes}


def top_ops(
    trace: ParsedTrace,
    structure: Structure,
    steps: StepSet,
    has_device: bool,
    limit: int = 25,
) -> list[OpStat]:
    """Operators by self time per step: device self time on GPU traces, else CPU self time."""
    from diagnose.trace.kernels import in_steps_mask

    host = trace.host
    n_steps = max(len(steps.steps), 1)
    ops = np.flatnonzero((~structure.is_annotation) & (in_steps_mask(host.ts, steps) >= 0))
    if not ops.size:
        return []
    device_self = np.zeros(len(host), dtype=np.float64)
    launched = structure.device_op >= 0
    np.add.at(device_self, structure.device_op[launched], trace.device.dur[launched])

    names = host.name[ops]
    unique, inverse = np.unique(names, return_inverse=True)
    calls = np.bincount(inverse)
    self_cpu = np.bincount(inverse, weights=structure.self_time[ops])
    total_cpu = np.bincount(inverse, weights=host.dur[ops])
    self_dev = np.bincount(inverse, weights=device_self[ops])
    key = self_dev if has_device and self_dev.sum() > 0 else self_cpu
    order = np.lexsort((-self_cpu, -key))[:limit]

    # The most expensive call signature (shapes + dtypes) per op name: group by
    # (name, dims, types) with one lexsort, sum the weights per group, keep each name's heaviest.
    weight = device_self[ops] if has_device else structure.self_time[ops]
    dims, types = host.input_dims[ops], host.input_types[ops]
    order_sig = np.lexsort((types, dims, inverse))
    keys = np.stack([inverse[order_sig], dims[order_sig], types[order_sig]])
    starts = np.flatnonzero(np.concatenate([[True], np.any(keys[:, 1:] != keys[:, :-1], axis=0)]))
    sig_weight = np.add.reduceat(weight[order_sig], starts)
    best_sig: dict[int, tuple[int, int]] = {}
    for g in np.argsort(-sig_weight, kind="stable").tolist():
        first = int(starts[g])
        name_index = int(keys[0, first])
        if name_index not in best_sig:
            best_sig[name_index] = (int(keys[1, first]), int(keys[2, first]))

    result: list[OpStat] = []
    for k in order.tolist():
        dims_id, types_id = best_sig.get(k, (-1, -1))
        shapes, dtypes = trace.name_of(dims_id), trace.name_of(types_id)
        result.append(
            OpStat(
                name=trace.names[int(unique[k])],
                calls_per_step=float(calls[k]) / n_steps,
                self_cpu_seconds=float(self_cpu[k]) / 1e6 / n_steps,
                self_device_seconds=float(self_dev[k]) / 1e6 / n_steps,
                cpu_total_seconds=float(total_cpu[k]) / 1e6 / n_steps,
                input_shapes=compact_dims(shapes),
                input_dtypes=dtypes,
            )
        )
    return result


def compact_dims(text: str) -> str:
    """``[[2,77,768],[768]]`` (as recorded) → ``[2, 77, 768], [768]``; empty shapes dropped."""
    if not text:
        return ""
    try:
        dims = json.loads(text)
    except ValueError:
        return text
    if not isinstance(dims, list):
        return text
    parts = [str(d).replace(" ", "").replace(",", ", ") for d in dims if d not in ([], None, "")]
    return ", ".join(parts)
