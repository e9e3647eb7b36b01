"""One reading of the syncs of the whole step: how many, where each one sits, what they cost.

Each sync (:mod:`diagnose.trace.syncs`) in the analysed steps is placed by the range around it:
the optimizer's step (of which class), the DataLoader, the backward, a range the code labels, a
module of the forward, or by its position in the step (between the backward and
``optimizer.step()``: gradient norms read for clipping; after it: logging). Syncs the trace
analysis' harness made, and a bare synchronize that closes the step after its last launch, are
counted apart and not judged.

Cost, per step, of the syncs at one place:

* read off the trace: from each sync's start to the device's next work (or the step's end), the
  host was blocked or the device idle because the queue had drained. Windows are cut where the
  next sync starts (it takes over) and leave out the host's data wait (the loader's time is its
  own finding). On the unprofiled basis, when the unprofiled step is known, the profiler's
  per-launch overhead (profiled minus unprofiled step, over the step's launches) is taken out of
  every launch made inside a window; trace-only, the windows stay as profiled.
* estimated without the profiler: that, plus for every sync that waits on work launched since the
  previous one, what such a wait costs an unprofiled host beyond the trace's reading
  (:data:`~diagnose.catalogs.compute_catalog.UNPROFILED_WAIT_US`: the profiled host reaches each
  wait after the device drained, the unprofiled one while its work still runs).

Never more than the step. Pure: a function of the trace context.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnose.catalogs.compute_catalog import UNPROFILED_WAIT_US
from diagnose.trace.breakdown import DATALOADER_RANGE
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import EMPTY, Intervals, subtract, union
from diagnose.trace.modules import class_of
from diagnose.trace.steps import OPTIMIZER_STEP_RANGE
from diagnose.trace.syncs import SyncPoints, ancestors

#: An optimizer's own ranges: its step (which names the class) and zero_grad.
_OPTIMIZER_RANGE = re.compile(r"^Optimizer\.(step|zero_grad)#(\w+)\.")
#: Labels torch, trainers' loops and this project write themselves: not the code's own ranges.
_TOOL_LABEL = re.compile(
    r"^(ProfilerStep#|enumerate\(DataLoader\)|Optimizer\.|diagnose::|## |\[Module\]|nn\.Module:)"
)
#: Ops that read a tensor's value into Python.
_SCALAR_READ = frozenset({"aten::item", "aten::_local_scalar_dense"})
#: Ops that copy to the host.
_TO_HOST = frozenset({"aten::to", "aten::_to_copy", "aten::copy_", "aten::cpu", "aten::tolist"})
#: Ops whose output shape depends on the values (they must read a count back).
_DATA_DEPENDENT = re.compile(
    r"^aten::(nonzero|nonzero_static|masked_select|unique\w*|repeat_interleave|index)$"
)
#: A gradient-norm op: what a clipping loop computes before reading it.
_NORM = re.compile(r"linalg_vector_norm|^aten::norm$|_foreach_norm|clip_grad", re.I)


@dataclass
class SyncPlace:
    """The syncs at one place of the step, per step."""

    #: A key of diagnose.catalogs.compute_catalog.SYNC_PLACES, or "optimizer".
    place: str
    #: What blocks: ".item()", ".cpu()", "torch.cuda.synchronize()", an op's name.
    what: str
    #: The optimizer's step range ("Optimizer.step#AdamW8bit.step") for the optimizer's place.
    optimizer: str = ""
    #: The ops, modules or labelled ranges the syncs sat in, most frequent first.
    where: list[str] = field(default_factory=list)
    syncs_per_step: float = 0.0
    #: Blocking calls by name, over the analysed steps.
    calls: dict[str, int] = field(default_factory=dict)
    #: Per step: host blocked or device idle from the syncs to the device's next work.
    read_off_seconds: float = 0.0
    #: Per step: syncs that wait on work launched since the previous one.
    waits_per_step: float = 0.0
    #: Per step, without the profiler (read-off plus the waits' unprofiled cost).
    estimate_seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "place": self.place,
            "what": self.what,
            "optimizer": self.optimizer,
            "where": self.where[:5],
            "syncs_per_step": self.syncs_per_step,
            "calls_in_profiled_steps": self.calls,
            "read_off_seconds_per_step": self.read_off_seconds,
            "waits_per_step": self.waits_per_step,
            "estimate_seconds_per_step": self.estimate_seconds,
        }


@dataclass
class SyncReading:
    """Every sync of the analysed steps, placed and costed."""

    #: False on traces where syncs cannot be judged (no device, no runtime calls); ``reason``.
    judged: bool
    reason: str = ""
    places: list[SyncPlace] = field(default_factory=list)
    syncs_per_step: float = 0.0
    #: Per step, all places together (never more than the step).
    read_off_seconds: float = 0.0
    estimate_seconds: float = 0.0
    #: The step the costs are shares of: unprofiled when known, else the profiled one.
    step_seconds: float = 0.0
    unprofiled_known: bool = False
    #: Profiler's host time per launch taken out of the windows (µs; 0 when not known).
    per_launch_overhead_us: float = 0.0
    #: Syncs per step of the analysis' harness and closing the step (not judged).
    harness_per_step: float = 0.0
    closing_per_step: float = 0.0
    #: The windows (profiled timeline) in the steps: what other rules must not count again.
    windows: Intervals = EMPTY

    def place(self, key: str) -> list[SyncPlace]:
        return [p for p in self.places if p.place == key]

    def to_dict(self) -> dict[str, object]:
        return {
            "judged": self.judged,
            "reason": self.reason,
            "syncs_per_step": self.syncs_per_step,
            "read_off_seconds_per_step": self.read_off_seconds,
            "estimate_seconds_per_step": self.estimate_seconds,
            "step_seconds": self.step_seconds,
            "step_basis": "unprofiled" if self.unprofiled_known else "profiled",
            "profiler_us_per_launch_taken_out": self.per_launch_overhead_us,
            "unprofiled_wait_us": UNPROFILED_WAIT_US,
            "harness_syncs_per_step": self.harness_per_step,
            "step_closing_syncs_per_step": self.closing_per_step,
            "places": [p.to_dict() for p in self.places],
        }


def syncs_of(ctx: TraceContext) -> SyncReading:
    """The syncs of the whole step, placed and costed, read once per context: the sync rule reports
    them, the launch rule leaves their time out."""
    return ctx.read_once("syncs", read_syncs)


def read_syncs(ctx: TraceContext) -> SyncReading:
    """The syncs of the analysed steps (see the module's docstring)."""
    syncs = ctx.phases.syncs
    if not ctx.has_device:
        return SyncReading(False, "a trace without device activity has no device to wait for")
    if not len(ctx.trace.runtime):
        return SyncReading(
            False, "the trace has no CUDA/HIP runtime calls, so no blocking call can be seen"
        )
    if ctx.steps.whole_trace:
        return SyncReading(False, "the trace has no steps to read the syncs per step in")
    n = ctx.n_steps
    step_of = ctx.step_of(syncs.ts)
    closing = _closes_its_step(ctx, syncs, step_of)
    judged = (step_of >= 0) & ~syncs.harness & ~closing
    reading = SyncReading(
        True,
        harness_per_step=float(((step_of >= 0) & syncs.harness).sum()) / n,
        closing_per_step=float(((step_of >= 0) & closing).sum()) / n,
    )
    overhead = ctx.profiler_us_per_launch()
    reading.unprofiled_known = ctx.unprofiled_step_seconds is not None
    reading.per_launch_overhead_us = overhead
    reading.step_seconds = ctx.step_seconds
    sites = np.flatnonzero(judged)
    if not sites.size:
        return reading
    starts, ends, windows = _windows(ctx, syncs, sites, step_of)
    launches = ctx.launch_times()
    in_window = np.searchsorted(launches, ends, side="left") - np.searchsorted(
        launches, starts, side="left"
    )
    busy_inside = np.array(
        [ctx.busy.clip(s, e).total for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    )
    read_off = np.maximum(ends - starts - overhead * in_window, busy_inside)
    read_off = np.maximum(read_off, 0.0)
    waits = _waits_on_work(syncs, sites, launches, ctx)
    estimate = read_off + waits * UNPROFILED_WAIT_US
    reading.windows = windows
    keys = [_place(ctx, syncs, int(i)) for i in sites.tolist()]
    groups: dict[tuple[str, str, str], list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault((key.place, key.what, key.optimizer), []).append(k)
    for (place, what, optimizer), members in groups.items():
        rows = np.asarray(members)
        reading.places.append(
            SyncPlace(
                place=place,
                what=what,
                optimizer=optimizer,
                where=[w for w, _ in Counter(keys[k].where for k in members).most_common() if w],
                syncs_per_step=rows.size / n,
                calls=dict(Counter(syncs.call[int(sites[k])] for k in members).most_common()),
                read_off_seconds=float(read_off[rows].sum()) / 1e6 / n,
                waits_per_step=float(waits[rows].sum()) / n,
                estimate_seconds=float(estimate[rows].sum()) / 1e6 / n,
            )
        )
    reading.places.sort(key=lambda p: -p.estimate_seconds)
    reading.syncs_per_step = sites.size / n
    step = reading.step_seconds
    reading.read_off_seconds = min(float(read_off.sum()) / 1e6 / n, step)
    reading.estimate_seconds = min(float(estimate.sum()) / 1e6 / n, step)
    return reading


def _windows(
    ctx: TraceContext, syncs: SyncPoints, sites: npt.NDArray[np.intp], step_of: npt.NDArray[np.intp]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], Intervals]:
    """Each sync's window: from its start to the device's next work after it returned, cut at
    the step's end and at the next sync's start; the host's data wait left out. (starts, ends
    whose lengths are the windows' less the data wait, the windows as a set of intervals)."""
    busy = ctx.busy
    starts = syncs.ts[sites]
    returned = syncs.end[sites]
    step_end = np.array([ctx.steps.steps[int(k)].end_us for k in step_of[sites].tolist()])
    running = busy.contains(returned)
    nxt = np.searchsorted(busy.starts, returned, side="left")
    has_next = nxt < busy.starts.size
    next_work = np.where(has_next, busy.starts[np.minimum(nxt, busy.starts.size - 1)], step_end)
    next_work = np.where(running, returned, next_work)
    ends = np.minimum(np.maximum(next_work, returned), step_end)
    following = np.append(starts[1:], np.inf)
    ends = np.minimum(ends, np.maximum(following, starts))
    ends = np.maximum(ends, starts)
    windows = union(starts, ends)
    data = ctx.phases.host.get("data_wait", EMPTY)
    if not len(data):
        return starts, ends, windows
    kept = np.array(
        [
            subtract(union([s], [e]), data.clip(s, e)).total if e > s else 0.0
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
    )
    return starts, starts + kept, subtract(windows, data)


def _waits_on_work(
    syncs: SyncPoints,
    sites: npt.NDArray[np.intp],
    launches: npt.NDArray[np.float64],
    ctx: TraceContext,
) -> npt.NDArray[np.float64]:
    """1 for a sync that waits on device work launched since the previous sync (or, for the
    first, since its step began; its own copy counts), else 0: only those block on work in
    flight."""
    starts = syncs.ts[sites]
    returned = syncs.end[sites]
    previous = np.concatenate([[-np.inf], syncs.end[sites][:-1]])
    step_start = np.array([ctx.steps.steps[int(k)].start_us for k in ctx.step_of(starts).tolist()])
    since = np.maximum(previous, step_start)
    launched = np.searchsorted(launches, returned, side="left") - np.searchsorted(
        launches, since, side="left"
    )
    blocked = ctx.busy.contains(starts)
    return np.asarray((launched > 0) | blocked, dtype=np.float64)


def _closes_its_step(
    ctx: TraceContext, syncs: SyncPoints, step_of: npt.NDArray[np.intp]
) -> npt.NDArray[np.bool_]:
    """A synchronize outside any operator and any range of the code, with no device work
    launched after it in its step: the end of a timing loop (``diagnose profile``'s), not the
    step's work."""
    out = np.zeros(len(syncs), dtype=bool)
    launches = ctx.launch_times()
    host, names = ctx.trace.host, ctx.trace.names
    for k in np.flatnonzero((syncs.op < 0) & (step_of >= 0)).tolist():
        chain = ancestors(ctx.structure, int(syncs.range[k]))
        if any(not names[int(host.name[i])].startswith("ProfilerStep#") for i in chain):
            continue
        step = ctx.steps.steps[int(step_of[k])]
        later = np.searchsorted(launches, step.end_us) - np.searchsorted(launches, syncs.end[k])
        out[k] = later == 0
    return out


@dataclass(frozen=True)
class _PlaceKey:
    place: str
    what: str
    optimizer: str
    where: str


def _place(ctx: TraceContext, syncs: SyncPoints, k: int) -> _PlaceKey:
    """Where sync ``k`` sits in its step, what makes it, and the op/module/range to name."""
    host, names, structure = ctx.trace.host, ctx.trace.names, ctx.structure
    chain = ancestors(structure, int(syncs.range[k]))
    chain_names = [names[int(host.name[i])] for i in chain]
    ops = [i for i in chain if not structure.is_annotation[i]]
    outer_op = names[int(host.name[ops[-1]])] if ops else ""
    what = _what(syncs.call[k], [names[int(host.name[i])] for i in ops])
    # The op is named only when it says more than what blocked (a user's own op, a module).
    named_op = "" if _says_nothing_more(outer_op, what) else outer_op
    ts = float(syncs.ts[k])
    for name in chain_names:
        match = _OPTIMIZER_RANGE.match(name)
        if match and ctx.phases.host.get("optimizer", EMPTY).contains(np.array([ts]))[0]:
            step_range = next((n for n in chain_names if OPTIMIZER_STEP_RANGE.search(n)), name)
            return _PlaceKey("optimizer", what, step_range, named_op)
    if any(DATALOADER_RANGE.search(n) for n in chain_names):
        return _PlaceKey("dataloader", what, "", named_op)
    if ops and _copies_to_device(ctx, ops[-1]):
        return _PlaceKey("h2d", ".to(device)", "", "")
    thread = int(syncs.thread[k])
    if (ops and bool(structure.in_backward[ops[0]])) or thread in structure.backward_threads:
        return _PlaceKey("backward", what, "", named_op)
    labels = [
        n
        for i, n in zip(chain, chain_names, strict=True)
        if structure.is_annotation[i] and not _TOOL_LABEL.match(n)
    ]
    if labels:
        return _PlaceKey("labelled", what, "", labels[0])
    return _by_position(ctx, k, what, named_op, ts)


def _by_position(ctx: TraceContext, k: int, what: str, outer_op: str, ts: float) -> _PlaceKey:
    """A sync in no telling range: placed by where it falls among the step's backward and
    optimizer step."""
    step = ctx.steps.steps[int(ctx.step_of(np.array([ts]))[0])]
    backward = ctx.phases.host.get("backward", EMPTY).clip(step.start_us, step.end_us)
    optimizer = ctx.phases.host.get("optimizer", EMPTY).clip(step.start_us, step.end_us)
    first_backward = float(backward.starts[0]) if len(backward) else np.inf
    last_backward = float(backward.ends[-1]) if len(backward) else -np.inf
    next_update = optimizer.starts[optimizer.starts > ts]
    scalar = what == ".item()"
    if ts < first_backward:
        return _PlaceKey("forward", what, "", _module_or_op(ctx, k, outer_op))
    if ts >= last_backward and next_update.size:
        if _after_a_norm(ctx, k, last_backward):
            return _PlaceKey("clipping", what, "", outer_op)
        return _PlaceKey("logging" if scalar else "before_step", what, "", outer_op)
    if ts >= last_backward:
        return _PlaceKey("logging" if scalar else "after_step", what, "", outer_op)
    return _PlaceKey("elsewhere", what, "", outer_op)


def _after_a_norm(ctx: TraceContext, k: int, since: float) -> bool:
    """Whether the host computed a norm on the same thread between ``since`` and the sync."""
    host, names = ctx.trace.host, ctx.trace.names
    thread = int(ctx.phases.syncs.thread[k])
    ts = float(ctx.phases.syncs.ts[k])
    near = np.flatnonzero((host.thread == thread) & (host.ts >= since) & (host.ts < ts))
    return any(_NORM.search(names[int(i)]) for i in np.unique(host.name[near]).tolist())


def _module_or_op(ctx: TraceContext, k: int, outer_op: str) -> str:
    """The module the sync ran in ("Block > Attention"), when the trace has module ranges."""
    scopes = ctx.modules()
    if not len(scopes.names):
        return outer_op
    index = scopes.innermost(int(ctx.phases.syncs.thread[k]), float(ctx.phases.syncs.ts[k]))
    if index < 0:
        return outer_op
    path = " > ".join(class_of(n) for n in scopes.path(index)[-2:])
    return f"{outer_op} in {path}" if outer_op else path


def _copies_to_device(ctx: TraceContext, op: int) -> bool:
    """Whether the top-level op ``op`` copied host to device (a batch's ``.to(device)``)."""
    structure, device, names = ctx.structure, ctx.trace.device, ctx.trace.names
    launched = np.flatnonzero(structure.device_op >= 0)
    mine = launched[structure.root_op[structure.device_op[launched]] == op]
    return any(names[int(i)].startswith("Memcpy HtoD") for i in device.name[mine].tolist())


def _says_nothing_more(op: str, what: str) -> bool:
    """Whether naming ``op`` beside ``what`` would repeat it (``aten::item`` for ".item()")."""
    if not op:
        return True
    return (
        (what == ".item()" and op in _SCALAR_READ)
        or (what == ".cpu()" and op in _TO_HOST)
        or op.removeprefix("aten::") == what
    )


def _what(call: str, ops: list[str]) -> str:
    """What made the sync, from the ops around the blocking call (innermost first)."""
    if "aten::is_nonzero" in ops:
        return "bool(tensor) (a tensor in an if)"
    if any(o in _SCALAR_READ for o in ops):
        return ".item()"
    dependent = next((o for o in ops if _DATA_DEPENDENT.match(o)), "")
    if dependent:
        return dependent.removeprefix("aten::")
    if any(o in _TO_HOST for o in ops):
        return ".cpu()"
    if ops:
        return ops[-1]
    if "Device" in call or "Ctx" in call:
        return "torch.cuda.synchronize()"
    if "Stream" in call or "Event" in call:
        return "stream or event waits"
    return "blocking copies"


__all__ = ["SyncPlace", "SyncReading", "read_syncs", "syncs_of"]
