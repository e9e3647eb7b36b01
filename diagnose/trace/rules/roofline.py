"""Roofline input: the work (FLOPs) and memory traffic of one training step, from the shapes the
trace recorded for each op (``record_shapes``).

Only ops inside the analysed steps count, and each piece of work once: the outermost op of a
compute kind is counted and the compute ops nested under it are not (``aten::linear`` over
``aten::addmm``, ``aten::conv2d`` over ``aten::convolution`` over the backend's convolution,
``scaled_dot_product_attention`` over its math path's ``bmm``). When the outermost op cannot be
counted (its arguments were not recorded) the ops nested under it are tried instead. The FLOPs of
one op are :func:`diagnose.roofline.op_work.op_work`'s (torch.utils.flop_counter's conventions).

What the trace does not record is inferred where the trace itself holds it, and said:

* a convolution's output size needs its stride/padding/dilation, which only torch's
  ``Concrete Inputs`` hold; without them it is read from the grad_output of the backward of the
  same input and weight shapes, else the convolution is listed as not counted (never guessed);
* a convolution backward's ``output_mask`` (which gradients it computes) likewise; without it the
  old per-gradient child ops tell, else the weight's gradient is taken as computed when the step
  accumulates a gradient of the weight's shape (a frozen LoRA base weight accumulates none) and
  the input's as always computed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from diagnose.record import ProbeResult
from diagnose.roofline.op_inputs import OpInputs, Shape, op_inputs
from diagnose.roofline.op_traffic import Traffic, is_memory_op, memory_traffic
from diagnose.roofline.op_work import (
    BEYOND_A_STEP,
    COMPUTE_CLASSES,
    GEMM,
    GRAD_INPUT_SUFFIX,
    MAX_STEP_FLOPS,
    NO_SHAPES,
    ConvHint,
    NotCounted,
    Work,
    bounded,
    compute_class,
    compute_dtype,
    conv_backward_operands,
    conv_operands,
    is_conv_backward_part,
    op_work,
)
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import Intervals
from diagnose.units import format_flops

RULE = "roofline"
CHECK_ID = "compute.flops_counted"

BASIS_SHAPES = "trace shapes"
BASIS_FLOPS_ARGS = "trace flops args"
BASIS_NONE = "none"

OUTPUT_FROM_BACKWARD = (
    "convolution output size read from the grad_output of the backward of the same shapes "
    "(stride/padding not recorded)"
)
MASK_FROM_GRADS = (
    "convolution_backward output_mask not recorded: weight gradient taken as computed where the "
    "step accumulates a gradient of the weight's shape, input gradient as always computed"
)
MASK_ASSUMED = (
    "convolution_backward output_mask not recorded and no gradient accumulation in the trace: "
    "input and weight gradients both taken as computed"
)
LIST_DTYPE_ASSUMED = "tensor lists (cat, _foreach_*) counted at 4 bytes per element"
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"

#: The phase an op's start is charged to when several PhaseModel.host ranges hold it: the
#: specific ranges (a DataLoader fetch, an optimizer step) lie inside the main thread's "forward"
#: ops, so they come first.
_PHASE_ORDER = (
    "data_wait",
    "h2d",
    "sync",
    "allocator",
    "collective",
    "optimizer",
    "backward",
    "encode",
    "forward",
)

_Key = tuple[int, int, int, int]


@dataclass
class _Rows:
    """Per host row (the whole trace), what the counting decided."""

    in_step: npt.NDArray[np.bool_]
    is_compute: npt.NDArray[np.bool_]
    is_memory: npt.NDArray[np.bool_]
    #: The row's own count succeeded (a Work).
    ok: npt.NDArray[np.bool_]
    counted: npt.NDArray[np.bool_] = field(init=False)
    #: Inside a counted op; inside any compute op; inside a memory op.
    covered: npt.NDArray[np.bool_] = field(init=False)
    inside_compute: npt.NDArray[np.bool_] = field(init=False)
    inside_memory: npt.NDArray[np.bool_] = field(init=False)
    #: The counted op a row is (or lies inside), -1 for none.
    root: npt.NDArray[np.int64] = field(init=False)
    #: A counted op lies inside the row.
    counted_below: npt.NDArray[np.bool_] = field(init=False)

    def __post_init__(self) -> None:
        n = self.ok.size
        self.counted = np.zeros(n, dtype=bool)
        self.covered = np.zeros(n, dtype=bool)
        self.inside_compute = np.zeros(n, dtype=bool)
        self.inside_memory = np.zeros(n, dtype=bool)
        self.root = np.full(n, -1, dtype=np.int64)
        self.counted_below = np.zeros(n, dtype=bool)


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    data, why_not = count_step_work(ctx)
    result.data = data
    # What was counted is a number for the utilisation, not a verdict on a slow-down: only a
    # count that could not be made is a check (the report's "could not be checked").
    if why_not:
        result.add_not_judged(CHECK_ID, f"FLOPs per step: {why_not}")
    else:
        data["summary"] = _summary(data)
    return result


def count_step_work(ctx: TraceContext) -> tuple[dict[str, Any], str]:
    """The rule's data and, when nothing could be counted, why (else "")."""
    trace, structure = ctx.trace, ctx.structure
    host = trace.host
    n_steps = ctx.n_steps
    in_step = (ctx.step_of(host.ts) >= 0) & ~structure.is_annotation
    if not in_step.any():
        why = "no operators in the analysed steps"
        return _uncounted(ctx, why), why
    if not (in_step & (host.input_dims >= 0)).any():
        why = "record_shapes was off (no op in the analysed steps has input shapes)"
        if trace.top_level.get("record_shapes") == 0:
            why = "record_shapes was off (the trace says record_shapes=0)"
        why += "; profile with torch.profiler.profile(record_shapes=True) to count them"
        return _uncounted(ctx, why), why

    concrete = trace.host.concrete_inputs
    recorded_flops = trace.host.flops
    names = trace.names
    unique = np.unique(host.name)
    compute_names = np.zeros(len(names), dtype=bool)
    memory_names = np.zeros(len(names), dtype=bool)
    for nid in unique.tolist():
        compute_names[nid] = compute_class(names[nid]) is not None
        memory_names[nid] = is_memory_op(names[nid])
    is_compute = compute_names[host.name] & ~structure.is_annotation
    is_memory = memory_names[host.name] & ~structure.is_annotation

    parsed: dict[_Key, OpInputs] = {}

    def inputs(row: int) -> OpInputs:
        key = (
            int(host.name[row]),
            int(host.input_dims[row]),
            int(host.input_types[row]),
            int(concrete[row]),
        )
        op = parsed.get(key)
        if op is None:
            op = op_inputs(
                names[key[0]], trace.name_of(key[1]), trace.name_of(key[2]), trace.name_of(key[3])
            )
            parsed[key] = op
        return op

    hints = _Hints.gather(ctx, in_step, inputs)
    results: dict[int, Work | NotCounted] = {}
    dtypes: dict[int, str] = {}
    from_arg: set[int] = set()
    outcomes: dict[tuple[OpInputs, ConvHint | None], Work | NotCounted | None] = {}
    for row in np.flatnonzero(is_compute & in_step).tolist():
        op = inputs(row)
        hint = hints.for_row(row, op)
        if (op, hint) not in outcomes:
            outcomes[(op, hint)] = op_work(op, hint)
        outcome = outcomes[(op, hint)]
        if outcome is None:  # e.g. a matrix-vector matmul: no FLOPs by convention
            is_compute[row] = False
            continue
        arg = float(recorded_flops[row])
        if np.isfinite(arg) and arg > 0:
            mnk = outcome.mnk if isinstance(outcome, Work) else None
            outcome = bounded(Work(compute_class(op.name) or GEMM, arg, compute_dtype(op), mnk))
            if isinstance(outcome, Work):
                from_arg.add(row)
        results[row] = outcome
        dtypes[row] = outcome.dtype or compute_dtype(op)
    ok = np.zeros(len(host), dtype=bool)
    ok[[r for r, o in results.items() if isinstance(o, Work)]] = True
    state = _Rows(in_step, is_compute, is_memory, ok)
    _walk(state, structure.parent, structure.depth)

    counted = np.flatnonzero(state.counted & in_step)
    # The compute dtype is the innermost op's: autocast records the fp32 call around the bf16 one.
    final_dtype = {int(r): dtypes.get(int(r), "") for r in counted}
    inner = np.flatnonzero(state.covered & in_step & is_compute & (state.root >= 0))
    for row in inner[np.argsort(structure.depth[inner], kind="stable")].tolist():
        if dtypes.get(row):
            final_dtype[int(state.root[row])] = dtypes[row]

    data = _aggregate(ctx, counted, results, final_dtype, n_steps)
    if data["flops_per_step"] > MAX_STEP_FLOPS:
        # Each op's count was possible, their sum per step is not: the shapes were misread.
        data["basis"] = BASIS_NONE
        data["notes"] = [f"{format_flops(data['flops_per_step'])} per step: {BEYOND_A_STEP}"]
        why = f"the counted FLOPs are {BEYOND_A_STEP}"
        return _nulled(data), why
    used_args = sum(1 for row in counted.tolist() if row in from_arg)
    data["basis"] = BASIS_FLOPS_ARGS if used_args else BASIS_SHAPES
    assumptions = Counter(
        part
        for row in counted.tolist()
        for part in _work(results, row).assumption.split("; ")
        if part
    )
    uncounted_rows = np.flatnonzero(
        in_step & is_compute & ~ok & ~state.inside_compute & ~state.counted_below
    )
    data.update(_not_counted(ctx, uncounted_rows, results, n_steps))
    memory_rows = np.flatnonzero(
        in_step & is_memory & ~state.inside_compute & ~state.inside_memory & (host.input_dims >= 0)
    )
    memory_bytes, memory_us, list_assumed = _memory(ctx, memory_rows, inputs)
    data["memory_bytes_per_step"] = memory_bytes / n_steps
    data["memory_host_seconds"] = memory_us / 1e6 / n_steps
    notes = [f"{text} ({count / n_steps:g} ops per step)" for text, count in assumptions.items()]
    if list_assumed:
        notes.append(f"{LIST_DTYPE_ASSUMED} ({list_assumed / n_steps:g} ops per step)")
    if used_args:
        notes.append(
            f"{used_args / n_steps:g} of {counted.size / n_steps:g} counted ops per step took the "
            "trace's own flops arg, the rest their shapes"
        )
    data["assumptions"] = notes
    if not counted.size and uncounted_rows.size:
        data["basis"] = BASIS_NONE
        listed = "; ".join(data["notes"])
        return _nulled(data), f"no compute op could be counted ({listed})"
    return data, ""


def _not_counted(
    ctx: TraceContext,
    rows: npt.NDArray[np.intp],
    results: dict[int, Work | NotCounted],
    n_steps: int,
) -> dict[str, Any]:
    """The "uncounted", "ops_without_shapes" and "notes" entries for the compute ops in ``rows``
    (outermost, with nothing counted inside them)."""
    names, host = ctx.trace.names, ctx.trace.host
    reasons: Counter[tuple[str, str]] = Counter()
    uncounted: Counter[str] = Counter()
    without_shapes = 0
    for row in rows.tolist():
        outcome = results.get(row, NotCounted(NO_SHAPES, no_shapes=True))
        assert isinstance(outcome, NotCounted)
        name = names[int(host.name[row])]
        without_shapes += outcome.no_shapes
        reasons[(name, outcome.reason)] += 1
        uncounted[name] += 1
    return {
        "uncounted": {k: round(v / n_steps, 3) for k, v in sorted(uncounted.items())},
        "ops_without_shapes": round(without_shapes / n_steps),
        "notes": [
            f"{name} not counted ({count / n_steps:g} per step): {reason}"
            for (name, reason), count in sorted(reasons.items())
        ],
    }


def _memory(
    ctx: TraceContext, rows: npt.NDArray[np.intp], inputs: Callable[[int], OpInputs]
) -> tuple[float, float, int]:
    """(bytes, host microseconds, ops whose tensor lists' dtype was assumed) of the memory-bound
    ops in ``rows``."""
    host = ctx.trace.host
    total, micros, assumed = 0.0, 0.0, 0
    traffic_of: dict[tuple[int, int, int], Traffic | None] = {}
    for row in rows.tolist():
        key = (int(host.name[row]), int(host.input_dims[row]), int(host.input_types[row]))
        if key not in traffic_of:
            traffic_of[key] = memory_traffic(inputs(row))
        traffic = traffic_of[key]
        if traffic is not None:
            total += traffic.bytes
            micros += float(host.dur[row])
            assumed += traffic.assumed_list_dtype
    return total, micros, assumed


def _work(results: dict[int, Work | NotCounted], row: int) -> Work:
    outcome = results[row]
    assert isinstance(outcome, Work)
    return outcome


@dataclass
class _Hints:
    """What the rest of the trace says about the convolutions' unrecorded arguments."""

    #: (input, weight) dims -> the output spatial dims the backward ops saw.
    outputs: dict[tuple[Shape, Shape], set[Shape]]
    #: Shapes of the gradients the step accumulates (trainable parameters).
    trainable: set[Shape]
    has_accumulate: bool
    #: Backward row -> (grad input, grad weight) from its old per-gradient child ops.
    children: dict[int, tuple[bool, bool]]

    @classmethod
    def gather(
        cls,
        ctx: TraceContext,
        in_step: npt.NDArray[np.bool_],
        inputs: Callable[[int], OpInputs],
    ) -> _Hints:
        host, names = ctx.trace.host, ctx.trace.names
        outputs: dict[tuple[Shape, Shape], set[Shape]] = {}
        trainable: set[Shape] = set()
        has_accumulate = False
        children: dict[int, tuple[bool, bool]] = {}
        wanted = {
            nid
            for nid in np.unique(host.name[in_step]).tolist()
            if compute_class(names[nid]) is not None or names[nid] == _ACCUMULATE_GRAD
        }
        rows = np.flatnonzero(in_step & np.isin(host.name, list(wanted)))
        for row in rows.tolist():
            name = names[int(host.name[row])]
            if name == _ACCUMULATE_GRAD:
                has_accumulate = True
                shape = inputs(row).shape(0)
                if shape is not None:
                    trainable.add(shape)
                continue
            if is_conv_backward_part(name):
                parent = int(ctx.structure.parent[row])
                if parent >= 0:
                    grad_in, grad_w = children.get(parent, (False, False))
                    part = name.endswith(GRAD_INPUT_SUFFIX)
                    children[parent] = (grad_in or part, grad_w or not part)
                continue
            operands = conv_backward_operands(inputs(row))
            if operands is not None:
                g, x, w = operands
                outputs.setdefault((x, w), set()).add(g[2:])
        return cls(outputs, trainable, has_accumulate, children)

    def for_row(self, row: int, op: OpInputs) -> ConvHint | None:
        forward = conv_operands(op)
        if forward is not None:
            seen = self.outputs.get(forward, set())
            if len(seen) == 1:
                return ConvHint(output=next(iter(seen)), output_from=OUTPUT_FROM_BACKWARD)
            return None
        backward = conv_backward_operands(op)
        if backward is None:
            return None
        if row in self.children:
            return ConvHint(mask=self.children[row])
        if self.has_accumulate:
            return ConvHint(mask=(True, backward[2] in self.trainable), mask_from=MASK_FROM_GRADS)
        return ConvHint(mask=(True, True), mask_from=MASK_ASSUMED)


def _walk(state: _Rows, parent: npt.NDArray[np.int64], depth: npt.NDArray[np.int64]) -> None:
    """Decide, top down, which rows are counted (outermost countable compute op) and what each row
    lies inside; then, bottom up, which rows hold a counted op."""
    if not depth.size:
        return
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    levels = [order[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    for at in levels:
        p = parent[at]
        has = p >= 0
        pc = np.where(has, p, 0)
        covered = has & (state.covered[pc] | state.counted[pc])
        state.covered[at] = covered
        state.counted[at] = state.ok[at] & ~covered
        state.inside_compute[at] = has & (state.inside_compute[pc] | state.is_compute[pc])
        state.inside_memory[at] = has & (state.inside_memory[pc] | state.is_memory[pc])
        state.root[at] = np.where(state.counted[at], at, np.where(covered, state.root[pc], -1))
    for at in reversed(levels):
        p = parent[at]
        holds = (state.counted[at] | state.counted_below[at]) & (p >= 0)
        state.counted_below[p[holds]] = True


def _aggregate(
    ctx: TraceContext,
    counted: npt.NDArray[np.intp],
    results: dict[int, Work | NotCounted],
    dtypes: dict[int, str],
    n_steps: int,
) -> dict[str, Any]:
    host = ctx.trace.host
    by_class = dict.fromkeys(COMPUTE_CLASSES, 0.0)
    seconds = dict.fromkeys(COMPUTE_CLASSES, 0.0)
    by_dtype: dict[str, float] = {}
    by_phase: dict[str, float] = {}
    phases = _phases_of(ctx.phases.host, host.ts[counted])
    largest: tuple[float, int] | None = None
    for row, phase in zip(counted.tolist(), phases, strict=True):
        work = _work(results, row)
        by_class[work.op_class] += work.flops
        seconds[work.op_class] += float(host.dur[row])
        dtype = dtypes.get(row) or "unknown"
        by_dtype[dtype] = by_dtype.get(dtype, 0.0) + work.flops
        by_phase[phase] = by_phase.get(phase, 0.0) + work.flops
        if work.op_class == GEMM and work.mnk and (largest is None or work.flops > largest[0]):
            largest = (work.flops, row)
    largest_gemm: dict[str, Any] | None = None
    if largest is not None:
        work = _work(results, largest[1])
        assert work.mnk is not None
        m, n, k = work.mnk
        largest_gemm = {
            "m": m,
            "n": n,
            "k": k,
            "dtype": dtypes.get(largest[1]) or "unknown",
            "flops": work.flops,
        }
    return {
        "basis": BASIS_SHAPES,
        "steps": len(ctx.steps.steps),
        "flops_per_step": sum(by_class.values()) / n_steps,
        "flops_by_class": {c: v / n_steps for c, v in by_class.items()},
        "flops_by_phase": {p: v / n_steps for p, v in sorted(by_phase.items()) if v > 0},
        "flops_by_dtype": {d: v / n_steps for d, v in sorted(by_dtype.items()) if v > 0},
        "host_seconds_by_class": {c: v / 1e6 / n_steps for c, v in seconds.items()},
        "memory_bytes_per_step": 0.0,
        "memory_host_seconds": 0.0,
        "ops_counted": round(counted.size / n_steps),
        "ops_without_shapes": 0,
        "uncounted": {},
        "largest_gemm": largest_gemm,
        "assumptions": [],
        "notes": [],
    }


def _phases_of(host_phases: dict[str, Intervals], starts: npt.NDArray[np.float64]) -> list[str]:
    names = [p for p in _PHASE_ORDER if p in host_phases]
    names += sorted(p for p in host_phases if p not in _PHASE_ORDER)
    phase = np.full(starts.size, "other", dtype=object)
    open_ = np.ones(starts.size, dtype=bool)
    for name in names:
        hit = open_ & host_phases[name].contains(starts)
        phase[hit] = name
        open_ &= ~hit
    return [str(p) for p in phase.tolist()]


def _uncounted(ctx: TraceContext, why: str) -> dict[str, Any]:
    data = _aggregate(ctx, np.empty(0, dtype=np.intp), {}, {}, ctx.n_steps)
    data["basis"] = BASIS_NONE
    data["notes"] = [why]
    return _nulled(data)


def _nulled(data: dict[str, Any]) -> dict[str, Any]:
    """Nothing was counted: the totals are unknown, not zero (a reader must not take 0 FLOPs)."""
    data["flops_per_step"] = None
    data["memory_bytes_per_step"] = None
    data["memory_host_seconds"] = None
    return data


def _summary(data: dict[str, Any]) -> str:
    total = float(data["flops_per_step"])
    basis = (
        "the ops' recorded shapes" if data["basis"] == BASIS_SHAPES else "the trace's flops args"
    )
    if total <= 0:
        text = "no matrix, convolution or attention op in the analysed steps: 0 FLOPs per step"
    else:
        parts = ", ".join(
            f"{cls} {format_flops(v)}" for cls, v in data["flops_by_class"].items() if v > 0
        )
        text = (
            f"{format_flops(total)} per step counted from {basis} ({parts}; "
            f"{data['ops_counted']} ops per step)"
        )
    if data["uncounted"]:
        listed = ", ".join(f"{name} x{n:g}" for name, n in data["uncounted"].items())
        text += f"; not counted per step: {listed} (see notes)"
    if data["assumptions"]:
        text += f"; {len(data['assumptions'])} assumption(s) listed"
    return text
