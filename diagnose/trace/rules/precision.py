"""Precision: matmuls, convolutions and attention that ran in fp32 inside a bf16/fp16 run.

Needs the ``Input type`` of each op (torch.profiler ``record_shapes=True``). Only the lowest-level
compute op of each call is judged: under autocast ``aten::linear`` appears twice, the outer call
with the fp32 inputs the user passed and an inner call with the bf16 copies autocast made; the
inner one (and its ``aten::addmm``) is what ran, so children decide.

Which ops are judged, how dtypes are read and what counts as deliberate fp32 (a rotary embedding
module) come from :mod:`diagnose.precision_policy`, which the ``precision`` probe shares, so a
trace and a run call the same op the same thing; the ids, thresholds and wording come from
:mod:`diagnose.catalogs.precision_catalog`, which the probe shares too.

When the trace has module ranges, the fp32 ops are charged to the component that ran them
(:mod:`diagnose.trace.components`): fp32 convolutions in the VAE are the trainer keeping the VAE
in fp32 on purpose, a different switch from an upcast in the denoiser's training code.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from diagnose.catalogs.precision_catalog import (
    ASSUMED_LOW_PRECISION_SPEEDUP,
    FP32_TRAINING_ID,
    LOW_PRECISION_RUN_SHARE,
    TRAINING_FACTOR,
    UPCAST_FIX,
    UPCAST_ID,
    fp32_training_finding,
    upcast_finding,
)
from diagnose.precision_policy import (
    LOW_PRECISION_DTYPES,
    claimed_vs_actual,
    deliberate_reason,
    is_attention_op,
    is_compute_op,
    judge,
    majority_dtype,
    normalize_dtype,
    op_kind,
    recommended_low_dtype,
)
from diagnose.record import Finding, ProbeResult
from diagnose.stats import at_line
from diagnose.trace import components
from diagnose.trace.breakdown import compact_dims
from diagnose.trace.context import TraceContext
from diagnose.trace.modules import ModuleShare
from diagnose.units import ms, pct

RULE = "precision"


def op_dtype(types: str) -> str | None:
    """The compute dtype of an op from its ``Input type`` list: the majority float input, ties to
    the lower precision (``_scaled_mm(fp8, fp8, fp32 scale, fp32 scale)`` is an fp8 op)."""
    return majority_dtype(normalize_dtype(t) for t in types.split(", "))


def _is_aten_compute(name: str) -> bool:
    return name.startswith("aten::") and is_compute_op(name)


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    trace, structure = ctx.trace, ctx.structure
    host = trace.host
    compute_ids = (
        [i for i in np.unique(host.name).tolist() if _is_aten_compute(trace.names[i])]
        if len(host)
        else []
    )
    if not compute_ids:
        result.add_not_judged(
            UPCAST_ID, "precision: no matmul, convolution or attention ops in the trace to judge"
        )
        return result
    is_compute = np.isin(host.name, np.asarray(compute_ids, dtype=np.int32))
    in_steps = ctx.step_of(host.ts) >= 0
    compute = np.flatnonzero(is_compute & in_steps)
    if not compute.size:
        result.add_not_judged(
            UPCAST_ID, "precision: no matmul/convolution ops inside the profiled steps"
        )
        return result

    # Lowest-level compute ops: no compute op below them. An attention op is judged as a whole
    # (the math path upcasts internally; that is the attention rule's finding), so the compute
    # ops inside it are not judged separately.
    attention_ids = [i for i in compute_ids if is_attention_op(trace.names[i])]
    is_attention = (
        np.isin(host.name, np.asarray(attention_ids, dtype=np.int32))
        if attention_ids
        else np.zeros(len(host), dtype=bool)
    )
    has_compute_child = np.zeros(len(host), dtype=bool)
    inside_attention = np.zeros(len(host), dtype=bool)
    parent = structure.parent
    for i in compute.tolist():
        p = int(parent[i])
        first = -1
        while p >= 0:
            if is_compute[p] and first < 0:
                first = p
            if is_attention[p]:
                inside_attention[i] = True
                break
            p = int(parent[p])
        if first >= 0 and not inside_attention[i]:
            has_compute_child[first] = True
    leaves = compute[~has_compute_child[compute] & ~inside_attention[compute]]
    # Judge the forward pass: every fp32 backward matmul mirrors an fp32 forward one (or an op
    # whose backward is generic autograd, such as the math attention path), so the forward says
    # what the code does; the backward cost is estimated from it.
    forward = leaves[~structure.in_backward[leaves]]
    if forward.size:
        leaves = forward
    typed = leaves[host.input_types[leaves] >= 0]
    if not typed.size:
        result.add_not_judged(
            UPCAST_ID,
            "precision: the trace records no input dtypes; capture it with "
            "torch.profiler.profile(record_shapes=True) to check for fp32 compute",
        )
        return result

    cost = ctx.op_cost()
    dtypes: list[str | None] = [
        op_dtype(trace.names[int(host.input_types[i])]) for i in typed.tolist()
    ]
    time_by_dtype: dict[str, float] = defaultdict(float)
    count_by_dtype: Counter[str] = Counter()
    for i, dtype in zip(typed.tolist(), dtypes, strict=True):
        if dtype:
            time_by_dtype[dtype] += float(cost[i]) / 1e6
            count_by_dtype[dtype] += 1
    judged_time = sum(time_by_dtype.values())
    judged_count = sum(count_by_dtype.values())
    if not judged_count:
        result.add_not_judged(
            UPCAST_ID, "precision: compute ops have no floating-point inputs recorded"
        )
        return result
    low_count = sum(c for d, c in count_by_dtype.items() if d in LOW_PRECISION_DTYPES)
    # Judged by calls, not time: the question is how the code is configured, and one slow fp32
    # matmul must not make a bf16 run look like an fp32 one.
    low_share = low_count / judged_count
    fp32 = [i for i, d in zip(typed.tolist(), dtypes, strict=True) if d == "fp32"]
    n = ctx.n_steps
    result.data = {
        "compute_ops_judged": judged_count,
        "seconds_by_dtype_per_step": {d: t / n for d, t in time_by_dtype.items()},
        "calls_by_dtype_per_step": {d: c / n for d, c in count_by_dtype.items()},
        "low_precision_share": low_share,
    }
    low_names = "/".join(sorted(d for d in count_by_dtype if d in LOW_PRECISION_DTYPES)) or "bf16"

    if low_count and at_line(low_share, LOW_PRECISION_RUN_SHARE).above:
        requested = "bf16" if "bf16" in count_by_dtype else low_names.split("/")[0]
        verdicts = {
            i: judge(
                op_kind(ctx.op_name(i)),
                "fp32",
                requested,
                deliberate_reason(dtype="fp32", module_class=_caller(ctx, i)),
            )
            for i in fp32
        }
        unexpected = [i for i in fp32 if verdicts[i] == "unexpected"]
        deliberate = sorted({_caller(ctx, i) for i in fp32 if verdicts[i] == "deliberate"})
        actual = claimed_vs_actual("", time_by_dtype)
        result.data["claimed_vs_actual"] = actual
        if deliberate:
            result.data["deliberate_fp32"] = deliberate
        if not unexpected:
            result.add_ok(
                UPCAST_ID,
                f"precision: all {judged_count - len(fp32)} matmul/convolution/attention calls "
                f"that should run in {low_names} did"
                + (
                    f" ({len(fp32)} deliberate fp32 call(s) in {', '.join(deliberate[:3])})"
                    if fp32
                    else ""
                )
                + f"; no fp32 upcasts ({actual})",
            )
            return result
        result.add_finding(_upcast_finding(ctx, unexpected, cost, low_names, judged_time))
        return result

    if not ctx.is_training:
        result.add_not_judged(
            FP32_TRAINING_ID,
            f"precision: an inference trace computing in fp32 ({pct(1 - low_share)} of compute "
            "calls); the training precision cannot be judged from it",
        )
        return result
    fp32_time = time_by_dtype.get("fp32", 0.0)
    if not fp32_time and not count_by_dtype.get("fp32"):
        result.add_not_judged(UPCAST_ID, "precision: compute ran in neither fp32 nor bf16/fp16")
        return result
    result.add_finding(_fp32_training_finding(ctx, fp32, cost, fp32_time, judged_time))
    return result


def _offender_table(ctx: TraceContext, ops: list[int], cost: Any) -> list[dict[str, Any]]:
    trace, host = ctx.trace, ctx.trace.host
    groups: dict[tuple[str, str, bool], list[int]] = defaultdict(list)
    for i in ops:
        shapes = compact_dims(trace.name_of(int(host.input_dims[i])))
        groups[(ctx.op_name(i), shapes, bool(ctx.structure.in_backward[i]))].append(i)
    rows = []
    for (name, shapes, backward), members in groups.items():
        seconds = float(sum(float(cost[i]) for i in members)) / 1e6
        caller = _caller(ctx, members[0])
        rows.append(
            {
                "op": name,
                "input_shapes": shapes,
                "pass": "backward" if backward else "forward",
                "calls_per_step": len(members) / ctx.n_steps,
                "seconds_per_step": seconds / ctx.n_steps,
                "called_from": caller,
            }
        )
    rows.sort(key=lambda r: -float(r["seconds_per_step"]))
    return rows[:10]


def _caller(ctx: TraceContext, index: int) -> str:
    """The nearest enclosing range that is not an aten op (a module or record_function label)."""
    p = int(ctx.structure.parent[index])
    while p >= 0:
        name = ctx.op_name(p)
        if not name.startswith("aten::") and not name.startswith("ProfilerStep#"):
            return name
        p = int(ctx.structure.parent[p])
    return ""


def _with_backward(ctx: TraceContext, forward_seconds: float) -> float:
    """Forward compute time → forward + backward (backward about twice the forward)."""
    return forward_seconds * (TRAINING_FACTOR if ctx.is_training else 1.0)


def _upcast_finding(
    ctx: TraceContext, fp32: list[int], cost: Any, low_names: str, judged_time: float
) -> Finding:
    n = ctx.n_steps
    forward_seconds = sum(float(cost[i]) for i in fp32) / 1e6 / n
    seconds = _with_backward(ctx, forward_seconds)
    step = ctx.wall_seconds / n if ctx.wall_seconds else 0.0
    table = _offender_table(ctx, fp32, cost)
    names = sorted({row["op"] for row in table})
    saving = seconds * (1 - 1 / ASSUMED_LOW_PRECISION_SPEEDUP)
    # A CPU's bf16 speed depends on AMX/AVX-512 bf16: without them bf16 is slower than fp32, so
    # the GPU's assumed speed-up is no estimate there.
    on_cpu = ctx.device.info.kind == "cpu"
    top = table[0] if table else {}
    shares = components.op_shares(ctx, fp32, [float(cost[i]) / 1e6 for i in fp32])
    where = components.where(shares)
    finding = upcast_finding(
        calls_per_step=len(fp32) / n,
        run=low_names,
        where=", ".join(names[:3]) + (f" in {where}" if where else ""),
        fp32_seconds=forward_seconds,
        seconds_label="forward",
        evidence={
            "fp32_forward_calls_per_step": len(fp32) / n,
            "fp32_forward_seconds_per_step": forward_seconds,
            "fp32_seconds_per_step_with_backward": seconds,
            "share_of_forward_compute_time": (forward_seconds * n) / judged_time
            if judged_time
            else None,
            "share_of_step": seconds / step if step else None,
            "ops": table,
            "largest": top,
            **components.evidence(ctx, shares),
        },
        saving=None if on_cpu else saving,
        basis="estimated",
        detail=(
            _by_component(shares)
            + "These are the lowest-level compute ops of their calls, so autocast did not lower "
            "them: their inputs really were fp32. "
            + (
                "On a CPU the gain depends on AMX/AVX-512 bf16 support (without it bf16 is "
                "slower than fp32), so none is estimated."
                if on_cpu
                else f"At about {ASSUMED_LOW_PRECISION_SPEEDUP:.0f}x for {low_names} over fp32"
                + (" (backward assumed 2x forward)" if ctx.is_training else "")
                + f" the estimate is {ms(saving)} per step."
            )
        ),
        source=f"trace:{RULE}",
    )
    finding.fix = _upcast_fix(ctx, shares, low_names)
    return finding


def _by_component(shares: list[ModuleShare]) -> str:
    """The detail's first sentence when the trace names components, else ""."""
    if not components.named(shares):
        return ""
    return f"fp32 forward time by component: {components.breakdown(shares)}. "


def _upcast_fix(ctx: TraceContext, shares: list[ModuleShare], run: str) -> str:
    """The fix for the components that pay, costliest first; the usual upcast fix when the trace
    names none, for the denoiser, the optimizer and unknown code (the training code's own
    upcasts, which is what that fix is about), and for an encoder that is not a denoiser's
    frozen conditioning."""
    frozen = components.frozen_encoders(ctx)
    fixes = [
        _component_fix(ctx, s.role, run) if frozen and s.role in components.ENCODERS else UPCAST_FIX
        for s in components.named(shares)
    ]
    return " ".join(dict.fromkeys(fixes)) or UPCAST_FIX


def _component_fix(ctx: TraceContext, role: str, run: str) -> str:
    """A frozen encoder's fp32 is a loading choice, not autocast's: the fix is its dtype, or not
    running it every step at all."""
    low = run.split("/")[0]
    if role == "vae":
        kept = (
            "its fp32 is the trainer keeping the VAE in fp32 (force_upcast in its config, kohya "
            "--no_half_vae), not autocast"
        )
        if ctx.modules().vae_encodes_only():
            return (
                "These are the VAE's ops, and the VAE only encodes the batch here (it never "
                f"decodes: it is frozen); {kept}. It need not run every step: "
                + components.cache_advice("vae")
                + f"; or run it in {_vae_dtype_advice(low)}."
            )
        return f"These are the VAE's ops: {kept}. Run it in {_vae_dtype_advice(low)}."
    return (
        "These are the text encoder's ops: it was loaded or kept in fp32 (fp32 weights outside "
        "autocast, or an upcast in the prompt encoding). When it is not trained, load it in "
        f"{low} (torch_dtype=torch.{_TORCH_DTYPES.get(low, 'bfloat16')}), or "
        + components.cache_advice("text_encoder")
        + "."
    )


#: torch's names for the low dtypes a run reports.
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _vae_dtype_advice(low: str) -> str:
    """bf16 has fp32's exponent range, so the overflow that force_upcast guards against in fp16
    does not happen there; fp16 needs a VAE fine-tuned not to overflow."""
    if low == "fp16":
        return (
            "fp16 only with a VAE made for it (madebyollin/sdxl-vae-fp16-fix for SDXL; "
            "diffusers --pretrained_vae_model_name_or_path), or bf16 where the GPU has it"
        )
    return (
        "bf16, which does not overflow where fp16 does: vae.to(torch.bfloat16) with force_upcast "
        "off (kohya: drop --no_half_vae)"
    )


def _fp32_training_finding(
    ctx: TraceContext, fp32: list[int], cost: Any, fp32_time: float, judged_time: float
) -> Finding:
    n = ctx.n_steps
    forward_seconds = fp32_time / n
    seconds = _with_backward(ctx, forward_seconds)
    saving = seconds * (1 - 1 / ASSUMED_LOW_PRECISION_SPEEDUP)
    low = recommended_low_dtype(ctx.device.info)
    on_cpu = ctx.device.info.kind == "cpu"
    shares = components.op_shares(ctx, fp32, [float(cost[i]) / 1e6 for i in fp32])
    return fp32_training_finding(
        how_known=(
            f"{len(fp32) / n:.0f} matmul/conv calls per step in the forward pass, "
            f"{ms(forward_seconds)}/step"
            + (f" ({ms(seconds)} with their backward)" if ctx.is_training else "")
        ),
        low=low,
        evidence={
            "fp32_forward_calls_per_step": len(fp32) / n,
            "fp32_forward_seconds_per_step": forward_seconds,
            "fp32_seconds_per_step_with_backward": seconds,
            "share_of_forward_compute_time": fp32_time / judged_time if judged_time else None,
            "ops": _offender_table(ctx, fp32, cost),
            **components.evidence(ctx, shares),
        },
        saving=None if on_cpu else saving,
        basis="estimated",
        detail=(
            _by_component(shares)
            + "Every judged matmul and convolution ran on fp32 inputs. "
            + (
                "Mixed precision runs them in bf16, which is faster only on a CPU with AMX or "
                "AVX-512 bf16 units, so no saving is estimated."
                if on_cpu
                else "Mixed precision runs them on the "
                f"{'matrix' if ctx.device.info.kind == 'rocm' else 'tensor'} cores; at about "
                f"{ASSUMED_LOW_PRECISION_SPEEDUP:.0f}x (backward assumed 2x forward) the estimate "
                f"is {ms(saving)} per step."
            )
        ),
        no_fast_bf16=low == "fp16",
        source=f"trace:{RULE}",
    )
