"""Training steps of a trace and how busy the device was in each.

A step is a ``ProfilerStep#N`` range (torch.profiler writes one per ``prof.step()``) on the main
thread. A loop profiled without a schedule has none; its iterations are then read from the
``Optimizer.step#<Class>.step`` ranges torch wraps every optimizer step in: a step runs from the
end of one optimizer step to the end of the next (the part before the first optimizer step is
left out). Without either, the whole trace is one window. A note says which was done. Per step:
wall time, device busy time (the union of kernel, memcpy and memset intervals on the primary
device, so overlapping streams count once) and device idle time (wall minus busy).

A training step is one optimizer step. With gradient accumulation it holds several micro-batches
(a forward and a backward pass each); their number is the count of backward passes that end in
the step. A loop that calls ``prof.step()`` once per micro-batch (Lightning's profiler does) marks
micro-batches, not steps: when the optimizer stepped in only some of its ProfilerSteps, every N
of them alike, the steps are read from the optimizer steps instead, and a note says so.
"""

from __future__ import annotations

import itertools
import re
import statistics
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnose.trace.intervals import EMPTY, Intervals, union
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.structure import STEP_PREFIX, Structure

_STEP_NUMBER = re.compile(r"ProfilerStep#(\d+)")
#: torch.optim.Optimizer wraps every step() in a record_function of this name (any subclass:
#: torch's own, bitsandbytes', accelerate's wrapper).
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
#: An optimizer step's range: torch's, or a trainer's own (Lightning's ``optimizer_step``).
OPTIMIZER_STEP_RANGE = re.compile(r"^Optimizer\.step#|optimizer_step", re.I)
#: A final step shorter than this share of the median step is the stub that torch.profiler leaves
#: when it stops (the range from the last ``step()`` call to ``stop()``), not a training step.
_STUB_SHARE = 0.1
#: Float rounding allowed (microseconds) between a range's end and the profiler's stop.
_CUT_TOLERANCE_US = 1.0
#: A step this many times the median is called out as warm-up or a stall.
_SLOW_STEP = 2.0


@dataclass
class StepWindow:
    """One training step (or the whole trace when there are no step markers)."""

    number: int
    label: str
    start_us: float
    end_us: float
    device_busy_seconds: float = 0.0
    #: Backward passes that ended in the step (micro-batches under gradient accumulation).
    backward_passes: int = 0

    @property
    def wall_seconds(self) -> float:
        return (self.end_us - self.start_us) / 1e6

    @property
    def device_idle_seconds(self) -> float:
        return max(self.wall_seconds - self.device_busy_seconds, 0.0)


@dataclass
class StepSet:
    steps: list[StepWindow]
    #: True when the trace had no ProfilerStep ranges and the whole trace is one window.
    whole_trace: bool
    notes: list[str] = field(default_factory=list)
    #: True when the steps were read from the optimizer steps (no ProfilerStep ranges, or
    #: ProfilerStep ranges that marked micro-batches).
    from_optimizer_steps: bool = False
    #: Forward and backward passes per optimizer step (gradient accumulation), when every step
    #: had the same number; 1 otherwise, and for traces without backward passes.
    micro_batches: int = 1


def device_busy(trace: ParsedTrace, device_index: int) -> Intervals:
    """Union of the activity intervals on one device (index into ``trace.devices``)."""
    if device_index < 0 or not len(trace.device):
        return EMPTY
    on_device = trace.device.device == device_index
    starts = trace.device.ts[on_device]
    return union(starts, starts + trace.device.dur[on_device])


def backward_intervals(trace: ParsedTrace, structure: Structure) -> Intervals:
    """The backward passes: autograd ranges, with the gaps between them closed while the main
    thread runs nothing else, so that each pass is one interval.

    On a GPU the engine runs on its own thread and the main thread waits inside ``backward()``
    with no op open; small gaps between engine nodes are still backward. Two passes stay apart
    when the main thread ran an op between them (the next micro-batch's forward).
    """
    host = trace.host
    mask = structure.in_backward & ~structure.is_annotation
    ranges = union(host.ts[mask], host.ts[mask] + host.dur[mask])
    if len(ranges) < 2:
        return ranges
    ops = ~structure.is_annotation
    others = (host.thread == structure.main_thread) & ~structure.in_backward & ops
    other_starts = np.sort(host.ts[others])
    gap_lo, gap_hi = ranges.ends[:-1], ranges.starts[1:]
    busy_in_gap = np.searchsorted(other_starts, gap_hi, side="left") - np.searchsorted(
        other_starts, gap_lo, side="left"
    )
    closable = busy_in_gap == 0
    fills_s, fills_e = gap_lo[closable], gap_hi[closable]
    return union(np.concatenate([ranges.starts, fills_s]), np.concatenate([ranges.ends, fills_e]))


def find_steps(
    trace: ParsedTrace, structure: Structure, busy: Intervals, backward: Intervals
) -> StepSet:
    """The training steps; ``backward`` holds the backward passes (:func:`backward_intervals`)."""
    host = trace.host
    notes: list[str] = []
    step_ids = [i for i, name in enumerate(trace.names) if name.startswith(STEP_PREFIX)]
    windows: list[StepWindow] = []
    if step_ids and len(host):
        is_step = np.isin(host.name, np.asarray(step_ids, dtype=np.int32))
        is_step &= host.thread == structure.main_thread
        for i in np.flatnonzero(is_step).tolist():
            label = trace.names[int(host.name[i])]
            match = _STEP_NUMBER.match(label)
            number = int(match.group(1)) if match else len(windows)
            start = float(host.ts[i])
            windows.append(StepWindow(number, label, start, start + float(host.dur[i])))
    windows.sort(key=lambda w: w.start_us)
    windows = [w for w in windows if w.end_us > w.start_us]

    optimizer_ends = _optimizer_step_ends(trace, structure)
    inferred = False
    if windows:
        per_step = _micro_batch_markers(windows, optimizer_ends, backward)
        if per_step is not None:
            windows = _optimizer_step_windows(optimizer_ends[optimizer_ends <= windows[-1].end_us])
            inferred = True
            notes.append(
                f"The ProfilerStep ranges mark micro-batches, not training steps: the optimizer "
                f"stepped once every {per_step} of them (gradient accumulation, with the "
                f"profiler stepped per batch, as Lightning's is). A step here runs from the end "
                f"of one optimizer.step() to the end of the next and holds its {per_step} "
                f"micro-batches."
            )
    else:
        windows = _optimizer_step_windows(optimizer_ends)
        inferred = bool(windows)
        if inferred:
            notes.append(
                f"No ProfilerStep ranges in the trace (the loop did not call prof.step()): the "
                f"{len(windows)} steps are read from the optimizer steps, each from the end of one "
                "optimizer.step() to the end of the next (the part before the first one is left "
                "out; with gradient accumulation a step spans all its micro-batches)."
            )
    whole = not windows
    if whole:
        start, end = _trace_extent(trace)
        windows = [StepWindow(0, "whole trace", start, end)]
        notes.append(
            "No ProfilerStep ranges in the trace (the loop did not call prof.step()): the whole "
            f"trace ({(end - start) / 1e3:.1f} ms) is analysed as one window, so per-step numbers "
            "are per trace."
        )
    for window in windows:
        window.device_busy_seconds = busy.clip(window.start_us, window.end_us).total / 1e6
        window.backward_passes = _passes_ending_in(backward, window.start_us, window.end_us)
    if not whole and len(windows) >= 2 and not inferred:
        others = statistics.median(w.wall_seconds for w in windows[:-1])
        last = windows[-1]
        # The stub holds no training step: in a training trace a last range with a backward pass
        # in it is a step, however short beside steps a busy machine stretched.
        stepped = last.backward_passes > 0 and any(w.backward_passes for w in windows[:-1])
        if others > 0 and last.wall_seconds < _STUB_SHARE * others and not stepped:
            windows.pop()
            notes.append(
                f"The last step ({last.label}, {last.wall_seconds * 1e3:.2f} ms, under "
                f"{_STUB_SHARE:.0%} of the median step) is the stub torch.profiler leaves when it "
                "stops; it is left out."
            )
    if len(windows) >= 3:
        typical = statistics.median(w.wall_seconds for w in windows)
        slow = [w for w in windows if w.wall_seconds > _SLOW_STEP * typical]
        if slow:
            listed = ", ".join(f"{w.label} ({w.wall_seconds * 1e3:.1f} ms)" for w in slow[:3])
            notes.append(
                f"Step(s) {listed} took over {_SLOW_STEP:.0f}x the median step "
                f"({typical * 1e3:.1f} ms): warm-up (compilation, autotuning, allocation) or a "
                "stall; per-step numbers are medians, so they do not dominate."
            )
    if not whole and len(windows) == 1:
        notes.append("Only one profiled step: there is no spread to report.")
    micro_batches = 1
    if not whole:
        micro_batches, note = _micro_batches(windows)
        notes.extend(note)
    return StepSet(
        windows, whole, notes, from_optimizer_steps=inferred, micro_batches=micro_batches
    )


def _passes_ending_in(backward: Intervals, start_us: float, end_us: float) -> int:
    ends = backward.ends
    return int(
        np.searchsorted(ends, end_us, side="right") - np.searchsorted(ends, start_us, side="right")
    )


def _micro_batches(windows: list[StepWindow]) -> tuple[int, list[str]]:
    """Backward passes per step when every step had the same number (1 without any), and a
    note when they differed."""
    counts = sorted({w.backward_passes for w in windows})
    if counts == [0]:
        return 1, []
    if len(counts) == 1:
        return counts[0], []
    return 1, [
        f"The steps held {counts[0]} to {counts[-1]} backward passes each (uneven gradient "
        "accumulation, or a step cut by the profiler's start or stop): per-step numbers mix "
        "steps of different sizes."
    ]


def _micro_batch_markers(
    windows: list[StepWindow], optimizer_ends: npt.NDArray[np.float64], backward: Intervals
) -> int | None:
    """The micro-batches per optimizer step when the ProfilerSteps mark micro-batches: some of
    them saw no optimizer step, each held one backward pass at most, and every optimizer step
    came after the same number N ≥ 2 of backward passes. None otherwise: the markers are steps
    (an irregular pattern, such as a GradScaler skipping steps, is read as steps)."""
    starts = np.asarray([w.start_us for w in windows])
    ends = np.asarray([w.end_us for w in windows])
    # Only the optimizer steps that ended inside the marked span are held against the markers
    # (in a trace without the profiler's own window, one cut by the stop ends after them).
    optimizer_ends = optimizer_ends[optimizer_ends <= ends[-1]]
    if len(optimizer_ends) < 2 or len(windows) < 2:
        return None
    stepped = (np.searchsorted(optimizer_ends, ends, side="right")) - np.searchsorted(
        optimizer_ends, starts, side="right"
    )
    if (stepped > 0).all():
        return None
    if any(_passes_ending_in(backward, w.start_us, w.end_us) > 1 for w in windows):
        return None
    between = {
        _passes_ending_in(backward, float(a), float(b))
        for a, b in itertools.pairwise(optimizer_ends.tolist())
    }
    if len(between) != 1 or (per_step := between.pop()) < 2:
        return None
    return per_step


def cut_by_stop(trace: ParsedTrace, ends: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
    """Which ranges ending at ``ends`` were still open when torch.profiler stopped: they end
    after its own window (its "Trace" event), where it closed them, not where they ended. A
    trace without that event has none known."""
    stop = trace.profiler_stop_us
    if stop is None:
        return np.zeros(len(ends), dtype=bool)
    return np.asarray(ends > stop + _CUT_TOLERANCE_US, dtype=bool)


def _optimizer_step_ends(trace: ParsedTrace, structure: Structure) -> npt.NDArray[np.float64]:
    """When each optimizer step ended, in order: the outermost ``Optimizer.step#`` ranges on the
    main thread.

    Outermost: a wrapper optimizer (accelerate's) steps the inner one inside its own range, and
    only the outer range ends an iteration. With several optimizer classes stepping side by
    side, the most frequent one marks the iterations.
    """
    host = trace.host
    ids = [i for i, n in enumerate(trace.names) if n.startswith(OPTIMIZER_STEP_PREFIX)]
    if not ids or not len(host):
        return np.zeros(0)
    mask = np.isin(host.name, np.asarray(ids, dtype=np.int32))
    mask &= host.thread == structure.main_thread
    index = np.flatnonzero(mask)
    if not len(index):
        return np.zeros(0)
    order = index[np.argsort(host.ts[index], kind="stable")]
    starts = host.ts[order].astype(float)
    ends = starts + host.dur[order].astype(float)
    # A step still open when the profiler stopped ends where it was closed, not where it did.
    whole = ~cut_by_stop(trace, ends)
    order, starts, ends = order[whole], starts[whole], ends[whole]
    if not len(order):
        return np.zeros(0)
    outer: list[int] = []
    reach = -np.inf
    for k in range(len(order)):
        if ends[k] <= reach:  # inside the previous outermost optimizer step
            continue
        outer.append(k)
        reach = max(reach, ends[k])
    names = [int(host.name[order[k]]) for k in outer]
    common = max(set(names), key=names.count)
    marks = [k for k, name in zip(outer, names, strict=True) if name == common]
    return np.asarray(ends[marks], dtype=np.float64)


def _optimizer_step_windows(optimizer_ends: npt.NDArray[np.float64]) -> list[StepWindow]:
    """Steps between the ends of consecutive optimizer steps (none with fewer than two)."""
    windows = []
    for number, (a, b) in enumerate(itertools.pairwise(optimizer_ends.tolist()), start=1):
        if b > a:
            label = f"step {number} (optimizer step to optimizer step)"
            windows.append(StepWindow(number, label, a, b))
    return windows


def _trace_extent(trace: ParsedTrace) -> tuple[float, float]:
    starts: list[float] = []
    ends: list[float] = []
    for table in (trace.host, trace.runtime, trace.device):
        if table.ts.size:
            starts.append(float(table.ts.min()))
            ends.append(float((table.ts + table.dur).max()))
    return (min(starts), max(ends)) if starts else (0.0, 0.0)
