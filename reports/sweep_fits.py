"""Which point of a sweep trains fastest, and which fits each common VRAM size; and how the page
and the charts name a point and a setting.

Reads the points' numbers (each point's own record gave them) and never measures: a point is ranked
per trained image, and points whose step times overlap are named together rather than let noise
pick one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diagnose.sweep.grid import AXIS_BY_NAME, Setting
from diagnose.sweep.results import PointResult

#: The memory sizes of common GPUs, GiB (a "24 GB" card holds 24 GiB).
VRAM_SIZES_GIB: tuple[int, ...] = (8, 12, 16, 24, 48, 80)
GIB = 1024**3


def setting_text(name: str, value: Setting) -> str:
    """A setting as the table and charts show it: on/off for switches, "preset's" for None."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "preset's"
    return str(value)


def point_label(result: PointResult, names: Sequence[str]) -> str:
    """``rank 8 · batch 2``: the point's values of ``names``."""
    settings = result.point.settings()
    return " · ".join(f"{AXIS_BY_NAME[n].label} {setting_text(n, settings[n])}" for n in names)


# --- the fastest point, and VRAM fits ---------------------------------------------------------


@dataclass(frozen=True)
class Fastest:
    """The point that trains an image fastest, and those the measurement cannot tell from it."""

    point: PointResult
    #: Points whose per-image interquartile range overlaps the fastest's: as fast within noise.
    ties: tuple[PointResult, ...] = ()


def fastest(points: Sequence[PointResult]) -> Fastest | None:
    """The fastest measured point per trained image (s/it over the batch), and its ties.

    Per image, because a point of batch 2 at 1.5x the s/it of batch 1 trains faster. Ties,
    because two points whose step times overlap cannot be ranked by one run: the page names
    both rather than let noise pick one."""
    timed = [(p, r) for p in points if p.status == "measured" and (r := p.per_image())]
    if not timed:
        return None
    best, (_, _, best_q3) = min(timed, key=lambda pr: pr[1][0])
    ties = tuple(p for p, (_, q1, _) in timed if p is not best and q1 <= best_q3)
    return Fastest(best, ties)


@dataclass(frozen=True)
class Fit:
    """The fastest measured point whose peak memory fits ``gib`` (None: none fits)."""

    gib: int
    point: PointResult | None
    ties: tuple[PointResult, ...] = ()


def vram_fits(points: Sequence[PointResult], sizes: Sequence[int] = VRAM_SIZES_GIB) -> list[Fit]:
    measured = [p for p in points if p.status == "measured" and p.peak_bytes]
    fits = []
    for gib in sizes:
        best = fastest([p for p in measured if (p.peak_bytes or 0) <= gib * GIB])
        fits.append(
            Fit(gib=gib, point=best.point if best else None, ties=best.ties if best else ())
        )
    return fits


def memory_kind(points: Sequence[PointResult]) -> str:
    """ "device" when any measured point has device memory, "host" for CPU runs, "" for none."""
    kinds = {p.summary.memory_kind for p in points if p.summary is not None}
    if "device" in kinds:
        return "device"
    return "host" if "host" in kinds else ""


__all__ = [
    "GIB",
    "VRAM_SIZES_GIB",
    "Fastest",
    "Fit",
    "fastest",
    "memory_kind",
    "point_label",
    "setting_text",
    "vram_fits",
]
