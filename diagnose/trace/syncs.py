"""Where the host blocked until the device caught up: the blocking runtime calls of a trace.

A sync is a runtime call that blocks the host (:func:`diagnose.catalogs.compute_catalog.
is_blocking_call`: a Stream/Device/Event/Ctx synchronize, a synchronous copy) or an asynchronous
device-to-host copy that returned only after the copy ended (into pageable memory). An op that
reads a device value (``.item()``, ``.cpu()``, ``nonzero``, a tensor in an ``if``) is a sync only
through such a call inside it: on a CPU tensor it makes none and costs nothing.

The calls made inside one operator are one sync (``.item()`` copies, then waits on the stream);
a call outside any operator (``torch.cuda.synchronize()`` from Python) is one sync by itself. The
trace analysis' own harness syncs are told apart: ``diagnose run`` synchronises at the edges of
its ``diagnose::<phase>`` ranges, and a synchronize outside any operator after the step's last
device launch closes the step (a timing loop's, ``diagnose profile``'s); neither is the
training code's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diagnose.catalogs.compute_catalog import (
    ASYNC_COPY_CALL,
    BLOCKING_SYNC_CALL,
    is_blocking_call,
)
from diagnose.trace.columns import MEMCPY
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.structure import Structure

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: The phase timer of ``diagnose run`` (its ranges are ``diagnose::<phase>``).
_HARNESS_RANGE = re.compile(r"^(diagnose::|ProfilerStep#)")


@dataclass(frozen=True)
class SyncPoints:
    """The syncs of a trace, one per operator that blocked (or per bare call), in time order."""

    #: First blocking call's start and last one's end (microseconds).
    ts: FloatArray
    end: FloatArray
    #: The call that names it: its synchronize, else its first blocking call
    #: ("cudaStreamSynchronize", "cudaMemcpy"...).
    call: list[str]
    #: Blocking calls in the sync (an ``.item()`` may copy and then wait).
    calls: IntArray
    #: Thread index of the calls.
    thread: IntArray
    #: The innermost operator the calls sit in (-1: none, a call from Python).
    op: IntArray
    #: The innermost host range the calls sit in, operator or label (-1: none).
    range: IntArray
    #: The trace analysis' own synchronisation (diagnose run's phase timer), not the code's.
    harness: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.ts.size)

    @property
    def dur(self) -> FloatArray:
        return np.asarray(self.end - self.ts, dtype=np.float64)


def _no_syncs() -> SyncPoints:
    empty = np.empty(0, dtype=np.float64)
    none = np.empty(0, dtype=np.int64)
    return SyncPoints(empty, empty, [], none, none, none, none, np.empty(0, dtype=bool))


def find_syncs(trace: ParsedTrace, structure: Structure) -> SyncPoints:
    """Every sync of the trace (whatever step it is in). Empty without device activity: a CPU
    trace has nothing to wait for."""
    runtime, device, names = trace.runtime, trace.device, trace.names
    if not len(device) or not len(runtime):
        return _no_syncs()
    ids = np.unique(runtime.name)
    blocking_ids = [i for i in ids.tolist() if is_blocking_call(names[i])]
    blocking = np.isin(runtime.name, np.asarray(blocking_ids or [-1], dtype=np.int32))
    blocking |= _blocking_async_copies(trace, structure, ids)
    calls = np.flatnonzero(blocking)
    if not calls.size:
        return _no_syncs()
    ranges = structure.runtime_op[calls]
    ops = _innermost_op(ranges, structure)
    # One sync per operator (its calls together); a call outside any operator stands alone.
    key = np.where(ops >= 0, ops, -1 - calls.astype(np.int64))
    order = np.lexsort((runtime.ts[calls], key))
    calls, key, ops, ranges = calls[order], key[order], ops[order], ranges[order]
    first = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    ends = runtime.ts[calls] + runtime.dur[calls]
    starts = runtime.ts[calls[first]]
    site_end = np.maximum.reduceat(ends, first)
    count = np.diff(np.append(first, calls.size)).astype(np.int64)
    site_ops, site_ranges = ops[first], ranges[first]
    site_threads = runtime.thread[calls[first]].astype(np.int64)
    harness = _harness(trace, structure, site_ops, site_ranges)
    by_time = np.argsort(starts, kind="stable")
    call_names = [
        _wait_named(names, runtime.name[calls[a : a + c]].tolist())
        for a, c in zip(first.tolist(), count.tolist(), strict=True)
    ]
    return SyncPoints(
        ts=starts[by_time],
        end=site_end[by_time],
        call=[call_names[i] for i in by_time.tolist()],
        calls=count[by_time],
        thread=site_threads[by_time],
        op=site_ops[by_time],
        range=site_ranges[by_time],
        harness=harness[by_time],
    )


def _wait_named(names: list[str], ids: list[int]) -> str:
    """The call that names a sync: its synchronize when it has one (``.item()`` copies and then
    waits on the stream), else its first blocking call."""
    calls = [names[i] for i in ids]
    return next((c for c in calls if BLOCKING_SYNC_CALL.match(c)), calls[0])


def _blocking_async_copies(
    trace: ParsedTrace, structure: Structure, ids: npt.NDArray[np.int32]
) -> npt.NDArray[np.bool_]:
    """Asynchronous copy calls that returned only after their device-to-host copy ended."""
    runtime, device, names = trace.runtime, trace.device, trace.names
    out = np.zeros(len(runtime), dtype=bool)
    async_ids = [i for i in ids.tolist() if ASYNC_COPY_CALL.match(names[i])]
    if not async_ids:
        return out
    dtoh_ids = [i for i in np.unique(device.name).tolist() if _is_device_to_host(names[i])]
    copies = np.flatnonzero(
        (device.kind == MEMCPY)
        & np.isin(device.name, np.asarray(dtoh_ids or [-1], dtype=np.int32))
        & (structure.device_runtime >= 0)
    )
    calls = structure.device_runtime[copies]
    is_async = np.isin(runtime.name[calls], np.asarray(async_ids, dtype=np.int32))
    returned_after = (
        runtime.ts[calls] + runtime.dur[calls] >= device.ts[copies] + device.dur[copies]
    )
    out[calls[is_async & returned_after]] = True
    return out


def _is_device_to_host(name: str) -> bool:
    """Kineto names copies "Memcpy DtoH (Device -> Pageable)"; older traces "Memcpy DtoH"."""
    return name.startswith("Memcpy DtoH") or "Device -> Pageable" in name


def _innermost_op(ranges: IntArray, structure: Structure) -> IntArray:
    """For each host range, itself if it is an operator, else its nearest operator ancestor."""
    current: IntArray = np.array(ranges, dtype=np.int64)
    for _ in range(int(structure.depth.max()) + 1 if structure.depth.size else 0):
        label = (current >= 0) & structure.is_annotation[np.maximum(current, 0)]
        if not label.any():
            break
        current[label] = structure.parent[current[label]]
    return current


def _harness(
    trace: ParsedTrace, structure: Structure, ops: IntArray, ranges: IntArray
) -> npt.NDArray[np.bool_]:
    """Syncs of ``diagnose run``'s phase timer: outside any operator, inside (or between) its
    ``diagnose::<phase>`` ranges only, in a trace that has them."""
    harness = np.zeros(ops.size, dtype=bool)
    names = trace.names
    if not any(n.startswith("diagnose::") for n in names):
        return harness
    host = trace.host
    for k in np.flatnonzero(ops < 0).tolist():
        current = int(ranges[k])
        own = True
        while current >= 0:
            if not _HARNESS_RANGE.match(names[int(host.name[current])]):
                own = False
                break
            current = int(structure.parent[current])
        harness[k] = own
    return harness


def ancestors(structure: Structure, index: int) -> list[int]:
    """The host range ``index`` and its enclosing ranges, innermost first."""
    chain: list[int] = []
    while index >= 0:
        chain.append(index)
        index = int(structure.parent[index])
    return chain


__all__ = ["SyncPoints", "ancestors", "find_syncs"]
