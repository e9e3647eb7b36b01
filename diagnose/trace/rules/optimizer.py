"""Optimizer: host-device synchronisations inside ``optimizer.step()``.

An optimizer that reads a device value on the host (``.item()``, ``float(t)``, a tensor in an
``if``; D-Adaptation/Prodigy-style step sizes, some 8-bit and schedule-free optimizers) stops the
host until the device has drained its queue, then the device idles while the host launches the
next kernels. The cost read off the trace is that idle time after each sync.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import numpy.typing as npt

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.record import ProbeResult
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import EMPTY, FloatArray, Intervals
from diagnose.trace.rules import ms, pct
from diagnose.trace.steps import OPTIMIZER_STEP_RANGE

RULE = "optimizer"
FINDING_ID = catalog.SYNC_IN_STEP.id
#: torch's span around Optimizer.step names the class: "Optimizer.step#AdamW8bit.step".
_STEP_CLASS = re.compile(r"^Optimizer\.step#(\w+)\.step$")


def idle_after(busy: Intervals, points: FloatArray, limit: FloatArray) -> FloatArray:
    """Device idle time from each point until the next device activity (capped at ``limit``)."""
    if not points.size:
        return np.zeros(0)
    if not len(busy):
        return np.asarray(np.maximum(limit - points, 0.0), dtype=np.float64)
    running = busy.contains(points)
    nxt = np.searchsorted(busy.starts, points, side="left")
    next_start = np.where(
        nxt < busy.starts.size, busy.starts[np.minimum(nxt, busy.starts.size - 1)], limit
    )
    gap = np.minimum(next_start, limit) - points
    return np.asarray(np.where(running, 0.0, np.maximum(gap, 0.0)), dtype=np.float64)


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    trace = ctx.trace
    host = trace.host
    ids = (
        [i for i in np.unique(host.name).tolist() if OPTIMIZER_STEP_RANGE.search(trace.names[i])]
        if (len(host))
        else []
    )
    if not ids:
        result.add_not_judged(
            FINDING_ID, "optimizer: no Optimizer.step ranges in the profiled steps"
        )
        return result
    if not ctx.has_device:
        result.add_not_judged(
            FINDING_ID, "optimizer: a CPU trace has no host-device synchronisation to look for"
        )
        return result
    mask = np.isin(host.name, np.asarray(ids, dtype=np.int32)) & (ctx.step_of(host.ts) >= 0)
    spans = np.flatnonzero(mask)
    if not spans.size:
        result.add_not_judged(
            FINDING_ID, "optimizer: no Optimizer.step ranges in the profiled steps"
        )
        return result
    optimizers = sorted({ctx.op_name(i) for i in spans.tolist()})
    syncs = ctx.phases.syncs
    starts, ends = host.ts[spans], host.ts[spans] + host.dur[spans]
    inside = np.zeros(syncs.ts.size, dtype=bool)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        inside |= (syncs.ts >= s) & (syncs.ts < e)
    # A closure run by the step (forward, backward, a logged loss.item()) is not the update.
    inside &= ctx.phases.host.get("optimizer", EMPTY).contains(syncs.ts)
    count = int(inside.sum())
    n = ctx.n_steps
    if not count:
        result.add_ok(
            FINDING_ID,
            f"optimizer: no host-device syncs inside {', '.join(optimizers)} "
            f"({spans.size} optimizer steps)",
        )
        return result

    sync_end = syncs.ts[inside] + syncs.dur[inside]
    step_index = ctx.step_of(syncs.ts[inside])
    step_end = np.array(
        [
            ctx.steps.steps[i].end_us if i >= 0 else e
            for i, e in zip(step_index.tolist(), sync_end.tolist(), strict=True)
        ]
    )
    bubble = idle_after(ctx.busy, sync_end, step_end)
    blocked = float(syncs.dur[inside].sum()) / 1e6 / n
    idle = float(bubble.sum()) / 1e6 / n
    step = ctx.wall_seconds / n if ctx.wall_seconds else 0.0
    names = Counter(syncs.names[i] for i in np.flatnonzero(inside).tolist())
    running = _running(ctx, spans, optimizers)
    result.add_finding(
        catalog.sync_in_step(
            optimizers=[catalog.label(running)] if running else optimizers,
            running=running,
            waits_per_step=count / n,
            idle_seconds=idle,
            evidence={
                "syncs_per_step": count / n,
                "sync_calls_in_profiled_steps": dict(names.most_common()),
                "optimizer_ranges": optimizers,
                "host_blocked_seconds_per_step": blocked,
                "device_idle_after_syncs_seconds_per_step": idle,
                "share_of_step": idle / step if step else None,
            },
            saving=idle,
            basis="trace",
            detail=(
                f"Inside the optimizer step the host blocked {count / n:.0f} time(s) per step "
                f"({ms(blocked)} blocked) on {', '.join(names)}; after each the device was idle "
                f"until the host launched more work, {ms(idle)} per step "
                f"({pct(idle / step) if step else 'n/a'} of the step)."
            ),
            source=f"trace:{RULE}",
        )
    )
    return result


def _running(ctx: TraceContext, spans: npt.NDArray[np.intp], ranges: list[str]) -> str | None:
    """The key of the optimizer the trace steps with (None when the ranges name none or several),
    so the fix proposes another one. torch AdamW's implementation is read off the ops it ran."""
    classes = {m.group(1) for r in ranges if (m := _STEP_CLASS.match(r))}
    if len(classes) != 1 or len(ranges) != 1:
        return None
    host = ctx.trace.host
    inside = np.zeros(len(host), dtype=bool)
    for i in spans.tolist():
        inside |= (host.ts >= host.ts[i]) & (host.ts < host.ts[i] + host.dur[i])
    op_names = {ctx.trace.names[k] for k in np.unique(host.name[inside]).tolist()}
    return catalog.key_of_step_range(classes.pop(), sorted(op_names))
