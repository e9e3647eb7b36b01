"""The view of a sweep: its table, which point fits each VRAM size, its charts, CSV and HTML.

Reads a :class:`~diagnose.sweep.results.Sweep` (the numbers each point's own record gave) and never
measures. The page follows the report's rules (:mod:`.html`): one self-contained file, every value
escaped, no script (the report's Content-Security-Policy forbids one), so the table sorts with CSS
alone: a hidden radio button per column and direction sets the CSS ``order`` of each row from a
rank the view computed.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose.sweep.grid import AXES, AXIS_BY_NAME, Setting
from diagnose.sweep.results import STATUS_LABELS, PointResult, Sweep
from diagnose.units import format_bytes, format_per_iteration, format_percent, format_seconds_range

from .charts import CHART_RC, figure_svg, new_figure

#: The memory sizes of common GPUs, GiB (a "24 GB" card holds 24 GiB).
VRAM_SIZES_GIB: tuple[int, ...] = (8, 12, 16, 24, 48, 80)
_GIB = 1024**3
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


def setting_text(name: str, value: Setting) -> str:
    """A setting as the table and charts show it: on/off for switches, "preset's" for None."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "preset's"
    return str(value)


def point_label(result: PointResult, names: Sequence[str]) -> str:
    """``rank 8 · batch 2``: the point's values of ``names``."""
    settings = result.point.settings()
    return " · ".join(f"{AXIS_BY_NAME[n].label} {setting_text(n, settings[n])}" for n in names)


# --- VRAM fits --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fastest:
    """The point that trains an image fastest, and those the measurement cannot tell from it."""

    point: PointResult
    #: Points whose per-image interquartile range overlaps the fastest's: as fast within noise.
    ties: tuple[PointResult, ...] = ()


def fastest(points: Sequence[PointResult]) -> Fastest | None:
    """The fastest measured point per trained image (s/it over the batch), and its ties.

    Per image, because a point of batch 2 at 1.5x the s/it of batch 1 trains faster. Ties,
    because two points whose step times overlap cannot be ranked by one run: the page names
    both rather than let noise pick one."""
    timed = [(p, r) for p in points if p.status == "measured" and (r := p.per_image())]
    if not timed:
        return None
    best, (_, _, best_q3) = min(timed, key=lambda pr: pr[1][0])
    ties = tuple(p for p, (_, q1, _) in timed if p is not best and q1 <= best_q3)
    return Fastest(best, ties)


@dataclass(frozen=True)
class Fit:
    """The fastest measured point whose peak memory fits ``gib`` (None: none fits)."""

    gib: int
    point: PointResult | None
    ties: tuple[PointResult, ...] = ()


def vram_fits(points: Sequence[PointResult], sizes: Sequence[int] = VRAM_SIZES_GIB) -> list[Fit]:
    measured = [p for p in points if p.status == "measured" and p.peak_bytes]
    fits = []
    for gib in sizes:
        best = fastest([p for p in measured if (p.peak_bytes or 0) <= gib * _GIB])
        fits.append(
            Fit(gib=gib, point=best.point if best else None, ties=best.ties if best else ())
        )
    return fits


def memory_kind(points: Sequence[PointResult]) -> str:
    """ "device" when any measured point has device memory, "host" for CPU runs, "" for none."""
    kinds = {p.summary.memory_kind for p in points if p.summary is not None}
    if "device" in kinds:
        return "device"
    return "host" if "host" in kinds else ""


# --- CSV --------------------------------------------------------------------------------------

CSV_COLUMNS: tuple[str, ...] = (
    "point",
    *(axis.name for axis in AXES),
    "status",
    "seconds_per_it",
    "seconds_per_it_q1",
    "seconds_per_it_q3",
    "steps",
    "peak_bytes",
    "memory_kind",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_rss_bytes",
    "exit_code",
    "reason",
    "wall_seconds",
    "record",
)


def sweep_csv(sweep: Sweep) -> str:
    """One row per point; empty cells for what was not measured."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for result in sweep.points:
        row = result.to_dict()
        summary = result.summary
        settings = result.point.settings()
        writer.writerow(
            [
                result.id,
                *("" if settings[a.name] is None else settings[a.name] for a in AXES),
                result.status,
                _cell(summary.seconds_per_it if summary else None),
                _cell(summary.q1 if summary else None),
                _cell(summary.q3 if summary else None),
                summary.steps if summary else "",
                _cell(summary.peak_bytes if summary else None),
                summary.memory_kind if summary else "",
                _cell(summary.peak_allocated_bytes if summary else None),
                _cell(summary.peak_reserved_bytes if summary else None),
                _cell(summary.peak_rss_bytes if summary else None),
                _cell(result.exit_code),
                result.reason,
                _cell(None if result.wall_seconds is None else round(result.wall_seconds, 3)),
                row["record"] or "",
            ]
        )
    return buffer.getvalue()


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


# --- charts -----------------------------------------------------------------------------------


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
        (memory_label, lambda p: None if p.peak_bytes is None else p.peak_bytes / _GIB),
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


# --- the view the template shows --------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A sortable column: ``key`` names its radio buttons and the CSS variables of its order."""

    key: str
    label: str
    numeric: bool = False


@dataclass(frozen=True)
class Row:
    index: int
    id: str
    status: str
    status_label: str
    settings: list[str]
    seconds_per_it: str
    spread: str
    peak: str
    reason: str
    report_href: str
    record_href: str
    log_href: str
    resumed: bool
    #: "busy: others held 1.6 of 2 cores, up to 70% of the s/it", "" on a quiet machine.
    load: str
    #: ``--a-rank:2;--d-rank:3;...``: the row's place in each column's ascending and descending
    #: order (the CSS sort reads it).
    order_style: str


@dataclass(frozen=True)
class FitRow:
    gib: int
    index: int | None
    label: str
    seconds_per_it: str
    peak: str
    report_href: str
    #: Points as fast within noise ("#3, #4"), "" when none.
    ties: str = ""


@dataclass(frozen=True)
class SweepView:
    tool_version: str
    title: str
    created: str
    updated: str
    headline: str
    counts: str
    device: str
    interrupted: bool
    fixed: list[tuple[str, str]]
    columns: list[Column]
    grid_columns: str
    rows: list[Row]
    memory_kind: str
    memory_note: str
    fits: list[FitRow]
    charts: list[SweepChart]
    command: str


def build_sweep_view(sweep: Sweep, *, with_charts: bool = True) -> SweepView:
    swept = sweep.grid.swept()
    points = sweep.points
    measured = [p for p in points if p.status == "measured" and p.seconds_per_it is not None]
    kind = memory_kind(points)
    best = fastest(points)
    index_of = {p.id: i + 1 for i, p in enumerate(points)}
    if best is not None:
        top = best.point
        label = point_label(top, swept) or "the only point"
        per_image = " per image" if "batch" in swept else ""
        rate = top.per_image()
        images = f" ({1 / rate[0]:.3g} images/s)" if per_image and rate and rate[0] > 0 else ""
        headline = (
            f"Fastest{per_image}: #{index_of[top.id]} ({label}) at "
            f"{format_per_iteration(top.seconds_per_it)}{images}, peak "
            f"{format_bytes(top.peak_bytes)} {_memory_word(kind)}."
        )
        if best.ties:
            headline += (
                f" {_tie_words(best.ties, index_of)} as fast within the noise of this "
                "measurement (their step times overlap): rerun with more --steps to rank them."
            )
        headline += _load_words(top, measured, index_of)
    else:
        headline = "No point was measured yet."
    device = ""
    for p in measured:
        if p.summary is not None:
            device = p.summary.device_name or p.summary.device_kind
            break
    columns = [Column("index", "#", numeric=True)]
    columns += [Column(name, AXIS_BY_NAME[name].label, numeric=True) for name in swept]
    columns += [
        Column("sit", "s/it", numeric=True),
        Column("peak", "peak memory", numeric=True),
        Column("status", "result"),
    ]
    orders = _orders(points, swept)
    rows = [
        Row(
            index=i + 1,
            id=p.id,
            status=p.status,
            status_label=STATUS_LABELS[p.status],
            settings=[setting_text(n, _shown_setting(p, n)) for n in swept],
            seconds_per_it=format_per_iteration(p.seconds_per_it, missing="—"),
            spread=_spread(p),
            peak=format_bytes(p.peak_bytes, missing="—"),
            reason=p.reason,
            report_href=f"{p.dir}/report.html" if p.status == "measured" else "",
            record_href=f"{p.dir}/record.json" if p.status == "measured" else "",
            log_href=p.log if p.exit_code is not None else "",
            resumed=p.resumed,
            load=_point_load(p),
            order_style=";".join(
                f"--a-{c.key}:{orders[c.key][0][i]};--d-{c.key}:{orders[c.key][1][i]}"
                for c in columns
            ),
        )
        for i, p in enumerate(points)
    ]
    setting_widths = ["minmax(4.5rem, 1fr)"] * len(swept)
    grid_columns = " ".join(
        [
            "3.5rem",
            *setting_widths,
            "minmax(8rem, 1.3fr)",
            "minmax(9rem, 1fr)",
            "minmax(12rem, 3fr)",
        ]
    )
    fits = [
        FitRow(
            gib=fit.gib,
            index=index_of[fit.point.id] if fit.point else None,
            label=(point_label(fit.point, swept) or "the only point") if fit.point else "",
            seconds_per_it=format_per_iteration(fit.point.seconds_per_it) if fit.point else "",
            peak=format_bytes(fit.point.peak_bytes) if fit.point else "",
            report_href=f"{fit.point.dir}/report.html" if fit.point else "",
            ties=", ".join(f"#{index_of[t.id]}" for t in fit.ties),
        )
        for fit in vram_fits(points)
    ]
    return SweepView(
        tool_version=sweep.tool_version,
        title=f"diagnose sweep: {len(points)} points"
        + (f" over {', '.join(swept)}" if swept else ""),
        created=sweep.created,
        updated=sweep.updated,
        headline=headline,
        counts=_counts(sweep, device),
        device=device,
        interrupted=sweep.interrupted,
        fixed=_fixed_settings(sweep, swept, measured),
        columns=columns,
        grid_columns=grid_columns,
        rows=rows,
        memory_kind=kind,
        memory_note=_memory_note(kind),
        fits=fits,
        charts=sweep_charts(sweep) if with_charts else [],
        command=sweep.command,
    )


def _point_load(result: PointResult) -> str:
    """What other work took while a point's steps ran, when it competed for the cores."""
    summary = result.summary
    if summary is None or not summary.busy or summary.others_cores is None:
        return ""
    of = f" of {summary.cpus}" if summary.cpus else ""
    return (
        f"busy: others held {summary.others_cores:.1f}{of} cores, up to "
        f"{format_percent(summary.load_share)} of the s/it"
    )


def _load_words(top: PointResult, measured: Sequence[PointResult], index_of: dict[str, int]) -> str:
    """The machine's load where the sweep's numbers stand: at the fastest point, and how many
    points ran beside other work ("" on a quiet machine)."""
    busy = [p for p in measured if p.summary is not None and p.summary.busy]
    if not busy:
        return ""
    text = ""
    summary = top.summary
    if summary is not None and summary.busy:
        text += (
            f" The machine was busy while #{index_of[top.id]} ran ({_point_load(top)}): its "
            "place may be the load's."
        )
    text += (
        f" {len(busy)} of {len(measured)} measured points ran beside other work (marked "
        "busy in the table): their s/it includes that load; rerun on an idle machine to rank "
        "them."
    )
    return text


def _tie_words(ties: Sequence[PointResult], index_of: dict[str, int]) -> str:
    names = ", ".join(f"#{index_of[t.id]}" for t in ties)
    return f"{names} {'is' if len(ties) == 1 else 'are'}"


def _memory_word(kind: str) -> str:
    return {"device": "device memory", "host": "host memory (peak RSS)"}.get(kind, "memory")


def _memory_note(kind: str) -> str:
    if kind == "host":
        return (
            "These are CPU runs: the sizes are compared with each point's peak host memory (the "
            "process's peak RSS, which includes Python, torch and the data), not with GPU memory."
        )
    if kind == "device":
        return (
            "Peak device memory is what torch's caching allocator reserved (allocated when "
            "reserved is unknown); the CUDA/HIP context takes a few hundred MiB more, so a point "
            "within half a GiB of a size is tight."
        )
    return ""


def _counts(sweep: Sweep, device: str) -> str:
    """``4 of 8 points measured on <device> (2 by an earlier invocation); 4 failed``."""
    text = f"{sweep.count('measured')} of {len(sweep.points)} points measured"
    if device:
        text += f" on {device}"
    resumed = sum(1 for p in sweep.points if p.resumed)
    if resumed:
        text += f" ({resumed} by an earlier invocation)"
    others = []
    for status in ("oom", "failed", "timeout", "pending"):
        n = sweep.count(status)  # type: ignore[arg-type]
        if n:
            others.append(f"{n} {STATUS_LABELS[status]}")
    return text + ("; " + ", ".join(others) if others else "")


def _shown_setting(result: PointResult, name: str) -> Setting:
    value = result.point.settings()[name]
    if name == "resolution" and value is None and result.summary and result.summary.resolution:
        return ",".join(map(str, result.summary.resolution))
    return value


def _spread(result: PointResult) -> str:
    summary = result.summary
    if summary is None or summary.q1 is None or summary.q3 is None:
        return ""
    text = f"IQR {format_seconds_range(summary.q1, summary.q3)}, {summary.steps} steps"
    if summary.seconds_per_it:
        text += f" · {result.point.batch / summary.seconds_per_it:.3g} images/s"
    return text


def _fixed_settings(
    sweep: Sweep, swept: Sequence[str], measured: Sequence[PointResult]
) -> list[tuple[str, str]]:
    """The settings every point shares, as (name, value) lines."""
    rows: list[tuple[str, str]] = []
    grid = sweep.grid.to_dict()
    summary = next((p.summary for p in measured if p.summary is not None), None)
    fixed = sweep.fixed
    preset = fixed.preset or (summary.preset if summary else "") or "the device's default"
    size = fixed.size or (summary.size if summary else "") or "the device's default"
    rows.append(("model", f"{preset} ({size})"))
    for axis in AXES:
        if axis.name not in swept:
            value = grid[axis.name][0]
            if axis.name == "resolution" and value is None and summary and summary.resolution:
                value = ",".join(map(str, summary.resolution))
            rows.append((axis.label, setting_text(axis.name, value)))
    rows.append(
        (
            "measured",
            f"{fixed.steps} timed steps after {fixed.warmup} warm-up, "
            f"{fixed.profiled_steps} profiled; "
            + ("probes off: " + ", ".join(fixed.skip_probes) if fixed.skip_probes else "probes on"),
        )
    )
    rows.append(("device", fixed.device))
    rows.append(("seed", str(fixed.seed)))
    if fixed.data_dir:
        rows.append(("data", fixed.data_dir))
    if fixed.workers:
        rows.append(("DataLoader workers", str(fixed.workers)))
    if fixed.attention != "auto":
        rows.append(("attention", fixed.attention))
    return rows


def _orders(
    points: Sequence[PointResult], swept: Sequence[str]
) -> dict[str, tuple[list[int], list[int]]]:
    """Per column key, each row's place in ascending and in descending order (rows without a
    value last in both)."""
    status_rank = {status: i for i, status in enumerate(STATUS_LABELS)}
    keys: dict[str, list[Any]] = {"index": list(range(len(points)))}
    for name in swept:
        keys[name] = [_sort_value(_shown_setting(p, name)) for p in points]
    keys["sit"] = [p.seconds_per_it for p in points]
    keys["peak"] = [p.peak_bytes for p in points]
    keys["status"] = [status_rank[p.status] for p in points]
    return {key: _ranks(values) for key, values in keys.items()}


def _sort_value(value: Setting) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.split(",")[0])
        except ValueError:
            return value
    return value


def _ranks(values: Sequence[Any]) -> tuple[list[int], list[int]]:
    present = [i for i, v in enumerate(values) if v is not None]
    missing = [i for i, v in enumerate(values) if v is None]
    ascending = sorted(present, key=lambda i: (values[i], i)) + missing
    descending = sorted(present, key=lambda i: (values[i], -i), reverse=True) + missing
    asc = [0] * len(values)
    desc = [0] * len(values)
    for place, i in enumerate(ascending):
        asc[i] = place
    for place, i in enumerate(descending):
        desc[i] = place
    return asc, desc


def render_sweep_html(sweep: Sweep, *, with_charts: bool = True) -> str:
    """The sweep's page (templates/sweep.html) as a string."""
    from .html import template_environment

    view = build_sweep_view(sweep, with_charts=with_charts)
    return template_environment().get_template("sweep.html").render(view=view)


__all__ = [
    "CSV_COLUMNS",
    "VRAM_SIZES_GIB",
    "Fit",
    "SweepChart",
    "SweepView",
    "build_sweep_view",
    "memory_kind",
    "render_sweep_html",
    "sweep_charts",
    "sweep_csv",
    "vram_fits",
]
