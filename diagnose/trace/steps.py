"""Training steps of a trace and how busy the device was in each.

A step is a ``ProfilerStep#N`` range (torch.profiler writes one per ``prof.step()``) on the main
thread. A loop profiled without a schedule has none; its iterations are then read from the
``Optimizer.step#<Class>.step`` ranges torch wraps every optimizer step in: a step runs from the
end of one optimizer step to the end of the next (the part before the first optimizer step is
left out). Without either, the whole trace is one window. A note says which was done. Per step:
wall time, device busy time (the union of kernel, memcpy and memset intervals on the primary
device, so overlapping streams count once) and device idle time (wall minus busy).
"""

from __future__ import annotations

import itertools
import re
import statistics
from dataclasses import dataclass, field

import numpy as np

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
    #: True when the steps were read from the optimizer steps (no ProfilerStep ranges).
    from_optimizer_steps: bool = False


def device_busy(trace: ParsedTrace, device_index: int) -> Intervals:
    """Union of the activity intervals on one device (index into ``trace.devices``)."""
    if device_index < 0 or not len(trace.device):
        return EMPTY
    on_device = trace.device.device == device_index
    starts = trace.device.ts[on_device]
    return union(starts, starts + trace.device.dur[on_device])


def find_steps(trace: ParsedTrace, structure: Structure, busy: Intervals) -> StepSet:
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

    inferred = False
    if not windows:
        windows = _optimizer_step_windows(trace, structure)
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
    elif len(windows) >= 2 and not inferred:
        others = statistics.median(w.wall_seconds for w in windows[:-1])
        last = windows[-1]
        if others > 0 and last.wall_seconds < _STUB_SHARE * others:
            windows.pop()
            notes.append(
                f"The last step ({last.label}, {last.wall_seconds * 1e3:.2f} ms, under "
                f"{_STUB_SHARE:.0%} of the median step) is the stub torch.profiler leaves when it "
                "stops; it is left out."
            )
    for window in windows:
        window.device_busy_seconds = busy.clip(window.start_us, window.end_us).total / 1e6
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
    return StepSet(windows, whole, notes, from_optimizer_steps=inferred)


def _optimizer_step_windows(trace: ParsedTrace, structure: Structure) -> list[StepWindow]:
    """Steps between the ends of consecutive outermost optimizer steps on the main thread.

    Outermost: a wrapper optimizer (accelerate's) steps the inner one inside its own range, and
    only the outer range ends an iteration. With several optimizer classes stepping side by
    side, the most frequent one marks the iterations. Fewer than two optimizer steps: no windows.
    """
    host = trace.host
    ids = [i for i, n in enumerate(trace.names) if n.startswith(OPTIMIZER_STEP_PREFIX)]
    if not ids or not len(host):
        return []
    mask = np.isin(host.name, np.asarray(ids, dtype=np.int32))
    mask &= host.thread == structure.main_thread
    index = np.flatnonzero(mask)
    if len(index) < 2:
        return []
    order = index[np.argsort(host.ts[index], kind="stable")]
    starts = host.ts[order].astype(float)
    ends = starts + host.dur[order].astype(float)
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
    windows = []
    for number, (a, b) in enumerate(itertools.pairwise(marks), start=1):
        if ends[b] > ends[a]:
            label = f"step {number} (optimizer step to optimizer step)"
            windows.append(StepWindow(number, label, float(ends[a]), float(ends[b])))
    return windows


def _trace_extent(trace: ParsedTrace) -> tuple[float, float]:
    starts: list[float] = []
    ends: list[float] = []
    for table in (trace.host, trace.runtime, trace.device):
        if table.ts.size:
            starts.append(float(table.ts.min()))
            ends.append(float((table.ts + table.dur).max()))
    return (min(starts), max(ends)) if starts else (0.0, 0.0)
