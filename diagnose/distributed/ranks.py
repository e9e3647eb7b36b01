"""Several ranks' traces read together: per-rank timing, wait for each other, the straggler.

``diagnose trace DIR`` (or several files) lands here. Each trace is analysed by the single-trace
engine in its own worker process (one file at a time per process, so memory stays bounded by the
largest trace, and the ranks use the machine's cores); only the small analyses come back. The
ranks' steps are then aligned by step number and compared.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnose.catalogs import distributed_catalog as catalog
from diagnose.catalogs.dataloader_catalog import GPU_STARVED
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import PHASES, Check, Finding, RankStat, RunRecord
from diagnose.stats import at_line
from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from diagnose.trace.rules import import_rules

#: A rank number in a file name: ``rank3``, ``rank_3``, ``rank-3``, ``rank3_iter16.json``.
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_TRACE_SUFFIXES = (".json", ".json.gz")


#: The source of the cross-rank findings and checks.
SOURCE = "trace:ranks"


@dataclass
class RankTrace:
    """One rank's analysed trace."""

    rank: int
    path: Path
    analysis: TraceAnalysis
    #: Where the rank number came from: "distributedInfo", "file name" or "order".
    rank_from: str


@dataclass
class RankComparison:
    """What the ranks' traces say together."""

    ranks: list[RankTrace]
    stats: list[RankStat]
    #: The rank whose pace the job runs at (the straggler, else the slowest by median step).
    pacing_rank: int
    findings: list[Finding] = field(default_factory=list)
    #: The cross-rank questions asked and their answers (findings are added when settled).
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Per aligned step: {"step": n, "wait_ms": {rank: ms}, "comm_ms": {rank: ms}}.
    aligned: list[dict[str, Any]] = field(default_factory=list)


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """The trace files named: files as given, folders by their ``*.json``/``*.json.gz`` files."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES)
            )
            if not found:
                raise DiagnoseError(
                    f"{path}: no trace files (*.json, *.json.gz) in this folder", ExitCode.BAD_INPUT
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            # A FIFO or a device would block or never end: only regular files are read.
            raise DiagnoseError(f"{path}: not a regular file", ExitCode.BAD_INPUT)
        else:
            raise DiagnoseError(f"{path}: no such file or folder", ExitCode.BAD_INPUT)
    unique = list(dict.fromkeys(p.resolve() for p in files))
    return unique


def _analyze_one(path: Path, parallel: bool | None = None) -> TraceAnalysis | str:
    """Worker: analyse one trace; an unusable one comes back as its one-line error."""
    try:
        return analyze_trace(path, parallel=parallel)
    except DiagnoseError as exc:
        return exc.message
    except Exception as exc:  # one broken rank must not hide the others
        return f"{path.name}: {type(exc).__name__}: {exc}"


def analyze_files(paths: Sequence[Path], *, jobs: int | None = None) -> list[tuple[Path, Any]]:
    """Analyse each file, in parallel worker processes when there are several."""
    if len(paths) == 1:
        return [(paths[0], _analyze_one(paths[0]))]
    workers = max(1, min(len(paths), jobs or os.cpu_count() or 1))
    import_rules()
    # fork where it exists: the workers need only numpy and orjson, already imported here.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        # The files share the cores already: each is read by its worker alone.
        results = list(pool.map(_analyze_one, paths, [False] * len(paths)))
    return list(zip(paths, results, strict=True))


def read_ranks(
    paths: Sequence[Path], *, jobs: int | None = None
) -> tuple[list[RankTrace], list[str]]:
    """Analyse the traces and number their ranks. Raises DiagnoseError when none can be read or
    two files claim the same rank."""
    results = analyze_files(paths, jobs=jobs)
    errors = [
        f"{path.name}: {r}" if not r.startswith(path.name) else r
        for path, r in results
        if isinstance(r, str)
    ]
    good = [(path, r) for path, r in results if not isinstance(r, str)]
    if not good:
        raise DiagnoseError("no trace could be read: " + "; ".join(errors[:3]), ExitCode.BAD_INPUT)
    ranks: list[RankTrace] = []
    for position, (path, analysis) in enumerate(good):
        if analysis.rank is not None:
            rank, source = analysis.rank, "distributedInfo"
        elif match := _RANK_IN_NAME.search(path.name):
            rank, source = int(match.group(1)), "file name"
        else:
            rank, source = position, "order"
        ranks.append(RankTrace(rank=rank, path=path, analysis=analysis, rank_from=source))
    seen: dict[int, Path] = {}
    for r in ranks:
        if r.rank in seen:
            raise DiagnoseError(
                f"{seen[r.rank].name} and {r.path.name} are both rank {r.rank}: give one run's "
                "traces (one file per rank)",
                ExitCode.BAD_INPUT,
            )
        seen[r.rank] = r.path
    ranks.sort(key=lambda r: r.rank)
    notes = [f"{e} (left out)" for e in errors]
    return ranks, notes


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _aligned_steps(ranks: list[RankTrace]) -> tuple[list[list[int]], str]:
    """Indices into each rank's steps of the steps all ranks have: by step number, else by
    position when every rank has as many steps. Empty when they cannot be aligned."""
    numbers = [[s.number for s in r.analysis.steps] for r in ranks]
    common = set(numbers[0]).intersection(*numbers[1:])
    if common:
        order = sorted(common)
        return [[n.index(k) for k in order] for n in numbers], "by step number"
    counts = {len(n) for n in numbers}
    if len(counts) == 1 and counts != {0}:
        count = counts.pop()
        return [list(range(count)) for _ in numbers], "by position (the step numbers differ)"
    return [], "the ranks' steps cannot be aligned (different step numbers and counts)"


def compare_ranks(ranks: list[RankTrace]) -> RankComparison:
    """Per-rank statistics and the cross-rank findings."""
    world = max([len(ranks)] + [r.analysis.world_size or 0 for r in ranks])
    index, how = _aligned_steps(ranks) if len(ranks) > 1 else ([], "")
    comms = [r.analysis.communication for r in ranks]
    has_comm = all(c.found for c in comms)
    # Per aligned step: each rank's collective seconds, and its excess over the least of them.
    waits: list[list[float]] = [[] for _ in ranks]
    aligned: list[dict[str, Any]] = []
    if index and has_comm:
        for k in range(len(index[0])):
            comm_k = [comms[i].steps[index[i][k]].comm_seconds for i in range(len(ranks))]
            least = min(comm_k)
            for i, c in enumerate(comm_k):
                waits[i].append(c - least)
            aligned.append(
                {
                    "step": ranks[0].analysis.steps[index[0][k]].number,
                    "comm_ms": {
                        str(r.rank): round(c * 1e3, 3) for r, c in zip(ranks, comm_k, strict=True)
                    },
                    "wait_ms": {
                        str(r.rank): round((c - least) * 1e3, 3)
                        for r, c in zip(ranks, comm_k, strict=True)
                    },
                }
            )
    stats = [
        _rank_stat(r, world, _median(waits[i]) if waits[i] else 0.0) for i, r in enumerate(ranks)
    ]
    result = RankComparison(ranks=ranks, stats=stats, pacing_rank=ranks[0].rank, aligned=aligned)
    if len(ranks) == 1:
        result.checks.append(
            _unjudged(
                "ranks: one trace only; give every rank's trace (diagnose trace DIR) to find a "
                "straggler and the wait between ranks"
            )
        )
        return result
    if how:
        result.notes.append(f"{len(ranks)} ranks read; steps aligned {how}.")
    if world > len(ranks):
        result.notes.append(
            f"The traces are {len(ranks)} of {world} ranks: a straggler among the missing ranks "
            "shows only as a wait here."
        )
    if not index:
        result.checks.append(_unjudged(f"ranks: {how}; each rank is reported on its own"))
        result.pacing_rank = max(stats, key=lambda s: s.median_seconds).rank
        return result
    if not has_comm:
        result.checks.append(
            _unjudged(
                "ranks: no collectives (NCCL/RCCL kernels or gloo ranges) in "
                + ("every trace" if not any(c.found for c in comms) else "some of the traces")
                + ": the wait between ranks cannot be read"
            )
        )
        result.pacing_rank = max(stats, key=lambda s: s.median_seconds).rank
        return result
    _judge(result, waits, index)
    return result


def _rank_stat(r: RankTrace, world: int, wait: float) -> RankStat:
    comm = r.analysis.communication
    kinds = sorted({k for s in comm.steps for k in s.by_kind})
    return RankStat(
        rank=r.rank,
        world_size=r.analysis.world_size or world,
        source=r.path.name,
        step_seconds=[s.wall_seconds for s in r.analysis.steps],
        phases=dict(r.analysis.breakdown.seconds),
        comm_seconds=comm.median("comm_seconds"),
        exposed_comm_seconds=comm.median("exposed_seconds"),
        wait_seconds=wait,
        comm_by_kind={k: _median([s.by_kind.get(k, 0.0) for s in comm.steps]) for k in kinds},
    )


def _judge(result: RankComparison, waits: list[list[float]], index: list[list[int]]) -> None:
    ranks, stats = result.ranks, result.stats
    world = len(ranks)
    # The straggler waits least: every other rank waits for it.
    s = min(range(world), key=lambda i: (stats[i].wait_seconds, -stats[i].median_seconds))
    straggler = ranks[s]
    # Without a straggler the ranks keep one pace; the slowest median stands for it.
    result.pacing_rank = max(stats, key=lambda st: st.median_seconds).rank
    others = [i for i in range(world) if i != s]
    # Per step, the least any other rank waited: every other rank lost at least this.
    per_step = [min(waits[i][k] for i in others) for k in range(len(waits[0]))]
    others_wait = _median(per_step)
    step = _median([straggler.analysis.steps[k].wall_seconds for k in index[s]])
    share = others_wait / step if step else 0.0
    # Judged on the size of the waits, paired by step: how much longer the others waited than
    # the straggler in each step, as an interval over the steps against their jitter. A rank
    # descheduled in a step or two makes the others wait then, and the interval stays wide; a
    # straggler makes them wait in every step, by about as much.
    gaps = [(per_step[k] - waits[s][k]) / step for k in range(len(per_step))] if step else []
    reading = at_line(share, catalog.RAISE_SHARE, samples=gaps)
    source = SOURCE
    steps = len(per_step)
    every_step = all(g > 0 for g in gaps)
    lasting = every_step and at_line(others_wait, catalog.MIN_SECONDS).above
    if lasting and at_line(steps, catalog.STRAGGLER_STEPS).below and not reading.below:
        result.checks.append(_unjudged(catalog.too_few_steps_straggler_line(straggler.rank, steps)))
    elif lasting and reading.above:
        result.pacing_rank = straggler.rank
        phase, excess = _slow_phase(stats, s, others)
        explains = others_wait > 0 and at_line(excess / others_wait, catalog.PHASE_EXPLAINS).above
        named = phase if explains else None
        result.findings.append(
            catalog.straggler_finding(
                straggler=straggler.rank,
                world_size=world,
                others_wait=others_wait,
                reading=reading,
                step_seconds=step,
                phase=named,
                phase_excess=excess,
                by_kind=stats[others[0]].comm_by_kind,
                evidence={
                    "straggler_rank": straggler.rank,
                    "others_wait_seconds_per_step": others_wait,
                    "share_of_step": share,
                    "wait_gap_share_interval": reading.share_interval(),
                    "interval_note": catalog.INTERVAL_NOTE,
                    "slow_phase": named,
                    "slow_phase_excess_seconds": excess,
                    "wait_seconds_by_rank": {str(st.rank): st.wait_seconds for st in stats},
                    "phase_seconds_by_rank": {str(st.rank): st.phases for st in stats},
                    "steps": result.aligned,
                },
                source=source,
            )
        )
    elif lasting and reading.borderline:
        result.checks.append(
            _unjudged(catalog.jittery_straggler_line(straggler.rank, reading, step, steps))
        )
    elif not at_line(share, catalog.RAISE_SHARE).below:
        waited = [ranks[i].rank for i in range(world) if any(w > 0 for w in waits[i])]
        result.checks.append(
            _unjudged(catalog.inconclusive_straggler_line(others_wait, step, waited))
        )
    else:
        worst = max(stats[i].wait_seconds for i in range(world))
        result.checks.append(
            Check(catalog.STRAGGLER_ID, "ok", catalog.no_straggler_line(worst, step, world), SOURCE)
        )
    exposed = stats[s].exposed_comm_seconds
    exposed_steps = [straggler.analysis.communication.steps[k].exposed_seconds for k in index[s]]
    exposed_reading = at_line(
        exposed / step if step else 0.0,
        catalog.RAISE_SHARE,
        samples=[e / step for e in exposed_steps] if step else (),
    )
    if at_line(exposed, catalog.MIN_SECONDS).above and not exposed_reading.below:
        result.findings.append(
            catalog.exposed_finding(
                rank=straggler.rank,
                exposed=exposed,
                reading=exposed_reading,
                step_seconds=step,
                by_kind=stats[s].comm_by_kind,
                evidence={
                    "rank": straggler.rank,
                    "exposed_seconds_per_step": exposed,
                    "comm_seconds_per_step": stats[s].comm_seconds,
                    "share_of_step": exposed_reading.value,
                    "share_interval": exposed_reading.share_interval(),
                    "interval_note": catalog.INTERVAL_NOTE,
                    "by_kind_seconds": stats[s].comm_by_kind,
                },
                source=source,
            )
        )
    else:
        line = catalog.hidden_comm_line(exposed, stats[s].comm_seconds, step)
        result.checks.append(Check(catalog.EXPOSED_COMM_ID, "ok", line, SOURCE))


def _unjudged(text: str) -> Check:
    """The straggler question, not answerable from these traces."""
    return Check(catalog.STRAGGLER_ID, "not_judged", text, SOURCE)


def _slow_phase(stats: list[RankStat], s: int, others: list[int]) -> tuple[str, float]:
    """The phase in which rank ``s`` spends most beyond the other ranks' median."""
    phases = [p for p in PHASES if any(p in st.phases for st in stats)]
    best, excess = "other", 0.0
    for phase in phases:
        extra = stats[s].phases.get(phase, 0.0) - _median(
            [stats[i].phases.get(phase, 0.0) for i in others]
        )
        if extra > excess:
            best, excess = phase, extra
    return best, excess


# --------------------------------------------------------------------------------------------
# The record


def comparison_record(comparison: RankComparison) -> RunRecord:
    """One record for all ranks: the pacing rank's analysis (its steps are the job's s/it), the
    per-rank table, and the findings of every rank merged by id."""
    pacing = next(r for r in comparison.ranks if r.rank == comparison.pacing_rank)
    record = analysis_to_record(pacing.analysis, pacing.path)
    record.ranks = comparison.stats
    for stat in record.ranks:
        stat.paces = stat.rank == comparison.pacing_rank
    if len(comparison.ranks) > 1:
        record.trace_path = str(pacing.path.parent)
        record.findings = _without_restated(_merged_findings(comparison), comparison.findings)
        record.notes = [
            n for n in record.notes if not n.startswith("This is rank ")
        ] + comparison.notes
        record.notes.insert(
            0,
            f"Timing, phases and kernels are rank {pacing.rank}'s, the rank the job waits for "
            f"(of ranks {', '.join(str(r.rank) for r in comparison.ranks)}).",
        )
    else:
        record.findings = record.findings + comparison.findings
        record.notes = record.notes + comparison.notes
    trace_probe = next(p for p in record.probes if p.name == "trace")
    # Every rank's traces read together answer the exposed-communication question on the rank
    # that waits least: the one rank's own reading (transfer or wait, untold) gives way.
    refined = {c.id for c in comparison.checks} | {f.id for f in comparison.findings}
    if len(comparison.ranks) > 1 and catalog.EXPOSED_COMM_ID in refined:
        trace_probe.checks = [c for c in trace_probe.checks if c.id != catalog.EXPOSED_COMM_ID]
        cross = {id(f) for f in comparison.findings}
        record.findings = [
            f for f in record.findings if f.id != catalog.EXPOSED_COMM_ID or id(f) in cross
        ]
    trace_probe.checks.extend(comparison.checks)
    if comparison.aligned:
        trace_probe.data["ranks"] = {
            "pacing_rank": comparison.pacing_rank,
            "files": {str(r.rank): r.path.name for r in comparison.ranks},
            "rank_from": {str(r.rank): r.rank_from for r in comparison.ranks},
            "aligned_steps": comparison.aligned,
        }
    return record


def _without_restated(merged: list[Finding], cross_rank: list[Finding]) -> list[Finding]:
    """The cross-rank findings, and the ranks' own findings that are not the same cause: a
    straggler slow in its data wait *is* that rank's starved loader, said once (its loader
    evidence moves into the straggler's)."""
    ids = {f.id for f in cross_rank}
    kept: list[Finding] = []
    for finding in merged:
        if finding.id == GPU_STARVED.id and catalog.DATA_WAIT_IMBALANCE_ID in ids:
            imbalance = next(f for f in cross_rank if f.id == catalog.DATA_WAIT_IMBALANCE_ID)
            imbalance.evidence["loader"] = finding.evidence
            continue
        kept.append(finding)
    return kept + cross_rank


def _merged_findings(comparison: RankComparison) -> list[Finding]:
    """One finding per id over the ranks' own rules: the pacing rank's where it has it (its time
    is the job's), else the largest; the evidence lists every rank that raised it."""
    by_id: dict[str, list[tuple[int, Finding]]] = {}
    for r in comparison.ranks:
        for f in r.analysis.findings:
            by_id.setdefault(f.id, []).append((r.rank, f))
    merged: list[Finding] = []
    for _, found in sorted(by_id.items()):
        chosen = next(
            (f for rank, f in found if rank == comparison.pacing_rank),
            max(found, key=lambda rf: rf[1].est_seconds_saved_per_it or 0.0)[1],
        )
        chosen.evidence = {**chosen.evidence, "ranks": [rank for rank, _ in found]}
        merged.append(chosen)
    return merged
