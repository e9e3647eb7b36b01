"""The ``precision`` probe: bf16/fp16 compute that silently runs in fp32, and what it costs.

A user asks for bf16 (``--mixed_precision bf16``, Lightning ``precision="bf16-mixed"``,
``--full_bf16``) and the stack reports bf16, while parts of the compute path run in fp32: a model
that disables autocast around a block, a layer cast back to fp32, weights left in fp32, a dtype
mismatch that blocks a fused kernel, or a device with no native bf16 at all. This probe turns that
into evidence:

1. **Dtype audit of one extra step** (:mod:`diagnose.probes.precision_audit`): every operator's
   real compute dtype, the module that issued it (backward ops through their autograd node), and
   its device-synchronised time; warnings raised meanwhile, with the call that raised them.
2. **Classification** (:mod:`diagnose.precision_policy`, shared with the trace rule): fp32
   matmul/conv/attention in a bf16/fp16 run is *unexpected*; softmax, norms, losses and reductions
   are fp32 *by policy*; RoPE tables in complex64 or a VAE kept in fp32 under ``force_upcast``
   are *deliberate*.
3. **Cost**: the audited time of the unexpected ops, and the saving estimated by re-running the
   same op signatures (shapes, strides) in the requested dtype and in fp32 on this device.
4. **More facts**: fp32 weights in a bf16-full run, dtype-mismatch warnings, bf16 without native
   support, bf16 measured slower than fp32 at the model's shapes, fp32 training on a device that
   is faster in bf16.
5. **Claimed vs actual**: "requested bf16-mixed → actual: 93% of GEMM/conv/attention time in
   bf16, 7% in fp32 (...)".

The workload is left as found (see :func:`~diagnose.probes.precision_audit.audit_step`).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose.device import bf16_native
from diagnose.precision_policy import (
    ASSUMED_LOW_PRECISION_SPEEDUP,
    BF16_NOT_NATIVE_ID,
    BF16_SLOWER_ID,
    DTYPE_MISMATCH_ID,
    FP32_TRAINING_ID,
    FP32_WEIGHTS_ID,
    UPCAST_FIX,
    UPCAST_ID,
    claimed_vs_actual,
    dtype_shares,
    is_dtype_warning,
    mixed_precision_fix,
    normalize_dtype,
    requested_low_dtype,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.precision_audit import (
    AuditLog,
    BenchResult,
    CapturedWarning,
    Fp32Weights,
    OpGroup,
    ReplaySpec,
    audit_step,
    bench_pair,
    fp32_parameters,
    workload_components,
)
from diagnose.record import DeviceInfo, Finding, ProbeResult, Severity
from diagnose.timing import device_synchronizer

#: Signatures (largest audited time first) benchmarked for the model-shape speed comparison.
BENCH_SIGNATURES = 8
#: Unexpected-fp32 signatures benchmarked for the saving estimate (the rest use the average).
UPCAST_BENCH_SIGNATURES = 12
BENCH_REPEATS = 15
BENCH_BUDGET_S = 0.25
#: All benchmarking of one probe run stops starting new signatures past this many seconds (a
#: full-size model on a CPU takes seconds per call).
TOTAL_BENCH_BUDGET_S = 20.0
#: bf16 counts as slower than fp32 when its summed time is at least this factor larger; from
#: WARN_SLOWER_FACTOR on the finding is a warning (below it, an informational one: small
#: microbenchmark ratios move with the machine's load).
SLOWER_FACTOR = 1.10
WARN_SLOWER_FACTOR = 1.25
#: fp32 training is worth a finding when bf16 runs the model's shapes at least this much faster.
FP32_TRAINING_MIN_SPEEDUP = 1.25
#: Share of s/it above which an upcast's estimated saving makes the finding critical.
CRITICAL_SHARE = 0.20
#: Rows of the op table kept in the probe's data.
TABLE_ROWS = 60

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _ms(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    value = seconds * 1e3
    return f"{value:.2f} ms" if value < 10 else f"{value:.0f} ms"


def _round(value: float | None, digits: int = 6) -> float | None:
    return round(value, digits) if value is not None and math.isfinite(value) else None


# --------------------------------------------------------------------------------------------
# Speed comparison at the model's shapes


@dataclass
class SignatureBench:
    """One op signature of the model, timed in a base dtype (fp32) and a low-precision one."""

    op: str
    shapes: str
    recorded_dtype: str | None
    calls: int
    base: BenchResult
    low: BenchResult

    @property
    def speedup(self) -> float:
        """Base time / low-precision time (above 1: the low precision is faster)."""
        if not (self.base.samples and self.low.samples) or self.low.median <= 0:
            return math.nan
        return float(self.base.median / self.low.median)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "shapes": self.shapes,
            "recorded_dtype": self.recorded_dtype,
            "calls_per_step": self.calls,
            f"{self.base.dtype}_ms": _round(self.base.median * 1e3, 4),
            f"{self.low.dtype}_ms": _round(self.low.median * 1e3, 4),
            "speedup": _round(self.speedup, 3),
            "error": self.base.error or self.low.error,
        }


@dataclass
class SpeedComparison:
    """A base dtype (fp32) against a low-precision one over the model's largest op signatures."""

    base: str
    low: str
    rows: list[SignatureBench] = field(default_factory=list)

    def totals(self) -> tuple[float, float]:
        """(base, low) seconds per step summed over the signatures timed in both."""
        base = low = 0.0
        for row in self.rows:
            if math.isfinite(row.speedup):
                base += row.calls * row.base.median
                low += row.calls * row.low.median
        return base, low

    @property
    def speedup(self) -> float:
        """Call-weighted base time / low-precision time (nan when nothing could be timed)."""
        base, low = self.totals()
        return base / low if low > 0 and base > 0 else math.nan

    def _quartile_totals(self) -> tuple[float, float, float, float]:
        """Call-weighted (base q1, base q3, low q1, low q3) over the rows timed in both."""
        b1 = b3 = l1 = l3 = 0.0
        for row in self.rows:
            if math.isfinite(row.speedup):
                base, low = row.base.stats, row.low.stats
                b1, b3 = b1 + row.calls * base.q1, b3 + row.calls * base.q3
                l1, l3 = l1 + row.calls * low.q1, l3 + row.calls * low.q3
        return b1, b3, l1, l3

    @property
    def clearly_slower(self) -> bool:
        """The low precision is slower beyond the spread: its lower quartiles sum above the
        base's upper ones."""
        _, b3, l1, _ = self._quartile_totals()
        return b3 > 0 and l1 > b3

    @property
    def clearly_faster(self) -> bool:
        b1, _, _, l3 = self._quartile_totals()
        return l3 > 0 and l3 < b1

    def to_dict(self) -> dict[str, Any]:
        base, low = self.totals()
        return {
            "base": self.base,
            "low": self.low,
            "speedup": _round(self.speedup, 3),
            "conclusive": self.clearly_faster or self.clearly_slower,
            f"{self.base}_seconds_per_step": _round(base),
            f"{self.low}_seconds_per_step": _round(low),
            "signatures": [r.to_dict() for r in self.rows],
            "method": (
                "the signatures with the most multiply-adds per step, each re-run (op, shapes, "
                "strides) on random data in both dtypes, calls alternating, device-synchronised; "
                f"median of up to {BENCH_REPEATS} calls each, weighted by calls per step; "
                "conclusive when the quartile ranges do not overlap"
            ),
        }


#: Times a signature in two dtypes, interleaved: (spec, base, low) -> (base result, low result).
Bencher = Callable[[ReplaySpec, torch.dtype, torch.dtype], tuple[BenchResult, BenchResult]]


def compare_speed(
    specs: Sequence[ReplaySpec], base: str, low: str, bench: Bencher
) -> SpeedComparison:
    """Time each signature in ``base`` and in ``low`` ("fp32", "bf16", "fp16")."""
    comparison = SpeedComparison(base=base, low=low)
    for spec in specs:
        base_result, low_result = bench(spec, _TORCH_DTYPES[base], _TORCH_DTYPES[low])
        comparison.rows.append(
            SignatureBench(
                op=spec.op,
                shapes=spec.shapes,
                recorded_dtype=spec.dtype,
                calls=spec.calls,
                base=base_result,
                low=low_result,
            )
        )
    return comparison


def speed_summary(comparison: SpeedComparison) -> str:
    """ "at this model's matmul/conv shapes bf16 runs 1.74x slower than fp32 here" """
    speedup = comparison.speedup
    if not math.isfinite(speedup):
        return f"{comparison.low} against {comparison.base}: could not be timed here"
    how = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    spread = (
        ""
        if comparison.clearly_faster or comparison.clearly_slower
        else " (within the measurement spread: inconclusive)"
    )
    return (
        f"at this model's matmul/conv shapes {comparison.low} runs {how} than "
        f"{comparison.base} here{spread}"
    )


def largest_signatures(log: AuditLog, count: int) -> list[ReplaySpec]:
    """The signatures with the most estimated work per step (shapes x calls, not audited time:
    a single call's time on a busy machine is too noisy to rank by)."""
    return sorted(log.replays.values(), key=lambda s: (-s.work * s.calls, s.key))[:count]


# --------------------------------------------------------------------------------------------
# The claimed-vs-actual summary and the op table (pure)


def fp32_compute_sites(log: AuditLog) -> list[str]:
    """Where fp32 matmul/conv/attention ran: unexpected modules by time, then the deliberate
    ones collected per component with their reason."""
    unexpected: dict[str, float] = {}
    deliberate: dict[str, float] = {}
    for group in log.compute_groups():
        if group.verdict == "unexpected":
            unexpected[group.site.where] = unexpected.get(group.site.where, 0.0) + group.seconds
        elif group.verdict == "deliberate":
            label = (
                f"{group.site.component or 'outside the models'} (deliberate: {group.deliberate})"
            )
            deliberate[label] = deliberate.get(label, 0.0) + group.seconds
    return sorted(unexpected, key=lambda w: -unexpected[w]) + sorted(
        deliberate, key=lambda w: -deliberate[w]
    )


def op_table(log: AuditLog, rows: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """Compute, by-policy, deliberate and unexpected op groups, largest first; every unexpected
    one is kept even past ``rows``."""
    judged = [g for g in log.groups if g.kind != "other" or g.verdict == "deliberate"]
    kept = judged[:rows] + [g for g in judged[rows:] if g.verdict == "unexpected"]
    return [g.to_dict() for g in kept]


def verdict_totals(log: AuditLog) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for group in log.groups:
        entry = totals.setdefault(group.verdict, {"calls": 0, "seconds": 0.0})
        entry["calls"] += group.calls
        entry["seconds"] += group.seconds
    return totals


# --------------------------------------------------------------------------------------------
# Rules (pure: data in, Finding or None out)


@dataclass
class UpcastSite:
    """The unexpected fp32 compute of one module."""

    where: str
    forward_calls: int = 0
    backward_calls: int = 0
    seconds: float = 0.0
    saving: float | None = 0.0
    ops: set[str] = field(default_factory=set)
    shapes: str = ""
    functions: set[str] = field(default_factory=set)
    autocast_states: set[bool] = field(default_factory=set)
    cause: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.where,
            "calls_per_step": self.forward_calls + self.backward_calls,
            "forward_calls": self.forward_calls,
            "backward_calls": self.backward_calls,
            "seconds_per_step": _round(self.seconds),
            "est_saving_seconds": _round(self.saving),
            "ops": sorted(self.ops),
            "called_via": sorted(f for f in self.functions if f),
            "shapes": self.shapes,
            "autocast": (
                "enabled"
                if self.autocast_states == {True}
                else "disabled"
                if self.autocast_states == {False}
                else "mixed"
                if self.autocast_states
                else "unknown"
            ),
            "cause": self.cause,
        }


def _cause(site: UpcastSite, precision: str, fp32_weight_sites: set[str]) -> str:
    if site.where in fp32_weight_sites:
        return "its weights are fp32"
    if not site.forward_calls:
        return "backward of an fp32 forward (the forward ran outside a hooked module)"
    if precision in ("bf16-mixed", "fp16"):
        if site.autocast_states == {False}:
            return (
                "autocast is disabled around it (torch.autocast(enabled=False)) and its inputs "
                "are fp32"
            )
        return (
            "fp32 although autocast was on: an op autocast does not lower, or a "
            "custom_fwd(cast_inputs=torch.float32) region"
        )
    return "fp32 inputs or weights: a bf16-full run has no autocast to lower them"


def upcast_sites(
    groups: Sequence[OpGroup],
    saving_of: Callable[[OpGroup], float | None],
    precision: str,
    fp32_weight_sites: set[str],
) -> list[UpcastSite]:
    """Unexpected op groups collected per module, largest first."""
    sites: dict[str, UpcastSite] = {}
    for group in groups:
        site = sites.setdefault(group.site.where, UpcastSite(group.site.where))
        if group.phase == "backward":
            site.backward_calls += group.calls
        else:
            site.forward_calls += group.calls
            site.shapes = site.shapes or group.shapes
            if group.autocast is not None:
                site.autocast_states.add(group.autocast)
        site.seconds += group.seconds
        saving = saving_of(group)
        site.saving = None if saving is None or site.saving is None else site.saving + saving
        site.ops.add(group.op)
        site.functions.add(group.function)
    for site in sites.values():
        site.cause = _cause(site, precision, fp32_weight_sites)
    return sorted(sites.values(), key=lambda s: -s.seconds)


def upcast_rule(
    log: AuditLog,
    sites: Sequence[UpcastSite],
    *,
    s_per_it: float | None,
    saving_method: str,
) -> Finding | None:
    """``precision.fp32_compute_in_low_precision_run`` from the audit's unexpected ops."""
    if not sites or log.requested_low is None:
        return None
    calls = sum(s.forward_calls + s.backward_calls for s in sites)
    seconds = sum(s.seconds for s in sites)
    savings = [s.saving for s in sites]
    saving = None if any(v is None for v in savings) else sum(v or 0.0 for v in savings)
    by_dtype = log.compute_seconds_by_dtype()
    compute = sum(by_dtype.values())
    actual = claimed_vs_actual(log.precision, by_dtype, fp32_compute_sites(log))
    share = saving / s_per_it if saving is not None and s_per_it else None
    severity: Severity = "warn"
    if saving is not None and saving <= 0:
        severity = "info"
    elif share is not None and share >= CRITICAL_SHARE:
        severity = "critical"
    top = sites[0]
    more = f" and {len(sites) - 1} more module(s)" if len(sites) > 1 else ""
    return Finding(
        id=UPCAST_ID,
        category="precision",
        severity=severity,
        title=(
            f"{calls} matmul/conv call(s) per step ran in fp32 in a {log.precision} run: "
            f"{top.where} ({top.cause.split(' (')[0]}){more}; {_ms(seconds)}/step audited"
        ),
        evidence={
            "requested": log.precision,
            "claimed_vs_actual": actual,
            "fp32_calls_per_step": calls,
            "fp32_seconds_per_step": _round(seconds),
            "share_of_compute_time": _round(seconds / compute, 4) if compute else None,
            "share_of_s_per_it": _round(seconds / s_per_it, 4) if s_per_it else None,
            "modules": [s.to_dict() for s in sites[:20]],
            "saving_method": saving_method,
            "timing": "audited step: each op timed alone, device-synchronised",
        },
        est_seconds_saved_per_it=None if saving is None else max(saving, 0.0),
        saving_basis="estimated" if saving is not None else "none",
        fix=UPCAST_FIX,
        detail=(
            f"{actual}. These ops are the lowest-level compute ops the dispatcher ran (after "
            "autocast), so their inputs really were fp32; each is attributed to the module that "
            "issued it (backward ops through the autograd node their forward call created). "
            f"Saving: {saving_method}."
            + (
                " On this device the requested dtype is not faster for these shapes, so fixing "
                "the upcast would not speed this run up (it still costs memory)."
                if severity == "info"
                else ""
            )
        ),
    )


def fp32_weights_rule(
    precision: str, rows: Sequence[Fp32Weights], upcast_modules: set[str]
) -> Finding | None:
    """``precision.fp32_weights_in_full_bf16``: fp32 parameters in a bf16-full run."""
    if precision != "bf16-full" or not rows:
        return None
    lora = [r for r in rows if r.trainable]
    base = [r for r in rows if not r.trainable]
    total_bytes = sum(r.bytes for r in rows)
    tensors = sum(r.tensors for r in rows)
    computing = sorted({r.where for r in rows} & upcast_modules)
    kinds = ", ".join(
        part
        for part in (
            f"{sum(r.tensors for r in lora)} LoRA" if lora else "",
            f"{sum(r.tensors for r in base)} base" if base else "",
        )
        if part
    )
    return Finding(
        id=FP32_WEIGHTS_ID,
        category="precision",
        severity="warn",
        title=(
            f"{tensors} weight tensor(s) stay fp32 in a bf16-full run ({kinds}; "
            f"{total_bytes / 2**20:.1f} MiB): {rows[0].where}"
            + (f" and {len(rows) - 1} more module(s)" if len(rows) > 1 else "")
        ),
        evidence={
            "tensors": tensors,
            "bytes": total_bytes,
            "lora_tensors": sum(r.tensors for r in lora),
            "base_tensors": sum(r.tensors for r in base),
            "modules": [r.to_dict() for r in rows[:20]],
            "modules_computing_in_fp32": computing,
        },
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=(
            "Cast every weight to bf16 after adding the adapter (peft/diffusers: "
            "model.to(torch.bfloat16), and do not call cast_training_params(model, "
            "dtype=torch.float32); kohya: --full_bf16; OneTrainer: train and weight dtype "
            "BFLOAT_16). Modules that must stay fp32 belong in the model's "
            "_keep_in_fp32_modules."
        ),
        detail=(
            "bf16-full runs without autocast, so an fp32 weight either makes its module compute "
            "in fp32 (peft casts the input to the LoRA weight's dtype) or fails on a dtype "
            "mismatch; it also doubles the weight's memory and, for a LoRA weight, its optimizer "
            "state. "
            + (
                f"The audit saw fp32 compute in {', '.join(computing[:3])}: its cost is in "
                f"{UPCAST_ID}."
                if computing
                else "The audit saw no fp32 matmul from these modules in this step."
            )
        ),
    )


def dtype_warning_rule(captured: Sequence[CapturedWarning]) -> Finding | None:
    """``precision.dtype_mismatch_warning`` from the warnings raised during the audited step."""
    relevant = [w for w in captured if is_dtype_warning(w.message)]
    if not relevant:
        return None
    relevant.sort(key=lambda w: (-w.count, w.message))
    count = sum(w.count for w in relevant)
    first = relevant[0]
    origin = " in ".join(part for part in (first.function, first.site.where) if part)
    return Finding(
        id=DTYPE_MISMATCH_ID,
        category="precision",
        severity="warn",
        title=(
            f"torch warned {count} time(s) per step about mismatched dtypes"
            + (f" ({origin})" if origin else "")
            + f": {first.message.split('(Triggered')[0].strip()[:140]}"
        ),
        evidence={
            "warnings_per_step": count,
            "warnings": [w.to_dict() for w in relevant[:10]],
            "seconds_in_warning_calls": _round(sum(w.seconds for w in relevant)),
        },
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=(
            "Give the op inputs of one dtype: cast the norm's weight to its input's dtype (or "
            "the input to the weight's), e.g. keep an upcast RMSNorm's weight in fp32 with its "
            "fp32 input (list the module in _keep_in_fp32_modules) or run both in bf16."
        ),
        detail=(
            "With the input and the weight in different dtypes torch cannot use the fused kernel "
            "and runs a slower composite path (and casts). The warnings were captured during the "
            "audited step with torch.set_warn_always(True), so warnings torch otherwise shows "
            "only once per process are counted per call; each is attributed to the torch call "
            "and the module that raised it."
        ),
    )


def _low_compute_seconds(log: AuditLog | None, low: str) -> float | None:
    if log is None:
        return None
    seconds = log.compute_seconds_by_dtype().get(low)
    return None if seconds is None else float(seconds)


def bf16_not_native_rule(
    precision: str,
    info: DeviceInfo,
    native: bool | None,
    fp16: SpeedComparison | None,
    bf16_compute_seconds: float | None,
) -> Finding | None:
    """``precision.bf16_not_native``: bf16 asked of a device without native bf16."""
    if requested_low_dtype(precision) != "bf16" or native is not False:
        return None
    on_cpu = info.kind == "cpu"
    saving: float | None = None
    fp16_vs_bf16: float | None = None
    if not on_cpu and fp16 is not None and math.isfinite(fp16.speedup):
        fp16_vs_bf16 = fp16.speedup
        if bf16_compute_seconds:
            saving = max(0.0, bf16_compute_seconds * (1 - 1 / fp16_vs_bf16))
    device = info.name or info.kind
    arch = f" ({info.arch})" if info.arch else ""
    if on_cpu:
        isa = info.extra.get("isa")
        fix = (
            "Train in fp32 on this CPU (diagnose --precision fp32; kohya --mixed_precision no; "
            'Lightning precision="32-true"), or use a CPU with AVX512-BF16 or AMX.'
        )
        detail = (
            "Without AVX512-BF16/AMX-BF16 (x86) or the BF16 extension (Arm), torch converts bf16 "
            f"to fp32 and back around every op. ISA flags seen: {isa}. "
            f"See {BF16_SLOWER_ID} for the measured ratio, when it is slower."
        )
    else:
        fix = (
            "Use fp16 mixed precision, which this GPU computes natively: kohya --mixed_precision "
            "fp16; diffusers: accelerate launch --mixed_precision fp16; Lightning: "
            'Trainer(precision="16-mixed") (with loss scaling, which these set up).'
        )
        detail = (
            "torch.cuda.is_bf16_supported() returns True on every HIP build, so the stack does "
            "not refuse bf16; without bf16 matrix instructions (Volta/Turing, RDNA1/RDNA2, Vega) "
            "it is emulated through fp32."
            + (
                f" fp16 measured {fp16_vs_bf16:.2f}x faster than bf16 at this model's shapes."
                if fp16_vs_bf16
                else ""
            )
        )
    return Finding(
        id=BF16_NOT_NATIVE_ID,
        category="precision",
        severity="warn",
        title=f"bf16 requested, but {device}{arch} has no native bf16 arithmetic",
        evidence={
            "device": device,
            "arch": info.arch,
            "kind": info.kind,
            "bf16_native": native,
            "fp16_vs_bf16_speedup": _round(fp16_vs_bf16, 3),
            "fp16_comparison": fp16.to_dict() if fp16 is not None else None,
        },
        est_seconds_saved_per_it=saving,
        saving_basis="estimated" if saving is not None else "none",
        fix=fix,
        detail=detail,
    )


def bf16_slower_rule(
    precision: str, comparison: SpeedComparison | None, bf16_compute_seconds: float | None
) -> Finding | None:
    """``precision.bf16_slower_than_fp32``: a bf16 run on a device where bf16 measured slower."""
    if requested_low_dtype(precision) != "bf16" or comparison is None:
        return None
    speedup = comparison.speedup
    if not math.isfinite(speedup) or 1 / speedup < SLOWER_FACTOR or not comparison.clearly_slower:
        return None
    slowdown = 1 / speedup
    saving = bf16_compute_seconds * (1 - speedup) if bf16_compute_seconds else None
    fp32, low = comparison.totals()
    return Finding(
        id=BF16_SLOWER_ID,
        category="precision",
        severity="warn" if slowdown >= WARN_SLOWER_FACTOR else "info",
        title=(
            f"bf16 is {slowdown:.2f}x slower than fp32 at this model's matmul/conv shapes on "
            f"this device ({_ms(low)} vs {_ms(fp32)} per step over the "
            f"{len(comparison.rows)} largest op signatures)"
        ),
        evidence={
            "bf16_over_fp32_time": _round(slowdown, 3),
            "comparison": comparison.to_dict(),
            "bf16_compute_seconds_per_step": _round(bf16_compute_seconds),
        },
        est_seconds_saved_per_it=saving,
        saving_basis="estimated" if saving is not None else "none",
        fix=(
            "Train in fp32 here (diagnose --precision fp32; kohya --mixed_precision no; "
            'Lightning precision="32-true"); on a GPU without fast bf16 use fp16 mixed precision.'
        ),
        detail=(
            "Measured, not assumed: the model's own largest op signatures (shapes and strides "
            "from the audited step) were re-run in bf16 and in fp32 on this device. The saving "
            "scales the audited bf16 matmul/conv/attention time of one step by that ratio."
        ),
    )


def fp32_training_rule(
    precision: str,
    info: DeviceInfo,
    comparison: SpeedComparison | None,
    fp32_compute_seconds: float | None,
) -> Finding | None:
    """``precision.fp32_training`` (same meaning as the trace rule's): the run trains in fp32 and
    this device runs the model's shapes clearly faster in low precision (measured here)."""
    if requested_low_dtype(precision) is not None or comparison is None:
        return None
    speedup = comparison.speedup
    if (
        not math.isfinite(speedup)
        or speedup < FP32_TRAINING_MIN_SPEEDUP
        or not comparison.clearly_faster
    ):
        return None
    saving = fp32_compute_seconds * (1 - 1 / speedup) if fp32_compute_seconds else None
    low = comparison.low
    return Finding(
        id=FP32_TRAINING_ID,
        category="precision",
        severity="info",
        title=(
            f"Training computes in fp32; {low} runs this model's matmul/conv shapes "
            f"{speedup:.2f}x faster on this device"
        ),
        evidence={
            "speedup": _round(speedup, 3),
            "comparison": comparison.to_dict(),
            "fp32_compute_seconds_per_step": _round(fp32_compute_seconds),
        },
        est_seconds_saved_per_it=saving,
        saving_basis="estimated" if saving is not None else "none",
        fix=mixed_precision_fix(low),
        detail=(
            f"The model's largest op signatures from the audited step were re-run in fp32 and in "
            f"{low} on this device (device-synchronised medians); the saving scales the "
            "audited fp32 matmul/conv/attention time of one step by that ratio. Mixed precision "
            "keeps fp32 master weights, so the update stays as accurate."
        ),
    )


# --------------------------------------------------------------------------------------------
# Deliberate fp32 components


def keep_fp32_parts(components: Mapping[str, torch.nn.Module]) -> dict[str, frozenset[str]]:
    """Per component, the module-name parts a model keeps in fp32 (``_keep_in_fp32_modules``)."""
    parts: dict[str, frozenset[str]] = {}
    for name, module in components.items():
        keep = getattr(module, "_keep_in_fp32_modules", None)
        if keep:
            parts[name] = frozenset(str(k) for k in keep)
    return parts


def component_reasons(
    components: Mapping[str, torch.nn.Module], requested_low: str | None
) -> dict[str, str]:
    """Components kept in fp32 on purpose: a VAE whose config says ``force_upcast``."""
    reasons: dict[str, str] = {}
    vae = components.get("vae")
    if requested_low is None or vae is None:
        return reasons
    config = getattr(vae, "config", None)
    force_upcast = bool(getattr(config, "force_upcast", False))
    weights_fp32 = any(p.dtype == torch.float32 for p in vae.parameters())
    if force_upcast and weights_fp32:
        reasons["vae"] = "VAE kept in fp32, force_upcast in its config"
    return reasons


# --------------------------------------------------------------------------------------------
# The probe


def _positive(value: float) -> float | None:
    return value if math.isfinite(value) and value > 0 else None


class PrecisionProbe:
    """Finds bf16/fp16 compute that silently runs in fp32, and what it costs."""

    name = "precision"
    description = (
        "bf16/fp16 compute that silently runs in fp32: which ops, in which module, how many per "
        "step, how much time; fp32 weights, dtype-mismatch warnings, bf16 speed on this device"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        bench_signatures: int = BENCH_SIGNATURES,
        upcast_bench_signatures: int = UPCAST_BENCH_SIGNATURES,
        bench_repeats: int = BENCH_REPEATS,
        bench_budget_s: float = BENCH_BUDGET_S,
        total_bench_budget_s: float = TOTAL_BENCH_BUDGET_S,
    ) -> None:
        self.bench_signatures = bench_signatures
        self.upcast_bench_signatures = upcast_bench_signatures
        self.bench_repeats = bench_repeats
        self.bench_budget_s = bench_budget_s
        self.total_bench_budget_s = total_bench_budget_s

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped(
                "needs the run's training step; a trace is judged from its input dtypes by the "
                "trace rule"
            )
        say = ctx.progress
        precision = ctx.config.precision
        low = requested_low_dtype(precision)
        device = ctx.device
        sync = device_synchronizer(device)
        result = ProbeResult()
        data = result.data
        native = bf16_native(ctx.device_info)
        s_per_it = _positive(ctx.record.timing.headline.median)
        data.update(
            requested=precision,
            requested_dtype=low or "fp32",
            bf16_native=native,
            s_per_it=s_per_it,
        )

        components = workload_components(workload)
        keep = keep_fp32_parts(components)
        weights = fp32_parameters(components, keep) if precision == "bf16-full" else []
        data["fp32_weights"] = [w.to_dict() for w in weights[:40]]

        say("precision: auditing the dtypes of one training step")
        log: AuditLog | None = None
        try:
            log = audit_step(
                workload,
                precision=precision,
                requested_low=low,
                device=device,
                component_reasons=component_reasons(components, low),
                keep_fp32_parts=keep,
            )
        except Exception as exc:  # report what the static checks found; say the audit failed
            first = (str(exc).strip().splitlines() or [""])[0]
            result.status = "error"
            result.reason = f"audit step failed: {type(exc).__name__}: {first}".rstrip(": ")
            result.traceback = traceback.format_exc()

        bench_cache: dict[tuple[str, torch.dtype, torch.dtype], tuple[BenchResult, BenchResult]]
        bench_cache = {}

        bench_started = time.perf_counter()

        def bench(
            spec: ReplaySpec, base: torch.dtype, lowered: torch.dtype
        ) -> tuple[BenchResult, BenchResult]:
            key = (spec.key, base, lowered)
            if key in bench_cache:
                return bench_cache[key]
            if time.perf_counter() - bench_started > self.total_bench_budget_s:
                skipped = "not timed: the probe's benchmark time budget was spent"
                return (
                    BenchResult(normalize_dtype(str(base)) or str(base), error=skipped),
                    BenchResult(normalize_dtype(str(lowered)) or str(lowered), error=skipped),
                )
            bench_cache[key] = bench_pair(
                spec,
                base,
                lowered,
                sync,
                repeats=self.bench_repeats,
                budget_s=self.bench_budget_s,
            )
            return bench_cache[key]

        comparison: SpeedComparison | None = None
        fp16_comparison: SpeedComparison | None = None
        sites: list[UpcastSite] = []
        if log is not None:
            data["audit"] = {
                "ops": log.ops,
                "wall_seconds": _round(log.wall_seconds),
                "backward_attribution": (
                    "autograd node of the forward call"
                    if log.node_attribution
                    else "unavailable on this torch (backward ops unattributed)"
                ),
                "note": (
                    "one extra step, each op timed alone with the device synchronised: op times "
                    "are real, the step's wall time is not a step time"
                ),
            }
            by_dtype = log.compute_seconds_by_dtype()
            data["compute_seconds_by_dtype"] = {k: _round(v) for k, v in by_dtype.items()}
            data["compute_share_by_dtype"] = {
                k: _round(v, 4) for k, v in dtype_shares(by_dtype).items()
            }
            data["compute_seconds_by_component"] = {
                component or "outside the models": {k: _round(v) for k, v in by.items()}
                for component, by in log.compute_seconds_by_component().items()
            }
            data["verdicts"] = verdict_totals(log)
            data["ops"] = op_table(log)
            data["warnings"] = [w.to_dict() for w in log.warnings[:20]]
            largest = largest_signatures(log, self.bench_signatures)
            say("precision: timing the model's largest ops in fp32 and low precision")
            comparison = compare_speed(largest, "fp32", low or "bf16", bench)
            data["speed_comparison"] = comparison.to_dict()
            data["speed_summary"] = speed_summary(comparison)
            if low == "bf16" and native is False and ctx.device_info.kind != "cpu":
                fp16_comparison = compare_speed(largest, "bf16", "fp16", bench)
                data["fp16_comparison"] = fp16_comparison.to_dict()
            sites, method = self._upcast_sites(log, comparison, precision, weights, bench, device)
            data["claimed_vs_actual"] = claimed_vs_actual(
                precision, by_dtype, fp32_compute_sites(log)
            )
            self._audit_findings(result, log, sites, method, s_per_it)

        weight_finding = fp32_weights_rule(precision, weights, {s.where for s in sites})
        if weight_finding is not None:
            result.findings.append(weight_finding)
        elif precision == "bf16-full":
            result.checked_ok.append(
                "precision: every weight is bf16 in this bf16-full run (no fp32 parameters)"
            )

        low_seconds = _low_compute_seconds(log, "bf16")
        for finding in (
            bf16_not_native_rule(precision, ctx.device_info, native, fp16_comparison, low_seconds),
            bf16_slower_rule(precision, comparison, low_seconds),
            fp32_training_rule(
                precision, ctx.device_info, comparison, _low_compute_seconds(log, "fp32")
            ),
        ):
            if finding is not None:
                result.findings.append(finding)
        self._speed_lines(result, precision, native, ctx.device_info, comparison)
        return result

    # ------------------------------------------------------------ parts of run()

    def _upcast_sites(
        self,
        log: AuditLog,
        comparison: SpeedComparison,
        precision: str,
        weights: Sequence[Fp32Weights],
        bench: Bencher,
        device: torch.device,
    ) -> tuple[list[UpcastSite], str]:
        unexpected = [g for g in log.with_verdict("unexpected") if g.kind != "other"]
        if not unexpected or log.requested_low is None:
            return [], ""
        low_dtype = _TORCH_DTYPES[log.requested_low]
        speedups: dict[str, float] = {}
        for spec_key in sorted(
            {g.signature for g in unexpected if g.signature},
            key=lambda k: (-log.replays[k].work * log.replays[k].calls, k),
        )[: self.upcast_bench_signatures]:
            spec = log.replays[spec_key]
            fp32, lowered = bench(spec, torch.float32, low_dtype)
            if fp32.samples and lowered.samples and lowered.median > 0:
                speedups[spec_key] = fp32.median / lowered.median
        fallback = comparison.speedup
        fallback_basis = "the model's largest ops measured here"
        if not math.isfinite(fallback):
            if device.type == "cpu":
                fallback, fallback_basis = math.nan, ""
            else:
                fallback = ASSUMED_LOW_PRECISION_SPEEDUP
                fallback_basis = f"an assumed {ASSUMED_LOW_PRECISION_SPEEDUP:.0f}x"

        def saving_of(group: OpGroup) -> float | None:
            speedup = speedups.get(group.signature, fallback)
            if not math.isfinite(speedup) or speedup <= 0:
                return None
            return float(group.seconds) * (1 - 1 / speedup)

        method = (
            f"each fp32 op signature re-run in {log.requested_low} and in fp32 on this device "
            f"(device-synchronised medians; {len(speedups)} signature(s) timed"
            + (f", others at {fallback_basis}" if fallback_basis else "")
            + "), applied to its audited time"
        )
        weight_sites = {w.where for w in weights}
        return upcast_sites(unexpected, saving_of, precision, weight_sites), method

    def _audit_findings(
        self,
        result: ProbeResult,
        log: AuditLog,
        sites: Sequence[UpcastSite],
        method: str,
        s_per_it: float | None,
    ) -> None:
        by_dtype = log.compute_seconds_by_dtype()
        if log.requested_low is None:
            result.checked_ok.append(
                f"precision: the run asked for fp32, so there is no bf16/fp16 upcast to look for "
                f"(upcast audit skipped; {claimed_vs_actual(log.precision, by_dtype)})"
            )
        else:
            finding = upcast_rule(log, sites, s_per_it=s_per_it, saving_method=method)
            if finding is not None:
                result.findings.append(finding)
            else:
                totals = verdict_totals(log)
                policy = int(totals.get("by_policy", {}).get("calls", 0))
                deliberate = int(totals.get("deliberate", {}).get("calls", 0))
                result.checked_ok.append(
                    "precision: "
                    + claimed_vs_actual(log.precision, by_dtype, fp32_compute_sites(log))
                    + f"; no unexpected fp32 matmul/conv/attention ({policy} fp32 op call(s) by "
                    f"autocast policy: softmax, norms, loss; {deliberate} deliberate)"
                )
        warning = dtype_warning_rule(log.warnings)
        if warning is not None:
            result.findings.append(warning)
        else:
            result.checked_ok.append(
                "precision: no dtype-mismatch or fused-kernel warnings during the audited step"
            )

    def _speed_lines(
        self,
        result: ProbeResult,
        precision: str,
        native: bool | None,
        info: DeviceInfo,
        comparison: SpeedComparison | None,
    ) -> None:
        ids = {f.id for f in result.findings}
        low = requested_low_dtype(precision)
        if low == "bf16" and native:
            result.checked_ok.append(
                f"precision: {info.name or info.kind} ({info.arch}) computes bf16 natively"
            )
        if comparison is None or not math.isfinite(comparison.speedup):
            return
        measured = speed_summary(comparison)
        if ids & {BF16_SLOWER_ID, FP32_TRAINING_ID}:
            return
        if low is None:
            if comparison.clearly_slower:
                measured += " (fp32 is the faster choice on this device)"
            elif comparison.clearly_faster:
                measured += " (too small a gain to recommend mixed precision)"
            result.checked_ok.append(f"precision: {measured}")
        elif not comparison.clearly_slower:
            result.checked_ok.append(
                f"precision: {measured}, so {precision} is not a measurable slowdown here"
            )


__all__ = [
    "PrecisionProbe",
    "SignatureBench",
    "SpeedComparison",
    "UpcastSite",
    "bf16_not_native_rule",
    "bf16_slower_rule",
    "compare_speed",
    "component_reasons",
    "dtype_warning_rule",
    "fp32_compute_sites",
    "fp32_training_rule",
    "fp32_weights_rule",
    "keep_fp32_parts",
    "op_table",
    "speed_summary",
    "upcast_rule",
    "upcast_sites",
    "verdict_totals",
]
