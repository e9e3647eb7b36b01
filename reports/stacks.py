"""The Python frames py-spy found running during a profile's sampled steps (display values only).

The ranking itself is made by :mod:`diagnose.profile.stacks`; the report shows the pacing rank's,
the loading frames first when the loader was sampled, so a data-starved step names its code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diagnose.record import RunRecord
from diagnose.units import pct


@dataclass(frozen=True)
class FrameRow:
    frame: str
    share: str
    samples: int
    #: "main", "worker", "main 12, worker 40".
    where: str
    called_from: str


@dataclass(frozen=True)
class StackTable:
    title: str
    rows: tuple[FrameRow, ...]


@dataclass(frozen=True)
class StacksView:
    #: How the samples were taken, or why there are none.
    summary: str
    tables: tuple[StackTable, ...]


def _where(by_role: Mapping[str, Any]) -> str:
    if len(by_role) == 1:
        return str(next(iter(by_role)))
    return ", ".join(f"{role} {count}" for role, count in by_role.items())


def _table(title: str, ranking: Mapping[str, Any]) -> StackTable | None:
    frames = ranking.get("top_frames") or []
    if not frames:
        return None
    rows = tuple(
        FrameRow(
            frame=str(f.get("frame", "")),
            share=pct(float(f.get("share") or 0.0)),
            samples=int(f.get("samples") or 0),
            where=_where(f.get("by_role") or {}),
            called_from=str(f.get("called_from") or ""),
        )
        for f in frames
    )
    return StackTable(f"{title} ({int(ranking.get('samples') or 0)} samples)", rows)


def build_stacks(record: RunRecord) -> StacksView | None:
    """The table of a profile's sampled frames; None outside ``diagnose profile``."""
    capture = next((p for p in record.probes if p.name == "capture"), None)
    stacks = capture.data.get("stacks") if capture is not None else None
    if not isinstance(stacks, Mapping):
        return None
    if "error" in stacks:
        return StacksView(f"Not sampled: {stacks['error']}.", ())
    summary = (
        f"Sampled with py-spy at {stacks.get('rate_hz', '?')} Hz for "
        f"{stacks.get('seconds', '?')} s "
        "(the profiled steps and the one before them), in the training process and its "
        "DataLoader workers. Only running threads are sampled: a thread waiting for the GPU or "
        "for a batch is not counted."
    )
    if stacks.get("note"):
        summary += f" Note: {stacks['note']}."
    tables = [
        _table("Data loading", stacks.get("loading") or {}),
        _table("All Python", stacks.get("all") or {}),
    ]
    return StacksView(summary, tuple(t for t in tables if t is not None))


__all__ = ["FrameRow", "StackTable", "StacksView", "build_stacks"]
