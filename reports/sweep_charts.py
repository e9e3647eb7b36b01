"""The sweep's charts: s/it and peak memory against each swept setting, one line per combination
of the other settings. Drawn with matplotlib through :mod:`.charts`, from the points' numbers and
the sweep's own setting values alone (never a string from a record)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diagnose.sweep.grid import AXIS_BY_NAME, Setting
from diagnose.sweep.results import PointResult, Sweep

from .charts import CHART_RC, figure_svg, new_figure
from .sweep_fits import GIB, memory_kind, point_label, setting_text

#: Okabe-Ito, then more: one colour per series of a chart.
SERIES_COLORS: tuple[str, ...] = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#000000",
    "#8C6BB1",
    "#B15928",
    "#7570B3",
)
#: A chart draws at most this many lines; beyond, every point is drawn in one colour.
_MAX_SERIES = len(SERIES_COLORS)


@dataclass(frozen=True)
class LegendEntry:
    color: str
    text: str


@dataclass(frozen=True)
class SweepChart:
    """s/it and peak memory against one swept setting, one line per combination of the others."""

    setting: str
    svg: str
    legend: list[LegendEntry] = field(default_factory=list)


def sweep_charts(sweep: Sweep) -> list[SweepChart]:
    """One chart per swept setting (none when nothing is swept or nothing was measured)."""
    swept = sweep.grid.swept()
    measured = [p for p in sweep.points if p.status == "measured" and p.summary is not None]
    if not measured:
        return []
    kind = memory_kind(measured)
    charts = []
    for index, name in enumerate(swept):
        others = [n for n in swept if n != name]
        values = sweep.grid.to_dict()[name]
        series: dict[tuple[Setting, ...], list[PointResult]] = {}
        for result in measured:
            settings = result.point.settings()
            series.setdefault(tuple(settings[n] for n in others), []).append(result)
        colored = len(series) <= _MAX_SERIES
        legend = []
        lines: list[tuple[str, list[PointResult]]] = []
        for position, (_, members) in enumerate(series.items()):
            color = SERIES_COLORS[position] if colored else "#5f6368"
            lines.append((color, members))
            if colored and others:
                legend.append(LegendEntry(color, point_label(members[0], others)))
        svg = _setting_chart_svg(
            name, values, lines, memory_kind=kind, chart_id=f"sweep-{index}-{name}"
        )
        charts.append(SweepChart(setting=AXIS_BY_NAME[name].label, svg=svg, legend=legend))
    return charts


def _setting_chart_svg(
    name: str,
    values: Sequence[Setting],
    lines: Sequence[tuple[str, Sequence[PointResult]]],
    *,
    memory_kind: str,
    chart_id: str,
) -> str:
    """Two panels side by side: s/it and peak memory (GiB) at each value of setting ``name``.

    Tick labels are the sweep's own setting values (numbers, option names, on/off), never a
    string from a record.
    """
    import matplotlib

    positions = {value: i for i, value in enumerate(values)}
    memory_label = "peak device memory, GiB" if memory_kind == "device" else "peak RSS, GiB"
    panels: list[tuple[str, Callable[[PointResult], float | None]]] = [
        ("seconds per iteration", lambda p: p.seconds_per_it),
        (memory_label, lambda p: None if p.peak_bytes is None else p.peak_bytes / GIB),
    ]
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(7.5, 2.6)
        axes = fig.subplots(1, 2)
        for ax, (ylabel, metric) in zip(axes, panels, strict=True):
            top = 0.0
            for color, members in lines:
                xy = sorted(
                    (positions[m.point.settings()[name]], y)
                    for m in members
                    if (y := metric(m)) is not None and math.isfinite(y)
                )
                if not xy:
                    continue
                top = max(top, *(y for _, y in xy))
                ax.plot(
                    [x for x, _ in xy],
                    [y for _, y in xy],
                    color=color,
                    marker="o",
                    markersize=4.5,
                    linewidth=1.0,
                    clip_on=False,
                )
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels([setting_text(name, v) for v in values])
            ax.set_xlim(-0.4, len(values) - 0.6)
            ax.set_ylim(0, top * 1.15 or 1.0)
            ax.set_xlabel(AXIS_BY_NAME[name].label)
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", color="#e5e5e5", linewidth=0.6)
            ax.set_axisbelow(True)
        fig.subplots_adjust(left=0.08, right=0.98, top=0.95, bottom=0.2, wspace=0.3)
        label = f"Seconds per iteration and peak memory against {AXIS_BY_NAME[name].label}"
        return figure_svg(fig, chart_id, label)


__all__ = ["SERIES_COLORS", "LegendEntry", "SweepChart", "sweep_charts"]
