"""`diagnose run --nproc N`: the ranks' measurements made into one record and one report.

The ranks run in their own processes (:mod:`diagnose.distributed.launch`); this module reads
their traces together (:mod:`diagnose.distributed.ranks`), picks the rank the job runs at the
pace of, runs the probes in this process on a single-process workload, and writes the outputs
the way a single-process run does (:func:`diagnose.finish.finish_run`).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diagnose.catalogs.distributed_catalog import steps_to_name_a_straggler
from diagnose.config import RunConfig
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.finish import Progress, RunOutputs, finish_run, redact_own_trace
from diagnose.inventory import collect_inventory
from diagnose.output import note_created
from diagnose.probes.base import Probe, run_workload_probes
from diagnose.record import DeviceInfo, ProbeResult, RankStat, RunRecord, new_record

if TYPE_CHECKING:
    from diagnose.distributed.launch import RankResult
    from diagnose.distributed.ranks import RankComparison

#: The folder of a --nproc run's rank traces (rank0.json.gz, ...), inside --out.
RANKS_DIR = "ranks"


def _check_gpu_count(config: RunConfig, device: torch.device) -> None:
    """One process per GPU: --nproc cannot exceed the GPUs torch sees."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count()
    if config.nproc > count:
        raise DiagnoseError(
            f"--nproc {config.nproc} needs {config.nproc} GPUs (one per rank), but torch sees "
            f"{count}; use --nproc {count} or fewer",
            ExitCode.UNSUPPORTED,
        )


def _compare_rank_traces(
    results: Sequence[RankResult], record: RunRecord, say: Progress
) -> RankComparison | None:
    """Read and compare the ranks' traces; the "trace" result goes into ``record.probes``."""
    import time

    from diagnose.distributed.ranks import compare_ranks, read_ranks

    traces = [r.trace_path for r in results if r.trace_path is not None]
    if not traces:
        return None
    say("analysing the ranks' traces")
    start = time.perf_counter()
    try:
        ranks, notes = read_ranks(traces)
        comparison = compare_ranks(ranks)
        result = _ranks_trace_result(comparison, record, start)
    except Exception as exc:
        record.probes.append(
            ProbeResult(
                name="trace",
                status="error",
                reason=f"trace analysis failed: {type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                duration_seconds=time.perf_counter() - start,
            )
        )
        return None
    record.probes.append(result)
    record.notes.extend(notes + comparison.notes)
    return comparison


def _has_straggler(comparison: RankComparison) -> bool:
    from diagnose.catalogs import distributed_catalog as catalog

    ids = {catalog.STRAGGLER_ID, catalog.DATA_WAIT_IMBALANCE_ID}
    return any(f.id in ids for f in comparison.findings)


def _pacing_result(results: Sequence[RankResult], comparison: RankComparison | None) -> RankResult:
    """The rank the job runs at the pace of: the straggler the traces found, else the rank whose
    timed steps have the largest median."""
    if comparison is not None and _has_straggler(comparison):
        found = [r for r in results if r.rank == comparison.pacing_rank]
        if found:
            return found[0]
    return max(results, key=lambda r: r.record.timing.headline.median)


def _rank_stats(
    results: Sequence[RankResult], comparison: RankComparison | None, pacing_rank: int
) -> list[RankStat]:
    """One RankStat per rank: the trace comparison's (collectives, wait) where there is one,
    with the rank's unprofiled timed steps as its steps (the timing samples, not the few traced
    steps, are the rank's s/it)."""
    by_rank = {s.rank: s for s in comparison.stats} if comparison is not None else {}
    world = len(results)
    stats: list[RankStat] = []
    for result in results:
        timing = result.record.timing
        stat = by_rank.get(result.rank) or RankStat(
            rank=result.rank,
            world_size=world,
            phases=dict(result.record.breakdown.seconds),
        )
        stat.step_seconds = [s.seconds for s in timing.samples if not s.profiled]
        stat.world_size = stat.world_size or world
        stat.paces = result.rank == pacing_rank
        stats.append(stat)
    return stats


def _ranks_trace_result(comparison: RankComparison, record: RunRecord, start: float) -> ProbeResult:
    """The record's "trace" result from the ranks' traces: every rank's trace rules merged by
    id, the cross-rank findings and checks; top operators and kernel classes of the pacing
    rank."""
    import time

    from diagnose.distributed.ranks import comparison_record

    traced = comparison_record(comparison)
    record.top_ops = traced.top_ops
    record.breakdown.take_device_time(traced.breakdown)
    result = next((p for p in traced.probes if p.name == "trace"), None)
    if result is None:
        result = ProbeResult(name="trace")
    result.findings = traced.findings
    result.duration_seconds = time.perf_counter() - start
    return result


def execute_distributed(
    config: RunConfig,
    out_dir: Path,
    *,
    device: torch.device,
    device_info: DeviceInfo,
    redact_paths: bool,
    probes: Sequence[Probe],
    say: Progress,
) -> RunOutputs:
    """--nproc N: N ranks measure the wrapped workload; one record for the run.

    The record's timing and phases are those of the rank the job runs at the pace of (the
    straggler the traces found, else the slowest by median s/it); its ``ranks`` hold every
    rank's steps, phases and collectives. The trace rules read every rank's trace
    (:mod:`diagnose.distributed.ranks`); the probes run afterwards in this process on a
    single-process workload, as in a run without --nproc.
    """
    from diagnose.distributed.launch import RankJob
    from diagnose.workload import build_workload

    _check_gpu_count(config, device)
    # Enough profiled steps that the waits between ranks have a jitter to be held against.
    needed = steps_to_name_a_straggler(config.nproc)
    if 0 < config.profiled_steps < needed:
        say(
            f"profiling {needed} steps per rank (--profiled-steps {config.profiled_steps}): fewer "
            "cannot tell a straggler from a busy machine"
        )
        config = dataclasses.replace(config, profiled_steps=needed)
    trace_dir = out_dir / RANKS_DIR
    scratch = Path(tempfile.mkdtemp(prefix="diagnose-scratch-"))
    try:
        say(f"starting {config.nproc} ranks ({config.strategy})")
        try:
            with RankJob(
                config, device_kind=device.type, trace_dir=trace_dir, scratch_dir=scratch
            ) as job:
                job.start()
                # The ranks build their models meanwhile.
                say("collecting the inventory")
                record = new_record("run")
                record.device = device_info
                record.inventory = collect_inventory(device_info.kind, redact_paths=redact_paths)
                results = job.wait(say)
        finally:
            # The ranks' processes wrote their traces (an earlier run's were removed at the
            # start): this run's files, for a clean-up to take if it does not finish.
            for path in sorted(trace_dir.glob("rank*.json.gz")):
                note_created(path)
        record.command = config.command_line()
        comparison = _compare_rank_traces(results, record, say)
        pacing = _pacing_result(results, comparison)
        record.timing = pacing.record.timing
        record.breakdown = pacing.record.breakdown
        record.model = pacing.record.model
        record.config = dict(pacing.record.config)
        backend = "gloo" if device.type == "cpu" else "NCCL/RCCL"
        how = "; ".join(pacing.record.notes) or config.strategy
        why = (
            "the rank the others wait for"
            if comparison is not None and _has_straggler(comparison)
            else "the rank with the largest median s/it"
        )
        record.notes.insert(
            0,
            f"{config.nproc} ranks ({backend}, one process each), denoiser wrapped with {how}. "
            f"Timing and phases are rank {pacing.rank}'s, {why} (the job runs at its pace); "
            "every rank's steps are in the ranks table.",
        )
        traces = [r.trace_path for r in results if r.trace_path is not None]
        if traces:
            record.trace_path = RANKS_DIR
        record.ranks = _rank_stats(results, comparison, pacing.rank)
        if record.timing.unprofiled.n < 5:
            record.notes.append(
                f"only {record.timing.unprofiled.n} timed steps: the spread is a rough guide; "
                "use --steps 10 or more for a firmer number"
            )

        active = [p for p in probes if p.name not in config.skip_probes]
        workload = None
        if active:
            record.notes.append(
                "The probes ran in one process, without DDP/FSDP, after the ranks' measurement."
            )
            say("building the model for the probes")
            torch.manual_seed(config.seed)
            workload = build_workload(config, device)
        try:
            record.probes.extend(
                run_workload_probes(
                    probes,
                    config=config,
                    device=device,
                    device_info=device_info,
                    record=record,
                    workload=workload,
                    scratch_dir=scratch,
                    say=say,
                )
            )
        finally:
            if workload is not None:
                workload.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    saved: Path | None = None
    if traces:
        saved = trace_dir
        if redact_paths:
            for path in traces:
                if redact_own_trace(path, record) is None:
                    saved = None
            if saved is None:
                record.trace_path = ""
    return finish_run(record, out_dir, saved, redact_paths=redact_paths, say=say)
