"""The page and the CSV of a sweep: its table, the fastest point, which point fits each VRAM size
(ranked by :mod:`.sweep_fits`) and its charts (:mod:`.sweep_charts`).

Reads a :class:`~diagnose.sweep.results.Sweep` (the numbers each point's own record gave) and never
measures. The page follows the report's rules (:mod:`.html`): one self-contained file, every value
escaped, no script (the report's Content-Security-Policy forbids one), so the table sorts with CSS
alone: a hidden radio button per column and direction sets the CSS ``order`` of each row from a
rank the view computed.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from diagnose.sweep.grid import AXES, AXIS_BY_NAME, Setting
from diagnose.sweep.results import STATUS_LABELS, PointResult, Sweep
from diagnose.units import format_bytes, format_per_iteration, format_percent, format_seconds_range

from .sweep_charts import SweepChart, sweep_charts
from .sweep_fits import fastest, memory_kind, point_label, setting_text, vram_fits

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
    "SweepView",
    "build_sweep_view",
    "render_sweep_html",
    "sweep_csv",
]
