"""The step's work against the device's peaks: model FLOPs utilisation (pure).

:func:`utilisation_of` takes the work the trace rule ``roofline`` counted, the s/it, the device's
spec peak (when the card is known) and the peaks measured here, and gives one
:class:`~diagnose.roofline.model.Utilisation`. Each dtype's FLOPs are held against that dtype's
own peak, so a step that mixes bf16 GEMMs with fp32 ones gets the time both need, not the time
at the faster rate. :func:`settle_utilisation` fills a record's field from what its stages left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from diagnose.record import DeviceInfo, RunRecord
from diagnose.roofline.model import ClassUtilisation, Peak, Utilisation

#: Kernel classes (diagnose.trace.kernels) whose device time each class of work takes. The math
#: attention path runs as GEMMs, and its FLOPs are counted as GEMM FLOPs too.
KERNEL_CLASSES_OF: dict[str, tuple[str, ...]] = {
    "gemm": ("gemm",),
    "conv": ("conv",),
    "attention": ("attention_fused",),
    "memory": ("elementwise", "norm", "reduction", "softmax"),
}
#: How far beyond a torch.mm microbenchmark a step's own rate can be and still be real: the
#: furthest seen is a CPU's fused attention computing bf16 in fp32 against torch.mm in emulated
#: bf16 (4.6x). Further is a misread count, not a faster kernel.
MAX_ABOVE_MEASURED = 10.0
#: A step rate this many times the fastest dense peak of any device the spec table knows is a
#: misread count whatever the device (the margin leaves room for cards newer than the table).
MAX_ABOVE_KNOWN_DEVICES = 2.0
#: Name of the probe that measures peaks, and of the trace rule that counts the work.
PROBE_NAME = "roofline"
RULE_NAME = "roofline"


def _positive(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number > 0:
            return number
    return None


def positive_values(values: Any) -> dict[str, float]:
    """The finite positive numbers of a mapping read from a record (FLOPs or rates by name)."""
    if not isinstance(values, Mapping):
        return {}
    return {str(k): v for k, raw in values.items() if (v := _positive(raw)) is not None}


def _held_against(flops_by_dtype: Mapping[str, float], peak: Peak, step_seconds: float) -> Peak:
    """``peak`` with the seconds the step's FLOPs need at it and the MFU that gives."""
    seconds = 0.0
    missing: list[str] = []
    for dtype, flops in flops_by_dtype.items():
        rate = peak.flops_per_s.get(dtype)
        if rate is None:
            missing.append(dtype)
            continue
        seconds += flops / rate
    peak.dtypes_without_peak = sorted(missing)
    if seconds > 0:
        peak.seconds_at_peak = seconds
        peak.mfu = seconds / step_seconds if step_seconds > 0 else None
    return peak


def mfu_against(u: Utilisation, peak: Peak) -> float | None:
    """``u``'s step held against another record's ``peak``: the gate compares records against
    one peak, so a change in MFU is a change in the step's work or time, not in how fast a
    microbenchmark happened to run on each side. None when a dtype of ``u`` has no rate there."""
    if u.misread or any(d not in peak.flops_per_s for d in u.flops_by_dtype):
        return None
    reference = Peak(basis=peak.basis, flops_per_s=dict(peak.flops_per_s))
    return _held_against(u.flops_by_dtype, reference, u.step_seconds).mfu


def _effective_rate(flops_by_dtype: Mapping[str, float], peak: Peak | None) -> float | None:
    """The FLOP/s the step's dtype mix reaches at ``peak`` (FLOPs over seconds at peak)."""
    if peak is None or peak.seconds_at_peak is None:
        return None
    counted = sum(f for d, f in flops_by_dtype.items() if d in peak.flops_per_s)
    return counted / peak.seconds_at_peak if counted > 0 else None


def _classes(
    work: Mapping[str, Any], kernel_seconds: Mapping[str, float]
) -> list[ClassUtilisation]:
    """Each class of work with its own time and achieved rate (its peak is set by :func:`_hold`)."""
    on_device = bool(kernel_seconds)
    host = work.get("host_seconds_by_class") or {}
    entries = list(positive_values(work.get("flops_by_class")).items())
    memory = _positive(work.get("memory_bytes_per_step"))
    if memory is not None:
        entries.append(("memory", memory))
    out: list[ClassUtilisation] = []
    for name, amount in sorted(entries, key=lambda e: (e[0] == "memory", -e[1])):
        if on_device:
            seconds = sum(kernel_seconds.get(k, 0.0) for k in KERNEL_CLASSES_OF.get(name, ()))
            basis = "device kernels"
        else:
            raw = work.get("memory_host_seconds") if name == "memory" else host.get(name)
            seconds = _positive(raw) or 0.0
            basis = "host ops"
        row = ClassUtilisation(op_class=name, work_per_step=amount, seconds_basis=basis)
        if seconds > 0:
            row.seconds = seconds
            row.achieved_per_s = amount / seconds
        out.append(row)
    return out


def _hold(
    classes: list[ClassUtilisation], rate: float | None, bandwidth: float | None
) -> list[str]:
    """Each class against its peak: the FLOP rate, or the bandwidth for "memory". Returns notes:
    the memory-bound ops' bytes are a model (each tensor read once), which data served from
    cache can beat; a share above the bandwidth is then not given."""
    notes = []
    for row in classes:
        peak = bandwidth if row.op_class == "memory" else rate
        if peak is None:
            continue
        row.peak_per_s = peak
        row.seconds_at_peak = row.work_per_step / peak
        if row.achieved_per_s is None:
            continue
        share = row.achieved_per_s / peak
        if row.op_class == "memory" and share > 1:
            notes.append(
                "the memory-bound ops' modelled bytes moved faster than the device's bandwidth "
                "(tensors served from cache): no share of the bandwidth is given"
            )
            continue
        row.share_of_peak = share
    return notes


def _raise_to_what_the_step_reached(
    result: Utilisation, measured: Peak, by_dtype: Mapping[str, float], bandwidth: float | None
) -> float | None:
    """A measured peak is the fastest rate the device was seen to reach: when a class of the
    step's own work ran faster than the microbenchmark (a fused kernel that computes bf16 in fp32
    on a CPU without native bf16, a layout torch.mm does not take), the step's rate is that
    fastest rate, and every share is held against it, so none reads above 100%. Returns that
    rate when it was raised to it (exact: rescaling the dtypes' rates rounds). A rate more than
    :data:`MAX_ABOVE_MEASURED` times the microbenchmark's is a misread count: the peak is left
    as measured and ``result`` is marked misread."""
    compute = [c for c in result.classes if c.op_class != "memory" and c.achieved_per_s]
    fastest = max(compute, key=lambda c: c.achieved_per_s or 0.0, default=None)
    rate = _effective_rate(by_dtype, measured)
    raised: float | None = None
    if fastest is not None and fastest.achieved_per_s is not None and rate is not None:
        factor = fastest.achieved_per_s / rate
        if factor > MAX_ABOVE_MEASURED:
            result.misread = (
                f"the {fastest.op_class} ops would have run more than {MAX_ABOVE_MEASURED:g}x "
                "faster than the peak measured on this machine"
            )
        elif factor > 1.0:
            measured.flops_per_s = {d: r * factor for d, r in measured.flops_per_s.items()}
            measured.source += (
                f"; raised to the {fastest.op_class} ops' own rate in the step "
                f"({fastest.achieved_per_s / 1e9:.3g} GFLOP/s), {factor:.2f}x the "
                "microbenchmark's"
            )
            _held_against(by_dtype, measured, result.step_seconds)
            raised = fastest.achieved_per_s
            result.notes.append(
                f"the step's {fastest.op_class} ops ran faster than the torch.mm microbenchmark "
                f"({factor:.2f}x): the measured peak is the fastest rate the step itself reached"
            )
    memory = next((c for c in result.classes if c.op_class == "memory"), None)
    reached = memory.achieved_per_s if memory is not None else None
    if reached and bandwidth and reached > bandwidth:
        measured.memory_bytes_per_s = reached
    return raised


def utilisation_of(
    work: Mapping[str, Any],
    *,
    step_seconds: float,
    step_basis: str,
    spec: Peak | None,
    measured: Peak | None,
    kernel_seconds: Mapping[str, float] | None = None,
) -> Utilisation | None:
    """MFU of a step from its counted work; None when nothing was counted or no s/it exists."""
    flops = _positive(work.get("flops_per_step"))
    if flops is None or not (math.isfinite(step_seconds) and step_seconds > 0):
        return None
    by_dtype = positive_values(work.get("flops_by_dtype")) or {"unknown": flops}
    result = Utilisation(
        flops_per_step=flops,
        basis=str(work.get("basis") or ""),
        flops_by_dtype=by_dtype,
        flops_by_phase=positive_values(work.get("flops_by_phase")),
        step_seconds=step_seconds,
        step_basis=step_basis,
        achieved_flops_per_s=flops / step_seconds,
        memory_bytes_per_step=_positive(work.get("memory_bytes_per_step")),
    )
    for peak in (measured, spec):
        if peak is not None:
            _held_against(by_dtype, peak, step_seconds)
    result.measured, result.spec = measured, spec
    # Per class against the peak measured here when there is one: the classes' own time was
    # measured on this machine too.
    reference = measured if measured is not None and measured.mfu is not None else spec

    def bandwidth() -> float | None:
        found = (p.memory_bytes_per_s for p in (measured, spec) if p is not None)
        return next((b for b in found if b), None)

    result.classes = _classes(work, kernel_seconds or {})
    raised = None
    if reference is measured and measured is not None:
        raised = _raise_to_what_the_step_reached(result, measured, by_dtype, bandwidth())
    result.notes += _hold(
        result.classes, raised or _effective_rate(by_dtype, reference), bandwidth()
    )
    misread = result.misread or result.above_peak() or _beyond_every_device(result)
    if misread:
        result.mark_misread(misread)
    without = int(work.get("ops_without_shapes") or 0)
    if without:
        result.notes.append(
            f"{without} compute ops per step had no recorded shapes and are not counted: "
            "the FLOPs are a lower bound"
        )
    uncounted = work.get("uncounted") or {}
    if isinstance(uncounted, Mapping) and uncounted:
        names = ", ".join(sorted(str(k) for k in uncounted)[:8])
        result.notes.append(f"ops not counted: {names}")
    result.lower_bound = bool(without) or bool(uncounted)
    for text in [*(work.get("notes") or []), *(work.get("assumptions") or [])]:
        result.notes.append(str(text))
    for peak in (measured, spec):
        if peak is not None and peak.dtypes_without_peak:
            result.notes.append(
                f"no {peak.basis} peak for {', '.join(peak.dtypes_without_peak)}: those FLOPs "
                f"are left out of the time at the {peak.basis} peak"
            )
    return result


def _beyond_every_device(result: Utilisation) -> str:
    """Why the step's rate is no device's (far above the fastest dense peak the spec table
    knows), or ""."""
    from diagnose.roofline.peaks import fastest_known_rate

    fastest = fastest_known_rate()
    if result.achieved_flops_per_s > fastest * MAX_ABOVE_KNOWN_DEVICES:
        return (
            f"in the measured {result.step_seconds:.3g} s step that is more than "
            f"{MAX_ABOVE_KNOWN_DEVICES:g}x the fastest dense peak of any device diagnose knows "
            f"({fastest / 1e12:.0f} TFLOP/s)"
        )
    return ""


# --------------------------------------------------------------------------------------------
# Peaks from what the stages left


def measured_peak(data: Mapping[str, Any]) -> Peak | None:
    """The Peak the ``roofline`` probe measured (its ProbeResult.data), or None."""
    rates = positive_values(data.get("flops_per_s"))
    if not rates:
        return None
    shapes = sorted(
        {str(g.get("shape", "")) for g in data.get("gemms") or [] if isinstance(g, Mapping)}
    )
    return Peak(
        basis="measured",
        flops_per_s=rates,
        memory_bytes_per_s=_positive(data.get("memory_bytes_per_s")),
        source="torch.mm microbenchmark here at " + "; ".join(s for s in shapes if s),
    )


SpecLookup = Callable[[DeviceInfo, str], Any]


def spec_peak_for(
    device: DeviceInfo, dtypes: list[str], lookup: SpecLookup | None = None
) -> Peak | None:
    """The vendor's dense peak of ``device`` for each dtype it has, or None for an unknown card."""
    if lookup is None:
        from diagnose.roofline.peaks import spec_peak

        lookup = spec_peak
    rates: dict[str, float] = {}
    bandwidth: float | None = None
    names: set[str] = set()
    sources: set[str] = set()
    for dtype in dtypes:
        found = lookup(device, dtype)
        if found is None:
            continue
        rates[dtype] = float(found.flops_per_s)
        bandwidth = bandwidth or found.memory_bytes_per_s
        names.add(str(found.device))
        sources.add(str(found.source))
    if not rates:
        return None
    return Peak(
        basis="spec",
        flops_per_s=rates,
        memory_bytes_per_s=bandwidth,
        source="; ".join(sorted(sources)),
        device=", ".join(sorted(names)),
    )


def counted_work(record: RunRecord) -> Mapping[str, Any]:
    """What the trace rule ``roofline`` counted in the record's trace ({} when nothing)."""
    for probe in record.probes:
        if probe.name == "trace":
            rules = probe.data.get("rules") or {}
            data = rules.get(RULE_NAME) if isinstance(rules, Mapping) else None
            return data if isinstance(data, Mapping) else {}
    return {}


def settle_utilisation(record: RunRecord) -> None:
    """Fill ``record.utilisation`` from the trace rule's count, the s/it and the peaks."""
    work = counted_work(record)
    if not work:
        return
    stats = record.timing.unprofiled if record.timing.unprofiled.n else record.timing.profiled
    if not stats.n:
        return
    basis = (
        "median s/it of the timed steps"
        if record.timing.unprofiled.n
        else ("median wall time of the trace's steps")
    )
    measured = next(
        (measured_peak(p.data) for p in record.probes if p.name == PROBE_NAME and p.status == "ok"),
        None,
    )
    dtypes = list(positive_values(work.get("flops_by_dtype")))
    record.utilisation = utilisation_of(
        work,
        step_seconds=float(stats.median),
        step_basis=basis,
        spec=spec_peak_for(record.device, dtypes) if dtypes else None,
        measured=measured,
        kernel_seconds=record.breakdown.device_seconds_by_kernel_class,
    )


__all__ = [
    "KERNEL_CLASSES_OF",
    "MAX_ABOVE_KNOWN_DEVICES",
    "MAX_ABOVE_MEASURED",
    "PROBE_NAME",
    "RULE_NAME",
    "counted_work",
    "measured_peak",
    "mfu_against",
    "positive_values",
    "settle_utilisation",
    "spec_peak_for",
    "utilisation_of",
]
