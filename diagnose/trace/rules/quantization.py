"""Quantized base: the time a trace spends expanding quantized weights to the compute dtype.

Read off any trace: bitsandbytes' ops (``bitsandbytes::dequantize_4bit``, ``gemm_4bit``,
``int8_*``), the device kernels of the same work, and the upcast of fp8-stored weights (a copy
whose input is float8). An op nested in another counted op is counted once, in the outer one.
What can be saved is the pure expansion (``dequantize*`` and the fp8 upcast); a fused 4-bit
matmul (``gemm_4bit``) also multiplies, which a bf16 base still does, so it is shown, not saved.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from diagnose import quantized_base as qb
from diagnose.catalogs import quantization_catalog as catalog
from diagnose.record import ProbeResult
from diagnose.stats import at_line
from diagnose.trace.context import TraceContext
from diagnose.units import ms, pct

RULE = "quantization"
FINDING_ID = catalog.DEQUANT_COST.id


def _matching_ops(ctx: TraceContext) -> dict[int, str]:
    """Host ops of the profiled steps that expand or multiply quantized weights, by index, with
    the storage they tell of ("4-bit", "int8", "fp8")."""
    trace = ctx.trace
    host = trace.host
    found: dict[int, str] = {}
    if not len(host):
        return found
    in_steps = ctx.step_of(host.ts) >= 0
    for name_id in np.unique(host.name).tolist():
        name = trace.names[name_id]
        kind = None
        if qb.DEQUANT_OPS.match(name):
            lowered = name.lower()
            kind = "int8" if "int8" in lowered or "8bit" in lowered else "4-bit"
        elif name in qb.UPCAST_OPS:
            kind = "fp8"
        if kind is None:
            continue
        for index in np.flatnonzero((host.name == name_id) & in_steps).tolist():
            if kind == "fp8":
                types = int(host.input_types[index])
                first = trace.names[types].split(",")[0].strip() if types >= 0 else ""
                if first not in qb.FP8_DTYPES:
                    continue
            found[index] = kind
    return found


def _outermost(ctx: TraceContext, indices: set[int]) -> list[int]:
    parent = ctx.structure.parent
    kept = []
    for index in indices:
        up = int(parent[index])
        while up >= 0 and up not in indices:
            up = int(parent[up])
        if up < 0:
            kept.append(index)
    return kept


def _unnamed_kernels(ctx: TraceContext, ops: dict[int, str]) -> tuple[float, float, Counter[str]]:
    """Device time (µs) of expansion kernels launched outside the matched ops (bitsandbytes
    before 0.45 called its kernels without a torch op): all of them, the pure expansions, and
    how many of each storage."""
    kinds: Counter[str] = Counter()
    if not ctx.has_device:
        return 0.0, 0.0, kinds
    trace, parent = ctx.trace, ctx.structure.parent
    device = trace.device
    in_steps = ctx.step_of(device.ts) >= 0
    total = pure = 0.0
    for name_id in np.unique(device.name).tolist():
        name = trace.names[name_id]
        if not qb.DEQUANT_KERNELS.search(name):
            continue
        for k in np.flatnonzero((device.name == name_id) & in_steps).tolist():
            up = int(ctx.structure.device_op[k])
            while up >= 0 and up not in ops:
                up = int(parent[up])
            if up >= 0:
                continue  # counted with the op that launched it
            total += float(device.dur[k])
            kinds["int8" if "int8" in name.lower() else "4-bit"] += 1
            if "dequant" in name.lower():
                pure += float(device.dur[k])
    return total, pure, kinds


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    ops = _matching_ops(ctx)
    unnamed, unnamed_pure, unnamed_kinds = _unnamed_kernels(ctx, ops)
    unnamed_count = sum(unnamed_kinds.values())
    if not ops and not unnamed_count:
        result.add_ok(
            FINDING_ID,
            "quantization: no quantized base (no dequantization or fp8 upcast in the profiled "
            "steps)",
        )
        return result
    n = ctx.n_steps
    cost = ctx.op_cost()  # device time on a GPU trace, CPU time otherwise (microseconds)
    outer = _outermost(ctx, set(ops))
    expanding = {i for i in ops if ctx.op_name(i).startswith("bitsandbytes::dequant")}
    expanding |= {i for i, kind in ops.items() if kind == "fp8"}
    pure = _outermost(ctx, expanding)
    seconds = (float(cost[outer].sum()) + unnamed) / 1e6 / n
    # None when the expansion runs unnamed inside a quantized matmul (bitsandbytes' int8 CPU
    # path): the trace cannot say which part of it a bf16 base would save.
    saving = (float(cost[pure].sum()) + unnamed_pure) / 1e6 / n if pure or unnamed_pure else None
    calls = (len(outer) + unnamed_count) / n
    step = ctx.wall_seconds / n if ctx.wall_seconds else 0.0
    # The host's own time in those ops: on a GPU the kernels are a part of a layer's cost, its
    # host path (the calls, their launches) another, which a host-bound step pays in full.
    host_seconds = float(ctx.trace.host.dur[outer].sum()) / 1e6 / n
    kinds = Counter(ops[i] for i in outer) + unnamed_kinds
    storage = {
        "4-bit": "4-bit (bitsandbytes NF4/FP4)",
        "int8": "int8 (bitsandbytes LLM.int8)",
        "fp8": "fp8 (upcast per layer)",
    }[kinds.most_common(1)[0][0]]
    names = Counter(ctx.op_name(i) for i in outer)
    evidence = {
        "storage": storage,
        "seconds_per_step": seconds,
        "expansion_seconds_per_step": saving,
        "calls_per_step": calls,
        "kernels_without_op_per_step": unnamed_count / n,
        "ops_per_step": {k: v / n for k, v in names.most_common(8)},
        "share_of_step": seconds / step if step else None,
        "measured_as": "device time of the ops' kernels" if ctx.has_device else "CPU time",
        "host_seconds_per_step": host_seconds,
        "host_share_of_step": host_seconds / step if step else None,
    }
    share = seconds / step if step else 0.0
    if at_line(share, catalog.MIN_SHARE).below:
        result.add_ok(
            FINDING_ID,
            f"quantization: the base is stored as {storage}; its quantized layers take "
            f"{pct(share)} of each profiled step ({ms(seconds)}/step)",
        )
        result.data[RULE] = evidence
        return result
    result.add_finding(
        catalog.dequant_cost(
            storage=storage,
            seconds=seconds,
            step_seconds=step,
            calls=calls,
            evidence=evidence,
            saving=saving,
            basis="trace" if saving is not None else "none",
            source=f"trace:{RULE}",
        )
    )
    return result
