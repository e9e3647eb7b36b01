"""Data loading: how much of each step the loop spends waiting for its next batch.

Reads the ``enumerate(DataLoader)#...__next__`` ranges torch.profiler records around every
``next()`` on a DataLoader iterator. The share it judges is the one the report's phase bar shows
for this trace (its ``data_wait`` phase over the median step, :func:`bar_wait`): on a GPU trace
that phase is the device time the wait left idle (a prefetched batch costs nothing even if
``next()`` is slow to return); on a CPU trace the compute device is the host itself, so the whole
wait counts. The ``dataloader`` probe answers the same question the same way on the run's timed
steps; ids, thresholds and wording live in :mod:`diagnose.catalogs.dataloader_catalog`.

Loading is not charged to a model component: it runs no module. But a Dataset or collate_fn that
calls the text encoder or the VAE puts their forward inside ``next()`` (with ``num_workers=0``;
in workers it is not in the trace at all). When those forwards fill most of the wait it is
encoding on the fly, not loading: the fix is caching the encoders' outputs, and more workers
would not help a GPU encoder (CUDA does not run in forked workers).
"""

from __future__ import annotations

import statistics

from diagnose.catalogs.dataloader_catalog import (
    DEFAULT_WORKERS,
    GPU_STARVED,
    bar_wait,
    device_word,
    gpu_starved,
    loader_fix,
    not_waiting_line,
    usual_fix,
    wait_at_line,
)
from diagnose.record import Finding, ProbeResult, RunRecord, StepSample, Timing
from diagnose.trace import components
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import Intervals, complement, intersect, union_of
from diagnose.trace.modules import ModuleShare
from diagnose.units import ms, pct

RULE = "dataloader"
#: The check (and finding) id, kept importable here for the modules that name it.
FINDING_ID = GPU_STARVED.id


def trace_as_record(ctx: TraceContext) -> RunRecord:
    """The part of the record this trace becomes that the phase bar is drawn from: its steps (the
    headline) and its breakdown."""
    record = RunRecord(mode="trace", breakdown=ctx.breakdown)
    record.timing = Timing(
        samples=[
            StepSample(index=s.number, seconds=s.wall_seconds, profiled=True)
            for s in ctx.steps.steps
        ]
    )
    record.timing.summarize()
    return record


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    waits = ctx.phases.host.get("data_wait")
    if waits is None or not len(waits):
        result.add_not_judged(
            FINDING_ID,
            "data loading: no DataLoader iteration ranges in the profiled steps (the loop does "
            "not iterate a torch DataLoader there, or the batch was fetched outside them)",
        )
        return result
    wait = bar_wait(trace_as_record(ctx))
    if wait is None:
        result.add_not_judged(FINDING_ID, "data loading: the trace has no step to measure")
        return result

    per_step: list[dict[str, float]] = []
    idle_shares: list[float] = []
    in_next_all: list[Intervals] = []
    for step, phases in zip(ctx.steps.steps, ctx.per_step, strict=True):
        s, e = step.start_us, step.end_us
        in_next = waits.clip(s, e)
        in_next_all.append(in_next)
        idle = intersect(in_next, complement(ctx.busy.clip(s, e), s, e))
        per_step.append(
            {
                "step": step.number,
                "wall_ms": round(step.wall_seconds * 1e3, 3),
                "in_next_ms": round(in_next.total / 1e3, 3),
                "data_wait_phase_ms": round(phases.seconds.get("data_wait", 0.0) * 1e3, 3),
                "device_idle_while_waiting_ms": round(idle.total / 1e3, 3),
            }
        )
        if step.wall_seconds > 0:
            idle_shares.append(idle.total / 1e6 / step.wall_seconds)
    in_next_seconds = statistics.median(r["in_next_ms"] for r in per_step) / 1e3
    idle_share = statistics.median(idle_shares) if ctx.has_device and idle_shares else None
    iterators = ctx.phases.dataloader_names
    single_process = any("_SingleProcessDataLoaderIter" in n for n in iterators)
    result.data = {
        "data_wait_share": wait.share,
        "data_wait_seconds_per_step": wait.seconds,
        "device_idle_while_waiting_share": idle_share,
        "per_step": per_step,
        "iterators": iterators,
    }
    reading = wait_at_line(
        wait,
        [
            phases.seconds.get("data_wait", 0.0) / step.wall_seconds
            for step, phases in zip(ctx.steps.steps, ctx.per_step, strict=True)
            if step.wall_seconds > 0
        ],
    )
    if reading.below:
        result.add_ok(FINDING_ID, not_waiting_line(wait, ctx.has_device, idle_share))
        return result

    workers_hint = (
        "The iterator is _SingleProcessDataLoaderIter: the DataLoader runs with num_workers=0, so "
        "every batch is loaded and decoded on the training thread. "
        if single_process
        else ""
    )
    word = device_word(ctx.has_device)
    shares = components.time_shares(ctx, union_of(in_next_all))
    finding = gpu_starved(
        wait,
        ctx.has_device,
        # A trace holds only profiled steps: said, so the share is not read as the timed
        # steps' phase bar when `diagnose run` shows both.
        steps="each profiled step",
        # A trace does not say how many cores or which trainer: the usual advice, both halves.
        fix=usual_fix(DEFAULT_WORKERS, pin_memory=ctx.has_device),
        detail=(
            f"{workers_hint}The profiled steps spent a median {ms(in_next_seconds)} per step "
            f"inside next(dataloader); the {word} had no work for {ms(wait.seconds)} of it "
            "(the data-wait phase of the breakdown). With the batch prepared ahead of time "
            "that wait disappears (the saving is that time, read off the trace). `diagnose "
            "run` measures the fixes on your data with an A/B (the dataloader probe)."
        ),
        evidence={
            "in_next_seconds_per_step": in_next_seconds,
            "device_idle_while_waiting_share": idle_share,
            "steps": per_step,
            "dataloader_iterators": iterators,
            "num_workers_zero": single_process,
        },
        saving=wait.seconds,
        basis="trace",
        source=f"trace:{RULE}",
        reading=reading,
    )
    if _encoding_on_the_fly(shares):
        finding = _as_encoding(ctx, finding, shares)
    result.add_finding(finding)
    return result


def _encoding_on_the_fly(shares: list[ModuleShare]) -> bool:
    """Whether the text encoder and the VAE together hold most of the wait: it is then encoding,
    not loading."""
    total = sum(s.seconds for s in shares)
    encoding = sum(s.seconds for s in shares if s.role in components.ENCODERS)
    return bool(total) and encoding >= total / 2


def _as_encoding(ctx: TraceContext, finding: Finding, shares: list[ModuleShare]) -> Finding:
    """The data-wait finding said as encoding on the fly: which encoder, its share of the wait,
    and caching (or encoding the batch in the step) as the fix instead of more workers."""
    encoders = [s for s in shares if s.role in components.ENCODERS]
    share = sum(s.seconds for s in encoders) / sum(s.seconds for s in shares)
    where = components.where(encoders)
    finding.title += f": {pct(share)} of it is {where} encoding on the fly"
    finding.detail = (
        f"Inside next(dataloader) the host spent the wait in {components.breakdown(shares)}: "
        "the Dataset or collate_fn encodes each sample as it is loaded, so the wait is "
        "encoding, not reading files. " + finding.detail
    )
    finding.fix = loader_fix(
        [components.cache_advice(s.role) for s in encoders]
        + ["encode in the training step instead, the whole batch at once"]
    )
    finding.evidence.update(components.evidence(ctx, shares))
    return finding


__all__ = ["FINDING_ID", "RULE", "check", "trace_as_record"]
