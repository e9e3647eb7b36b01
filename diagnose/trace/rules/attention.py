"""Attention: which implementation ran, and how long it took.

From the ops (``aten::_scaled_dot_product_flash_attention``, ``..._efficient_attention``,
``..._cudnn_attention``, ``..._attention_math``, xFormers, flash-attn) when the trace has CPU ops;
from the kernels (FlashAttention, AOTriton ``attn_fwd``, CK ``fmha``, cuDNN SDPA...) otherwise.
A hand-written ``bmm → softmax → bmm`` (diffusers' legacy AttnProcessor, old kohya code) is found
as that op sequence outside any SDPA op.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diagnose import attention_paths
from diagnose.attention_paths import classify_op, kernel_family
from diagnose.catalogs import attention_catalog as ac
from diagnose.record import Finding, ProbeResult
from diagnose.trace import components
from diagnose.trace.breakdown import compact_dims
from diagnose.trace.context import TraceContext
from diagnose.trace.kernel_classes import KERNEL_CLASSES
from diagnose.trace.kernels import short_kernel_name
from diagnose.trace.modules import ModuleShare
from diagnose.units import ms

RULE = "attention"
MATH_ID = ac.MATH_ID
MANUAL_ID = ac.MANUAL_ID
#: A fused kernel is about this much faster than the math path or a hand-written bmm/softmax/bmm
#: (2-4x is usual for diffusion shapes; the conservative end is used for the estimate).
FUSED_SPEEDUP = 2.0
#: Without a measured backward, training attention costs about 3x its forward (fwd + 2x bwd).
TRAINING_FACTOR = 3.0


@dataclass
class PathStat:
    path: str
    calls: int = 0
    seconds: float = 0.0
    ops: Counter[str] = field(default_factory=Counter)
    shapes: Counter[str] = field(default_factory=Counter)
    dtypes: Counter[str] = field(default_factory=Counter)
    kernels: Counter[str] = field(default_factory=Counter)
    #: Host op of each call (the first matmul of a hand-written one) and its seconds, for the
    #: component that pays it.
    call_ops: list[int] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)


def _path_of(name: str) -> str | None:
    kind = classify_op(name)
    return kind.path if kind else None


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    trace, structure = ctx.trace, ctx.structure
    host = trace.host
    n = ctx.n_steps
    cost = ctx.op_cost()
    in_steps = ctx.step_of(host.ts) >= 0

    path_of_name: dict[int, str] = {}
    for name_id in np.unique(host.name).tolist() if len(host) else []:
        path = _path_of(trace.names[name_id])
        if path:
            path_of_name[name_id] = path
    is_path = (
        np.isin(host.name, np.fromiter(path_of_name, dtype=np.int32))
        if path_of_name
        else np.zeros(len(host), dtype=bool)
    )
    # Outermost path op of each call (its children are the same call).
    under_path = _has_ancestor(structure.parent, is_path)
    stats: dict[str, PathStat] = {}
    kernel_names = _kernels_under(ctx)
    for i in np.flatnonzero(is_path & ~under_path & in_steps).tolist():
        path = path_of_name[int(host.name[i])]
        stat = stats.setdefault(path, PathStat(path))
        if not structure.in_backward[i]:
            stat.calls += 1
            stat.shapes[compact_dims(trace.name_of(int(host.input_dims[i])))] += 1
            stat.dtypes[trace.name_of(int(host.input_types[i]))] += 1
        stat.seconds += float(cost[i]) / 1e6
        if not structure.in_backward[i]:
            stat.call_ops.append(i)
            stat.call_seconds.append(float(cost[i]) / 1e6)
        stat.ops[ctx.op_name(i)] += 1
        for kernel in kernel_names.get(i, ()):
            stat.kernels[kernel] += 1

    manual = _manual_attention(ctx, is_path | under_path, in_steps, cost)
    if manual.calls:
        stats[attention_paths.MANUAL] = manual

    if not stats and ctx.has_device:
        from_kernels = _fused_kernels(ctx)
        if from_kernels.seconds > 0:
            stats[attention_paths.FROM_KERNELS] = from_kernels

    result.data = {
        "paths": [
            {
                "path": s.path,
                "calls_per_step": s.calls / n,
                "seconds_per_step": s.seconds / n,
                "ops": dict(s.ops.most_common(5)),
                "kernels": [short_kernel_name(k, 80) for k, _ in s.kernels.most_common(3)],
                "kernel_families": sorted(
                    {f.label for k in s.kernels if (f := kernel_family(k)) is not None}
                ),
                "input_shapes": [k for k, _ in s.shapes.most_common(3) if k],
                "input_types": [k for k, _ in s.dtypes.most_common(3) if k],
            }
            for s in sorted(stats.values(), key=lambda s: -s.seconds)
        ]
    }
    if not stats:
        result.add_not_judged(
            MATH_ID, "attention: no attention ops or attention kernels in the trace"
        )
        return result

    # One answer per question: the fused paths are "found fine" for the math question only when
    # no call ran the math path, and the hand-written question is answered only where host ops
    # were recorded (a device-only trace cannot show a matmul → softmax → matmul).
    unfused = (attention_paths.MATH, attention_paths.MANUAL)
    fused = {path: stat for path, stat in stats.items() if path not in unfused}
    if attention_paths.MATH in stats:
        result.add_finding(_math_finding(ctx, stats[attention_paths.MATH]))
    else:
        for path, stat in fused.items():
            kernel = stat.kernels.most_common(1)[0][0] if stat.kernels else ""
            via = f" (`{short_kernel_name(kernel, 60)}`)" if kernel else ""
            calls = f"{stat.calls / n:.0f} calls/step, " if stat.calls else ""
            result.add_ok(
                MATH_ID,
                f"attention: the fused {path} path ran{via}: {calls}{ms(stat.seconds / n)}/step",
            )
    if attention_paths.MANUAL in stats:
        result.add_finding(_manual_finding(ctx, stats[attention_paths.MANUAL]))
    elif len(host):
        result.add_ok(MANUAL_ID, ac.NO_MANUAL_TEXT)
    return result


def _has_ancestor(parent: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """For each range, whether some ancestor has ``mask`` set."""
    out = np.zeros(mask.size, dtype=bool)
    if not mask.size:
        return out
    current = parent.copy()
    active = current >= 0
    while active.any():
        idx = np.flatnonzero(active)
        out[idx] |= mask[current[idx]]
        current[idx] = parent[current[idx]]
        active = (current >= 0) & ~out
    return out


def _kernels_under(ctx: TraceContext) -> dict[int, list[str]]:
    """Host range index -> names of the attention kernels it (or a descendant) launched."""
    out: dict[int, list[str]] = {}
    if not ctx.has_device:
        return out
    attn = KERNEL_CLASSES.index("attention_fused")
    launched = np.flatnonzero((ctx.kernels.classes == attn) & (ctx.structure.device_op >= 0))
    parent = ctx.structure.parent
    for k in launched.tolist():
        name = ctx.trace.names[int(ctx.trace.device.name[k])]
        op = int(ctx.structure.device_op[k])
        while op >= 0:
            out.setdefault(op, []).append(name)
            op = int(parent[op])
    return out


def _fused_kernels(ctx: TraceContext) -> PathStat:
    stat = PathStat(attention_paths.FROM_KERNELS)
    attn = KERNEL_CLASSES.index("attention_fused")
    mask = (ctx.kernels.classes == attn) & (ctx.step_of(ctx.trace.device.ts) >= 0)
    for k in np.flatnonzero(mask).tolist():
        stat.seconds += float(ctx.trace.device.dur[k]) / 1e6
        stat.kernels[ctx.trace.names[int(ctx.trace.device.name[k])]] += 1
    return stat


def _manual_attention(
    ctx: TraceContext, excluded: np.ndarray, in_steps: np.ndarray, cost: Any
) -> PathStat:
    """``matmul → softmax → matmul`` sequences in the forward pass, outside any SDPA op."""
    trace, structure = ctx.trace, ctx.structure
    host = trace.host
    stat = PathStat(attention_paths.MANUAL)
    matmul_ids = ctx.host_ids(attention_paths.MATMUL_OPS)
    softmax_ids = ctx.host_ids(attention_paths.SOFTMAX_OPS)
    if not matmul_ids.size or not softmax_ids.size:
        return stat
    is_mm = np.isin(host.name, matmul_ids)
    is_sm = np.isin(host.name, softmax_ids)
    relevant = is_mm | is_sm
    # Outermost of nested matmul/softmax calls (matmul -> bmm, softmax -> _softmax).
    nested = _has_ancestor(structure.parent, relevant)
    chosen = np.flatnonzero(relevant & ~nested & ~excluded & in_steps & ~structure.in_backward)
    for thread in np.unique(host.thread[chosen]).tolist():
        seq = chosen[host.thread[chosen] == thread]
        seq = seq[np.argsort(host.ts[seq], kind="stable")].tolist()
        k = 0
        while k + 2 < len(seq):
            a, b, c = seq[k], seq[k + 1], seq[k + 2]
            if is_mm[a] and is_sm[b] and is_mm[c]:
                stat.calls += 1
                seconds = float(cost[a] + cost[b] + cost[c]) / 1e6
                stat.seconds += seconds
                stat.call_ops.append(a)
                stat.call_seconds.append(seconds)
                stat.ops[ctx.op_name(a)] += 1
                stat.ops[ctx.op_name(c)] += 1
                stat.ops[ctx.op_name(b)] += 1
                stat.shapes[compact_dims(trace.name_of(int(host.input_dims[a])))] += 1
                stat.dtypes[trace.name_of(int(host.input_types[a]))] += 1
                k += 3
            else:
                k += 1
    return stat


def _fix_for(ctx: TraceContext, fp32_inputs: bool) -> str:
    info = ctx.device.info
    return ac.math_fix(info.kind, info.arch, forced=True, fp32_inputs=fp32_inputs)


def _estimate(ctx: TraceContext, forward_seconds: float) -> float:
    factor = TRAINING_FACTOR if ctx.is_training else 1.0
    return forward_seconds * factor * (1 - 1 / FUSED_SPEEDUP)


def _how_estimated(ctx: TraceContext, saving: float) -> str:
    return (
        f" At about {FUSED_SPEEDUP:.0f}x for a fused kernel"
        + (" (backward assumed 2x forward)" if ctx.is_training else "")
        + f" the estimate is {ms(saving)} per step."
    )


def _math_finding(ctx: TraceContext, stat: PathStat) -> Finding:
    n = ctx.n_steps
    seconds = stat.seconds / n
    dtypes = [d for d, _ in stat.dtypes.most_common(2) if d]
    why: list[str] = []
    fp32_inputs = any(d.split(", ")[0] == "float" for d in dtypes)
    if fp32_inputs and ctx.device.info.kind != "cpu":
        why.append("the inputs are fp32: the flash kernel needs fp16/bf16")
    if ctx.device.info.kind == "rocm" and attention_paths.rocm_needs_experimental(
        ctx.device.info.arch
    ):
        why.append(
            f"on {ctx.device.info.arch} the fused kernels are off unless "
            f"{attention_paths.ROCM_EXPERIMENTAL_ENV}=1"
        )
    saving = _estimate(ctx, seconds)
    shares = _components(ctx, stat)
    where = f" It runs in {components.where(shares)}." if components.named(shares) else ""
    return ac.math_fallback(
        calls=stat.calls / n,
        seconds_per_step=seconds,
        why=why,
        how_measured=where + _how_estimated(ctx, saving),
        fix=_fix_for(ctx, fp32_inputs),
        evidence={
            "calls_per_step": stat.calls / n,
            "seconds_per_step": seconds,
            "ops": dict(stat.ops.most_common(5)),
            "input_shapes": [s for s, _ in stat.shapes.most_common(3) if s],
            "input_types": dtypes,
            "device": ctx.device.info.name,
            # Kept for a re-judgement of the saving (diagnose profile measures it).
            "why": why,
            "runs_in": where.strip(),
            **components.evidence(ctx, shares),
        },
        saving=saving,
        basis="estimated",
        source=f"trace:{RULE}",
    )


def _manual_finding(ctx: TraceContext, stat: PathStat) -> Finding:
    n = ctx.n_steps
    seconds = stat.seconds / n
    saving = _estimate(ctx, seconds)
    shares = _components(ctx, stat)
    known = components.named(shares)
    where, fix = "", ac.MANUAL_FIX
    if known:
        # The title names the component that pays most; the fix is the one that reaches it,
        # followed by the others' when several components compute attention by hand.
        where = components.where(shares)
        fixes = list(dict.fromkeys(ac.manual_fix_for(s.role) for s in known))
        fix = " ".join(fixes)
    return ac.unfused_manual(
        calls=stat.calls / n,
        seconds_per_step=seconds,
        how_measured=_how_estimated(ctx, saving),
        where=where,
        fix=fix,
        evidence={
            "calls_per_step": stat.calls / n,
            "forward_seconds_per_step": seconds,
            "ops": dict(stat.ops.most_common(5)),
            "input_shapes": [s for s, _ in stat.shapes.most_common(3) if s],
            "input_types": [d for d, _ in stat.dtypes.most_common(2) if d],
            **components.evidence(ctx, shares),
        },
        saving=saving,
        basis="estimated",
        source=f"trace:{RULE}",
    )


def _components(ctx: TraceContext, stat: PathStat) -> list[ModuleShare]:
    """The components (text encoder, VAE, denoiser...) that ran the calls, costliest first;
    empty when the trace has no module ranges."""
    return components.op_shares(ctx, stat.call_ops, stat.call_seconds)
