"""The headline of a report: the s/it, how it was measured, what the setup was, and what the
machine's load, the tiny model and the command's own wall time mean for it.

Pure wording over a RunRecord, shared by the HTML and terminal renderers through
:mod:`diagnose.reports.view` (and by the gate's summary, which names the setup).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diagnose.carry_over import carry_over
from diagnose.config import MAX_TIMED_STEPS
from diagnose.contention import describe as describe_load
from diagnose.record import HostLoad, RunRecord, Stats, Timing
from diagnose.trainers import accumulation_setting
from diagnose.units import (
    NOT_MEASURED,
    format_per_iteration,
    format_percent,
    format_seconds,
    format_seconds_range,
    format_value,
    is_number,
)

#: Relative spread (IQR / median) above which the headline is flagged noisy.
NOISY_RELATIVE_SPREAD = 0.10

PRESET_LABELS: dict[str, str] = {
    "sd15": "SD 1.5",
    "sdxl": "SDXL",
    "zimage": "Z-Image",
    "flux": "FLUX",
    "sd3": "SD3",
}

OPTIMIZER_LABELS: dict[str, str] = {
    "adamw": "AdamW",
    "adamw8bit": "AdamW8bit",
    "adafactor": "Adafactor",
}


# --------------------------------------------------------------------------------------------
# 1. The number


@dataclass(frozen=True)
class Headline:
    """The first line of the report."""

    #: Whether there is a step time at all.
    measured: bool
    #: "1.84 s/it", or "not measured".
    value: str
    #: "median of 20 unprofiled steps, IQR 1.80–1.90 s".
    how: str
    #: "AMD Radeon RX 7900 XTX, SDXL LoRA rank 32, bf16-mixed, AdamW8bit, 1024 px, batch 1".
    setup: str
    #: The whole first line as one sentence, for the terminal and the page title.
    sentence: str
    noisy: bool
    #: Why the spread is flagged, or "".
    noise_text: str
    #: Profiled vs unprofiled medians and the profiler's overhead, or "".
    profiler_text: str
    #: Where the step time came from: "measured" or "trace".
    source: str
    #: Whether other work competed for the cores while the steps or the probes were timed.
    busy: bool = False
    #: How busy, and what it means for the numbers on the page; "" when not busy or not known.
    busy_text: str = ""
    #: On a run of a shrunk (tiny) model: which verdicts carry over to the real one, in one line;
    #: and one line per verdict. Empty at the real size.
    scale_text: str = ""
    scale_lines: tuple[str, ...] = ()
    #: How much of the step the GPU sat idle (no kernel, copy or memset on any stream), from
    #: the trace; "" without a device trace.
    device_text: str = ""


def build_headline(record: RunRecord) -> Headline:
    timing = record.timing
    stats = timing.headline
    from_trace = record.mode == "trace"
    setup = describe_setup(record)
    if not stats.n or not is_number(stats.median):
        what = "step time" if from_trace else "seconds per iteration"
        why = "the trace held no complete step" if from_trace else "no step was timed"
        sentence = f"{what.capitalize()} not measured ({why})"
        return Headline(
            measured=False,
            value=NOT_MEASURED,
            how=why,
            setup=setup,
            sentence=f"{sentence}{' on ' + setup if setup else ''}.",
            noisy=False,
            noise_text="",
            profiler_text="",
            source="trace" if from_trace else "none",
            **_scale(record),
        )
    busy_text = describe_machine_load(record)
    value = format_per_iteration(stats.median)
    how = _describe_stats(stats, timing, from_trace)
    spread = stats.relative_spread
    noisy = stats.n >= 2 and is_number(spread) and spread > NOISY_RELATIVE_SPREAD
    where = "the median"
    buckets = timing.buckets()
    if buckets:
        # Steps of different input shapes take different times: that is the run's mix, not
        # noise. Lead with the mix's s/it and judge the spread within each bucket.
        value = format_per_iteration(timing.per_iteration)
        how = _describe_buckets(buckets, stats.n) + _budget_note(timing, from_trace)
        spread, bucket = max(
            ((b.relative_spread, name) for name, b in buckets.items() if b.n >= 2),
            default=(math.nan, ""),
        )
        noisy = is_number(spread) and spread > NOISY_RELATIVE_SPREAD
        where = f"the median of the {bucket} steps"
    elif from_trace and (shape := _one_input_shape(timing)):
        how += f"; one input shape, {shape}"
    how += _describe_micro_batches(record, stats.median)
    noise_text = ""
    if noisy:
        advice = _noise_advice(record.timing.host_load, record.timing.step_budget_s is not None)
        noise_text = (
            f"The interquartile range is {format_percent(spread)} of {where} "
            f"(above {format_percent(NOISY_RELATIVE_SPREAD)}); differences smaller than that "
            f"are not conclusive. {advice}"
        )
    sentence = f"{value} ({how})"
    if setup:
        sentence += f" on {setup}"
    return Headline(
        measured=True,
        value=value,
        how=how,
        setup=setup,
        sentence=sentence + ".",
        noisy=noisy,
        noise_text=noise_text,
        profiler_text=_describe_profiler(timing, from_trace),
        source="trace" if from_trace else "measured",
        busy=bool(busy_text),
        busy_text=busy_text,
        device_text=describe_device_time(record),
        **_scale(record),
    )


@dataclass(frozen=True)
class DeviceTime:
    """The device's busy and idle time per step, on the steps the phase bar is on."""

    busy: float
    idle: float
    #: Which steps: "unprofiled step", "profiled step", "traced step".
    steps: str
    #: How the numbers were had, for the line under the bar.
    how: str

    @property
    def idle_share(self) -> float:
        total = self.busy + self.idle
        return self.idle / total if total > 0 else 0.0


def phase_bar_steps(record: RunRecord) -> str:
    """Which steps the phase bar is per: the unprofiled ones when the record timed any (``diagnose
    run`` measures its phases there; ``diagnose profile`` scales the trace's to them), else the
    trace's."""
    if record.timing.unprofiled.n:
        return "unprofiled step"
    return "traced step" if record.mode == "trace" else "profiled step"


def device_time(record: RunRecord) -> DeviceTime | None:
    """The device's time per step on the phase bar's steps, or None without a device trace.

    Kernels run as long under the profiler as without it, so the busy time read off the trace
    holds for an unprofiled step, and the rest of that step is idle; the trace's own idle time
    belongs to the longer profiled steps."""
    breakdown = record.breakdown
    busy, idle = breakdown.device_busy_seconds, breakdown.device_idle_seconds
    if busy is None or idle is None or breakdown.device_idle_share is None:
        return None
    steps = phase_bar_steps(record)
    step = record.timing.per_iteration
    if steps == "unprofiled step" and is_number(step) and step > 0:
        return DeviceTime(
            busy,
            max(step - busy, 0.0),
            steps,
            "busy is the kernels, copies and memsets of the profiled steps (the profiler barely "
            "changes their time), idle the rest of the unprofiled step",
        )
    return DeviceTime(
        busy, idle, steps, "busy is any kernel, copy or memset on any stream; mean over the steps"
    )


def describe_device_time(record: RunRecord) -> str:
    """ "The GPU sat idle 29% of each unprofiled step (...)", or "" without a device trace."""
    time = device_time(record)
    if time is None:
        return ""
    device = "GPU" if record.device.kind in ("cuda", "rocm") else "device"
    return (
        f"The {device} sat idle {format_percent(time.idle_share)} of each {time.steps} (idle "
        f"{format_seconds(time.idle)}, busy {format_seconds(time.busy)} per step): the time no "
        f"kernel, copy or memset ran on any stream; {time.how}."
    )


def _gpu_sharers(record: RunRecord) -> int:
    """Processes not of this job seen on the GPU during the timed steps (0 when not known)."""
    during = (record.inventory.get("telemetry") or {}).get("during_steps") or {}
    others = (
        (during.get("stats") or {}).get("other_processes_max") if isinstance(during, dict) else None
    )
    return others if isinstance(others, int) and not isinstance(others, bool) else 0


def _scale(record: RunRecord) -> dict[str, Any]:
    scale = carry_over(record)
    if scale is None:
        return {}
    return {"scale_text": scale.summary(), "scale_lines": tuple(scale.lines())}


def _noise_advice(load: HostLoad | None, budgeted: bool) -> str:
    more = f"more steps (--steps {MAX_TIMED_STEPS})" if budgeted else "more steps"
    if load is None or load.basis != "psutil":
        return f"Rerun with {more} on an otherwise idle machine."
    if load.contended:
        return f"The machine was busy (above): rerun with {more} on an idle machine."
    return (
        "The machine was not busy while the steps ran, so the spread is the workload's own "
        f"(steps that differ in content, garbage collection, thermal limits): use {more}."
    )


def describe_machine_load(record: RunRecord) -> str:
    """One paragraph when other work competed for the cores during the timed steps or a probe:
    what it took, how much of the numbers it may explain, what was set aside. "" otherwise."""
    load = record.timing.host_load
    busy_probes = [p for p in record.probes if p.host_load is not None and p.host_load.contended]
    sharing = _gpu_sharers(record)
    if not (load is not None and load.contended) and not busy_probes and not sharing:
        return ""
    parts = []
    if sharing:
        processes = f"{sharing} other process{'es' if sharing != 1 else ''}"
        parts.append(
            f"{processes} had work on the GPU while the timed steps ran: the GPU's time was "
            "shared, so the s/it and the comparisons may be slower than this workload alone."
        )
    if load is not None and load.contended:
        # `diagnose profile` watches the command from its start: its window is the whole run.
        window = "the profiled command ran" if record.mode == "profile" else "the timed steps ran"
        parts.append(
            f"While {window}, {describe_load(load)}. Up to "
            f"{format_percent(load.competing_share)} of the s/it above may be that load, not this "
            "workload."
        )
    if busy_probes:
        set_aside = sum(p.host_load.comparisons_set_aside for p in busy_probes if p.host_load)
        names = ", ".join(p.name for p in busy_probes)
        also = "also " if parts else ""
        text = f"The machine was {also}busy while these probes compared settings: {names}"
        if set_aside:
            were = "were" if set_aside != 1 else "was"
            text += (
                f"; {set_aside} comparison{'s' if set_aside != 1 else ''} the load could "
                f"explain {were} set aside rather than raised"
            )
        parts.append(text + ".")
    parts.append("Rerun on an idle machine for verdicts that hold.")
    return " ".join(parts)


def _one_input_shape(timing: Timing) -> str:
    """The input shape every step trained, when the steps recorded one and all the same."""
    shapes = {s.bucket for s in timing.samples}
    return shapes.pop() if len(shapes) == 1 else ""


def _describe_buckets(buckets: Mapping[str, Stats], steps: int) -> str:
    """``"the run's bucket mix over 30 steps: 512x512 210 ms/it (15 steps, IQR …), …"``."""
    parts = [
        f"{name} {format_per_iteration(b.median)} ({b.n} step{'s' if b.n != 1 else ''}, "
        f"IQR {format_seconds_range(b.q1, b.q3)})"
        for name, b in buckets.items()
    ]
    return (
        f"the run's mix of {len(buckets)} input shapes over {steps} steps, each shape's median "
        f"weighted by its share of the steps: {'; '.join(parts)}"
    )


def _describe_stats(stats: Stats, timing: Timing, from_trace: bool) -> str:
    steps = "step" if stats.n == 1 else "steps"
    if from_trace:
        kind = f"{steps} in the trace"
    elif timing.unprofiled.n:
        kind = f"unprofiled {steps}"
    else:
        kind = f"profiled {steps}, no unprofiled step was timed, so it includes profiler overhead"
    if stats.n == 1:
        text = f"1 {kind}, no spread"
    else:
        text = f"median of {stats.n} {kind}, IQR {format_seconds_range(stats.q1, stats.q3)}"
    if from_trace:
        text += "; step time read from the profiler trace"
    return text + _budget_note(timing, from_trace)


def _describe_micro_batches(record: RunRecord, step_seconds: float) -> str:
    """``"; each step is 4 micro-batches (gradient accumulation), 52 ms per micro-batch"``, or
    "" without accumulation. The setting is named when the trainer is known."""
    micro_batches = record.breakdown.micro_batches_per_step
    if micro_batches <= 1:
        return ""
    per = format_seconds(step_seconds / micro_batches)
    setting = accumulation_setting(record.config.get("trainer"), micro_batches)
    return (
        f"; each step is {micro_batches} micro-batches (gradient accumulation"
        f"{': ' + setting if setting else ''}), {per} per micro-batch"
    )


def _budget_note(timing: Timing, from_trace: bool) -> str:
    """Said when a step budget ended the timed steps, so a reader comparing two records knows
    why one holds fewer samples."""
    if from_trace or timing.step_budget_s is None or not timing.unprofiled.n:
        return ""
    return (
        f"; the timed steps ended after {timing.step_budget_s:g} s "
        f"(pass --steps {MAX_TIMED_STEPS} to take them all)"
    )


def _describe_profiler(timing: Timing, from_trace: bool) -> str:
    if from_trace:
        return ""
    profiled, unprofiled = timing.profiled, timing.unprofiled
    overhead = timing.profiler_overhead
    if overhead is not None:
        against = (
            "each compared with the unprofiled steps of its input shape"
            if timing.buckets()
            else f"unprofiled median {format_seconds(unprofiled.median)}"
        )
        return (
            f"Profiled steps: median {format_seconds(profiled.median)} over {profiled.n} "
            f"({against}): profiler overhead {format_percent(overhead, signed=True)}."
        )
    if unprofiled.n and profiled.n:
        return (
            f"Profiled steps: median {format_seconds(profiled.median)} over {profiled.n}; no "
            "unprofiled step had their input shape, so the profiler's overhead is not measured."
        )
    if unprofiled.n and not profiled.n:
        return "No step was profiled: the profiler's overhead is not measured."
    return ""


def describe_setup(record: RunRecord) -> str:
    """Device and workload in one phrase; only the parts the record holds."""
    parts: list[str] = []
    device = describe_device_name(record)
    if device:
        parts.append(device)
    model = _model_phrase(record)
    if model:
        parts.append(model)
    config = record.config
    precision = config.get("precision")
    if isinstance(precision, str) and precision:
        parts.append(precision)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, str) and optimizer:
        parts.append(OPTIMIZER_LABELS.get(optimizer, optimizer))
    resolution = _resolution_phrase(config.get("resolution"))
    if resolution:
        parts.append(resolution)
    batch = config.get("batch")
    if is_number(batch):
        parts.append(f"batch {format_value(batch)}")
    return ", ".join(parts)


def describe_device_name(record: RunRecord) -> str:
    device = record.device
    if device.name:
        return device.name
    if device.kind == "cpu":
        return "the CPU"
    if device.kind and device.kind != "unknown":
        return f"a {device.kind} device (name not recorded)"
    return ""


def _model_phrase(record: RunRecord) -> str:
    model = record.model
    preset = model.preset or record.config.get("preset") or ""
    if not isinstance(preset, str):
        preset = str(preset)
    name = PRESET_LABELS.get(preset, preset) or model.class_name
    if not name:
        return ""
    size = model.size or record.config.get("size") or ""
    if size and size != "full":
        name += f" ({size})"
    base = record.config.get("base")
    on = f" on a {base} base" if isinstance(base, str) and base else ""
    rank = record.config.get("rank")
    if is_number(rank):
        return f"{name} LoRA rank {format_value(rank)}{on}"
    return name + on


def _resolution_phrase(resolution: Any) -> str:
    if is_number(resolution):
        return f"{format_value(resolution)} px"
    if isinstance(resolution, (list, tuple)) and resolution and all(map(is_number, resolution)):
        return "/".join(format_value(r) for r in resolution) + " px"
    return ""


#: The stages of ``diagnose run`` in the order they happen (RunRecord.wall_seconds' keys).
RUN_STAGES = (
    "start-up",
    "inventory",
    "build",
    "warm-up steps",
    "timed steps",
    "profiled steps",
    "trace analysis",
)


def describe_wall(wall: Mapping[str, float]) -> str:
    """``"This run took 1 min 52 s: start-up 8.1 s · build 3.0 s · … · probes 50.2 s (dataloader
    24.0 s, …)"``: where the command's own time went, so a slow run says what to skip."""
    if not wall:
        return ""
    probes = {k.removeprefix("probe "): v for k, v in wall.items() if k.startswith("probe ")}
    # In the order the run goes through them (a saved record's keys come back sorted).
    known = {name: i for i, name in enumerate(RUN_STAGES)}
    stages = sorted(
        ((k, v) for k, v in wall.items() if not k.startswith("probe ")),
        key=lambda kv: (known.get(kv[0], len(known)), kv[0]),
    )
    parts = [f"{name} {format_seconds(seconds)}" for name, seconds in stages]
    if probes:
        each = ", ".join(
            f"{name} {format_seconds(s)}"
            for name, s in sorted(probes.items(), key=lambda kv: -kv[1])
        )
        parts.append(f"probes {format_seconds(sum(probes.values()))} ({each})")
    total = sum(wall.values())
    return f"This run took {format_seconds(total)} before writing its outputs: " + " · ".join(parts)
