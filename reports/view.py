"""The view: everything the report shows, as display-ready values derived from a RunRecord.

Pure functions of the record: no analysis (the record already holds the findings and the numbers),
no HTML (the templates lay it out, escaping every value), no torch. Both the HTML and the terminal
renderer read the same view, so the two always say the same thing; tests check the view directly.

Every part copes with a record that lacks it (no samples, no breakdown, no device name, a trace
without a model, an old record): it says "not measured" or leaves the part out, never raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose.carry_over import carry_over
from diagnose.errors import first_line
from diagnose.record import (
    PHASE_LABELS,
    Breakdown,
    Finding,
    OpStat,
    ProbeResult,
    RunRecord,
    Timing,
)
from diagnose.record import step_seconds as step_seconds_of
from diagnose.trace.kernel_classes import COUNTED_ONCE_PRECEDENCE
from diagnose.units import (
    NOT_MEASURED,
    format_bytes,
    format_count,
    format_per_iteration,
    format_percent,
    format_seconds,
    format_seconds_range,
    format_value,
    is_number,
)
from diagnose.verdicts import ranked

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
from .gate_outputs import CompareView
from .headline import (
    NOISY_RELATIVE_SPREAD,
    PRESET_LABELS,
    DeviceTime,
    Headline,
    build_headline,
    describe_device_name,
    describe_setup,
    describe_wall,
    device_time,
    phase_bar_steps,
)
from .ranks import RanksView, build_ranks
from .stacks import StacksView, build_stacks
from .utilisation import UtilisationView, build_utilisation

#: How each saving basis reads in the report.
SAVING_BASIS_LABELS: dict[str, str] = {
    "measured": "measured (A/B)",
    "estimated": "estimated",
    "trace": "from the trace",
    "none": "not quantified",
}

BREAKDOWN_BASIS_LABELS: dict[str, str] = {
    "measured": "measured: device-synchronised timers around each phase, median over the steps",
    "estimated": "estimated",
    "trace": "from the trace: phase spans read off the profiler trace, median over its steps",
    "none": "how these were obtained was not recorded",
}


#: Nested key/value trees deeper than this are shown flattened to one text cell.
_MAX_KV_DEPTH = 6
#: Lists longer than this are cut, with a note of how many were left out.
_MAX_LIST_ITEMS = 50


# --------------------------------------------------------------------------------------------
# Generic key/value trees (evidence, inventory, config, probe data)


@dataclass(frozen=True)
class KV:
    """One row of a key/value table: a text value, or nested rows."""

    key: str
    text: str = ""
    children: tuple[KV, ...] = ()
    #: A list of flat records (e.g. per-step rows, an A/B table) shown as one table:
    #: ``columns`` are the keys in first-seen order, ``cells`` one formatted row per record.
    columns: tuple[str, ...] = ()
    cells: tuple[tuple[str, ...], ...] = ()


def kv_rows(value: Any, *, depth: int = 0) -> tuple[KV, ...]:
    """Rows for a mapping (keys sorted, so the output is deterministic) or a list (indexed)."""
    if isinstance(value, Mapping):
        items: list[tuple[str, Any]] = sorted(((str(k), v) for k, v in value.items()))
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value[:_MAX_LIST_ITEMS])]
        if len(value) > _MAX_LIST_ITEMS:
            items.append(("…", f"{len(value) - _MAX_LIST_ITEMS} more not shown"))
    else:
        return (KV(key="", text=format_value(value)),)
    return tuple(_kv_row(key, item, depth) for key, item in items)


def _is_record_list(value: Sequence[Any]) -> bool:
    """A list of mappings whose values are all scalars or short scalar lists: a table."""
    return all(isinstance(item, Mapping) for item in value) and all(
        not isinstance(v, Mapping)
        and not (
            isinstance(v, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple)) for x in v)
        )
        for item in value
        for v in item.values()
    )


def _records_row(key: str, records: Sequence[Mapping[str, Any]]) -> KV:
    columns: dict[str, None] = {}
    for record in records:
        columns.update((str(k), None) for k in record)
    shown = records[:_MAX_LIST_ITEMS]

    def cell(record: Mapping[str, Any], column: str) -> str:
        if column not in record:
            return ""
        value = record[column]
        if isinstance(value, (list, tuple)):
            return ", ".join(format_value(v) for v in value)
        return format_value(value)

    cells = tuple(tuple(cell(r, c) for c in columns) for r in shown)
    if len(records) > _MAX_LIST_ITEMS:
        cells += (
            (f"… {len(records) - _MAX_LIST_ITEMS} more not shown",) + ("",) * (len(columns) - 1),
        )
    return KV(key=key, columns=tuple(columns), cells=cells)


def _kv_row(key: str, value: Any, depth: int) -> KV:
    if isinstance(value, (Mapping, list, tuple)):
        if not value:
            return KV(key=key, text="(empty)")
        if isinstance(value, (list, tuple)) and all(
            not isinstance(v, (Mapping, list, tuple)) for v in value
        ):
            shown = [format_value(v) for v in value[:_MAX_LIST_ITEMS]]
            if len(value) > _MAX_LIST_ITEMS:
                shown.append(f"… {len(value) - _MAX_LIST_ITEMS} more")
            return KV(key=key, text=", ".join(shown))
        if depth >= _MAX_KV_DEPTH:
            return KV(key=key, text=format_value(value))
        if isinstance(value, (list, tuple)) and _is_record_list(value):
            return _records_row(key, value)
        return KV(key=key, children=kv_rows(value, depth=depth + 1))
    return KV(key=key, text=format_value(value))


# --------------------------------------------------------------------------------------------
# 2. Where it goes


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
# 3. Why, ranked by what it costs


@dataclass(frozen=True)
class FindingView:
    rank: int
    id: str
    severity: str
    category: str
    title: str
    #: "0.52 s/it", or "" when the saving is not quantified.
    saving: str
    #: "measured (A/B)", "estimated", "from the trace", "not quantified".
    saving_basis: str
    #: "28% of the step", or "".
    saving_share: str
    fix: str
    detail: str
    source: str
    evidence: tuple[KV, ...]
    #: On a tiny run, what this finding says about the real model ("" at the real size):
    #: "holds for the tiny model only: <why>", "carries over", "judged at full size".
    at_full_size: str = ""
    #: "borderline: data wait 9.6%–12.3% of the step, at the 10% line", or "".
    borderline: str = ""


def build_findings(record: RunRecord) -> tuple[FindingView, ...]:
    # Shares are of the step the verdicts graded against (the bucket mix's s/it, when mixed).
    step = step_seconds_of(record)
    scale = carry_over(record)
    kinds = {} if scale is None else {i.check_id: i for i in scale.items}
    views = []
    for i, finding in enumerate(ranked(record.findings)):
        view = _finding_view(i + 1, finding, step)
        item = kinds.get(finding.id)
        if item is not None and item.kind != "unclassified":
            note = (
                item.kind
                if item.kind != "tiny-model only"
                else f"holds for the tiny model only: {item.why}"
            )
            view = dataclasses.replace(view, at_full_size=note)
        views.append(view)
    return tuple(views)


def _finding_view(rank: int, finding: Finding, step_seconds: float | None) -> FindingView:
    saved = finding.est_seconds_saved_per_it
    quantified = saved is not None and is_number(saved)
    share = ""
    if quantified and step_seconds and saved is not None and step_seconds > 0:
        share = f"{format_percent(saved / step_seconds)} of the step"
    return FindingView(
        rank=rank,
        id=finding.id,
        severity=finding.severity,
        category=finding.category,
        title=finding.title or finding.id or "(untitled finding)",
        saving=format_per_iteration(saved, like=step_seconds) if quantified else "",
        saving_basis=_saving_basis(finding.saving_basis, quantified),
        saving_share=share,
        fix=finding.fix,
        detail=finding.detail,
        source=finding.source,
        evidence=kv_rows(finding.evidence) if finding.evidence else (),
        borderline=borderline_line(finding),
    )


def borderline_line(finding: Finding) -> str:
    """What a borderline finding's value says against its line, for the finding's line."""
    if finding.borderline is None or not finding.borderline.text:
        return ""
    return (
        f"borderline: {finding.borderline.text} (a rerun may land on either side; "
        "the CI gate reads a change across it as no change)"
    )


def _saving_basis(basis: str, quantified: bool) -> str:
    if not quantified:
        return SAVING_BASIS_LABELS["none"]
    if basis == "none":  # a number without its basis (an older or hand-written record)
        return "how obtained not recorded"
    return SAVING_BASIS_LABELS.get(basis, basis)


# --------------------------------------------------------------------------------------------
# 4. What was checked


#: NotChecked.status of one check a probe that ran could not make.
NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class CheckedOk:
    probe: str
    text: str


@dataclass(frozen=True)
class NotChecked:
    probe: str
    #: "skipped" or "error" (the whole probe), or "not judged" (one check of a probe that ran).
    status: str
    reason: str
    traceback: str


@dataclass(frozen=True)
class ProbeRow:
    name: str
    status: str
    duration: str
    reason: str
    findings: int
    traceback: str
    data: tuple[KV, ...]


@dataclass(frozen=True)
class ChecksView:
    found_fine: tuple[CheckedOk, ...]
    could_not_check: tuple[NotChecked, ...]
    probes: tuple[ProbeRow, ...]
    #: Names of the probes that ran to completion (for the "no finding" state).
    ran: tuple[str, ...]
    #: "12 ok, 1 skipped, 1 error".
    status_counts: str


def build_checks(probes: Sequence[ProbeResult], findings: Sequence[Finding] = ()) -> ChecksView:
    # A saved record keeps its findings in RunRecord.findings, each naming its source probe.
    by_source: dict[str, int] = {}
    for finding in findings:
        # Trace rules name themselves "trace:<rule>"; they belong to the "trace" row.
        source = finding.source.split(":", 1)[0]
        by_source[source] = by_source.get(source, 0) + 1
    # Findings, "checked and found fine" and "could not be checked" are views of one check list.
    found_fine = tuple(CheckedOk(p.name, c.text) for p in probes for c in p.checks_with("ok"))
    could_not_check = tuple(
        NotChecked(
            probe=p.name,
            status=p.status,
            reason=first_line(p.reason, limit=None)
            or (
                "no reason recorded"
                if p.status == "skipped"
                else _last_line(p.traceback) or "no error recorded"
            ),
            traceback=p.traceback if p.status == "error" else "",
        )
        for p in probes
        if p.status != "ok"
    ) + tuple(
        NotChecked(
            probe=p.name, status=NOT_JUDGED, reason=first_line(c.text, limit=None), traceback=""
        )
        for p in probes
        for c in p.checks_with("not_judged")
    )
    rows = tuple(
        ProbeRow(
            name=p.name,
            status=p.status,
            duration=format_seconds(p.duration_seconds),
            reason=first_line(p.reason, limit=None),
            findings=len(p.findings) + by_source.get(p.name, 0),
            traceback=p.traceback,
            data=kv_rows(p.data) if p.data else (),
        )
        for p in probes
    )
    counts: dict[str, int] = {}
    for p in probes:
        counts[p.status] = counts.get(p.status, 0) + 1
    order = ["ok", "skipped", "error", *sorted(set(counts) - {"ok", "skipped", "error"})]
    status_counts = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    return ChecksView(
        found_fine=found_fine,
        could_not_check=could_not_check,
        probes=rows,
        ran=tuple(p.name for p in probes if p.status == "ok"),
        status_counts=status_counts or "no probe ran",
    )


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip() if text.strip() else ""


# --------------------------------------------------------------------------------------------
# Below the first screen


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


@dataclass(frozen=True)
class OpRow:
    name: str
    calls_per_step: str
    self_cpu: str
    self_device: str
    cpu_total: str
    shapes: str
    dtypes: str


def build_ops(ops: Sequence[OpStat]) -> tuple[OpRow, ...]:
    return tuple(
        OpRow(
            name=op.name,
            calls_per_step=format_value(round(op.calls_per_step, 2))
            if is_number(op.calls_per_step)
            else "—",
            self_cpu=format_seconds(op.self_cpu_seconds, missing="—"),
            self_device=format_seconds(op.self_device_seconds, missing="—"),
            cpu_total=format_seconds(op.cpu_total_seconds, missing="—"),
            shapes=op.input_shapes,
            dtypes=op.input_dtypes,
        )
        for op in ops
    )


def build_memory(timing: Timing) -> tuple[tuple[str, str], ...]:
    rows = (
        ("peak device memory allocated", timing.peak_allocated_bytes),
        ("peak device memory reserved", timing.peak_reserved_bytes),
        ("peak host memory (RSS)", timing.peak_rss_bytes),
    )
    out = tuple((label, format_bytes(value)) for label, value in rows if value is not None)
    if timing.first_batch_seconds is not None:
        out += (("first batch arrived after", format_seconds(timing.first_batch_seconds)),)
    return out


def build_device(record: RunRecord) -> tuple[KV, ...]:
    d = record.device
    fields: list[tuple[str, str]] = [
        ("kind", d.kind),
        ("vendor", d.vendor),
        ("name", d.name),
        ("architecture", d.arch),
        ("memory", format_bytes(d.memory_bytes) if d.memory_bytes is not None else ""),
        ("runtime", d.runtime),
        ("driver", d.driver),
        ("torch device", d.torch_device),
    ]
    rows = [KV(key=k, text=v) for k, v in fields if v]
    if d.extra:
        rows.append(KV(key="extra", children=kv_rows(d.extra)))
    return tuple(rows)


def build_model(record: RunRecord) -> tuple[KV, ...]:
    m = record.model
    fields: list[tuple[str, str]] = [
        ("preset", PRESET_LABELS.get(m.preset, m.preset)),
        ("size", m.size),
        ("class", m.class_name),
        ("weights", m.source),
        ("parameters", format_count(m.parameters) if m.parameters else ""),
        (
            "trainable (LoRA) parameters",
            format_count(m.trainable_parameters) if m.trainable_parameters else "",
        ),
        ("LoRA-wrapped modules", str(m.lora_modules) if m.lora_modules else ""),
        ("text encoders", ", ".join(m.text_encoders)),
        ("VAE", m.vae),
    ]
    return tuple(KV(key=k, text=v) for k, v in fields if v)


# --------------------------------------------------------------------------------------------
# The whole report


@dataclass(frozen=True)
class ReportView:
    title: str
    mode: str
    headline: Headline
    breakdown: BreakdownView
    findings: tuple[FindingView, ...]
    checks: ChecksView
    steps: StepsView
    ops: tuple[OpRow, ...]
    memory: tuple[tuple[str, str], ...]
    device: tuple[KV, ...]
    inventory: tuple[KV, ...]
    model: tuple[KV, ...]
    config: tuple[KV, ...]
    notes: tuple[str, ...]
    command: str
    trace_path: str
    tool_version: str
    schema_version: int
    created: str
    #: Problems met while rendering (a chart that could not be drawn); shown in the notes.
    render_notes: tuple[str, ...] = field(default=())
    #: The comparison with a baseline record (the CI gate), when one was given.
    comparison: CompareView | None = None
    #: Every rank beside the pacing one (multi-process runs, folders of rank traces).
    ranks: RanksView | None = None
    #: Where this command's own wall time went ("" when the record does not say).
    wall_text: str = ""
    #: The step's FLOPs against the device's peak (None when no FLOPs were counted).
    utilisation: UtilisationView | None = None
    #: The Python frames py-spy sampled (``diagnose profile`` only).
    stacks: StacksView | None = None


def build_view(record: RunRecord, *, comparison: CompareView | None = None) -> ReportView:
    """Everything the report shows, derived from ``record`` (and a comparison, if given)."""
    problems: list[str] = []
    headline = build_headline(record)
    step_seconds = step_seconds_of(record)
    from_trace = record.mode == "trace"
    title_number = headline.value if headline.measured else "no step time"
    where = describe_device_name(record)
    view = ReportView(
        title=f"diagnose: {title_number}" + (f" on {where}" if where else ""),
        mode=record.mode,
        headline=headline,
        breakdown=build_breakdown(
            record.breakdown,
            step_seconds,
            problems,
            steps=phase_bar_steps(record),
            device=device_time(record),
        ),
        findings=build_findings(record),
        checks=build_checks(record.probes, record.findings),
        steps=build_steps(record.timing, from_trace=from_trace, problems=problems),
        ops=build_ops(record.top_ops),
        memory=build_memory(record.timing),
        device=build_device(record),
        inventory=kv_rows(record.inventory) if record.inventory else (),
        model=build_model(record),
        config=kv_rows(record.config) if record.config else (),
        notes=tuple(record.notes),
        command=record.command,
        trace_path=record.trace_path,
        tool_version=record.tool_version,
        schema_version=record.schema_version,
        created=record.created,
        render_notes=tuple(problems),
        comparison=comparison,
        ranks=build_ranks(record.ranks),
        wall_text=describe_wall(record.wall_seconds),
        utilisation=build_utilisation(record),
        stacks=build_stacks(record),
    )
    return view


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
    "KV",
    "NOISY_RELATIVE_SPREAD",
    "SAVING_BASIS_LABELS",
    "BreakdownView",
    "ChecksView",
    "FindingView",
    "Headline",
    "ReportView",
    "build_view",
    "describe_setup",
    "kv_rows",
]
