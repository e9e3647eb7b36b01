"""The record's view of utilisation: what the step does, what the device can do, how far apart.

Plain dataclasses (no torch) so that the record, the reports and the gate read them anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ClassUtilisation:
    """One class of work in the step: FLOPs (or bytes, for "memory") against its own time."""

    #: "gemm", "conv", "attention" (FLOPs) or "memory" (bytes moved by elementwise/norm ops).
    op_class: str = ""
    #: FLOPs per step, or bytes per step for "memory".
    work_per_step: float = 0.0
    #: Seconds per step the class took: device kernel time on a GPU, op time on a CPU.
    seconds: float | None = None
    #: "device kernels" or "host ops": where ``seconds`` comes from.
    seconds_basis: str = ""
    #: work / seconds: FLOP/s (bytes/s for "memory").
    achieved_per_s: float | None = None
    #: The peak it is held against (FLOP/s or bytes/s) and the seconds the work needs at it.
    peak_per_s: float | None = None
    seconds_at_peak: float | None = None
    #: achieved / peak, in (0, 1] when both are known.
    share_of_peak: float | None = None


@dataclass
class Peak:
    """A device peak the step is compared with, per dtype."""

    #: "measured" (a microbenchmark on this machine) or "spec" (the vendor's dense figure).
    basis: str = ""
    #: FLOP/s per dtype name ("bfloat16", "float32", ...).
    flops_per_s: dict[str, float] = field(default_factory=dict)
    memory_bytes_per_s: float | None = None
    #: How it was obtained: the shapes measured, or the datasheet and the card it matched.
    source: str = ""
    #: The card the spec is of, as the table names it ("" for a measured peak).
    device: str = ""
    #: Seconds the step's counted FLOPs need at this peak (each dtype at its own rate).
    seconds_at_peak: float | None = None
    #: seconds_at_peak / measured s/it: model FLOPs utilisation against this peak.
    mfu: float | None = None
    #: Dtypes with FLOPs in the step but no peak here (left out of seconds_at_peak).
    dtypes_without_peak: list[str] = field(default_factory=list)


@dataclass
class Utilisation:
    """Model FLOPs utilisation of the step, as a whole and per class of work."""

    #: FLOPs per training step, counted from the ops' recorded shapes (or their flops args).
    flops_per_step: float = 0.0
    #: "trace shapes" or "trace flops args".
    basis: str = ""
    flops_by_dtype: dict[str, float] = field(default_factory=dict)
    flops_by_phase: dict[str, float] = field(default_factory=dict)
    #: The s/it the FLOPs are divided by, and which number it is.
    step_seconds: float = 0.0
    step_basis: str = ""
    achieved_flops_per_s: float = 0.0
    #: Measured here (run) and the vendor's spec (when the device is in the table).
    measured: Peak | None = None
    spec: Peak | None = None
    classes: list[ClassUtilisation] = field(default_factory=list)
    #: Bytes per step moved by memory-bound ops (elementwise, norms, reductions).
    memory_bytes_per_step: float | None = None
    #: What could not be counted, and the assumptions the count made.
    notes: list[str] = field(default_factory=list)
    #: Ops without shapes or unknown to the count were left out: the FLOPs are a lower bound.
    lower_bound: bool = False
    #: Why the count cannot be the step's work ("" when it can): it needs longer at the device's
    #: peak than the step took, or a rate no device reaches. Then no MFU and no share of a peak
    #: is given: the trace's shapes were misread, the device was not that fast.
    misread: str = ""

    def above_peak(self) -> str:
        """Why the MFU or a class's share of its peak is above 100% (a record from elsewhere, or
        an older diagnose), or "" when none is."""
        for peak in (self.spec, self.measured):
            if peak is not None and peak.mfu is not None and peak.mfu > 1:
                at = f"the {peak.device}'s dense peak" if peak.device else f"the {peak.basis} peak"
                need = f" ({peak.seconds_at_peak:.3g} s)" if peak.seconds_at_peak else ""
                return (
                    f"at {at} the counted FLOPs need longer{need} than the measured "
                    f"{self.step_seconds:.3g} s step"
                )
        for row in self.classes:
            if row.op_class != "memory" and row.share_of_peak is not None and row.share_of_peak > 1:
                return f"the {row.op_class} work needs longer at its peak than its own time"
        return ""

    def mark_misread(self, reason: str) -> None:
        """Say the count is a misread (``reason``), and drop every number made from it that
        would read as a rate or a share: the MFUs, the shares of the peaks, the achieved rates."""
        self.misread = reason
        self.achieved_flops_per_s = math.nan
        for peak in (self.spec, self.measured):
            if peak is not None:
                peak.mfu = None
        for row in self.classes:
            if row.op_class != "memory":
                row.share_of_peak = None
                row.achieved_per_s = None

    @property
    def headline_peak(self) -> Peak | None:
        """The peak the first screen quotes: the spec when known (comparable across machines,
        as MFU is usually quoted), else the one measured here."""
        if self.spec is not None and self.spec.mfu is not None:
            return self.spec
        if self.measured is not None and self.measured.mfu is not None:
            return self.measured
        return None


__all__ = ["ClassUtilisation", "Peak", "Utilisation"]
