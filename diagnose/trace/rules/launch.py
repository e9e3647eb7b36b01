"""Compute: the device idles because the host cannot feed it fast enough.

Device idle time inside the steps that is neither waiting for data nor blocked in a sync is time
the device waited for the host. Its gaps tell two phenomena apart:

* many short gaps (under :data:`LONG_GAP_US`) between short kernels: launch overhead, the host
  cannot issue kernels as fast as the device runs them (small batch, many tiny ops, Python
  dispatch cost);
* a few long gaps: host stalls, the host ran something else (Python preprocessing, logging,
  checkpointing, compilation) while nothing was queued.

With module ranges in the trace, the gap time is split by the component whose forward the host
was inside (:mod:`diagnose.trace.components`): launch overhead in a frozen text encoder's forward
goes away by caching its outputs, not by making the denoiser's kernels bigger.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diagnose.catalogs.compute_catalog import (
    LAUNCH_BOUND,
    LONG_GAP_US,
    PROFILER_US_PER_LAUNCH,
    RAISE_SHARE,
    launch_bound_finding,
    launch_wait_undecided,
)
from diagnose.record import Finding, ProbeResult
from diagnose.stats import at_line
from diagnose.trace import components
from diagnose.trace.columns import KERNEL
from diagnose.trace.context import SAVING_ON_UNPROFILED_STEPS, TraceContext
from diagnose.trace.intervals import EMPTY, Intervals, subtract, union_of
from diagnose.trace.modules import ModuleShare
from diagnose.trace.sync_reading import syncs_of
from diagnose.units import pct

RULE = "launch"
FINDING_ID = LAUNCH_BOUND.id


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    if not ctx.has_device:
        result.add_not_judged(FINDING_ID, "launch overhead: no device activity in the trace")
        return result
    n = ctx.n_steps
    host_gaps = _host_bound_gaps(ctx)
    syncs = syncs_of(ctx)
    # Idle the device owes to something named elsewhere: the next batch, a sync (the call and the
    # drained queue after it), the allocator, a collective.
    explained = union_of(
        [
            ctx.phases.host.get(phase, EMPTY)
            for phase in ("data_wait", "sync", "allocator", "collective")
        ]
        + [syncs.windows]
    )
    waiting_all = subtract(host_gaps, explained) if len(explained) else host_gaps
    # On the unprofiled basis each gap ends with one launch, which the profiler slowed.
    overhead = ctx.profiler_us_per_launch()
    # Trace-only the profiler's part of each gap is not measured: the saving is what is left with
    # the part a profiled launch is expected to carry taken out, the whole gaps its upper end.
    expected = 0.0 if ctx.unprofiled_step_seconds is not None else PROFILER_US_PER_LAUNCH
    gaps: list[float] = []
    in_steps_gaps: list[Intervals] = []
    largest_at = 0.0
    for window in ctx.steps.steps:
        waiting = waiting_all.clip(window.start_us, window.end_us)
        in_steps_gaps.append(waiting)
        lengths = np.maximum(waiting.ends - waiting.starts - overhead, 0.0).tolist()
        if lengths and max(lengths) > max(gaps, default=0.0):
            k = int(np.argmax(waiting.ends - waiting.starts))
            largest_at = float(waiting.starts[k] + waiting.ends[k]) / 2
        gaps.extend(lengths)
    gap_array = np.asarray(gaps, dtype=np.float64)
    gap_array = gap_array[gap_array > 0]
    total = float(gap_array.sum()) / 1e6
    step = ctx.step_seconds or 1.0
    # Only the syncs' idle part is idle the device owes them: while the host blocks on a busy
    # device, that time is already the device's busy time.
    sync_idle = subtract(syncs.windows, ctx.busy).total / 1e6 / n if len(syncs.windows) else 0.0
    ceiling = _ceiling(ctx, sync_idle)
    wait = min(total / n, ceiling)
    share = wait / step
    # Without the profiler's expected part of every launch, the step itself would be shorter by
    # as much (the host is what the device waits for), and so would the idle a fix can recover.
    launches = ctx.launch_times().size / n
    net_ceiling = max(ceiling - launches * expected / 1e6, 0.0)
    net_wait = min(float(np.maximum(gap_array - expected, 0.0).sum()) / 1e6 / n, net_ceiling)
    net_share = net_wait / step
    short = gap_array[gap_array < LONG_GAP_US]
    long = gap_array[gap_array >= LONG_GAP_US]

    by_phase: dict[str, float] = {}
    for b in ctx.per_step:
        for phase, seconds in b.device_idle.items():
            if phase not in ("data_wait", "sync"):
                by_phase[phase] = by_phase.get(phase, 0.0) + seconds / n
    device = ctx.trace.device
    in_steps = (ctx.step_of(device.ts) >= 0) & (device.device == ctx.device.primary_device)
    kernels = np.flatnonzero(in_steps & (device.kind == KERNEL))
    durations = device.dur[kernels]
    busy = sum(s.device_busy_seconds for s in ctx.steps.steps) / n
    evidence: dict[str, Any] = {
        "device_waiting_for_host_seconds_per_step": wait,
        "share_of_step": share,
        "device_busy_share": busy / step,
        "short_gaps_per_step": short.size / n,
        "short_gap_seconds_per_step": float(short.sum()) / 1e6 / n,
        "median_short_gap_us": float(np.median(short)) if short.size else None,
        "long_gaps_per_step": long.size / n,
        "long_gap_seconds_per_step": float(long.sum()) / 1e6 / n,
        "largest_gap_ms": float(gap_array.max()) / 1e3 if gap_array.size else None,
        "largest_gap_host_activity": _host_activity_at(ctx, largest_at) if gap_array.size else "",
        "idle_while_host_in": {p: v for p, v in sorted(by_phase.items()) if v > 0},
        "kernels_per_step": kernels.size / n,
        "median_kernel_us": float(np.median(durations)) if durations.size else None,
        "whole_trace_window": ctx.steps.whole_trace,
        "launches_per_step": launches,
        "profiler_us_per_launch_taken_out": overhead,
        "expected_profiler_us_per_launch": expected,
        "wait_less_expected_profiler_seconds_per_step": net_wait,
        "ceiling_seconds_per_step": ceiling,
        "step_seconds": step,
        "step_basis": "unprofiled" if ctx.unprofiled_step_seconds is not None else "profiled",
    }
    if ctx.unprofiled_step_seconds is not None:
        evidence[SAVING_ON_UNPROFILED_STEPS] = True
    result.data = evidence
    basis = "unprofiled step" if ctx.unprofiled_step_seconds is not None else "profiled step"
    raised = at_line(net_share, RAISE_SHARE, interval=(net_share, share))
    if raised.below:
        result.add_ok(
            FINDING_ID,
            f"host overhead: the device is busy {pct(busy / step)} of the {basis} and waits for "
            f"the host (not for data or syncs) {pct(share)} of it",
        )
        return result
    if raised.borderline:
        result.add_not_judged(
            FINDING_ID,
            launch_wait_undecided(share, net_share, launches, short.size / n, expected),
        )
        return result
    shares = components.time_shares(ctx, union_of(in_steps_gaps))
    finding = launch_bound_finding(
        share=share,
        wait_seconds=wait,
        wait_less_profiler_seconds=net_wait if expected else None,
        launch_bound=float(short.sum()) >= float(long.sum()),
        short_gaps=short.size / n,
        short_seconds=float(short.sum()) / 1e6 / n,
        long_gaps=long.size / n,
        long_seconds=float(long.sum()) / 1e6 / n,
        kernels_per_step=kernels.size / n,
        median_short_gap_us=evidence["median_short_gap_us"],
        median_kernel_us=evidence["median_kernel_us"],
        largest_gap_ms=evidence["largest_gap_ms"],
        largest_gap_activity=evidence["largest_gap_host_activity"],
        steps=len(ctx.steps.steps),
        whole_trace=ctx.steps.whole_trace,
        launches_per_step=evidence["launches_per_step"],
        profiler_us_per_launch=overhead,
        unprofiled_known=ctx.unprofiled_step_seconds is not None,
        capped=total / n > ceiling,
        evidence={**evidence, **components.evidence(ctx, shares)},
        source=f"trace:{RULE}",
    )
    result.add_finding(_with_components(ctx, finding, shares))
    return result


def _ceiling(ctx: TraceContext, sync_idle: float) -> float:
    """The most a fix of the host's pace can save per step: the step (unprofiled when known)
    less the device's busy time and the idle time other causes explain (data wait, the idle the
    syncs open, the allocator, collectives)."""
    n = ctx.n_steps
    busy = sum(s.device_busy_seconds for s in ctx.steps.steps) / n
    attributed = sum(
        b.device_idle.get(phase, 0.0)
        for b in ctx.per_step
        for phase in ("data_wait", "allocator", "communication")
    )
    return max(ctx.step_seconds - busy - attributed / n - sync_idle, 0.0)


def _with_components(ctx: TraceContext, finding: Finding, shares: list[ModuleShare]) -> Finding:
    """The finding with the components the host was inside while the device waited: all of them
    in the detail; in the title the one that holds most of the wait; and when that one is a
    frozen encoder, caching its output first in the fix (its forward need not run per step)."""
    if not components.named(shares):
        return finding
    finding.detail += (
        f" Where the host was while the device waited: {components.breakdown(shares)}."
    )
    top = shares[0]
    if not top.role or components.top_share(shares) < 0.5:
        # No component holds most of the wait: naming one in the title would mislead.
        return finding
    finding.title += f"; {pct(components.top_share(shares))} of it inside {top.label}"
    advice = components.cache_advice(top.role) if components.frozen_encoders(ctx) else ""
    if advice:
        finding.fix = (
            f"Most of the wait is in {top.label}: when it is not trained, {advice}. " + finding.fix
        )
    return finding


def _host_bound_gaps(ctx: TraceContext) -> Intervals:
    """Device idle gaps that end with work the host launched only after the device went idle.

    A gap whose next kernel was already queued (its launch call returned before the gap began)
    is the device's own latency between kernels or a wait on another stream, not the host.
    """
    device, structure = ctx.trace.device, ctx.structure
    busy = ctx.busy
    if not len(busy):
        return EMPTY
    on_device = np.flatnonzero(device.device == ctx.device.primary_device)
    runtime = ctx.trace.runtime
    launch_end = np.full(len(device), np.nan)
    rt = structure.device_runtime
    has_rt = rt >= 0
    launch_end[has_rt] = runtime.ts[rt[has_rt]] + runtime.dur[rt[has_rt]]
    by_op = ~has_rt & ~np.isnan(structure.launch_ts)
    launch_end[by_op] = structure.launch_ts[by_op]
    starts = device.ts[on_device]
    first_step = ctx.steps.steps[0].start_us if ctx.steps.steps else float(busy.starts[0])
    gap_starts = np.concatenate([[min(first_step, float(busy.starts[0]))], busy.ends[:-1]])
    gap_ends = busy.starts
    nxt = np.searchsorted(starts, gap_ends, side="left")
    nxt = np.minimum(nxt, starts.size - 1)
    next_launch = launch_end[on_device[nxt]]
    host_bound = (gap_ends > gap_starts) & ~np.isnan(next_launch) & (next_launch > gap_starts)
    starts_out, ends_out = gap_starts[host_bound], gap_ends[host_bound]
    # After the last activity nothing else was queued before the trace ends: the device waits for
    # whatever the host does next.
    last_end = ctx.steps.steps[-1].end_us if ctx.steps.steps else float(busy.ends[-1])
    if last_end > float(busy.ends[-1]):
        starts_out = np.append(starts_out, float(busy.ends[-1]))
        ends_out = np.append(ends_out, last_end)
    return Intervals(starts_out, ends_out)


def _host_activity_at(ctx: TraceContext, ts: float) -> str:
    """The outermost op the main thread was running at ``ts`` (or an empty string)."""
    host = ctx.trace.host
    main = ctx.structure.main_thread
    candidates = np.flatnonzero(
        (host.thread == main)
        & ~ctx.structure.is_annotation
        & (host.ts <= ts)
        & (host.ts + host.dur > ts)
    )
    if not candidates.size:
        return ""
    outer = candidates[np.argmin(ctx.structure.depth[candidates])]
    return ctx.op_name(int(outer))
