"""Resolution buckets in a trace: which input shape each step trained.

Multi-bucket training (kohya's bucketing, ``--resolution 512,1024``) alternates steps of different
sizes, so their times differ by design; the record then gives each bucket its own s/it and
judges noise within a bucket (:meth:`diagnose.record.Timing.buckets`). A step's shape is read
from ``record_shapes``, from the data that enters the model, never from the DataLoader's, the
sampler's or the optimizer's own ops (a new epoch's ``randperm`` is no image size):

* the batch's host→device copies, when the steps make them (a GPU loop);
* else the set of ``Input Dims`` its forward ops saw, inside the denoiser's first call when the
  trace has module ranges (the text encoder's input, the captions, need not change with the
  images).

Steps that saw the same set are one bucket, named by the first input of the first op whose shapes
differ between buckets; when all steps saw one, a note names it.
"""

from __future__ import annotations

import json
import re

import numpy as np
import numpy.typing as npt

from diagnose.trace.kernels import in_steps_mask
from diagnose.trace.modules import ModuleScopes
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.steps import StepSet
from diagnose.trace.structure import Structure

_Signature = frozenset[int]
#: Ranges whose ops are the loop's own, not the model's: the DataLoader's ``__next__`` (its
#: sampler's ``randperm`` at a new epoch, collate, pinning) and the optimizer's step and zero_grad.
_LOOP_RANGE = re.compile(
    r"enumerate\(DataLoader\)|DataLoader.*__next__|dataloader_next|^Optimizer\.(step|zero_grad)#"
    r"|optimizer_step|optimizer_zero_grad|sampler",
    re.I,
)


def step_buckets(
    trace: ParsedTrace, structure: Structure, steps: StepSet, scopes: ModuleScopes
) -> tuple[list[str], list[str]]:
    """(the bucket of each step, notes). One shape read from the batch's copy names every step;
    buckets are all "" when the forward's ops saw one shape, when the trace did not record shapes,
    or when no shape recurs (nothing to group)."""
    n = len(steps.steps)
    none = [""] * n
    host = trace.host
    if n < 2 or steps.whole_trace or not len(host) or not bool((host.input_dims >= 0).any()):
        return none, []
    step_of = in_steps_mask(host.ts, steps)
    top_level = structure.root_op == np.arange(len(host))
    candidates = (
        top_level
        & (host.thread == structure.main_thread)
        & ~structure.in_backward
        & (host.input_dims >= 0)
        & (step_of >= 0)
        & ~_under_loop_ranges(trace, structure)
    )
    copies = candidates & _copies_to_device(trace, structure)
    if all((copies & (step_of == k)).any() for k in range(n)):
        return _group(trace, [np.flatnonzero(copies & (step_of == k)) for k in range(n)], "copy")
    denoiser = [
        i
        for i, role in enumerate(scopes.role)
        if role == "denoiser"
        and int(scopes.owner[i]) == i
        and int(scopes.thread[i]) == structure.main_thread
    ]
    # Ops that saw no data (only empty or zero-size tensors: a DataLoader's shared-memory storage
    # being set up in some steps and not others) say nothing about the input size.
    ids = np.unique(host.input_dims[candidates])
    empty = ids[[not _carries_data(trace.name_of(int(i))) for i in ids.tolist()]]
    candidates &= ~np.isin(host.input_dims, empty)
    step_ops: list[npt.NDArray[np.int64]] = []
    for k, step in enumerate(steps.steps):
        ops = np.flatnonzero(candidates & (step_of == k))
        inside = [i for i in denoiser if step.start_us <= float(scopes.ts[i]) < step.end_us]
        if inside:
            first = min(inside, key=lambda i: float(scopes.ts[i]))
            ops = ops[(host.ts[ops] >= scopes.ts[first]) & (host.ts[ops] < scopes.end[first])]
        step_ops.append(ops[np.argsort(host.ts[ops], kind="stable")])
    return _group(trace, step_ops, "forward")


def _group(
    trace: ParsedTrace, step_ops: list[npt.NDArray[np.int64]], read_from: str
) -> tuple[list[str], list[str]]:
    """Buckets of steps by the set of shapes their ``step_ops`` saw (``read_from``: "copy" for the
    batch's host→device copies, "forward" for the forward's ops)."""
    host = trace.host
    n = len(step_ops)
    none = [""] * n
    source = (
        "the batch's host→device copy"
        if read_from == "copy"
        else "the shapes each step's forward ops saw (the denoiser's, when the trace names it)"
    )
    step_ops = [ops[np.argsort(host.ts[ops], kind="stable")] for ops in step_ops]
    # The set of shapes a step's ops saw: the same model at the same input size sees the same set,
    # whatever the order its ops ran in.
    signatures: list[_Signature] = [frozenset(host.input_dims[ops].tolist()) for ops in step_ops]
    groups = list(dict.fromkeys(signatures))
    if len(groups) < 2:
        first = next((int(d) for ops in step_ops for d in host.input_dims[ops].tolist()), -1)
        shape = _first_input(trace.name_of(first))
        if not shape:
            return none, []
        # The batch's copy names the shape for sure: each step carries it, as a run's steps do.
        named = [shape] * n if read_from == "copy" else none
        return named, [
            f"Every profiled step trained one input shape ({shape}, read from {source})."
        ]
    if len(groups) == n:
        return none, [
            "Every profiled step saw different input shapes: they are not grouped into "
            "resolution buckets (no shape recurs), so the spread includes the shapes' costs."
        ]
    shared = frozenset.intersection(*groups)
    labels: dict[_Signature, str] = {}
    for ops, signature in zip(step_ops, signatures, strict=True):
        if signature in labels:
            continue
        # Named by the first op whose shapes depend on the bucket: its data input.
        first = next((int(d) for d in host.input_dims[ops].tolist() if d not in shared), -1)
        label = _first_input(trace.name_of(first)) or f"shape {len(labels) + 1}"
        while label in labels.values():
            label += "'"
        labels[signature] = label
    buckets = [labels[sig] for sig in signatures]
    listed = ", ".join(f"{b} ({buckets.count(b)} steps)" for b in dict.fromkeys(buckets))
    return buckets, [
        f"The profiled steps have {len(groups)} input shapes ({listed}), read from {source}: "
        "step time is given per shape, and noise is judged within each one."
    ]


def _under_loop_ranges(trace: ParsedTrace, structure: Structure) -> npt.NDArray[np.bool_]:
    """Host ranges inside the DataLoader's, the optimizer's or a sampler's own ranges: their ops
    handle indices and state, not the model's input."""
    host = trace.host
    ids = [i for i in np.unique(host.name).tolist() if _LOOP_RANGE.search(trace.names[i])]
    under = np.isin(host.name, np.asarray(ids or [-1], dtype=np.int32))
    if len(host):
        for level in range(1, int(structure.depth.max()) + 1):
            at_level = np.flatnonzero(structure.depth == level)
            under[at_level] |= under[structure.parent[at_level]]
    return under


def _copies_to_device(trace: ParsedTrace, structure: Structure) -> npt.NDArray[np.bool_]:
    """Host ranges whose ops launched a host→device copy (a batch's ``.to(device)``)."""
    copies = np.zeros(len(trace.host), dtype=bool)
    device = trace.device
    ids = [i for i in np.unique(device.name).tolist() if trace.names[i].startswith("Memcpy HtoD")]
    launched = (structure.device_op >= 0) & np.isin(
        device.name, np.asarray(ids or [-1], dtype=np.int32)
    )
    roots = structure.root_op[structure.device_op[launched]]
    copies[roots[roots >= 0]] = True
    return copies


def _carries_data(dims_text: str) -> bool:
    """Whether an op's input shapes include a tensor with elements (``[[0],[]]`` has none)."""
    try:
        dims = json.loads(dims_text)
    except ValueError:
        return True  # unreadable: kept, as before
    if not isinstance(dims, list):
        return True
    return any(
        isinstance(d, list) and d and all(isinstance(x, int) and x > 0 for x in d) for d in dims
    )


def _first_input(dims_text: str) -> str:
    """``[[2,4,64,64],[320,4,3,3]]`` → ``2x4x64x64``: an op's first tensor input is its data
    (the activations of a conv, linear or matmul), the rest its weights."""
    try:
        dims = json.loads(dims_text)
    except ValueError:
        return ""
    if not isinstance(dims, list):
        return ""
    shapes = [d for d in dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    if not shapes:
        return ""
    return "x".join(str(x) for x in shapes[0])


__all__ = ["step_buckets"]
