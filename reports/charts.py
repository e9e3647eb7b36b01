"""Charts for the HTML report as inline SVG.

The functions take plain numbers (the view decides what to plot) and return an ``<svg>`` element
as a string that can be pasted into the page as is. The two charts of every report (the breakdown
bar and the per-step times) are written here directly, so rendering a report never imports
matplotlib; the comparison strip of ``diagnose compare`` and the sweep's charts are matplotlib
figures turned into SVG by :func:`figure_svg`. Either way the element is:

- deterministic: the same numbers give the same bytes (matplotlib's ``svg.hashsalt`` is fixed and
  no date or creator metadata is written);
- self-contained: no URL of any kind, not even a namespace URI (the HTML parser puts ``<svg>`` in
  the SVG namespace by itself), no script, no style sheet. The direct charts write their text as
  ``<text>`` in the page's generic font stack; matplotlib's glyphs are drawn as paths;
- free of data strings: labels that come from the record (phase names) are drawn by the HTML around
  the chart, never inside it; the text inside is only numbers and this module's own labels;
- unique ids: every id starts with the chart's id, so several charts in one page never collide.

No pyplot: a bare :class:`~matplotlib.figure.Figure` with an Agg canvas leaves the process's backend
and figure registry alone.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diagnose.units import format_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Colour per phase (Okabe-Ito, colour-blind safe); phases not listed cycle through EXTRA_COLORS.
PHASE_COLORS: dict[str, str] = {
    "data_wait": "#E69F00",
    "h2d": "#F0E442",
    "encode": "#CC79A7",
    "forward": "#0072B2",
    "backward": "#56B4E9",
    "optimizer": "#009E73",
    "communication": "#882255",
    "sync": "#D55E00",
    "allocator": "#AA4499",
    "device_work": "#332288",
    "host_code": "#DDCC77",
    "idle": "#999999",
    "other": "#CCCCCC",
}
EXTRA_COLORS: tuple[str, ...] = ("#8C6BB1", "#B15928", "#1B9E77", "#7570B3", "#E7298A")

UNPROFILED_COLOR = "#0072B2"
PROFILED_COLOR = "#D55E00"
WARMUP_COLOR = "#999999"

# Typed loosely: matplotlib types rc keys as a Literal of every known name.
CHART_RC: dict[Any, Any] = {
    "svg.hashsalt": "diagnose-report",
    "svg.fonttype": "path",
    # Never interpret "$...$" as mathtext: a stray dollar sign must not break a chart.
    "text.parse_math": False,
    "font.size": 9.0,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def phase_color(phase: str, position: int) -> str:
    """The colour of a phase; unknown phases get a colour by their position among the unknowns."""
    return PHASE_COLORS.get(phase, EXTRA_COLORS[position % len(EXTRA_COLORS)])


@dataclass(frozen=True)
class Segment:
    """One part of the stacked breakdown bar."""

    seconds: float
    color: str


@dataclass(frozen=True)
class StepPoint:
    """One step on the per-step chart: its position in run order and its seconds."""

    position: int
    seconds: float


# --- the two charts of every report, written as SVG directly ---------------------------------
# Drawing them needs no matplotlib, whose import alone is a large part of a `diagnose trace`.
# Sizes are in points of a 540-wide view box, as matplotlib's 7.5-inch figures were: the page
# scales it to its width, so 9 units of font read like the page's own text.

_WIDTH = 540.0
#: The page's own font stack; only numbers and the constant labels below are written with it.
_FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
_TEXT_COLOR = "#3c4043"
_AXIS_COLOR = "#5f6368"
_GRID_COLOR = "#e5e5e5"
_FONT_SIZE = 9.0
_SMALL_FONT_SIZE = 8.0
#: Mean advance of a character of that font, in ems: a layout estimate (legend, left margin).
_CHAR_EM = 0.56
_TICK = 3.5

_NICE_MANTISSAS = (1.0, 2.0, 5.0, 10.0)
_CHART_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*\Z")

#: (the smallest axis top shown in this unit, seconds per unit, the unit's name), largest first:
#: an axis reads 0-150 minutes or 0-40 microseconds rather than 0-9000 or 0-0.00004 seconds.
_AXIS_UNITS: tuple[tuple[float, float, str], ...] = (
    (36_000.0, 3600.0, "hours"),
    (1200.0, 60.0, "minutes"),
    # From 1 s, as the page's own numbers switch from ms to s: a 0-80 ms axis under segments
    # labelled "11.9 ms" rather than 0.00-0.08 seconds.
    (1.0, 1.0, "seconds"),
    (1e-3, 1e-3, "milliseconds"),
    (1e-6, 1e-6, "microseconds"),
    (0.0, 1e-9, "nanoseconds"),
)

BREAKDOWN_LABEL = "Stacked bar of seconds per step by phase"
DEVICE_TIME_LABEL = "Bar of the seconds per step the GPU was busy and idle"
#: The device busy (any kernel, copy or memset on any stream) and idle, under the phase bar.
DEVICE_BUSY_COLOR = "#332288"
DEVICE_IDLE_COLOR = PHASE_COLORS["idle"]
STEPS_LABEL = "Seconds of each step in run order"


def nice_step(span: float, max_intervals: int = 8, *, integer: bool = False) -> float:
    """The smallest of 1, 2 or 5 times a power of ten that cuts ``span`` into at most
    ``max_intervals`` parts (at least 1 with ``integer``); 1.0 for a span that is not positive."""
    if not (math.isfinite(span) and span > 0):
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(span / max(1, max_intervals)))
    if integer:
        magnitude = max(magnitude, 1.0)
    step = 10.0 * magnitude
    for mantissa in _NICE_MANTISSAS:
        if span / (mantissa * magnitude) <= max(1, max_intervals) * (1 + 1e-9):
            step = mantissa * magnitude
            break
    return step


def step_decimals(step: float) -> int:
    """Decimals that write every multiple of ``step`` exactly: 0.05 -> 2, 0.2 -> 1, 2000 -> 0."""
    for decimals in range(13):
        if abs(round(step, decimals) - step) <= abs(step) * 1e-9:
            return decimals
    return 12


def nice_ticks(
    high: float, *, low: float = 0.0, max_intervals: int = 8, integer: bool = False
) -> tuple[float, ...]:
    """Evenly spaced round values from the first multiple of the step at or above ``low`` to the
    first at or above ``high``: 0.337 -> 0, 0.05, ..., 0.35; 1.44 -> 0, 0.2, ..., 1.6.

    The values are rounded to the step's decimals, so 0.3 is 0.3 and never 0.30000000000000004.
    Empty when ``low`` or ``high`` is not finite or ``high`` is below ``low``.
    """
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        return ()
    step = nice_step(high - low, max_intervals, integer=integer)
    decimals = step_decimals(step)
    first = math.ceil(low / step - 1e-9)
    last = max(first, math.ceil(high / step - 1e-9))
    ticks = (round(k * step, decimals) for k in range(first, last + 1))
    return tuple(t + 0.0 for t in ticks if math.isfinite(t))  # + 0.0: no "-0"


def _value_ticks(top: float, *, max_intervals: int) -> tuple[list[float], int]:
    """The nice ticks of an axis from 0 to ``top`` (none beyond it) and their decimals."""
    step = nice_step(top, max_intervals)
    ticks = [t for t in nice_ticks(top, max_intervals=max_intervals) if t <= top * (1 + 1e-9)]
    return ticks or [0.0], step_decimals(step)


def _axis_unit(top_seconds: float) -> tuple[float, str]:
    for smallest, seconds_per_unit, name in _AXIS_UNITS:
        if top_seconds >= smallest:
            return seconds_per_unit, name
    return 1.0, "seconds"  # unreachable: the last unit starts at 0


def _tick_label(value: float, decimals: int) -> str:
    if abs(value) >= 1e7:
        return f"{value:.3g}"  # an absurd axis still gets a short label
    return f"{value:.{decimals}f}"


def _num(value: float) -> str:
    """A coordinate, compact and the same on every machine: 12.5, 3, 0.25."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _text_width(text: str, size: float) -> float:
    return len(text) * size * _CHAR_EM


def _xml(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


def _svg_open(chart_id: str, height: float, label: str) -> str:
    if not _CHART_ID.match(chart_id):
        raise ValueError(f"chart id must be a letter then letters, digits, - or _: {chart_id!r}")
    return (
        f'<svg role="img" aria-label="{_xml(label)}" width="{_num(_WIDTH)}pt" '
        f'height="{_num(height)}pt" viewBox="0 0 {_num(_WIDTH)} {_num(height)}" version="1.1" '
        f'font-family="{_FONT}" font-size="{_num(_FONT_SIZE)}" fill="{_TEXT_COLOR}">'
    )


def _text(x: float, y: float, text: str, *, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="{anchor}"{extra}>{_xml(text)}</text>'


def _line(x1: float, y1: float, x2: float, y2: float, style: str) -> str:
    return f'<path d="M{_num(x1)} {_num(y1)}L{_num(x2)} {_num(y2)}" {style}/>'


def _axis_ticks(
    ticks: Sequence[float], decimals: int, to_px: Callable[[float], float], axis: float, x: bool
) -> list[str]:
    """Tick marks and labels along a bottom (``x``) or left axis at ``axis``."""
    marks: list[str] = []
    labels: list[str] = []
    for tick in ticks:
        at = to_px(tick)
        label = _tick_label(tick, decimals)
        if x:
            marks.append(f"M{_num(at)} {_num(axis)}v{_num(_TICK)}")
            labels.append(_text(at, axis + _TICK + 9.5, label))
        else:
            marks.append(f"M{_num(axis)} {_num(at)}h{_num(-_TICK)}")
            labels.append(_text(axis - _TICK - 2.5, at + 3.2, label, anchor="end"))
    path = f'<path d="{"".join(marks)}" stroke="{_AXIS_COLOR}" stroke-width="0.8" fill="none"/>'
    return [path, *labels] if marks else []


def breakdown_bar_svg(
    segments: Sequence[Segment], *, chart_id: str = "breakdown", label: str = BREAKDOWN_LABEL
) -> str:
    """One horizontal bar stacked from ``segments`` (left to right), seconds on the x axis.

    Segments with no positive, finite width are left out. Returns "" when nothing is left to draw.
    """
    drawable = [s for s in segments if math.isfinite(s.seconds) and s.seconds > 0]
    total = sum(s.seconds for s in drawable)
    if not drawable or not math.isfinite(total):
        return ""
    per_unit, unit = _axis_unit(total)
    scaled_total = total / per_unit
    ticks, decimals = _value_ticks(scaled_total, max_intervals=10)
    # Room for half of the widest tick label at either end (the first is at 0, the last may be
    # at the end of the bar).
    half_label = max(_text_width(_tick_label(t, decimals), _FONT_SIZE) for t in ticks) / 2
    margin = max(10.8, half_label + 2.0)
    height, left, right = 68.4, margin, _WIDTH - margin
    bar_top, bar_bottom, axis_y = 5.5, 30.1, 34.2

    def to_x(value: float) -> float:
        return left + (right - left) * value / scaled_total

    parts = [_svg_open(chart_id, height, label), f'<g id="{chart_id}-bar">']
    start = 0.0
    for segment in drawable:
        x0, x1 = to_x(start / per_unit), to_x((start + segment.seconds) / per_unit)
        start += segment.seconds
        parts.append(
            f'<rect x="{_num(x0)}" y="{_num(bar_top)}" width="{_num(max(x1 - x0, 0.01))}" '
            f'height="{_num(bar_bottom - bar_top)}" fill="{_xml(segment.color)}" '
            'stroke="#ffffff" stroke-width="0.8"/>'
        )
    parts.append("</g>")
    parts.append(f'<g id="{chart_id}-x-axis">')
    parts.append(_line(left, axis_y, right, axis_y, f'stroke="{_AXIS_COLOR}" stroke-width="0.8"'))
    parts.extend(_axis_ticks(ticks, decimals, to_x, axis_y, x=True))
    parts.append(_text((left + right) / 2, axis_y + 26.5, f"{unit} per step"))
    parts.append("</g></svg>")
    return "".join(parts)


#: (series key, colour, marker, legend label) in drawing order: warm-up below the timed steps.
_STEP_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("warmup", WARMUP_COLOR, "square", "warm-up (not counted)"),
    ("unprofiled", UNPROFILED_COLOR, "circle", "unprofiled"),
    ("profiled", PROFILED_COLOR, "triangle", "profiled"),
)


def _marker(shape: str, x: float, y: float, r: float) -> str:
    """A marker centred on (x, y), filled by its group."""
    if shape == "circle":
        return f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(r)}"/>'
    if shape == "square":
        side = r * 1.7
        return (
            f'<rect x="{_num(x - side / 2)}" y="{_num(y - side / 2)}" '
            f'width="{_num(side)}" height="{_num(side)}"/>'
        )
    t = r * 1.25  # a triangle looks smaller than a circle of the same radius
    return (
        f'<path d="M{_num(x)} {_num(y - t)}L{_num(x - t)} {_num(y + t * 0.8)}'
        f'L{_num(x + t)} {_num(y + t * 0.8)}Z"/>'
    )


def step_times_svg(
    *,
    unprofiled: Sequence[StepPoint],
    profiled: Sequence[StepPoint],
    warmup: Sequence[StepPoint],
    median: float | None,
    chart_id: str = "steps",
) -> str:
    """Seconds of every step in run order: warm-up, unprofiled and profiled steps told apart.

    The y axis is scaled to the timed steps: a warm-up step far above them (compile, autotune) is
    drawn at the top edge with its value written next to it, so it does not flatten the steps that
    matter. Returns "" when there is no step to draw.
    """
    given = {"warmup": warmup, "unprofiled": unprofiled, "profiled": profiled}
    finite = {
        key: sorted(
            (p for p in given[key] if math.isfinite(p.seconds) and p.seconds >= 0),
            key=lambda p: p.position,
        )
        for key, *_ in _STEP_SERIES
    }
    timed = [p.seconds for key in ("unprofiled", "profiled") for p in finite[key]]
    every = timed + [p.seconds for p in finite["warmup"]]
    if not every:
        return ""
    highest = max(timed) if timed else max(every)
    top = highest * 1.25 if math.isfinite(highest * 1.25) else highest
    top = top or 1.0
    per_unit, unit = _axis_unit(top)
    y_ticks, y_decimals = _value_ticks(top / per_unit, max_intervals=6)
    y_labels = [_tick_label(t, y_decimals) for t in y_ticks]

    positions = [p.position for points in finite.values() for p in points]
    first, last = min(positions), max(positions)
    pad = max(0.5, 0.03 * (last - first))
    x_low, x_high = first - pad, last + pad
    x_ticks = [
        t for t in nice_ticks(x_high, low=x_low, max_intervals=10, integer=True) if t <= x_high
    ]

    height = 201.6
    longest = max((_text_width(label, _FONT_SIZE) for label in y_labels), default=0.0)
    left = max(40.0, 16.0 + longest + _TICK + 6.0)
    right, plot_top, plot_bottom = _WIDTH - 10.8, 20.2, 141.1

    def to_x(position: float) -> float:
        return left + (right - left) * (position - x_low) / (x_high - x_low)

    def to_y(value: float) -> float:
        return plot_bottom - (plot_bottom - plot_top) * min(value, top) / top

    spacing = (right - left) / (x_high - x_low)
    radius = min(2.4, max(1.1, spacing * 0.3))
    parts = [_svg_open(chart_id, height, STEPS_LABEL)]
    grid = "".join(f"M{_num(left)} {_num(to_y(t * per_unit))}H{_num(right)}" for t in y_ticks[1:])
    if grid:
        parts.append(
            f'<path id="{chart_id}-grid" d="{grid}" stroke="{_GRID_COLOR}" stroke-width="0.6" '
            'fill="none"/>'
        )
    legend: list[tuple[str, str, str | None, bool]] = []  # label, colour, marker, dashed
    notes: list[str] = []
    note_end = -math.inf
    for key, color, shape, label in _STEP_SERIES:
        points = finite[key]
        if not points:
            continue
        legend.append((label, color, shape, False))
        coords = [(to_x(p.position), to_y(p.seconds)) for p in points]
        parts.append(f'<g id="{chart_id}-{key}" fill="{color}">')
        if len(coords) > 1:
            line = " ".join(f"{_num(x)},{_num(y)}" for x, y in coords)
            parts.append(
                f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="0.8"/>'
            )
        parts.extend(_marker(shape, x, y, radius) for x, y in coords)
        parts.append("</g>")
        for p, (x, _) in zip(points, coords, strict=True):
            if p.seconds <= top:
                continue
            value = format_seconds(p.seconds) if p.seconds < 1e6 else f"{p.seconds:.3g} s"
            note = f"↑ {value}"
            width = _text_width(note, 7.5)
            if x - width / 2 < note_end + 4:
                continue  # would overlap the previous note; the text under the chart lists it
            note_end = x + width / 2
            notes.append(_text(x, plot_top - 5.5, note, extra=f' font-size="7.5" fill="{color}"'))
    parts.extend(notes)
    if median is not None and math.isfinite(median) and 0 < median <= top:
        y = to_y(median)
        parts.append(
            f'<path id="{chart_id}-median" d="M{_num(left)} {_num(y)}H{_num(right)}" '
            f'stroke="{UNPROFILED_COLOR}" stroke-width="0.8" stroke-dasharray="3.5 2" fill="none"/>'
        )
        legend.append(("unprofiled median", UNPROFILED_COLOR, None, True))
    axis_style = f'stroke="{_AXIS_COLOR}" stroke-width="0.8" fill="none"'
    parts.append(
        f'<path d="M{_num(left)} {_num(plot_top)}V{_num(plot_bottom)}H{_num(right)}" {axis_style}/>'
    )
    parts.extend(_axis_ticks(x_ticks, 0, to_x, plot_bottom, x=True))
    parts.extend(_axis_ticks(y_ticks, y_decimals, lambda t: to_y(t * per_unit), left, x=False))
    parts.append(_text((left + right) / 2, plot_bottom + 26.5, "step, in run order"))
    middle = (plot_top + plot_bottom) / 2
    parts.append(
        _text(0, 0, unit, extra=f' transform="translate({_num(11.0)} {_num(middle)}) rotate(-90)"')
    )
    parts.append(_legend(legend, (left + right) / 2, plot_bottom + 42.5))
    parts.append("</svg>")
    return "".join(parts)


def _legend(entries: Sequence[tuple[str, str, str | None, bool]], middle: float, y: float) -> str:
    """One centred row: a line sample (with the marker, or dashed) and the label per entry."""
    sample, gap, size = 18.0, 16.0, _SMALL_FONT_SIZE
    widths = [sample + 4.0 + _text_width(label, size) for label, *_ in entries]
    x = middle - (sum(widths) + gap * (len(widths) - 1)) / 2
    parts = [f'<g font-size="{_num(size)}">']
    for (label, color, shape, dashed), width in zip(entries, widths, strict=True):
        dash = ' stroke-dasharray="3.5 2"' if dashed else ""
        parts.append(
            f'<path d="M{_num(x)} {_num(y - 2.8)}h{_num(sample)}" stroke="{color}" '
            f'stroke-width="0.8" fill="none"{dash}/>'
        )
        if shape is not None:
            parts.append(f'<g fill="{color}">{_marker(shape, x + sample / 2, y - 2.8, 2.2)}</g>')
        parts.append(_text(x + sample + 4.0, y, label, anchor="start"))
        x += width + gap
    parts.append("</g>")
    return "".join(parts)


COMPARE_CURRENT_COLOR = "#D55E00"
COMPARE_BASELINE_COLOR = "#0072B2"
BAND_COLOR = "#E5E5E5"


def compare_strip_svg(
    rows: Sequence[Sequence[float]],
    row_names: Sequence[str],
    *,
    band: tuple[float, float] | None,
    chart_id: str = "compare",
) -> str:
    """Every compared step's seconds, one row per record (the last row is the current record),
    each row's median as a vertical tick, and ``band`` (the threshold around the baseline median)
    shaded: the picture of what the gate decided.

    ``row_names`` are drawn inside the chart, so they must not come from a record (the caller
    passes "baseline", "baseline 2", "current"). Points beyond the x range (a contended step 20x
    the others) are drawn at the right edge as a triangle. Returns "" when no row has a value.
    """
    finite = [[v for v in row if math.isfinite(v) and v >= 0] for row in rows]
    values = [v for row in finite for v in row]
    if not values:
        return ""
    # Scale to the bulk of every row, not to a lone outlier.
    highs = []
    for row in finite:
        if row:
            ordered = sorted(row)
            highs.append(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))])
    right = max(highs) * 1.3
    if band is not None:
        right = max(right, band[1] * 1.1)
    right = right or 1.0
    import statistics

    import matplotlib

    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(7.5, 0.55 * len(rows) + 0.9)
        ax = fig.add_subplot()
        if band is not None:
            ax.axvspan(band[0], band[1], color=BAND_COLOR, zorder=0, linewidth=0)
        count = len(finite)
        for index, row in enumerate(finite):
            y = count - 1 - index
            color = COMPARE_CURRENT_COLOR if index == count - 1 else COMPARE_BASELINE_COLOR
            # Deterministic vertical jitter (golden-ratio steps) so equal times stay visible.
            jitter = [((k * 0.618034) % 1.0 - 0.5) * 0.45 for k in range(len(row))]
            inside = [(v, y + j) for v, j in zip(row, jitter, strict=True) if v <= right]
            beyond = [(right, y + j) for v, j in zip(row, jitter, strict=True) if v > right]
            if inside:
                ax.scatter(
                    [v for v, _ in inside],
                    [yy for _, yy in inside],
                    s=12,
                    color=color,
                    alpha=0.7,
                    linewidths=0,
                    clip_on=False,
                )
            if beyond:
                ax.scatter(
                    [v for v, _ in beyond],
                    [yy for _, yy in beyond],
                    s=22,
                    marker=">",
                    color=color,
                    clip_on=False,
                )
            if row:
                ax.plot([statistics.median(row)] * 2, [y - 0.35, y + 0.35], color="black", lw=1.6)
        ax.set_yticks(range(count))
        ax.set_yticklabels(list(reversed(row_names)))
        ax.set_ylim(-0.6, count - 0.4)
        ax.set_xlim(0, right)
        ax.set_xlabel("seconds per step (black tick: median; grey band: ± the threshold)")
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
        ax.set_axisbelow(True)
        height = 0.55 * count + 0.9
        fig.subplots_adjust(left=0.13, right=0.97, top=1 - 0.1 / height, bottom=0.6 / height)
        return figure_svg(fig, chart_id, "Seconds of every compared step, per record")


def new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself to the figure; no pyplot, no global backend change
    return fig


_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.DOTALL)
_METADATA = re.compile(r"<metadata>.*?</metadata>", re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
# matplotlib's global "*{stroke-linejoin...}" would leak into the HTML page; the page's CSS sets
# the same properties scoped to the charts.
_STYLE = re.compile(r"<style\b[^>]*>.*?</style>", re.DOTALL)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')
_ID = re.compile(r'\bid="([^"]+)"')
_HREF = re.compile(r'\b(?:xlink:)?href="#([^"]+)"')
_URL_REF = re.compile(r"url\(#([^)]+)\)")
_SPACE = re.compile(r"\s+")


def figure_svg(fig: Figure, chart_id: str, label: str) -> str:
    buffer = io.StringIO()
    fig.savefig(
        buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None}
    )
    return clean_svg(buffer.getvalue(), chart_id, label)


def clean_svg(raw: str, chart_id: str, label: str) -> str:
    """Make matplotlib's SVG document fit to inline in HTML (see the module docstring)."""
    svg = _PROLOG.sub("", raw, count=1)
    svg = _METADATA.sub("", svg)
    svg = _COMMENT.sub("", svg)
    svg = _STYLE.sub("", svg)
    svg = _XMLNS.sub("", svg)  # the HTML parser puts <svg> in the SVG namespace by itself
    svg = _ID.sub(lambda m: f'id="{chart_id}-{m.group(1)}"', svg)
    svg = _HREF.sub(lambda m: f'href="#{chart_id}-{m.group(1)}"', svg)
    svg = _URL_REF.sub(lambda m: f"url(#{chart_id}-{m.group(1)})", svg)
    svg = svg.replace("<defs> </defs>", "")
    svg = _SPACE.sub(" ", svg).replace("> <", "><").strip()
    safe_label = label.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    svg = svg.replace("<svg ", f'<svg role="img" aria-label="{safe_label}" ', 1)
    if "://" in svg or "<script" in svg.lower():
        # Not expected from matplotlib; refuse rather than put an external reference in the page.
        raise ValueError("chart SVG holds an external reference or a script")
    return svg


__all__ = [
    "DEVICE_BUSY_COLOR",
    "DEVICE_IDLE_COLOR",
    "DEVICE_TIME_LABEL",
    "EXTRA_COLORS",
    "PHASE_COLORS",
    "Segment",
    "StepPoint",
    "breakdown_bar_svg",
    "clean_svg",
    "compare_strip_svg",
    "nice_step",
    "nice_ticks",
    "phase_color",
    "step_decimals",
    "step_times_svg",
]
