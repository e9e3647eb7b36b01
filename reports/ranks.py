"""The per-rank table of a multi-process run or of a folder of rank traces (display values only).

The record's timing is the pacing rank's (the job runs at its pace); this table puts every
rank beside it, so a reader sees who waits for whom and where each rank's step goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diagnose.record import PHASE_LABELS, PHASES, RankStat, Stats
from diagnose.units import format_seconds, format_seconds_range


@dataclass(frozen=True)
class RankRow:
    rank: str
    source: str
    median: str
    spread: str
    #: One cell per :attr:`RanksView.phase_labels`.
    phases: tuple[str, ...]
    comm: str
    #: The collectives that took the time: "all-reduce 296 ms, broadcast 1.2 ms".
    kinds: str
    exposed: str
    wait: str
    pacing: bool


@dataclass(frozen=True)
class RanksView:
    rows: tuple[RankRow, ...]
    phase_labels: tuple[str, ...]
    #: One sentence: how many ranks, which one the timing above is, who waits.
    summary: str


def build_ranks(ranks: Sequence[RankStat]) -> RanksView | None:
    """The table, or None for a single-process record."""
    if len(ranks) < 2:
        return None
    pacing = [r.rank for r in ranks if r.paces]
    pacing_rank = pacing[0] if pacing else max(ranks, key=lambda r: r.median_seconds).rank
    phases = [p for p in PHASES if any(p in r.phases for r in ranks)]
    phases += sorted({p for r in ranks for p in r.phases} - set(phases))
    rows = tuple(
        RankRow(
            rank=str(r.rank),
            source=r.source,
            median=format_seconds(Stats.of(r.step_seconds).median, missing="—"),
            spread=format_seconds_range(
                Stats.of(r.step_seconds).q1, Stats.of(r.step_seconds).q3, missing="—"
            ),
            phases=tuple(format_seconds(r.phases.get(p, 0.0), missing="—") for p in phases),
            comm=format_seconds(r.comm_seconds, missing="—"),
            kinds=", ".join(
                f"{kind.replace('_', '-')} {format_seconds(seconds)}"
                for kind, seconds in sorted(r.comm_by_kind.items(), key=lambda kv: -kv[1])
                if seconds > 0
            ),
            exposed=format_seconds(r.exposed_comm_seconds, missing="—"),
            wait=format_seconds(r.wait_seconds, missing="—"),
            pacing=r.rank == pacing_rank,
        )
        for r in ranks
    )
    world = max([len(ranks)] + [r.world_size or 0 for r in ranks])
    of_world = f" of {world}" if world > len(ranks) else ""
    summary = (
        f"{len(ranks)} ranks{of_world}. The numbers above are rank {pacing_rank}'s (marked): "
        "the rank the others wait for when one holds them back in every step, else the slowest "
        "median step. 'Waits for others' is each rank's time in collectives beyond the least any "
        "rank spent in the same step's collectives (a median over the steps)."
    )
    return RanksView(
        rows=rows, phase_labels=tuple(PHASE_LABELS.get(p, p) for p in phases), summary=summary
    )
