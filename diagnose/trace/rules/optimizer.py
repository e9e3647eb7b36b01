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

from diagnose.record import Finding, ProbeResult, Severity
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import FloatArray, Intervals
from diagnose.trace.rules import ms, pct

RULE = "optimizer"
FINDING_ID = "optimizer.sync_in_step"
_STEP_RANGE = re.compile(r"^Optimizer\.step#|optimizer_step", re.I)
#: Below this share of step time lost to idle after the syncs, the finding is only "info".
WARN_SHARE = 0.01


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
        [i for i in np.unique(host.name).tolist() if _STEP_RANGE.search(trace.names[i])]
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
    severity: Severity = "warn" if step and idle >= WARN_SHARE * step else "info"
    result.findings.append(
        Finding(
            id=FINDING_ID,
            category="optimizer",
            severity=severity,
            title=(
                f"The optimizer step waits for the GPU {count / n:.0f} time(s) per step "
                f"({', '.join(optimizers)}; {ms(idle)}/step of GPU idle after the waits)"
            ),
            evidence={
                "syncs_per_step": count / n,
                "sync_calls_in_profiled_steps": dict(names.most_common()),
                "optimizer_ranges": optimizers,
                "host_blocked_seconds_per_step": blocked,
                "device_idle_after_syncs_seconds_per_step": idle,
                "share_of_step": idle / step if step else None,
            },
            est_seconds_saved_per_it=idle,
            saving_basis="trace",
            fix=(
                "Use an optimizer that keeps its state on the device and never reads it back "
                "each step: torch.optim.AdamW(fused=True) or foreach=True, bitsandbytes AdamW8bit "
                "(a recent release); for adaptive-step optimizers (Prodigy, D-Adaptation) avoid "
                "per-parameter .item() (Prodigy: keep d on device / use the fused variant); "
                "drop gradient-norm logging (.item()) inside the step."
            ),
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
