"""The view: everything the report shows, as display-ready values derived from a RunRecord.

:func:`build_view` puts the report together from its parts: the headline (:mod:`.headline`),
where the step's time goes and each step's time (:mod:`.step_time`), the ranked findings
(:mod:`.ranked_findings`), what was checked (:mod:`.checks`), the ranks (:mod:`.ranks`), the
utilisation (:mod:`.utilisation`) and the sampled stacks (:mod:`.stacks`); the tables below the
first screen (top ops, memory, device, model) are built here. Free-form mappings are shown as
key/value trees (:mod:`.key_values`).

Pure functions of the record: no analysis (the record already holds the findings and the numbers),
no HTML (the templates lay it out, escaping every value), no torch. Both the HTML and the terminal
renderer read the same view, so the two always say the same thing; tests check the view directly.

Every part copes with a record that lacks it (no samples, no breakdown, no device name, a trace
without a model, an old record): it says "not measured" or leaves the part out, never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from diagnose.record import OpStat, RunRecord, Timing
from diagnose.record import step_seconds as step_seconds_of
from diagnose.units import format_bytes, format_count, format_seconds, format_value, is_number

from .checks import ChecksView, build_checks
from .gate_outputs import CompareView
from .headline import (
    PRESET_LABELS,
    Headline,
    build_headline,
    describe_device_name,
    describe_wall,
    device_time,
    phase_bar_steps,
)
from .key_values import KV, kv_rows
from .ranked_findings import FindingView, build_findings
from .ranks import RanksView, build_ranks
from .stacks import StacksView, build_stacks
from .step_time import BreakdownView, StepsView, build_breakdown, build_steps
from .utilisation import UtilisationView, build_utilisation

# --------------------------------------------------------------------------------------------
# Below the first screen


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


__all__ = [
    "OpRow",
    "ReportView",
    "build_device",
    "build_memory",
    "build_model",
    "build_ops",
    "build_view",
]
