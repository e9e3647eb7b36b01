"""Charts for the HTML report: matplotlib figures turned into inline SVG.

The functions take plain numbers (the view decides what to plot) and return an ``<svg>`` element
as a string that can be pasted into the page as is:

- deterministic: ``svg.hashsalt`` is fixed and no date or creator metadata is written, so the same
  record renders to the same bytes;
- self-contained: glyphs are drawn as paths (no font is needed to view it), the XML prolog, DOCTYPE,
  metadata and namespace URIs are removed, so the page holds no URL of any kind;
- free of data strings: labels that come from the record (phase names) are drawn by the HTML around
  the chart, never inside it, so nothing from the record needs escaping here;
- unique ids: every id gets a per-chart prefix, so several charts in one page never collide.

No pyplot: a bare :class:`~matplotlib.figure.Figure` with an Agg canvas leaves the process's backend
and figure registry alone.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    "sync": "#D55E00",
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


def import_in_background() -> threading.Thread:
    """Start importing matplotlib (about half a second) on a thread, for a caller that waits on
    other processes meanwhile (``diagnose trace DIR`` while its workers read the ranks): the
    charts drawn later then find it imported. Import locks make a later import wait for it."""

    def load() -> None:
        with contextlib.suppress(Exception):  # the charts import it again and report failures
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
            from matplotlib.figure import Figure  # noqa: F401
            from matplotlib.ticker import MaxNLocator  # noqa: F401

    thread = threading.Thread(target=load, name="import-matplotlib", daemon=True)
    thread.start()
    return thread


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


def breakdown_bar_svg(segments: Sequence[Segment], *, chart_id: str = "breakdown") -> str:
    """One horizontal bar stacked from ``segments`` (left to right), seconds on the x axis.

    Segments with no positive, finite width are left out. Returns "" when nothing is left to draw.
    """
    drawable = [s for s in segments if math.isfinite(s.seconds) and s.seconds > 0]
    if not drawable:
        return ""
    import matplotlib

    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(7.5, 0.95)
        ax = fig.add_subplot()
        left = 0.0
        for segment in drawable:
            ax.barh(
                [0],
                [segment.seconds],
                left=left,
                height=0.6,
                color=segment.color,
                edgecolor="white",
                linewidth=0.8,
            )
            left += segment.seconds
        ax.set_xlim(0, left)
        ax.set_ylim(-0.4, 0.4)
        ax.set_yticks([])
        ax.spines["left"].set_visible(False)
        ax.set_xlabel("seconds per step")
        fig.subplots_adjust(left=0.02, right=0.98, top=0.98, bottom=0.5)
        return figure_svg(fig, chart_id, "Stacked bar of seconds per step by phase")


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
    series = [
        (warmup, WARMUP_COLOR, "s", "warm-up (not counted)"),
        (unprofiled, UNPROFILED_COLOR, "o", "unprofiled"),
        (profiled, PROFILED_COLOR, "^", "profiled"),
    ]
    finite = [
        [p for p in points if math.isfinite(p.seconds) and p.seconds >= 0] for points, *_ in series
    ]
    timed = [p.seconds for points in finite[1:] for p in points]
    every = timed + [p.seconds for p in finite[0]]
    if not every:
        return ""
    top = (max(timed) if timed else max(every)) * 1.25 or 1.0
    import matplotlib

    with matplotlib.rc_context(CHART_RC):
        from matplotlib.ticker import MaxNLocator

        fig = new_figure(7.5, 2.8)
        ax = fig.add_subplot()
        for points, (_, color, marker, label) in zip(finite, series, strict=True):
            if not points:
                continue
            ax.plot(
                [p.position for p in points],
                [min(p.seconds, top) for p in points],
                linestyle="-",
                linewidth=0.8,
                marker=marker,
                markersize=4.5,
                color=color,
                label=label,
                clip_on=False,
            )
            for p in points:
                if p.seconds > top:
                    ax.annotate(
                        f"↑ {p.seconds:.3g} s",
                        (p.position, top),
                        xytext=(0, 6),
                        textcoords="offset points",
                        fontsize=7.5,
                        color=color,
                        ha="center",
                        va="bottom",
                    )
        if median is not None and math.isfinite(median) and median > 0:
            ax.axhline(
                median,
                color=UNPROFILED_COLOR,
                linestyle="--",
                linewidth=0.8,
                label="unprofiled median",
            )
        ax.set_ylim(0, top)
        ax.set_xlabel("step, in run order")
        ax.set_ylabel("seconds")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False, fontsize=8
        )
        fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.3)
        return figure_svg(fig, chart_id, "Seconds of each step in run order")


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
    "EXTRA_COLORS",
    "PHASE_COLORS",
    "Segment",
    "StepPoint",
    "breakdown_bar_svg",
    "clean_svg",
    "compare_strip_svg",
    "phase_color",
    "step_times_svg",
]
