"""Sets of time intervals as pairs of sorted numpy arrays (vectorised, no per-interval Python).

An :class:`Intervals` value is always *normalised*: sorted, disjoint, non-empty intervals. Every
operation returns a normalised value, so lengths never double-count overlapping events (two
kernels on two streams at once count once towards "device busy").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Intervals:
    """Disjoint, sorted half-open intervals [starts[i], ends[i]) in microseconds."""

    starts: FloatArray
    ends: FloatArray

    @property
    def total(self) -> float:
        """Summed length (microseconds)."""
        return float(np.sum(self.ends - self.starts)) if self.starts.size else 0.0

    def __len__(self) -> int:
        return int(self.starts.size)

    def contains(self, points: FloatArray) -> npt.NDArray[np.bool_]:
        """For each point, whether it lies inside one of the intervals (start <= t < end)."""
        if not self.starts.size:
            return np.zeros(points.shape, dtype=bool)
        idx = np.searchsorted(self.starts, points, side="right") - 1
        inside = idx >= 0
        safe = np.where(inside, idx, 0)
        return inside & (points < self.ends[safe])

    def clip(self, start: float, end: float) -> Intervals:
        """The part of this set inside [start, end)."""
        if not self.starts.size or end <= start:
            return EMPTY
        lo = int(np.searchsorted(self.ends, start, side="right"))
        hi = int(np.searchsorted(self.starts, end, side="left"))
        if hi <= lo:
            return EMPTY
        s = np.maximum(self.starts[lo:hi], start)
        e = np.minimum(self.ends[lo:hi], end)
        keep = e > s
        return Intervals(s[keep], e[keep])


def _empty() -> Intervals:
    return Intervals(np.empty(0, dtype=np.float64), np.empty(0, dtype=np.float64))


EMPTY = _empty()


def union(starts: npt.ArrayLike, ends: npt.ArrayLike) -> Intervals:
    """Merge possibly overlapping intervals into a normalised set."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    keep = e > s
    s, e = s[keep], e[keep]
    if not s.size:
        return EMPTY
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    running_end = np.maximum.accumulate(e)
    # A new merged interval starts wherever a start lies after every earlier end.
    new_group = np.empty(s.size, dtype=bool)
    new_group[0] = True
    new_group[1:] = s[1:] > running_end[:-1]
    group_starts = s[new_group]
    last_of_group = np.append(np.flatnonzero(new_group)[1:] - 1, s.size - 1)
    return Intervals(group_starts, running_end[last_of_group])


def union_of(sets: Iterable[Intervals]) -> Intervals:
    parts = list(sets)
    if not parts:
        return EMPTY
    return union(np.concatenate([p.starts for p in parts]), np.concatenate([p.ends for p in parts]))


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Points covered by both sets."""
    if not a.starts.size or not b.starts.size:
        return EMPTY
    # Sweep: +1 at each start, -1 at each end; both sets are disjoint, so coverage 2 = both.
    points = np.concatenate([a.starts, a.ends, b.starts, b.ends])
    deltas = np.concatenate(
        [
            np.ones(a.starts.size),
            -np.ones(a.ends.size),
            np.ones(b.starts.size),
            -np.ones(b.ends.size),
        ]
    )
    # Ends sort before starts at the same instant so touching intervals do not "overlap".
    order = np.lexsort((deltas, points))
    points, deltas = points[order], deltas[order]
    coverage = np.cumsum(deltas)
    opening = np.flatnonzero(coverage == 2)
    if not opening.size:
        return EMPTY
    # Coverage only ever leaves 2 at the very next event.
    s = points[opening]
    e = points[opening + 1]
    keep = e > s
    return Intervals(s[keep], e[keep])


def complement(a: Intervals, start: float, end: float) -> Intervals:
    """The parts of [start, end) not covered by ``a``."""
    if end <= start:
        return EMPTY
    inner = a.clip(start, end)
    if not inner.starts.size:
        return Intervals(np.array([start]), np.array([end]))
    s = np.concatenate([[start], inner.ends])
    e = np.concatenate([inner.starts, [end]])
    keep = e > s
    return Intervals(s[keep], e[keep])


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """Points in ``a`` not in ``b``."""
    if not a.starts.size or not b.starts.size:
        return a
    lo, hi = float(a.starts[0]), float(a.ends[-1])
    return intersect(a, complement(b, lo, hi))


def window(start: float, end: float) -> Intervals:
    if end <= start:
        return EMPTY
    return Intervals(np.array([start], dtype=np.float64), np.array([end], dtype=np.float64))
