"""Where a step's time goes and what each step took, as the report shows them: the phases of a step
(bar, seconds, shares), the device's busy and idle time, the time per kernel class, and the chart
of every step's time with its summary lines.

A chart that cannot be drawn becomes a note of the report, never a crash: its numbers are in the
text beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diagnose.record import PHASE_LABELS, Breakdown, Timing
from diagnose.trace.kernel_classes import COUNTED_ONCE_PRECEDENCE
from diagnose.units import (
    NOT_MEASURED,
    format_percent,
    format_seconds,
    format_seconds_range,
    is_number,
)

from .charts import (
    DEVICE_BUSY_COLOR,
    DEVICE_IDLE_COLOR,
    DEVICE_TIME_LABEL,
    Segment,
    StepPoint,
    breakdown_bar_svg,
    phase_color,
    step_times_svg,
)
from .headline import DeviceTime

BREAKDOWN_BASIS_LABELS: dict[str, str] = {
    "measured": "measured: device-synchronised timers around each phase, median over the steps",
    "estimated": "estimated",
    "trace": "from the trace: phase spans read off the profiler trace, median over its steps",
    "none": "how these were obtained was not recorded",
}


# --------------------------------------------------------------------------------------------
# Where it goes (the report's second part)


@dataclass(frozen=True)
class PhaseView:
    key: str
    label: str
    seconds: str
    percent: str
    color: str


@dataclass(frozen=True)
class BreakdownView:
    phases: tuple[PhaseView, ...]
    #: "3.12 s", the sum of the phases.
    total: str
    basis: str
    #: A note comparing the phase sum with the step time, or "".
    coverage: str
    #: Inline SVG of the stacked bar ("" when nothing to draw).
    svg: str
    #: Per kernel class: name, device time counted once, summed kernel time; when a device
    #: trace was read.
    kernel_classes: tuple[tuple[str, str, str], ...]
    #: The device's busy and idle time per step ("" without a device trace), and its bar.
    device_line: str = ""
    device_svg: str = ""
    #: The device bar's legend: busy and idle, seconds and share.
    device_legend: tuple[PhaseView, ...] = ()
    #: How the kernel-class times were counted (under their table).
    kernel_classes_note: str = ""
    #: Which steps both bars are per ("unprofiled step", "profiled step", "traced step").
    steps: str = "step"


def build_breakdown(
    breakdown: Breakdown,
    headline_seconds: float | None,
    problems: list[str],
    *,
    draw: bool = True,
    steps: str = "step",
    device: DeviceTime | None = None,
) -> BreakdownView:
    """The phases in report order; ``draw=False`` skips the chart (the terminal needs none).
    ``steps`` says which steps the phases are per; ``device`` the device's time on those steps
    (:func:`device_time`), drawn under the phases."""
    ordered = [(k, v) for k, v in breakdown.ordered() if is_number(v)]
    total = sum(v for _, v in ordered if v > 0)
    phases: list[PhaseView] = []
    segments: list[Segment] = []
    unknown_position = 0
    for key, seconds in ordered:
        color = phase_color(key, unknown_position)
        if key not in PHASE_LABELS:
            unknown_position += 1
        phases.append(
            PhaseView(
                key=key,
                label=PHASE_LABELS.get(key, key.replace("_", " ")),
                seconds=format_seconds(seconds, like=headline_seconds),
                percent=format_percent(seconds / total) if total > 0 and seconds >= 0 else "",
                color=color,
            )
        )
        segments.append(Segment(seconds=float(seconds), color=color))
    coverage = ""
    if total > 0 and headline_seconds is not None and is_number(headline_seconds):
        coverage = (
            f"The phases add up to {format_seconds(total)} against a step of "
            f"{format_seconds(headline_seconds)} (medians are taken per phase, so the two need "
            "not match exactly)."
        )
    once = breakdown.device_seconds_by_kernel_class
    summed = breakdown.kernel_seconds_summed_by_class
    kernel_classes = tuple(
        (
            name,
            format_seconds(once.get(name), like=headline_seconds) if once else NOT_MEASURED,
            format_seconds(summed.get(name, 0.0), like=headline_seconds) if summed else "",
        )
        for name in sorted(
            set(once) | set(summed),
            key=lambda k: (-_number_or_zero(once.get(k, summed.get(k))), k),
        )
    )
    device_line, device_svg, device_legend = _device_time(device, headline_seconds, problems, draw)
    return BreakdownView(
        phases=tuple(phases),
        total=format_seconds(total, like=headline_seconds) if phases else NOT_MEASURED,
        basis=BREAKDOWN_BASIS_LABELS.get(breakdown.basis, breakdown.basis),
        steps=steps,
        coverage=coverage,
        svg=_chart(lambda: breakdown_bar_svg(segments), problems) if draw else "",
        kernel_classes=kernel_classes,
        device_line=device_line,
        device_svg=device_svg,
        device_legend=device_legend,
        kernel_classes_note=KERNEL_CLASSES_NOTE if once else KERNEL_CLASSES_SUMMED_ONLY,
    )


#: Under the kernel-class table: how its two columns were counted.
KERNEL_CLASSES_NOTE = (
    "Device time counts each instant once: where kernels of several classes ran at once (on "
    "several streams), the instant goes to one, in this order: "
    + ", ".join(COUNTED_ONCE_PRECEDENCE)
    + ". The classes add up to the busy time, and communication keeps only the time no other "
    "work hid (its exposed part). Summed kernel time adds every kernel's duration, so "
    "overlapping kernels count twice. Means over the steps."
)
KERNEL_CLASSES_SUMMED_ONLY = (
    "This record holds only summed kernel time per class (overlapping kernels count twice): it "
    "was written before diagnose counted device time once."
)


def _number_or_zero(value: float | None) -> float:
    return float(value) if value is not None and is_number(value) else 0.0


def _device_time(
    time: DeviceTime | None, headline_seconds: float | None, problems: list[str], draw: bool
) -> tuple[str, str, tuple[PhaseView, ...]]:
    """The line, the bar and the legend of the device's busy and idle time per step."""
    if time is None:
        return "", "", ()
    busy, idle, share = time.busy, time.idle, time.idle_share
    line = (
        f"Device busy {format_seconds(busy, like=headline_seconds)} and idle "
        f"{format_seconds(idle, like=headline_seconds)} per {time.steps} "
        f"({format_percent(share)} idle): {time.how}. The phase 'idle, no host activity' is the "
        "part of the idle time the host did nothing traced in."
    )
    segments = [Segment(busy, DEVICE_BUSY_COLOR), Segment(idle, DEVICE_IDLE_COLOR)]
    svg = (
        _chart(
            lambda: breakdown_bar_svg(segments, chart_id="device-time", label=DEVICE_TIME_LABEL),
            problems,
        )
        if draw
        else ""
    )
    legend = tuple(
        PhaseView(
            key=key,
            label=label,
            seconds=format_seconds(seconds, like=headline_seconds),
            percent=format_percent(part),
            color=color,
        )
        for key, label, seconds, part, color in (
            ("device_busy", "device busy", busy, 1.0 - share, DEVICE_BUSY_COLOR),
            ("device_idle", "device idle", idle, share, DEVICE_IDLE_COLOR),
        )
    )
    return line, svg, legend


# --------------------------------------------------------------------------------------------
# Each step's time (below the first screen)


@dataclass(frozen=True)
class StepsView:
    #: Inline SVG ("" when there are no steps).
    svg: str
    #: One line per kind of step: how many and their median.
    summary: tuple[str, ...]
    warmup_note: str


def build_steps(timing: Timing, *, from_trace: bool, problems: list[str]) -> StepsView:
    warmup = [StepPoint(i + 1, s) for i, s in enumerate(timing.warmup_seconds) if is_number(s)]
    offset = len(timing.warmup_seconds)
    ordered = sorted(timing.samples, key=lambda s: s.index)
    unprofiled = [
        StepPoint(offset + i + 1, s.seconds) for i, s in enumerate(ordered) if not s.profiled
    ]
    profiled = [StepPoint(offset + i + 1, s.seconds) for i, s in enumerate(ordered) if s.profiled]
    median = timing.unprofiled.median if timing.unprofiled.n else None
    summary: list[str] = []
    for label, stats in (("unprofiled", timing.unprofiled), ("profiled", timing.profiled)):
        if stats.n:
            if from_trace:
                label = "steps in the trace" if label == "profiled" else "steps"
            else:
                label += " steps"
            summary.append(
                f"{stats.n} {label}: median {format_seconds(stats.median)}, "
                f"IQR {format_seconds_range(stats.q1, stats.q3)}, "
                f"min {format_seconds(stats.min)}, max {format_seconds(stats.max)}"
            )
    warmup_note = ""
    if timing.warmup_seconds:
        warmup_note = (
            f"{len(timing.warmup_seconds)} warm-up step(s), not counted: "
            + ", ".join(format_seconds(s) for s in timing.warmup_seconds)
            + "."
        )
    elif timing.warmup_steps:
        warmup_note = f"{timing.warmup_steps} warm-up step(s) ran; their times were not kept."
    return StepsView(
        svg=_chart(
            lambda: step_times_svg(
                unprofiled=unprofiled, profiled=profiled, warmup=warmup, median=median
            ),
            problems,
        ),
        summary=tuple(summary),
        warmup_note=warmup_note,
    )


def _chart(draw: Callable[[], str], problems: list[str]) -> str:
    """Draw a chart; a failure (matplotlib on an odd value) becomes a note, not a crash.

    A chart is optional: the numbers it shows are in the text next to it.
    """
    try:
        return draw()
    except Exception as exc:
        problems.append(f"A chart could not be drawn: {type(exc).__name__}: {exc}")
        return ""


__all__ = [
    "BREAKDOWN_BASIS_LABELS",
    "KERNEL_CLASSES_NOTE",
    "BreakdownView",
    "PhaseView",
    "StepsView",
    "build_breakdown",
    "build_steps",
]
