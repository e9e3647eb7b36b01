"""The device's own peak, measured: what the step's FLOPs are held against on this machine.

The trace rule ``roofline`` counted the step's FLOPs per dtype from the profiled steps; this probe
times ``torch.mm`` in each dtype that carries a real share of them (at the step's largest GEMM
and at a square shape that fills the device) and one large copy for the bandwidth. The record's
utilisation (:func:`diagnose.roofline.utilisation.settle_utilisation`) combines the three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.record import ProbeResult
from diagnose.roofline.measure import DTYPES, measure_peaks
from diagnose.roofline.utilisation import counted_work, positive_values

#: A dtype is measured when it carries at least this share of the step's counted FLOPs.
MIN_DTYPE_SHARE = 0.05
CHECK_ID = "compute.peak_measured"


def dtypes_to_measure(flops_by_dtype: Mapping[str, Any]) -> list[str]:
    """Dtypes with a real share of the step's FLOPs, largest first (ones torch can multiply)."""
    values = positive_values(flops_by_dtype)
    total = sum(values.values())
    if total <= 0:
        return []
    return [
        d
        for d, v in sorted(values.items(), key=lambda kv: -kv[1])
        if v / total >= MIN_DTYPE_SHARE and d in DTYPES
    ]


class RooflineProbe:
    """Measures the matrix peak per dtype and the memory bandwidth of this device."""

    name = "roofline"
    description = "the device's measured GEMM peak in the step's dtypes and its copy bandwidth"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        work = counted_work(ctx.record)
        dtypes = dtypes_to_measure(work.get("flops_by_dtype") or {})
        if not dtypes:
            raise ProbeSkipped(
                "the trace analysis counted no FLOPs in a dtype this probe can multiply "
                "(no recorded shapes, or no trace)"
            )
        gemm = work.get("largest_gemm")
        step_gemm = None
        if isinstance(gemm, Mapping):
            dims = tuple(gemm.get(k) for k in ("m", "n", "k"))
            if all(isinstance(d, int) and d > 0 for d in dims):
                step_gemm = (int(dims[0]), int(dims[1]), int(dims[2]))  # type: ignore[arg-type]
        ctx.progress("roofline: timing torch.mm and a copy")
        peaks = measure_peaks(ctx.device, dtypes, step_gemm)
        result = ProbeResult()
        result.data = {
            "flops_per_s": dict(peaks.flops_per_s),
            "memory_bytes_per_s": peaks.memory_bytes_per_s,
            "gemms": [{**dataclasses.asdict(g), "shape": g.shape} for g in peaks.gemms],
            "notes": list(peaks.notes),
        }
        # A measured peak is a number, not a verdict: only its absence is a check (what MFU
        # could not be held against).
        if not peaks.flops_per_s:
            result.add_not_judged(
                CHECK_ID,
                "the device's peak could not be measured here, so MFU is held against the "
                "vendor's spec only: " + "; ".join(peaks.notes),
            )
        return result


__all__ = ["CHECK_ID", "MIN_DTYPE_SHARE", "RooflineProbe", "dtypes_to_measure"]
