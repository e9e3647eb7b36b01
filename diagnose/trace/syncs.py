"""Where the host blocked until the device caught up: sync calls, blocking device-to-host copies
and ops that read a device value on the host (``.item()``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diagnose.trace.columns import MEMCPY
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.structure import Structure

#: Host API calls that block until the device catches up.
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "hipDeviceSynchronize",
        "hipStreamSynchronize",
        "hipEventSynchronize",
        "cudaMemcpy",
        "hipMemcpy",
        "hipMemcpyWithStream",
        "cudaMemcpy2D",
        "hipMemcpy2D",
        "cuMemcpyDtoH_v2",
        "cuMemcpyDtoH",
        "hipMemcpyDtoH",
    }
)
_ASYNC_COPIES = frozenset({"cudaMemcpyAsync", "hipMemcpyAsync", "cuMemcpyDtoHAsync_v2"})
#: Ops that read a device value on the host (``.item()``, ``bool(tensor)``, ``print``).
SYNC_OPS = frozenset({"aten::_local_scalar_dense"})


@dataclass
class SyncPoints:
    """Host-blocking device synchronisations (outermost only: an ``.item()`` counts once)."""

    ts: npt.NDArray[np.float64]
    dur: npt.NDArray[np.float64]
    names: list[str]
    #: Thread index of each sync.
    thread: npt.NDArray[np.int64]


def find_syncs(trace: ParsedTrace, structure: Structure) -> SyncPoints:
    """Blocking sync calls, blocking device-to-host copies and ``_local_scalar_dense`` ops."""
    host, runtime, device = trace.host, trace.runtime, trace.device
    names = trace.names
    if not len(device):
        empty = np.empty(0)
        return SyncPoints(empty, empty, [], np.empty(0, dtype=np.int64))
    sync_op_ids = [i for i, n in enumerate(names) if n in SYNC_OPS]
    op_mask = (
        np.isin(host.name, np.asarray(sync_op_ids, dtype=np.int32))
        if sync_op_ids
        else (np.zeros(len(host), dtype=bool))
    )
    call_ids = [i for i, n in enumerate(names) if n in SYNC_CALLS]
    call_mask = (
        np.isin(runtime.name, np.asarray(call_ids, dtype=np.int32))
        if call_ids
        else (np.zeros(len(runtime), dtype=bool))
    )
    # An async copy blocks when it is device-to-host into pageable memory: the call returns only
    # after the copy ended on the device.
    async_ids = [i for i, n in enumerate(names) if n in _ASYNC_COPIES]
    if async_ids and len(device):
        is_async = np.isin(runtime.name, np.asarray(async_ids, dtype=np.int32))
        dtoh_ids = [i for i, n in enumerate(names) if n.startswith("Memcpy DtoH")]
        copies = np.flatnonzero(
            (device.kind == MEMCPY)
            & np.isin(device.name, np.asarray(dtoh_ids or [-1], dtype=np.int32))
            & (structure.device_runtime >= 0)
        )
        calls = structure.device_runtime[copies]
        blocking = runtime.ts[calls] + runtime.dur[calls] >= device.ts[copies] + device.dur[copies]
        blocking_calls = calls[blocking & is_async[calls]]
        call_mask[blocking_calls] = True
    # Drop calls made inside a sync op (the op already counts them).
    calls = np.flatnonzero(call_mask)
    if calls.size and op_mask.any():
        op = structure.runtime_op[calls]
        inside = np.zeros(calls.size, dtype=bool)
        current = op.copy()
        while True:
            valid = current >= 0
            if not valid.any():
                break
            inside[valid] |= op_mask[current[valid]]
            current[valid] = structure.parent[current[valid]]
            current[~valid] = -1
        calls = calls[~inside]
    ops = np.flatnonzero(op_mask)
    ts = np.concatenate([host.ts[ops], runtime.ts[calls]])
    dur = np.concatenate([host.dur[ops], runtime.dur[calls]])
    threads = np.concatenate([host.thread[ops], runtime.thread[calls]]).astype(np.int64)
    labels = [names[i] for i in host.name[ops].tolist()] + [
        names[i] for i in runtime.name[calls].tolist()
    ]
    order = np.argsort(ts, kind="stable")
    return SyncPoints(ts[order], dur[order], [labels[i] for i in order.tolist()], threads[order])
