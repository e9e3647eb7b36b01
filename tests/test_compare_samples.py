"""The comparison behind the CI gate on samples: the statistics, the verdicts on two sets of step
times, and the false-alarm rate on noise recorded from real runs of the tiny workload on this
CPU (records compared with each other are ``test_compare.py``)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from diagnose.config import MAX_TIMED_STEPS
from diagnose.gate import CompareOptions, compare_samples
from diagnose.record import Stats
from diagnose.stats import mann_whitney_u, minimum_samples, ratio_interval, smallest_p_value
from tests.recorded_runs import COMPARE, lognormal, noise_runs, quiet_runs

# --------------------------------------------------------------------------------------------
# Statistics


def _brute_force_counts(m: int, n: int) -> list[int]:
    counts = [0] * (m * n + 1)
    for positions in itertools.combinations(range(m + n), n):
        taken = set(positions)
        u = sum(sum(1 for i in range(j) if i not in taken) for j in positions)
        counts[u] += 1
    return counts


@pytest.mark.parametrize(("m", "n"), [(1, 1), (2, 3), (4, 4), (3, 6), (5, 5)])
def test_exact_u_distribution_matches_enumeration(m: int, n: int) -> None:
    from diagnose.stats import _u_counts

    assert list(_u_counts(m, n)) == _brute_force_counts(m, n)


def test_mann_whitney_known_values() -> None:
    # Complete separation of 5 and 5: the exact two-sided p is 2 / C(10, 5) = 0.00794.
    t = mann_whitney_u([1.0, 2, 3, 4, 5], [6.0, 7, 8, 9, 10])
    assert t.method == "exact" and t.u == 25
    assert t.p_value == pytest.approx(2 / 252)
    # Textbook example (scipy.stats.mannwhitneyu gives U=17, p=0.1111 exact for x against y).
    t = mann_whitney_u([20.0, 11, 17, 12], [19.0, 22, 16, 29, 24])
    assert t.u == 17 and t.p_value == pytest.approx(0.111111, abs=1e-6)
    # Ties: normal approximation with tie and continuity corrections (worked by hand:
    # U=30.5, mean 18, variance 3 * (13 - 96/132), z = 12 / 6.068 -> p = 0.0480).
    t = mann_whitney_u([1.0, 2, 2, 3, 3, 3], [2.0, 3, 4, 4, 5, 5])
    assert t.ties and "tie correction" in t.method
    assert t.p_value == pytest.approx(0.04797, abs=1e-4)
    # Identical values everywhere: nothing to tell apart.
    assert mann_whitney_u([1.0, 1.0], [1.0, 1.0]).p_value == 1.0


def test_normal_approximation_is_close_to_exact_for_larger_samples() -> None:
    rng = random.Random(3)
    a = lognormal(rng, 60, 1.0, 0.1)
    b = lognormal(rng, 60, 1.04, 0.1)
    exact_small = mann_whitney_u(a[:50], b[:50])  # exact
    normal = mann_whitney_u(a, b)  # beyond 50 a side: normal
    assert exact_small.method == "exact" and normal.method == "normal approximation"
    assert 0 < normal.p_value < 1 and 0 < exact_small.p_value < 1


def test_smallest_p_and_minimum_samples() -> None:
    assert smallest_p_value(8, 8) == pytest.approx(2 / 12870)
    assert minimum_samples(0.01) == 5  # 2/C(10,5) = 0.0079 < 0.01; 2/C(8,4) = 0.029
    assert minimum_samples(0.002) == 7  # asv's level needs 7 a side
    assert smallest_p_value(0, 5) == 1.0


def test_ratio_interval_covers_the_true_ratio() -> None:
    rng = random.Random(11)
    covered = 0
    trials = 200
    for _ in range(trials):
        a = lognormal(rng, 12, 1.0, 0.05)
        b = lognormal(rng, 12, 1.2, 0.05)
        interval = ratio_interval(a, b, 0.05)
        assert interval is not None
        covered += interval[0] <= 1.2 <= interval[1]
    assert covered / trials >= 0.9  # a 95% interval; a few misses are expected
    assert ratio_interval([1.0, 2.0], [1.0, 2.0], 0.01) is None  # too few for any interval


def test_ratio_interval_with_zero_values_uses_the_raw_shift() -> None:
    interval = ratio_interval([0.0, 0.01] * 6, [0.0, 0.011] * 6, 0.01)
    assert interval is not None and interval[0] <= 1.0 <= interval[1] + 1e-9


# --------------------------------------------------------------------------------------------
# Verdicts on samples


def _judge(a: list[float], b: list[float], **kw: object) -> str:
    options: dict[str, object] = {"threshold": 0.10, "significance": 0.01}
    options.update(kw)
    return compare_samples(a, b, key="step", kind="step", label="s/it", **options).verdict  # type: ignore[arg-type]


def test_a_large_real_slowdown_is_slower_and_a_speedup_faster() -> None:
    rng = random.Random(1)
    a = lognormal(rng, 12, 1.0, 0.03)
    b = lognormal(rng, 12, 1.3, 0.03)
    assert _judge(a, b) == "slower"
    assert _judge(b, a) == "faster"


def test_same_distribution_is_same() -> None:
    rng = random.Random(2)
    assert _judge(lognormal(rng, 20, 1.0, 0.01), lognormal(rng, 20, 1.0, 0.01)) == "same"


def test_a_significant_change_under_the_threshold_is_not_a_regression() -> None:
    rng = random.Random(3)
    metric = compare_samples(
        lognormal(rng, 30, 1.0, 0.005),
        lognormal(rng, 30, 1.05, 0.005),
        key="step",
        kind="step",
        label="s/it",
        threshold=0.10,
        significance=0.01,
    )
    assert metric.p_value is not None and metric.p_value < 1e-6
    assert metric.verdict == "same" and "under" in metric.reason


def test_a_slowdown_of_the_threshold_is_caught_even_when_its_estimate_lands_under_it() -> None:
    """The threshold is the slowdown the gate must catch: a significant change whose interval
    reaches it is a regression even when the median ratio came out at +8%."""
    a = [1.00, 1.01, 0.99, 1.02, 0.98, 1.03, 0.97, 1.00, 1.01, 0.99, 1.02, 0.98]
    b = [x * 1.08 for x in a[:6]] + [x * 1.12 for x in a[6:]]
    metric = compare_samples(
        a, b, key="step", kind="step", label="s/it", threshold=0.10, significance=0.01
    )
    assert metric.ratio is not None and metric.ratio < 1.10
    assert metric.ci_high is not None and metric.ci_high >= 1.10
    assert metric.verdict == "slower"
    assert "interval reaches +10%" in metric.reason
    # Its clean twin: the same +8% measured tightly enough to rule out +10% is not a failure.
    tight_a = [1 + 0.002 * ((i * 7) % 11 - 5) for i in range(30)]
    tight = compare_samples(
        tight_a,
        [x * 1.08 for x in tight_a],
        key="step",
        kind="step",
        label="s/it",
        threshold=0.10,
        significance=0.01,
    )
    assert tight.ci_high is not None and tight.ci_high < 1.10
    assert tight.verdict == "same" and "under" in tight.reason


def test_a_big_change_that_is_not_significant_is_inconclusive_not_a_failure() -> None:
    # +30% median shift, but the spread swamps it: the data can neither rule it in nor out.
    a = [1.0, 0.5, 2.0, 1.1, 0.4, 2.5, 0.9, 1.8]
    b = [1.3, 0.6, 2.2, 1.4, 0.5, 2.6, 1.2, 1.9]
    metric = compare_samples(
        a, b, key="step", kind="step", label="s/it", threshold=0.10, significance=0.01
    )
    assert metric.verdict == "inconclusive"
    assert "too much spread" in metric.reason and "IQR" in metric.reason


def test_too_few_samples_is_inconclusive_and_says_the_minimum() -> None:
    metric = compare_samples(
        [1.0, 1.01, 0.99],
        [2.0, 2.01, 1.99],
        key="step",
        kind="step",
        label="s/it",
        threshold=0.10,
        significance=0.01,
    )
    assert metric.verdict == "inconclusive"
    assert "too few samples" in metric.reason and "at least 5 steps" in metric.reason
    assert metric.ratio == pytest.approx(2.0)  # the medians are still shown


def test_a_phase_change_under_the_floor_is_same() -> None:
    # A 60 µs copy that grows by half: significant, beyond 10%, but 30 µs of a 100 ms step.
    a = [60e-6 + i * 1e-7 for i in range(10)]
    b = [90e-6 + i * 1e-7 for i in range(10)]
    metric = compare_samples(
        a,
        b,
        key="phase.h2d",
        kind="phase",
        label="h2d",
        threshold=0.10,
        significance=0.01,
        floor_seconds=0.002,
    )
    assert metric.verdict == "same" and "floor" in metric.reason
    assert (
        compare_samples(
            a, b, key="phase.h2d", kind="phase", label="h2d", threshold=0.1, significance=0.01
        ).verdict
        == "slower"
    )


def test_missing_samples_are_inconclusive() -> None:
    metric = compare_samples(
        [], [1.0], key="step", kind="step", label="s/it", threshold=0.1, significance=0.01
    )
    assert metric.verdict == "inconclusive" and "baseline" in metric.reason


# --------------------------------------------------------------------------------------------
# False alarms on recorded noise


def _false_alarm_rate(
    pairs: list[tuple[list[float], list[float]]], options: CompareOptions
) -> float:
    alarms = 0
    for a, b in pairs:
        metric = compare_samples(
            a,
            b,
            key="step",
            kind="step",
            label="s/it",
            threshold=options.threshold,
            significance=options.significance,
        )
        alarms += metric.verdict == "slower"
    return alarms / len(pairs)


@pytest.mark.parametrize("n", [8, 20, MAX_TIMED_STEPS])
def test_a_a_false_alarm_rate_on_recorded_noise_is_at_most_one_percent(n: int) -> None:
    """A/A pairs resampled from the per-step times of real same-config runs (with this shared
    machine's contention spikes in them): the gate must cry "slower" in at most 1% of them.

    Pairs are drawn from one run's steps (two disjoint sets) and from the pool of all runs'
    steps, so both sides come from the same distribution: any "slower" is a false alarm.
    """
    rng = random.Random(20240501 + n)
    runs = [run for run in noise_runs() if len(run) >= 2 * n]
    pooled = [s for run in runs for s in run]
    pairs: list[tuple[list[float], list[float]]] = []
    for _ in range(1000):
        run = rng.choice(runs)
        picked = rng.sample(run, 2 * n)
        pairs.append((picked[:n], picked[n:]))
        pairs.append(
            ([rng.choice(pooled) for _ in range(n)], [rng.choice(pooled) for _ in range(n)])
        )
    rate = _false_alarm_rate(pairs, CompareOptions())
    assert rate <= 0.01, f"false-alarm rate {rate:.2%} at n={n}"


@pytest.mark.parametrize(("n", "slowdown"), [(8, 0.5), (20, 0.3), (MAX_TIMED_STEPS, 0.10)])
def test_a_slowdown_on_recorded_quiet_noise_is_detected(n: int, slowdown: float) -> None:
    """The clean twin of the A/A test: the same within-run resampling of the quiet runs, with the
    current side slower, must be caught; at the default step count that includes a slowdown of
    exactly the default threshold (bench_compare_gate.py has the whole power table)."""
    rng = random.Random(7)
    runs = [run for run in quiet_runs() if len(run) >= 2 * n]
    assert len(runs) >= 5
    detected = 0
    trials = 300
    for _ in range(trials):
        picked = rng.sample(rng.choice(runs), 2 * n)
        a, b = picked[:n], [s * (1 + slowdown) for s in picked[n:]]
        verdict = compare_samples(
            a, b, key="step", kind="step", label="s/it", threshold=0.1, significance=0.01
        ).verdict
        detected += verdict == "slower"
    assert detected / trials >= 0.95


def test_noise_fixture_is_recorded_from_runs() -> None:
    data = json.loads((COMPARE / "noise.json").read_text(encoding="utf-8"))
    assert len(data["runs"]) >= 10
    for run in data["runs"]:
        assert run["command"].startswith("diagnose run --preset sd15 --size tiny")
        assert len(run["samples"]) >= 30
        assert run["median_seconds"] == pytest.approx(
            Stats.of(s["seconds"] for s in run["samples"]).median, rel=1e-4
        )
    assert (COMPARE / "README.md").is_file()
