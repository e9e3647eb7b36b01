"""One statistics module for every verdict: the Mann–Whitney U test, the Hodges–Lehmann intervals
that invert it, the A/B helpers probes judge a saving with, and :func:`at_line`, the one way a
value is held against a threshold. The CI gate, the probes and the trace rules all use these;
nothing here imports torch, numpy or scipy.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
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
#: A value held against a line (:func:`at_line`) carries the interval of its samples at this
#: level: a value that sits on its line reads borderline in all but this share of runs, so reruns
#: agree on the findings even with several values near their lines.
LINE_SIGNIFICANCE = 0.01
#: ... but a handful of samples (the profiled steps of a trace) cannot give a 99% interval
#: narrower than several times their own spread (Student's t for 3 samples is 9.9), which would
#: leave every verdict on them borderline: their t interval is taken at this level. A trace is
#: read the same way each time, so its verdicts do not flip between reruns anyway.
FEW_SAMPLES_SIGNIFICANCE = SAVING_SIGNIFICANCE


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
    return _cumulative(_u_counts(m, n), math.comb(m + n, m))


def _cumulative(counts: Sequence[int], total: int) -> tuple[float, ...]:
    """The distribution function of a statistic from how many orderings give each value."""
    out: list[float] = []
    running = 0
    for c in counts:
        running += c
        out.append(running / total)
    return tuple(out)


def _last_at_most(cdf: Sequence[float], level: float) -> int:
    """The largest k with ``cdf[k] <= level``, or -1 when there is none."""
    c = -1
    for k, p in enumerate(cdf):
        if p > level:
            break
        c = k
    return c


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
        return _last_at_most(_u_cdf(m, n), significance / 2)
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


def saving_interval(
    faster: Sequence[float], slower: Sequence[float], *, allowance: float | None = None
) -> tuple[float, float] | None:
    """Seconds ``faster`` saves over ``slower`` per call: the Hodges–Lehmann interval of
    slower - faster at :data:`SAVING_SIGNIFICANCE`, None when the samples are too few.

    On a busy machine the interval is widened on both ends by the share of the slower side the
    load could explain (``allowance``; by default the open load window's, see
    :mod:`diagnose.contention`): a difference other processes could have made or hidden is not
    one the A/B is sure of."""
    interval = shift_interval(faster, slower, SAVING_SIGNIFICANCE)
    if interval is None:
        return None
    share = contention.current_allowance() if allowance is None else allowance
    widen = share * statistics.median(slower) if share > 0 else 0.0
    return interval[0] - widen, interval[1] + widen


def sure_saving(
    faster: Sequence[float], slower: Sequence[float], *, allowance: float | None = None
) -> float:
    """Seconds the A/B is sure ``faster`` saves over ``slower`` (per call): the low end of
    :func:`saving_interval`, never below 0; 0 when the samples are too few for an interval."""
    interval = saving_interval(faster, slower, allowance=allowance)
    return 0.0 if interval is None else max(0.0, interval[0])


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


# --------------------------------------------------------------------------------------------
# A value against its line: above, below, or borderline

#: Where a value stands against a threshold once its uncertainty is counted: its whole interval
#: at or above the line, wholly below it, or straddling it.
LineSide = Literal["above", "below", "borderline"]


@functools.lru_cache(maxsize=64)
def _signed_rank_cdf(n: int) -> tuple[float, ...]:
    """P(W <= k) for k = 0..n(n+1)/2, W the Wilcoxon signed-rank statistic of n values (no ties,
    no zeros) when each rank's sign is a fair coin: counts of the subsets of 1..n by their sum."""
    top = n * (n + 1) // 2
    counts = [1] + [0] * top
    for rank in range(1, n + 1):
        for k in range(top, rank - 1, -1):
            counts[k] += counts[k - rank]
    return _cumulative(counts, 2**n)


def _signed_rank_critical(n: int, significance: float) -> int:
    """The largest c with P(W <= c) <= significance / 2, or -1 when there is none."""
    if n <= EXACT_MAX_SAMPLES:
        return _last_at_most(_signed_rank_cdf(n), significance / 2)
    sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    z = statistics.NormalDist().inv_cdf(1 - significance / 2)
    return math.floor(n * (n + 1) / 4 - z * sd - 0.5)


def _t_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with a whole number ``df`` of degrees of freedom, from the
    closed form that whole degrees of freedom have (a finite series in the angle atan(t/√df))."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    if df % 2 == 0:
        for k in range(2, df, 2):
            term *= cos2 * (k - 1) / k
            total += term
        return math.sin(theta) * total
    for k in range(3, df, 2):
        term *= cos2 * (k - 1) / k
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


@functools.lru_cache(maxsize=256)
def t_quantile(significance: float, df: int) -> float:
    """The t with P(|T| > t) = ``significance`` for Student's t with ``df`` degrees of freedom."""
    high = 1.0
    while _t_coverage(high, df) < 1 - significance:
        high *= 2
    low = 0.0
    for _ in range(100):
        mid = (low + high) / 2
        if _t_coverage(mid, df) < 1 - significance:
            low = mid
        else:
            high = mid
    return high


def location_interval(
    samples: Sequence[float], significance: float = LINE_SIGNIFICANCE
) -> tuple[float, float] | None:
    """Confidence interval of where ``samples`` centre; None for fewer than two finite values.

    Rank based wherever the samples allow it: the one-sample Hodges–Lehmann interval that
    inverts Wilcoxon's signed-rank test at ``significance`` (order statistics of the Walsh
    averages), which one descheduled step moves little. With too few samples for ranks ever to
    reach that level (7 or fewer at 1%), Student's t interval of their mean at
    :data:`FEW_SAMPLES_SIGNIFICANCE` (or ``significance``, if looser): the values' size against
    their spread, which is what three profiled steps can say (a sign or rank test cannot say
    anything there)."""
    values = [float(v) for v in samples if math.isfinite(v)]
    n = len(values)
    if n < 2:
        return None
    c = _signed_rank_critical(n, significance)
    if c >= 0:
        walsh = sorted((values[i] + values[j]) / 2 for i in range(n) for j in range(i, n))
        return walsh[c], walsh[len(walsh) - 1 - c]
    level = max(significance, FEW_SAMPLES_SIGNIFICANCE)
    mean = statistics.fmean(values)
    half = t_quantile(level, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean - half, mean + half


@dataclass(frozen=True)
class AtLine:
    """A value held against a threshold (its line), with the interval its samples give it."""

    value: float
    line: float
    #: The interval the value carries; both ends are the value for a single number.
    low: float
    high: float
    #: How many samples the interval came from (1: a single number, judged as it is).
    samples: int = 1

    @property
    def side(self) -> LineSide:
        if math.isnan(self.low) or math.isnan(self.high):
            return "below"  # nothing measured reaches a line
        if self.low >= self.line:
            return "above"
        if self.high < self.line:
            return "below"
        return "borderline"

    @property
    def above(self) -> bool:
        return self.side == "above"

    @property
    def below(self) -> bool:
        return self.side == "below"

    @property
    def borderline(self) -> bool:
        return self.side == "borderline"

    def share_interval(self) -> list[float]:
        """The interval of a share (a part of a whole) as a record keeps it: the statistical
        interval of a few samples may reach past 0 or 1, which no share can."""
        return [min(max(self.low, 0.0), 1.0), min(max(self.high, 0.0), 1.0)]

    def words(self, what: str, fmt: Callable[[float], str], of: str = "") -> str:
        """``data wait 9%–12% of the step, at the 10% line``: what was judged, its interval
        (or its value, for a single number), and the line."""
        span = fmt(self.value) if self.low == self.high else f"{fmt(self.low)}–{fmt(self.high)}"
        return f"{what} {span}{of}, at the {fmt(self.line)} line"


def at_line(
    value: float,
    line: float,
    *,
    samples: Sequence[float] = (),
    interval: tuple[float, float] | None = None,
    significance: float = LINE_SIGNIFICANCE,
) -> AtLine:
    """``value`` against ``line``: the one way a verdict compares with a threshold.

    Above when the value's whole interval is at or above the line, below when it lies wholly
    under it, borderline when it straddles it. The interval is ``interval`` when the caller has
    one (an A/B's), else that of ``samples`` (:func:`location_interval`: the per-step values the
    value summarises), else none: a single number is judged as it is. The interval is widened to
    hold ``value`` itself, so the number shown is always inside the interval shown."""
    if interval is None and len(samples) > 1:
        interval = location_interval(samples, significance)
    low, high = interval if interval is not None else (value, value)
    return AtLine(
        value=value,
        line=line,
        low=min(low, value),
        high=max(high, value),
        samples=max(1, len(samples)),
    )
