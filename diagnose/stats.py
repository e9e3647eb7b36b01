"""One statistics module for every verdict: the Mann–Whitney U test, the Hodges–Lehmann intervals
that invert it, and the A/B helpers probes judge a saving with. The CI gate and the probes both
use these; nothing here imports torch, numpy or scipy.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from diagnose import contention

#: Exact U distribution up to this many samples per side (beyond, the normal approximation is
#: within a few per cent of the exact p-value and the exact one costs O(m^2 n)).
EXACT_MAX_SAMPLES = 50
#: A/B probes judge a finding's severity on the low end of the saving's interval at this level,
#: not on its median: a saving that hovers at a severity boundary would otherwise read warn in one
#: run and info in the next, and `diagnose compare` reads a severity change as a regression.
SAVING_SIGNIFICANCE = 0.05
#: An interleaved A/B that keeps sampling until it is sure looks at its samples several times;
#: each look asks for this stricter level, so that looking again does not make a wrong verdict
#: likely (with 5 samples a side the exact test can reach it).
SEQUENTIAL_SIGNIFICANCE = 0.01


@dataclass(frozen=True)
class UTest:
    """A two-sided Mann–Whitney U test of ``current`` against ``baseline``."""

    #: U of the current sample: pairs (baseline a, current b) with b > a, ties counted half.
    u: float
    p_value: float
    #: "exact" or "normal approximation" (with tie correction when there are ties).
    method: str
    ties: bool


def _ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Mid-ranks (1-based) of ``values`` and the sizes of the tie groups."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    tie_sizes: list[int] = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        mid = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[order[k]] = mid
        if j > i:
            tie_sizes.append(j - i + 1)
        i = j + 1
    return ranks, tie_sizes


@functools.lru_cache(maxsize=256)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings give U = 0, 1, ..., m*n (no ties).

    These are the coefficients of the Gaussian binomial [m+n choose m]_q, built one factor
    (1 - q^(n+i)) / (1 - q^i) at a time: every partial product is itself a Gaussian binomial, so
    the arithmetic stays in exact integers and costs O(m * m * n).
    """
    if m > n:
        m, n = n, m
    top = m * n
    poly = [1] + [0] * top
    for i in range(1, m + 1):
        shift = n + i
        for k in range(top, shift - 1, -1):  # multiply by (1 - q^(n+i))
            poly[k] -= poly[k - shift]
        for k in range(i, top + 1):  # divide by (1 - q^i)
            poly[k] += poly[k - i]
    return tuple(poly)


@functools.lru_cache(maxsize=256)
def _u_cdf(m: int, n: int) -> tuple[float, ...]:
    """P(U <= k) for k = 0..m*n under the null hypothesis, no ties."""
    counts = _u_counts(m, n)
    total = math.comb(m + n, m)
    out: list[float] = []
    running = 0
    for c in counts:
        running += c
        out.append(running / total)
    return tuple(out)


def smallest_p_value(m: int, n: int) -> float:
    """The smallest two-sided p-value the exact test can give with m and n samples."""
    if m < 1 or n < 1:
        return 1.0
    return min(1.0, 2.0 / math.comb(m + n, m))


def minimum_samples(significance: float) -> int:
    """Steps needed on each side (equal counts) before a difference can be significant."""
    n = 1
    while smallest_p_value(n, n) >= significance:
        n += 1
    return n


def mann_whitney_u(baseline: Sequence[float], current: Sequence[float]) -> UTest:
    """Two-sided Mann–Whitney U test. Both samples must be non-empty."""
    m, n = len(baseline), len(current)
    if not m or not n:
        raise ValueError("both samples need at least one value")
    pooled = [*baseline, *current]
    ranks, tie_sizes = _ranks(pooled)
    u = sum(ranks[m:]) - n * (n + 1) / 2
    ties = bool(tie_sizes)
    if not ties and max(m, n) <= EXACT_MAX_SAMPLES:
        cdf = _u_cdf(m, n)
        k = round(u)  # U is an integer without ties
        low = cdf[k]
        high = 1.0 - (cdf[k - 1] if k > 0 else 0.0)
        return UTest(u=u, p_value=min(1.0, 2.0 * min(low, high)), method="exact", ties=False)
    mean = m * n / 2
    variance = _u_variance(m, n, tie_sizes)
    method = "normal approximation" + (" with tie correction" if ties else "")
    if variance <= 0:  # every value equal: nothing to tell apart
        return UTest(u=u, p_value=1.0, method=method, ties=ties)
    z = max(0.0, abs(u - mean) - 0.5) / math.sqrt(variance)  # continuity-corrected
    return UTest(u=u, p_value=min(1.0, math.erfc(z / math.sqrt(2))), method=method, ties=ties)


def _u_variance(m: int, n: int, tie_sizes: Sequence[int]) -> float:
    """Variance of U under the null hypothesis, corrected for ties."""
    total = m + n
    tie_term = sum(t**3 - t for t in tie_sizes) / (total * (total - 1)) if total > 1 else 0.0
    return m * n / 12 * ((total + 1) - tie_term)


def _critical_count(m: int, n: int, significance: float, tie_sizes: Sequence[int]) -> int:
    """The largest c with P(U <= c) <= significance / 2, or -1 when there is none.

    The pairwise differences ranked c+1 from either end bound the confidence interval.
    """
    if not tie_sizes and max(m, n) <= EXACT_MAX_SAMPLES:
        cdf = _u_cdf(m, n)
        c = -1
        for k, p in enumerate(cdf):
            if p > significance / 2:
                break
            c = k
        return c
    variance = _u_variance(m, n, tie_sizes)
    if variance <= 0:
        return -1
    z = statistics.NormalDist().inv_cdf(1 - significance / 2)
    return math.floor(m * n / 2 - z * math.sqrt(variance) - 0.5)


def shift_interval(
    baseline: Sequence[float], current: Sequence[float], significance: float
) -> tuple[float, float] | None:
    """Confidence interval (1 - significance) of the shift current - baseline, in the samples'
    unit (Hodges–Lehmann, inverting the U test); None when the samples are too few."""
    m, n = len(baseline), len(current)
    if not m or not n:
        return None
    _, tie_sizes = _ranks([*baseline, *current])
    c = _critical_count(m, n, significance, tie_sizes)
    if c < 0:
        return None
    diffs = sorted(b - a for a in baseline for b in current)
    return diffs[c], diffs[len(diffs) - 1 - c]


def ratio_interval(
    baseline: Sequence[float], current: Sequence[float], significance: float
) -> tuple[float, float] | None:
    """Confidence interval (1 - significance) of current / baseline, inverting the U test.

    Hodges–Lehmann: the interval of the shift of log-times is bounded by order statistics of all
    m*n pairwise differences log(b) - log(a). Times are positive and noise on them multiplies,
    so the log scale fits; with a zero or negative value (a phase that took no time) the shift is
    taken on the raw values and divided by the baseline median. None when the samples are too
    few for any finite interval, or the baseline median is not positive.
    """
    if not baseline or not current:
        return None
    if min(baseline) > 0 and min(current) > 0:
        logs = shift_interval(
            [math.log(a) for a in baseline], [math.log(b) for b in current], significance
        )
        return None if logs is None else (math.exp(logs[0]), math.exp(logs[1]))
    shift = shift_interval(baseline, current, significance)
    base_median = statistics.median(baseline)
    if shift is None or base_median <= 0:
        return None
    return 1 + shift[0] / base_median, 1 + shift[1] / base_median


def sure_saving(
    faster: Sequence[float], slower: Sequence[float], *, allowance: float | None = None
) -> float:
    """Seconds the A/B is sure ``faster`` saves over ``slower`` (per call): the low end of the
    Hodges–Lehmann interval of slower - faster at :data:`SAVING_SIGNIFICANCE`, never below 0.
    0 when the samples are too few for an interval.

    On a busy machine the interval is widened by the share of the slower side the load could
    explain (``allowance``; by default the open load window's, see :mod:`diagnose.contention`),
    so a difference other processes could have made is not one the A/B is sure of."""
    interval = shift_interval(faster, slower, SAVING_SIGNIFICANCE)
    if interval is None:
        return 0.0
    share = contention.current_allowance() if allowance is None else allowance
    widened = interval[0] - share * statistics.median(slower) if share > 0 else interval[0]
    return max(0.0, widened)


def clearly_faster(
    faster: Sequence[float], slower: Sequence[float], *, min_saving: float = 0.0
) -> bool:
    """Whether ``faster`` is surely faster than ``slower`` by more than ``min_saving`` seconds per
    call (the low end of the interval clears it): an A/B verdict that does not flip on a rerun.
    A difference only the machine's load keeps from being sure is counted as set aside."""
    sure = sure_saving(faster, slower) > min_saving
    if not sure and sure_saving(faster, slower, allowance=0.0) > min_saving:
        contention.note_set_aside()
    return sure


# --------------------------------------------------------------------------------------------
# A verdict that does not flip: sure faster, sure not faster, or inconclusive

#: The answer of :func:`ab_verdict`: ``candidate`` is surely faster than ``baseline`` by more
#: than the margin, surely not, or the samples cannot say which (yet).
ABOutcome = Literal["faster", "not_faster", "inconclusive"]


@dataclass(frozen=True)
class ABVerdict:
    """Whether ``candidate`` beats ``baseline`` by more than ``min_relative`` of its time."""

    outcome: ABOutcome
    #: Interval of candidate / baseline time at ``significance``; None with too few samples.
    ratio: tuple[float, float] | None
    baseline_samples: int
    candidate_samples: int
    significance: float
    min_relative: float
    #: Sure on a quiet machine, but not beyond what the load's swings could explain.
    set_aside: bool = False

    @property
    def decided(self) -> bool:
        return self.outcome != "inconclusive"

    def text(self) -> str:
        """``0.48–0.52× the time (99% interval, 7 and 7 samples)``, or why there is none."""
        n = f"{self.baseline_samples} and {self.candidate_samples} samples"
        if self.ratio is None:
            return f"too few samples for an interval ({n})"
        low, high = self.ratio
        level = f"{1 - self.significance:.0%}"
        return f"{low:.2f}–{high:.2f}× the time ({level} interval, {n})"


def ab_verdict(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    min_relative: float,
    significance: float = SEQUENTIAL_SIGNIFICANCE,
) -> ABVerdict:
    """Is ``candidate`` faster than ``baseline`` by more than ``min_relative`` of its time?

    Three answers from one interval of the time ratio (:func:`ratio_interval`): "faster" when
    the whole interval lies below ``1 - min_relative``, "not_faster" when it lies above it, and
    "inconclusive" when it straddles it. The two sure answers exclude each other, so a rerun can
    only move between one of them and "inconclusive", never from one to the other, unless the
    interval itself is wrong (at most ``significance`` of the time).

    On a busy machine (an open load window, :mod:`diagnose.contention`) the swing of the load
    could make either side look faster by its allowance: "faster" then needs the interval below
    ``(1 - min_relative) * (1 - allowance)``, "not_faster" above ``(1 - min_relative) /
    (1 - allowance)``; an answer only the load kept from being sure says so (``set_aside``), for
    the caller's final verdict to count (a sequential A/B asks after every sample)."""
    interval = ratio_interval(baseline, candidate, significance)
    keep = 1.0 - min_relative
    allowance = contention.current_allowance() if interval is not None else 0.0
    outcome: ABOutcome = "inconclusive"
    if interval is not None:
        if interval[1] < keep * (1 - allowance):
            outcome = "faster"
        elif interval[0] > keep / (1 - allowance):
            outcome = "not_faster"
    set_aside = (
        outcome == "inconclusive"
        and interval is not None
        and (interval[1] < keep or interval[0] > keep)
    )
    return ABVerdict(
        outcome=outcome,
        ratio=interval,
        baseline_samples=len(baseline),
        candidate_samples=len(candidate),
        significance=significance,
        min_relative=min_relative,
        set_aside=set_aside,
    )
