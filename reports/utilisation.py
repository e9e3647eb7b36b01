"""The report's utilisation: the step's FLOPs against the device's peak, one line on the first
screen and a per-class table below (from :attr:`diagnose.record.RunRecord.utilisation`)."""

from __future__ import annotations

from dataclasses import dataclass

from diagnose.carry_over import shrunk_preset
from diagnose.record import RunRecord
from diagnose.roofline.model import Peak, Utilisation
from diagnose.units import (
    format_bytes,
    format_bytes_rate,
    format_flops,
    format_percent,
    format_seconds,
)

_CLASS_LABELS = {
    "gemm": "matrix multiply (GEMM)",
    "conv": "convolution",
    "attention": "fused attention",
    "memory": "memory-bound ops (bytes)",
}


@dataclass(frozen=True)
class ClassRow:
    label: str
    work: str
    seconds: str
    achieved: str
    peak: str
    share: str


@dataclass(frozen=True)
class UtilisationView:
    #: One sentence for the first screen.
    line: str
    #: The tiny-model caution, or "".
    caution: str
    #: The same against the other peak (spec when the line used measured, or the reverse).
    other: str
    rows: tuple[ClassRow, ...]
    #: How each number was obtained, and what could not be counted.
    notes: tuple[str, ...]


def _dtype_rates(peak: Peak) -> str:
    return ", ".join(
        f"{dtype} {format_flops(rate, per_second=True)}"
        for dtype, rate in sorted(peak.flops_per_s.items(), key=lambda kv: -kv[1])
    )


def _peak_phrase(peak: Peak) -> str:
    if peak.basis == "spec":
        return f"the vendor's dense peak of the {peak.device} ({_dtype_rates(peak)})"
    return f"the peak measured on this machine ({_dtype_rates(peak)})"


def _against(u: Utilisation, peak: Peak) -> str:
    return (
        f"at {_peak_phrase(peak)} it needs {format_seconds(peak.seconds_at_peak)}; "
        f"the measured {format_seconds(u.step_seconds)} is {format_percent(peak.mfu)} "
        "model FLOPs utilisation (MFU)"
    )


def _row(u: Utilisation, index: int) -> ClassRow:
    c = u.classes[index]
    memory = c.op_class == "memory"
    return ClassRow(
        label=_CLASS_LABELS.get(c.op_class, c.op_class),
        work=format_bytes(c.work_per_step) if memory else format_flops(c.work_per_step),
        seconds=(
            f"{format_seconds(c.seconds)} ({c.seconds_basis})" if c.seconds is not None else "—"
        ),
        achieved=(
            format_bytes_rate(c.achieved_per_s)
            if memory
            else format_flops(c.achieved_per_s, per_second=True)
        )
        if c.achieved_per_s is not None
        else "—",
        peak=(
            format_bytes_rate(c.peak_per_s)
            if memory
            else format_flops(c.peak_per_s, per_second=True)
        )
        if c.peak_per_s is not None
        else "—",
        share=format_percent(c.share_of_peak, missing="—"),
    )


def build_utilisation(record: RunRecord) -> UtilisationView | None:
    """The report's utilisation view, or None when the record counted no FLOPs."""
    u = record.utilisation
    if u is None or not u.flops_per_step:
        return None
    at_least = "at least " if u.lower_bound else ""
    counted = f"This step does {at_least}{format_flops(u.flops_per_step)} (counted from {u.basis})"
    peak = u.headline_peak
    if u.misread:
        line = (
            f"{counted}: {u.misread}, so the count is a misread of the trace (shapes recorded "
            "wrong, or work counted twice), not a utilisation; no MFU is given."
        )
    elif peak is None:
        line = (
            f"{counted}, {format_flops(u.achieved_flops_per_s, per_second=True)} at the measured "
            f"{format_seconds(u.step_seconds)}; no peak of this device is known or was measured."
        )
    else:
        line = f"{counted}: {_against(u, peak)}."
    other_peak = u.measured if peak is u.spec else u.spec
    other = ""
    if other_peak is not None and other_peak.mfu is not None and peak is not None:
        other = f"Against {_peak_phrase(other_peak)}: {format_percent(other_peak.mfu)} MFU."
    caution = ""
    if shrunk_preset(record.config):
        caution = (
            "This is the tiny stand-in's MFU: the real model's larger ops use the device "
            "differently, so its own distance from the peak is measured on the real model."
        )
    notes = [f"s/it: {u.step_basis}."]
    for source in (u.spec, u.measured):
        if source is not None and source.source:
            notes.append(f"{source.basis} peak: {source.source.rstrip('.')}.")
    notes += [n.rstrip(".") + "." for n in u.notes]
    return UtilisationView(
        line=line,
        caution=caution,
        other=other,
        rows=tuple(_row(u, i) for i in range(len(u.classes))),
        notes=tuple(notes),
    )


__all__ = ["ClassRow", "UtilisationView", "build_utilisation", "format_flops"]
