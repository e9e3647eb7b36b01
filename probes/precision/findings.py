"""The precision probe's judgements (pure: data in, findings out): the claimed-vs-actual summary
and op table of an audited step, the unexpected fp32 compute collected per module, and one rule
per finding id. Every finding is built by :mod:`diagnose.catalogs.precision_catalog`, the wording
the trace rule shares; every saving is per iteration of the headline run (see
:class:`~diagnose.probes.precision.speed.HeadlineScale`), and severity is left to
:mod:`diagnose.verdicts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose.catalogs.precision_catalog import (
    BF16_SLOWER_ID,
    FP32_TRAINING_MIN_SPEEDUP,
    SLOWER_FACTOR,
    UPCAST_ID,
    bf16_not_native_finding,
    bf16_slower_finding,
    dtype_mismatch_finding,
    fp32_training_finding,
    fp32_weights_finding,
    upcast_finding,
)
from diagnose.precision_policy import claimed_vs_actual, is_dtype_warning, requested_low_dtype
from diagnose.probes.precision.audit_log import AuditLog, CapturedWarning, OpGroup
from diagnose.probes.precision.speed import HeadlineScale, SpeedComparison, round_or_none
from diagnose.probes.precision.weights import Fp32Weights
from diagnose.record import DeviceInfo, Finding
from diagnose.stats import at_line
from diagnose.units import ms
from diagnose.verdicts import borderline_at

#: Rows of the op table kept in the probe's data.
TABLE_ROWS = 60


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
# Unexpected fp32 compute per module


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
            "seconds_per_step": round_or_none(self.seconds),
            "est_saving_seconds": round_or_none(self.saving),
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


# --------------------------------------------------------------------------------------------
# Rules: one per finding id


def upcast_rule(
    log: AuditLog,
    sites: Sequence[UpcastSite],
    *,
    scale: HeadlineScale,
    saving_method: str,
) -> Finding | None:
    """``precision.fp32_compute_in_low_precision_run`` from the audit's unexpected ops."""
    if not sites or log.requested_low is None:
        return None
    calls = sum(s.forward_calls + s.backward_calls for s in sites)
    audited = sum(s.seconds for s in sites)
    savings = [s.saving for s in sites]
    audited_saving = None if any(v is None for v in savings) else sum(v or 0.0 for v in savings)
    saving = None if audited_saving is None else scale(max(audited_saving, 0.0))
    seconds = scale(audited)
    by_dtype = log.compute_seconds_by_dtype()
    compute = sum(by_dtype.values())
    actual = claimed_vs_actual(log.precision, by_dtype, fp32_compute_sites(log))
    top = sites[0]
    more = f" and {len(sites) - 1} more module(s)" if len(sites) > 1 else ""
    return upcast_finding(
        calls_per_step=calls,
        run=log.precision,
        where=f"{top.where} ({top.cause.split(' (')[0]}){more}",
        fp32_seconds=seconds,
        seconds_label="of fp32 compute",
        evidence={
            "requested": log.precision,
            "claimed_vs_actual": actual,
            "fp32_calls_per_step": calls,
            "fp32_seconds_per_it": round_or_none(seconds),
            "fp32_audited_seconds": round_or_none(audited),
            "share_of_compute_time": round_or_none(audited / compute, 4) if compute else None,
            "modules": [s.to_dict() for s in sites[:20]],
            "saving_method": saving_method,
            "headline_scale": scale.to_dict(),
            "timing": "audited step: each op timed alone, device-synchronised, then scaled to "
            "the headline run's compute phases",
        },
        saving=saving,
        basis="estimated",
        detail=(
            f"{actual}. These ops are the lowest-level compute ops the dispatcher ran (after "
            "autocast), so their inputs really were fp32; each is attributed to the module that "
            "issued it (backward ops through the autograd node their forward call created). "
            f"Saving: {saving_method}."
            + (
                " On this device the requested dtype is not faster for these shapes, so fixing "
                "the upcast would not speed this run up (it still costs memory)."
                if saving is not None and saving <= 0
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
    computing = sorted({r.where for r in rows} & upcast_modules)
    kinds = ", ".join(
        part
        for part in (
            f"{sum(r.tensors for r in lora)} LoRA" if lora else "",
            f"{sum(r.tensors for r in base)} base" if base else "",
        )
        if part
    )
    tensors = sum(r.tensors for r in rows)
    return fp32_weights_finding(
        tensors=tensors,
        kinds=kinds,
        mib=total_bytes / 2**20,
        where=rows[0].where + (f" and {len(rows) - 1} more module(s)" if len(rows) > 1 else ""),
        evidence={
            "tensors": tensors,
            "bytes": total_bytes,
            "lora_tensors": sum(r.tensors for r in lora),
            "base_tensors": sum(r.tensors for r in base),
            "modules": [r.to_dict() for r in rows[:20]],
            "modules_computing_in_fp32": computing,
        },
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
    first = relevant[0]
    return dtype_mismatch_finding(
        count=sum(w.count for w in relevant),
        origin=" in ".join(part for part in (first.function, first.site.where) if part),
        message=first.message,
        evidence={
            "warnings_per_step": sum(w.count for w in relevant),
            "warnings": [w.to_dict() for w in relevant[:10]],
            "seconds_in_warning_calls": round_or_none(sum(w.seconds for w in relevant)),
        },
    )


def _saving_evidence(
    comparison: SpeedComparison, current: str, scale: HeadlineScale | None
) -> tuple[float | None, float | None, dict[str, Any]]:
    """The saving of switching ``comparison``'s signatures away from ``current``, per headline
    iteration, and the evidence that shows how it was derived."""
    if scale is None:
        return None, None, {"comparison": comparison.to_dict()}
    saving, sure, measured = comparison.headline_saving(current, scale)
    central, sure_fraction = comparison.saving_fractions(current)
    return (
        saving,
        sure,
        {
            "comparison": comparison.to_dict(),
            "measured_signatures_seconds_per_it": round_or_none(measured),
            "saved_fraction_of_them": round_or_none(central, 4),
            "sure_saved_fraction_of_them": round_or_none(sure_fraction, 4),
            "headline_scale": scale.to_dict(),
        },
    )


_SAVING_DETAIL = (
    "The saving is the measured difference as a fraction of the benchmarked signatures' time, "
    "applied to the time those same signatures take per iteration of the headline run (their "
    "audited time scaled to its compute phases); the signatures that were not benchmarked are "
    "left out, so it is a lower estimate."
)


@dataclass(frozen=True)
class Bf16Hardware:
    """The hardware fact behind ``precision.bf16_not_native``: bf16 was asked of a device without
    native bf16 arithmetic. Raised as its own finding, or carried by the measured
    ``precision.bf16_slower_than_fp32`` when that one says the same cause in seconds."""

    #: The device as titles name it: "AMD Radeon RX 6800 XT (gfx1030)".
    device: str
    on_cpu: bool
    evidence: dict[str, Any]
    #: What the device does with bf16 instead (one or two sentences for a finding's detail).
    why: str


def bf16_hardware(precision: str, info: DeviceInfo, native: bool | None) -> Bf16Hardware | None:
    """The hardware fact, when this run asks for bf16 and the device is known to lack it."""
    if requested_low_dtype(precision) != "bf16" or native is not False:
        return None
    on_cpu = info.kind == "cpu"
    evidence: dict[str, Any] = {
        "device": info.name or info.kind,
        "arch": info.arch,
        "kind": info.kind,
        "bf16_native": native,
    }
    if on_cpu:
        evidence["isa"] = info.extra.get("isa")
        why = (
            "Without AVX512-BF16/AMX-BF16 (x86) or the BF16 extension (Arm), torch converts bf16 "
            f"to fp32 and back around every op. ISA flags seen: {info.extra.get('isa')}."
        )
    else:
        why = (
            "torch.cuda.is_bf16_supported() returns True on every HIP build, so the stack does "
            "not refuse bf16; without bf16 matrix instructions (Volta/Turing, RDNA1/RDNA2, Vega) "
            "it is emulated through fp32."
        )
    device = (info.name or info.kind) + (f" ({info.arch})" if info.arch else "")
    return Bf16Hardware(device, on_cpu, evidence, why)


def bf16_not_native_rule(
    precision: str,
    info: DeviceInfo,
    native: bool | None,
    fp16: SpeedComparison | None,
    scale: HeadlineScale | None,
) -> Finding | None:
    """``precision.bf16_not_native``: bf16 asked of a device without native bf16. On a GPU its
    saving is fp16's, measured against bf16 at the model's shapes; without that it is the
    hardware fact alone (which a measured ``bf16_slower_than_fp32`` then carries instead)."""
    hardware = bf16_hardware(precision, info, native)
    if hardware is None:
        return None
    saving = sure = None
    speed: dict[str, Any] = {}
    fp16_vs_bf16: float | None = None
    if not hardware.on_cpu and fp16 is not None and math.isfinite(fp16.speedup):
        fp16_vs_bf16 = fp16.speedup
        saving, sure, speed = _saving_evidence(fp16, fp16.base, scale)
    detail = hardware.why + (
        f" fp16 measured {fp16_vs_bf16:.2f}x faster than bf16 at this model's shapes. "
        + _SAVING_DETAIL
        if fp16_vs_bf16
        else " No measurement of bf16 against fp32 at this model's shapes stands behind this "
        f"finding (when one shows bf16 slower, {BF16_SLOWER_ID} carries this fact instead)."
    )
    return bf16_not_native_finding(
        device=hardware.device,
        on_cpu=hardware.on_cpu,
        evidence={
            **hardware.evidence,
            "fp16_vs_bf16_speedup": round_or_none(fp16_vs_bf16, 3),
            **speed,
        },
        saving=saving,
        sure_saving=sure,
        detail=detail,
    )


def bf16_slower_rule(
    precision: str,
    comparison: SpeedComparison | None,
    scale: HeadlineScale | None,
    hardware: Bf16Hardware | None = None,
) -> Finding | None:
    """``precision.bf16_slower_than_fp32``: a bf16 run on a device where bf16 measured slower.

    ``hardware``: the device has no native bf16 (the slowdown's cause); the finding carries that
    fact in its title, evidence and detail, so one cause makes one finding."""
    if requested_low_dtype(precision) != "bf16" or comparison is None:
        return None
    speedup = comparison.speedup
    if not math.isfinite(speedup) or not comparison.clearly_slower:
        return None
    interval = comparison.speedup_interval()
    slower = at_line(
        1 / speedup,
        SLOWER_FACTOR,
        interval=None if interval is None else (1 / interval[1], 1 / interval[0]),
    )
    if slower.below:
        return None
    saving, sure, evidence = _saving_evidence(comparison, comparison.low, scale)
    fp32, low = comparison.totals()
    finding = bf16_slower_finding(
        slowdown=1 / speedup,
        signatures=len(comparison.timed_rows()),
        evidence={
            "bf16_over_fp32_time": round_or_none(1 / speedup, 3),
            "benchmark_bf16_seconds_per_step": round_or_none(low),
            "benchmark_fp32_seconds_per_step": round_or_none(fp32),
            **evidence,
            **({"bf16_not_native": hardware.evidence} if hardware else {}),
        },
        saving=saving,
        sure_saving=sure,
        detail=(
            "Measured, not assumed: the model's own largest op signatures (shapes and strides "
            "from the audited step) were re-run in bf16 and in fp32 on this device, calls "
            f"alternating ({ms(low)} against {ms(fp32)} per step of them in the benchmark). "
            + _SAVING_DETAIL
            + (
                f" Why: {hardware.device} has no native bf16 arithmetic. {hardware.why}"
                if hardware
                else ""
            )
        ),
        not_native=hardware.device if hardware else "",
        on_cpu=hardware.on_cpu if hardware else False,
    )
    if slower.borderline:
        finding.borderline = borderline_at(slower, "bf16 over fp32 time", "", ratio=True)
    return finding


def fp32_training_rule(
    precision: str,
    info: DeviceInfo,
    comparison: SpeedComparison | None,
    scale: HeadlineScale | None,
) -> Finding | None:
    """``precision.fp32_training`` (same meaning as the trace rule's): the run trains in fp32 and
    this device runs the model's shapes clearly faster in low precision (measured here)."""
    if requested_low_dtype(precision) is not None or comparison is None:
        return None
    speedup = comparison.speedup
    if not math.isfinite(speedup) or not comparison.clearly_faster:
        return None
    faster = at_line(speedup, FP32_TRAINING_MIN_SPEEDUP, interval=comparison.speedup_interval())
    if faster.below:
        return None
    saving, sure, evidence = _saving_evidence(comparison, comparison.base, scale)
    low = comparison.low
    finding = fp32_training_finding(
        how_known=f"{low} runs this model's matmul/conv shapes {speedup:.2f}x faster on this "
        "device",
        low=low,
        evidence={"speedup": round_or_none(speedup, 3), **evidence},
        saving=saving,
        sure_saving=sure,
        basis="estimated",
        detail=(
            f"The model's largest op signatures from the audited step were re-run in fp32 and in "
            f"{low} on this device, calls alternating. " + _SAVING_DETAIL
        ),
        no_fast_bf16=low == "fp16" and info.kind != "cpu",
    )
    if faster.borderline:
        finding.borderline = borderline_at(faster, f"{low} speed-up", "", ratio=True)
    return finding


__all__ = [
    "TABLE_ROWS",
    "Bf16Hardware",
    "UpcastSite",
    "bf16_hardware",
    "bf16_not_native_rule",
    "bf16_slower_rule",
    "dtype_warning_rule",
    "fp32_compute_sites",
    "fp32_training_rule",
    "fp32_weights_rule",
    "op_table",
    "upcast_rule",
    "upcast_sites",
    "verdict_totals",
]
