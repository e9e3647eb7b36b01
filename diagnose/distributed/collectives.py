"""Collectives in one rank's trace: how long each step spends in them, and how much is exposed.

On a GPU the collectives are the NCCL/RCCL kernels (kernel class "communication"); each kernel's
duration includes the time it waits for the other ranks to arrive. On a CPU (gloo) the work runs
on gloo's own threads and torch records it as ``gloo:<collective>`` ranges there; the training
thread only launches it (``c10d::allreduce_``) and later blocks until it is done.

"Exposed" is the part of the collective time during which the rank computed nothing else: on a
GPU no other kernel or copy ran on the device; on a CPU no operator ran on the training or
autograd threads. Overlaps are counted once (two buckets in flight at once are one wait).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import EMPTY, Intervals, subtract, union
from diagnose.trace.kernel_classes import KERNEL_CLASSES

#: Host ranges that are a collective's own work (gloo/MPI/UCC run it on host threads).
_HOST_COLLECTIVE = re.compile(r"^(gloo|mpi|ucc):")
#: Host names that belong to a collective's launch (used to name a GPU kernel's collective).
_COLLECTIVE_OP = re.compile(r"^(nccl|rccl|gloo|mpi|ucc):|^c10d::|^record_param_comms$")
#: (kind, pattern on the name lower-cased with "_" removed), most specific first.
_KINDS: tuple[tuple[str, str], ...] = (
    ("reduce_scatter", "reducescatter"),
    ("all_gather", "allgather"),
    ("all_reduce", "allreduce"),
    ("all_to_all", "alltoall"),
    ("broadcast", "broadcast"),
    ("send_recv", "sendrecv"),
    ("send_recv", "send"),
    ("send_recv", "recv"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
)
OTHER_KIND = "other"


def collective_kind(name: str) -> str:
    """``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` → ``all_reduce``; unknown → ``other``."""
    flat = name.lower().replace("_", "")
    for kind, pattern in _KINDS:
        if pattern in flat:
            return kind
    return OTHER_KIND


@dataclass
class StepComm:
    """Collective time of one step, microseconds turned into seconds."""

    number: int
    wall_seconds: float
    comm_seconds: float = 0.0
    exposed_seconds: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)


@dataclass
class Communication:
    """Collectives of one trace, per analysed step."""

    #: "device" (NCCL/RCCL kernels), "host" (gloo/MPI ranges) or "" when the trace has none.
    where: str
    steps: list[StepComm]

    @property
    def found(self) -> bool:
        return bool(self.where)

    def median(self, attribute: str) -> float:
        values = [float(getattr(s, attribute)) for s in self.steps]
        return float(np.median(values)) if values else 0.0


def communication_of(ctx: TraceContext) -> Communication:
    """The collectives of each step and their exposed part, read once per context: the
    communication rule judges them, the analysis keeps them for the ranks' comparison."""
    return ctx.read_once("communication", communication)


def communication(ctx: TraceContext) -> Communication:
    """Per-step collective time of a trace (empty ``where`` when it has no collectives)."""
    spans = _device_collectives(ctx)
    where = "device" if spans is not None else ""
    if spans is None:
        spans = _host_collectives(ctx)
        where = "host" if spans is not None else ""
    if spans is None:
        return Communication(where="", steps=[])
    starts, ends, kinds, compute = spans
    by_kind_sets = {
        k: union(starts[kinds == i], ends[kinds == i]) for i, k in enumerate(_KIND_NAMES)
    }
    comm = union(starts, ends)
    exposed = subtract(comm, compute)
    steps: list[StepComm] = []
    for step in ctx.steps.steps:
        s, e = step.start_us, step.end_us
        by_kind = {
            k: spans_k.clip(s, e).total / 1e6 for k, spans_k in by_kind_sets.items() if len(spans_k)
        }
        steps.append(
            StepComm(
                number=step.number,
                wall_seconds=step.wall_seconds,
                comm_seconds=comm.clip(s, e).total / 1e6,
                exposed_seconds=exposed.clip(s, e).total / 1e6,
                by_kind={k: v for k, v in by_kind.items() if v > 0},
            )
        )
    return Communication(where=where, steps=steps)


_KIND_NAMES: tuple[str, ...] = (*dict.fromkeys(k for k, _ in _KINDS), OTHER_KIND)
_Spans = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64], Intervals]


def _kind_index(name: str) -> int:
    return _KIND_NAMES.index(collective_kind(name))


def _device_collectives(ctx: TraceContext) -> _Spans | None:
    device = ctx.trace.device
    if not len(device) or ctx.device.primary_device < 0:
        return None
    on_device = device.device == ctx.device.primary_device
    comm = (ctx.kernels.classes == KERNEL_CLASSES.index("communication")) & on_device
    if not comm.any():
        return None
    index = np.flatnonzero(comm)
    kinds = np.array([_device_kind(ctx, int(i)) for i in index], dtype=np.int64)
    rest = on_device & ~comm
    compute = union(device.ts[rest], device.ts[rest] + device.dur[rest])
    return device.ts[index], device.ts[index] + device.dur[index], kinds, compute


def _device_kind(ctx: TraceContext, activity: int) -> int:
    """The collective a kernel runs: from its name, else from the ops that launched it
    (``ncclDevKernel_Generic`` names no collective; ``nccl:all_reduce`` above it does)."""
    kind = _kind_index(ctx.trace.name_of(int(ctx.trace.device.name[activity])))
    if _KIND_NAMES[kind] != OTHER_KIND:
        return kind
    op = int(ctx.structure.device_op[activity])
    for _ in range(8):
        if op < 0:
            break
        name = ctx.op_name(op)
        if _COLLECTIVE_OP.search(name) and collective_kind(name) != OTHER_KIND:
            return _kind_index(name)
        op = int(ctx.structure.parent[op])
    return kind


def _host_collectives(ctx: TraceContext) -> _Spans | None:
    host = ctx.trace.host
    if not len(host):
        return None
    ids = [i for i, n in enumerate(ctx.trace.names) if _HOST_COLLECTIVE.search(n)]
    if not ids:
        return None
    mask = np.isin(host.name, np.asarray(ids, dtype=np.int32))
    if not mask.any():
        return None
    index = np.flatnonzero(mask)
    kinds = np.array([_kind_index(ctx.op_name(int(i))) for i in index], dtype=np.int64)
    # Compute: operators (not annotations) on the training and autograd threads.
    threads = {ctx.structure.main_thread, *ctx.structure.backward_threads}
    working = (
        ~ctx.structure.is_annotation
        & np.isin(host.thread, np.asarray(sorted(threads), dtype=np.int32))
        & ~mask
    )
    compute = (
        union(host.ts[working], host.ts[working] + host.dur[working]) if working.any() else EMPTY
    )
    return host.ts[index], host.ts[index] + host.dur[index], kinds, compute
