"""How the events of a trace hang together.

* The call tree of host ranges on each thread (parent, root, self time), from time nesting.
* Which runtime call launched each device activity (the ``correlation`` id), and which CPU op
  made that call (the ``External id``, else the innermost op enclosing the call on its thread).
* The role of each thread: the main (training-loop) thread and the autograd (backward) threads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diagnose.trace.reader import ParsedTrace

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

STEP_PREFIX = "ProfilerStep#"
#: record_function labels torch writes itself. The 2021 trace schema files them under "Operator"
#: like real ops; they are labels, not ops, whatever their category.
_LABELS = re.compile(
    r"^(ProfilerStep#|enumerate\(DataLoader\)#|Optimizer\.(step|zero_grad)#|diagnose::)"
)


def is_backward_name(name: str) -> bool:
    """Autograd work: engine nodes, ``*Backward*`` nodes and ops, gradient accumulation."""
    return (
        name.startswith("autograd::engine::evaluate_function")
        or "Backward" in name
        or name.endswith("_backward")
        or "_backward_" in name
        or "AccumulateGrad" in name
    )


@dataclass(frozen=True)
class Structure:
    """Derived, per-event relations. Arrays are indexed like the tables they describe."""

    #: Host: a record_function label (user_annotation, or a label torch writes) rather than an op.
    is_annotation: BoolArray
    #: Host: parent host-range index (-1 for top level) and nesting depth.
    parent: IntArray
    depth: IntArray
    #: Host: the outermost enclosing *operator* (record_function annotations such as ProfilerStep
    #: do not count), the range itself for a top-level op, -1 for an annotation outside any op.
    root_op: IntArray
    #: Host: duration minus the durations of direct children on the same thread.
    self_time: FloatArray
    #: Host: the range or one of its ancestors is autograd work, or it runs on an autograd thread.
    in_backward: BoolArray
    #: Runtime call -> host op that made it (-1 if none).
    runtime_op: IntArray
    #: Device activity -> runtime call that launched it (-1 if not in the trace).
    device_runtime: IntArray
    #: Device activity -> host op that launched it (-1 if not known).
    device_op: IntArray
    #: Device activity: when and on which thread it was launched (NaN / -1 without a launch).
    launch_ts: FloatArray
    launch_thread: IntArray
    #: Thread indexes (into ParsedTrace.threads).
    main_thread: int
    backward_threads: frozenset[int]
    #: Names of host ranges, resolved once (index -> str is needed by several rules).
    backward_name: BoolArray


def build_structure(trace: ParsedTrace) -> Structure:
    host = trace.host
    n = len(host)
    names = trace.names
    unique_names = np.unique(host.name) if n else np.empty(0, dtype=np.int32)
    backward_ids = np.array(
        [i for i in unique_names.tolist() if is_backward_name(names[i])], dtype=np.int32
    )
    backward_name = np.isin(host.name, backward_ids) if n else np.zeros(0, dtype=bool)

    parent, depth = nesting(host.ts, host.dur, host.thread)
    label_ids = [i for i in unique_names.tolist() if _LABELS.match(names[i])]
    is_annotation = host.is_annotation | (
        np.isin(host.name, np.asarray(label_ids, dtype=np.int32)) if label_ids else False
    )
    root_op = _root_ops(parent, depth, is_annotation)
    child_time = np.zeros(n, dtype=np.float64)
    has_parent = parent >= 0
    np.add.at(child_time, parent[has_parent], host.dur[has_parent])
    self_time = np.maximum(host.dur - child_time, 0.0)

    main_thread, backward_threads = _thread_roles(trace, parent, backward_name)
    in_backward = backward_name.copy()
    if backward_threads:
        in_backward |= np.isin(host.thread, np.fromiter(backward_threads, dtype=np.int32))
    # Inherit from ancestors: process by depth so each parent is final before its children.
    if n:
        for level in range(1, int(depth.max()) + 1):
            at_level = np.flatnonzero(depth == level)
            in_backward[at_level] |= in_backward[parent[at_level]]

    runtime_op = _runtime_ops(trace, parent)
    device_runtime = _device_runtime(trace)
    device_op = np.full(len(trace.device), -1, dtype=np.int64)
    launched = device_runtime >= 0
    device_op[launched] = runtime_op[device_runtime[launched]]
    # Kernels without a runtime row (some ROCm traces) still carry the External id of their op.
    missing = np.flatnonzero(device_op < 0)
    if missing.size:
        device_op[missing] = _ops_by_ext_id(host.ext_id, trace.device.ext_id[missing])
    launch_ts = np.full(len(trace.device), np.nan)
    launch_thread = np.full(len(trace.device), -1, dtype=np.int64)
    launch_ts[launched] = trace.runtime.ts[device_runtime[launched]]
    launch_thread[launched] = trace.runtime.thread[device_runtime[launched]]
    by_op = (~launched) & (device_op >= 0)
    launch_ts[by_op] = host.ts[device_op[by_op]]
    launch_thread[by_op] = host.thread[device_op[by_op]]

    return Structure(
        is_annotation=np.asarray(is_annotation, dtype=bool),
        parent=parent,
        depth=depth,
        root_op=root_op,
        self_time=self_time,
        in_backward=in_backward,
        runtime_op=runtime_op,
        device_runtime=device_runtime,
        device_op=device_op,
        launch_ts=launch_ts,
        launch_thread=launch_thread,
        main_thread=main_thread,
        backward_threads=frozenset(backward_threads),
        backward_name=backward_name,
    )


def nesting(
    ts: FloatArray, dur: FloatArray, thread: npt.NDArray[np.int32]
) -> tuple[IntArray, IntArray]:
    """Parent and depth of each range from time nesting on its own thread."""
    n = ts.size
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    if not n:
        return parent, depth
    # Per thread, by start time; at equal starts the longer range is the outer one.
    order = np.lexsort((-dur, ts, thread))
    ends = ts + dur
    th_sorted = thread[order]
    bounds = np.flatnonzero(np.diff(th_sorted)) + 1
    order_list = order.tolist()
    ts_list = ts.tolist()
    end_list = ends.tolist()
    parent_list = [-1] * n
    depth_list = [0] * n
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), n], strict=True):
        stack: list[int] = []
        stack_end: list[float] = []
        for k in range(lo, hi):
            i = order_list[k]
            start = ts_list[i]
            # Pop ranges that ended before this one starts (ties: a range starting exactly where
            # another ends is its sibling, not its child).
            while stack and stack_end[-1] <= start:
                stack.pop()
                stack_end.pop()
            if stack:
                parent_list[i] = stack[-1]
                depth_list[i] = len(stack)
            stack.append(i)
            stack_end.append(end_list[i])
    parent[:] = parent_list
    depth[:] = depth_list
    return parent, depth


def _root_ops(parent: IntArray, depth: IntArray, is_annotation: BoolArray) -> IntArray:
    root = np.where(is_annotation, -1, np.arange(parent.size, dtype=np.int64))
    if not parent.size:
        return root
    for level in range(1, int(depth.max()) + 1):
        at_level = np.flatnonzero(depth == level)
        inherited = root[parent[at_level]]
        root[at_level] = np.where(inherited >= 0, inherited, root[at_level])
    return root


def _thread_roles(
    trace: ParsedTrace, parent: IntArray, backward_name: BoolArray
) -> tuple[int, set[int]]:
    """(main thread, autograd threads).

    The main thread is the one that runs ProfilerStep ranges; without steps, the thread with the
    most top-level forward (non-autograd) time, else the busiest runtime-calling thread. An
    autograd thread is another thread whose top-level time is mostly autograd work: on CUDA/ROCm
    the engine runs backward on its own device thread while the main thread waits.
    """
    host = trace.host
    top = parent < 0
    n_threads = len(trace.threads)
    backward_top = (
        np.bincount(
            host.thread[top & backward_name],
            weights=host.dur[top & backward_name],
            minlength=n_threads,
        )
        if len(host)
        else np.zeros(n_threads)
    )
    all_top = (
        np.bincount(host.thread[top], weights=host.dur[top], minlength=n_threads)
        if len(host)
        else np.zeros(n_threads)
    )

    main = -1
    step_ids = [i for i, name in enumerate(trace.names) if name.startswith(STEP_PREFIX)]
    if step_ids and len(host):
        is_step = np.isin(host.name, np.asarray(step_ids, dtype=np.int32))
        if is_step.any():
            main = int(np.bincount(host.thread[is_step], minlength=n_threads).argmax())
    if main < 0 and len(host):
        forward_top = all_top - backward_top
        if forward_top.max() > 0:
            main = int(forward_top.argmax())
    if main < 0 and len(trace.runtime):
        main = int(np.bincount(trace.runtime.thread, minlength=n_threads).argmax())

    backward: set[int] = set()
    for t in range(n_threads):
        if t != main and all_top[t] > 0 and backward_top[t] >= 0.5 * all_top[t]:
            backward.add(t)
    return main, backward


def _ops_by_ext_id(op_ext: npt.NDArray[np.int64], wanted: npt.NDArray[np.int64]) -> IntArray:
    """Index of the host range with each wanted External id (-1 where none or ambiguous)."""
    result = np.full(wanted.size, -1, dtype=np.int64)
    valid_ops = np.flatnonzero(op_ext > 0)
    if not valid_ops.size or not wanted.size:
        return result
    order = valid_ops[np.argsort(op_ext[valid_ops], kind="stable")]
    sorted_ext = op_ext[order]
    pos = np.searchsorted(sorted_ext, wanted)
    pos_ok = pos < sorted_ext.size
    safe = np.where(pos_ok, pos, 0)
    hit = pos_ok & (sorted_ext[safe] == wanted) & (wanted > 0)
    result[hit] = order[safe[hit]]
    return result


def _runtime_ops(trace: ParsedTrace, parent: IntArray) -> IntArray:
    """For each runtime call, the innermost host op on the same thread that encloses it."""
    host, runtime = trace.host, trace.runtime
    result = _ops_by_ext_id(host.ext_id, runtime.ext_id)
    # Trust the id only when the op really encloses the call on the same thread; Kineto reuses
    # small External ids for annotations in some versions.
    hit = result >= 0
    if hit.any():
        op = result[hit]
        ok = (
            (host.thread[op] == runtime.thread[hit])
            & (host.ts[op] <= runtime.ts[hit] + 1e-3)
            & (host.ts[op] + host.dur[op] >= runtime.ts[hit] - 1e-3)
        )
        idx = np.flatnonzero(hit)
        result[idx[~ok]] = -1
    missing = np.flatnonzero(result < 0)
    if missing.size and len(host):
        result[missing] = _enclosing(trace, parent, runtime.ts[missing], runtime.thread[missing])
    return result


def _enclosing(
    trace: ParsedTrace,
    parent: IntArray,
    points: FloatArray,
    threads: npt.NDArray[np.int32],
) -> IntArray:
    """Innermost host range on ``threads[i]`` that contains ``points[i]`` (-1 if none)."""
    host = trace.host
    out = np.full(points.size, -1, dtype=np.int64)
    ends = host.ts + host.dur
    for thread in np.unique(threads).tolist():
        ops = np.flatnonzero(host.thread == thread)
        if not ops.size:
            continue
        ops = ops[np.lexsort((-host.dur[ops], host.ts[ops]))]
        starts = host.ts[ops]
        which = np.flatnonzero(threads == thread)
        cand = np.searchsorted(starts, points[which], side="right") - 1
        for k, c in zip(which.tolist(), cand.tolist(), strict=True):
            if c < 0:
                continue
            op = int(ops[c])
            t = float(points[k])
            # The latest-starting range may have ended: climb to an ancestor that still runs.
            while op >= 0 and ends[op] < t:
                op = int(parent[op])
            out[k] = op
    return out


def _device_runtime(trace: ParsedTrace) -> IntArray:
    """For each device activity, the runtime call with the same correlation id (-1 if none)."""
    device, runtime = trace.device, trace.runtime
    result = np.full(len(device), -1, dtype=np.int64)
    valid = np.flatnonzero(runtime.correlation >= 0)
    if not valid.size or not len(device):
        return result
    order = valid[np.argsort(runtime.correlation[valid], kind="stable")]
    sorted_corr = runtime.correlation[order]
    pos = np.searchsorted(sorted_corr, device.correlation)
    pos_ok = pos < sorted_corr.size
    safe = np.where(pos_ok, pos, 0)
    hit = pos_ok & (sorted_corr[safe] == device.correlation) & (device.correlation >= 0)
    result[hit] = order[safe[hit]]
    return result
