"""Syncs: the host blocks until the device drains, anywhere in the step.

One reading of the whole step (:mod:`diagnose.trace.sync_reading`) places every sync and costs it;
this rule says it as two findings: the optimizer's own step (``optimizer.sync_in_step``, worded
by the optimizer catalog, whose fix names the optimizer) and every other place
(``compute.sync_in_step``: logging, clipping, the forward...). Each is raised as soon as its place
holds a sync; its severity comes from its cost. On the unprofiled basis when the unprofiled step
is known (``diagnose run``, ``diagnose profile``); trace-only, its read-off part is a lower bound
and the finding says so.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt

from diagnose.catalogs import compute_catalog
from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.record import ProbeResult
from diagnose.trace.context import SAVING_ON_UNPROFILED_STEPS, TraceContext
from diagnose.trace.steps import OPTIMIZER_STEP_RANGE
from diagnose.trace.sync_reading import SyncPlace, SyncReading, syncs_of
from diagnose.units import ms

RULE = "syncs"
OPTIMIZER_ID = catalog.SYNC_IN_STEP.id
ELSEWHERE_ID = compute_catalog.SYNC_IN_STEP.id
#: torch's span around Optimizer.step names the class: "Optimizer.step#AdamW8bit.step".
_STEP_CLASS = re.compile(r"^Optimizer\.step#(\w+)\.step$")


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    reading = syncs_of(ctx)
    if not reading.judged:
        for check_id in (OPTIMIZER_ID, ELSEWHERE_ID):
            result.add_not_judged(check_id, f"syncs: {reading.reason}")
        return result
    result.data = reading.to_dict()
    _judge_optimizer(ctx, reading, result)
    _judge_elsewhere(reading, result)
    return result


def _judge_optimizer(ctx: TraceContext, reading: SyncReading, result: ProbeResult) -> None:
    ranges = _optimizer_ranges(ctx)
    places = reading.place("optimizer")
    if not places:
        if ranges:
            result.add_ok(
                OPTIMIZER_ID,
                f"optimizer: no host-device syncs inside {', '.join(ranges)} ({_counted(reading)})",
            )
        else:
            result.add_not_judged(
                OPTIMIZER_ID, "optimizer: no Optimizer.step ranges in the profiled steps"
            )
        return
    steps_in = sorted({p.optimizer for p in places})
    running = _running(ctx, steps_in)
    per_step = sum(p.syncs_per_step for p in places)
    calls = _calls_per_step(places, ctx.n_steps)
    cost = sum(p.estimate_seconds for p in places)
    read_off = sum(p.read_off_seconds for p in places)
    waits = sum(p.waits_per_step for p in places)
    result.add_finding(
        catalog.sync_in_step(
            optimizers=[catalog.label(running)] if running else steps_in,
            running=running,
            waits_per_step=per_step,
            calls=calls,
            cost_said=compute_catalog.sync_cost_said(
                estimate_seconds=cost,
                read_off_seconds=read_off,
                share=cost / reading.step_seconds if reading.step_seconds else None,
                unprofiled_known=reading.unprofiled_known,
            ),
            evidence=_evidence(reading, places),
            saving=cost,
            basis="estimated",
            detail=(
                f"Inside {', '.join(steps_in)} the host called "
                + ", ".join(f"{n:.0f} {call}" for call, n in calls.items())
                + " per step; while it waits it launches nothing, and after each wait the "
                "device idles until the host launches the next tensor's kernels. "
                + compute_catalog.sync_cost_detail(
                    read_off_seconds=read_off,
                    waits=waits,
                    wait_us=compute_catalog.UNPROFILED_WAIT_US,
                    unprofiled_known=reading.unprofiled_known,
                )
            ),
            source=f"trace:{RULE}",
        )
    )


def _judge_elsewhere(reading: SyncReading, result: ProbeResult) -> None:
    places = [p for p in reading.places if p.place != "optimizer"]
    if not places:
        result.add_ok(
            ELSEWHERE_ID,
            f"syncs: none outside the optimizer's step ({_counted(reading)})",
        )
        return
    top = places[0]
    cost = sum(p.estimate_seconds for p in places)
    read_off = sum(p.read_off_seconds for p in places)
    finding = compute_catalog.sync_elsewhere_finding(
        syncs_per_step=top.syncs_per_step,
        what=top.what,
        place=top.place,
        where=", ".join(top.where[:2]),
        estimate_seconds=cost,
        read_off_seconds=read_off,
        waits=sum(p.waits_per_step for p in places),
        share=cost / reading.step_seconds if reading.step_seconds else None,
        unprofiled_known=reading.unprofiled_known,
        evidence=_evidence(reading, places),
        source=f"trace:{RULE}",
    )
    if len(places) > 1:
        others = "; ".join(
            f"{p.syncs_per_step:.0f} {p.what} "
            f"{compute_catalog.SYNC_PLACES.get(p.place, p.place)} (≈{ms(p.estimate_seconds)})"
            for p in places[1:]
        )
        finding.title += f"; also {others}"
        finding.fix += ". Also: " + "; ".join(
            dict.fromkeys(compute_catalog.sync_fix(p.place) for p in places[1:])
        )
    result.add_finding(finding)


def _counted(reading: SyncReading) -> str:
    """What the reading set aside, for an ok line: the analysis' harness and closing syncs."""
    parts = [f"{reading.syncs_per_step:.0f} sync(s) per step in all"]
    if reading.harness_per_step:
        parts.append(f"{reading.harness_per_step:.0f} of diagnose's phase timer not counted")
    if reading.closing_per_step:
        parts.append(f"{reading.closing_per_step:.0f} closing the step not counted")
    return "; ".join(parts)


def _calls_per_step(places: list[SyncPlace], n: int) -> dict[str, float]:
    calls: dict[str, float] = {}
    for place in places:
        for call, count in place.calls.items():
            calls[call] = calls.get(call, 0.0) + count / n
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


def _evidence(reading: SyncReading, places: list[SyncPlace]) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "syncs_per_step": sum(p.syncs_per_step for p in places),
        "places": [p.to_dict() for p in places],
        "read_off_seconds_per_step": sum(p.read_off_seconds for p in places),
        "estimate_seconds_per_step": sum(p.estimate_seconds for p in places),
        "waits_on_work_per_step": sum(p.waits_per_step for p in places),
        "unprofiled_wait_us": compute_catalog.UNPROFILED_WAIT_US,
        "step_seconds": reading.step_seconds,
        "step_basis": "unprofiled" if reading.unprofiled_known else "profiled",
        "profiler_us_per_launch_taken_out": reading.per_launch_overhead_us,
        "read_off_is_a_lower_bound": not reading.unprofiled_known,
    }
    if reading.unprofiled_known:
        evidence[SAVING_ON_UNPROFILED_STEPS] = True
    return evidence


def _optimizer_ranges(ctx: TraceContext) -> list[str]:
    host = ctx.trace.host
    if not len(host):
        return []
    ids = [
        i for i in np.unique(host.name).tolist() if OPTIMIZER_STEP_RANGE.search(ctx.trace.names[i])
    ]
    spans = np.flatnonzero(np.isin(host.name, np.asarray(ids or [-1], dtype=np.int32)))
    spans = spans[ctx.step_of(host.ts[spans]) >= 0]
    return sorted({ctx.op_name(i) for i in spans.tolist()})


def _running(ctx: TraceContext, ranges: list[str]) -> str | None:
    """The key of the optimizer the trace steps with (None when the ranges name none or several),
    so the fix proposes another one. torch AdamW's implementation is read off the ops it ran."""
    classes = {m.group(1) for r in ranges if (m := _STEP_CLASS.match(r))}
    if len(classes) != 1 or len(ranges) != 1:
        return None
    host = ctx.trace.host
    spans = _spans(ctx, ranges[0])
    inside = np.zeros(len(host), dtype=bool)
    for i in spans.tolist():
        inside |= (host.ts >= host.ts[i]) & (host.ts < host.ts[i] + host.dur[i])
    op_names = {ctx.trace.names[k] for k in np.unique(host.name[inside]).tolist()}
    return catalog.key_of_step_range(classes.pop(), sorted(op_names))


def _spans(ctx: TraceContext, name: str) -> npt.NDArray[np.intp]:
    host = ctx.trace.host
    ids = [i for i, n in enumerate(ctx.trace.names) if n == name]
    spans = np.flatnonzero(np.isin(host.name, np.asarray(ids or [-1], dtype=np.int32)))
    return spans[ctx.step_of(host.ts[spans]) >= 0]
