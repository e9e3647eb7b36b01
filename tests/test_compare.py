"""The comparison behind the CI gate: the statistics, the verdicts, the findings diff, the gate,
and the false-alarm rate on noise recorded from real runs of the tiny workload on this CPU."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import statistics
from typing import Any

import pytest

from diagnose.config import MAX_TIMED_STEPS
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate import (
    CompareOptions,
    Comparison,
    compare_records,
    compare_runs,
    compare_samples,
    diff_findings,
    gate_exit_code,
    gate_failures,
    parse_fail_on,
    record_differences,
)
from diagnose.record import Breakdown, Finding, RunRecord, Stats, StepSample
from diagnose.record_io import load_record, record_from_dict
from diagnose.stats import mann_whitney_u, minimum_samples, ratio_interval, smallest_p_value
from tests.conftest import FIXTURES

COMPARE = FIXTURES / "compare"


def load(name: str) -> RunRecord:
    return load_record(COMPARE / name)


def noise_runs() -> list[list[float]]:
    """Per-step s/it of same-config runs, recorded on this 2-core box (see the fixture README)."""
    data = json.loads((COMPARE / "noise.json").read_text(encoding="utf-8"))
    return [[s["seconds"] for s in run["samples"]] for run in data["runs"]]


def with_samples(
    record: RunRecord, seconds: list[float], phases: list[dict[str, float]] | None = None
) -> RunRecord:
    """A copy of a real record whose unprofiled steps are replaced by ``seconds``."""
    out = copy.deepcopy(record)
    out.timing.samples = [
        StepSample(index=i, seconds=s, phases=(phases[i] if phases else {}))
        for i, s in enumerate(seconds)
    ]
    out.timing.summarize()
    return out


def lognormal(rng: random.Random, n: int, median: float, sigma: float) -> list[float]:
    return [median * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


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
# Records


@pytest.fixture(scope="module")
def baseline() -> RunRecord:
    return load("baseline.json")


@pytest.fixture
def quiet(baseline: RunRecord) -> RunRecord:
    """The real baseline record with 12 tightly spread step times (a quiet GPU runner's noise),
    for tests about findings and single numbers that must not hinge on this box's noise."""
    rng = random.Random(5)
    return with_samples(baseline, lognormal(rng, 12, 0.1, 0.01))


def test_records_fixtures_are_real_runs(baseline: RunRecord) -> None:
    for name in ("baseline.json", "same_config.json", "slow_data.json", "few_steps.json"):
        record = load(name)
        assert record.mode == "run" and record.device.kind == "cpu"
        assert record.command.startswith("diagnose run")
        assert record.timing.samples and all(s.phases for s in record.timing.samples)


def test_same_config_twice_is_no_regression(baseline: RunRecord) -> None:
    comparison = compare_records(baseline, load("same_config.json"))
    # Recorded on a noisy machine: the s/it's spread leaves it unjudged, which is no pass.
    assert comparison.step is not None and comparison.step.verdict == "inconclusive"
    assert not comparison.findings
    assert gate_exit_code(comparison) == ExitCode.INCONCLUSIVE
    assert gate_exit_code(comparison, {"slower", "memory", "new-warn"}) == ExitCode.OK


def test_planted_slow_data_is_caught(baseline: RunRecord) -> None:
    """27-megapixel JPEGs decoded in the loop (--workers 0): the data-wait phase, and so the step,
    is several times slower, and the trace rule's data-loading finding goes from warn (the
    generated 2-megapixel photos already cost 12 ms a step) to critical."""
    comparison = compare_records(baseline, load("slow_data.json"))
    data_wait = comparison.metric("phase.data_wait")
    assert data_wait is not None and data_wait.verdict == "slower"
    assert data_wait.ratio is not None and data_wait.ratio > 3
    assert comparison.step is not None and comparison.step.verdict == "slower"
    assert [
        (c.id, c.change, c.baseline_severity, c.current_severity) for c in comparison.findings
    ] == [("dataloader.gpu_starved", "escalated", "warn", "critical")]
    assert gate_exit_code(comparison) == ExitCode.REGRESSION
    criteria = {f.criterion for f in gate_failures(comparison, {"slower", "phase", "new-critical"})}
    assert criteria == {"slower", "phase", "new-critical"}
    # The s/it failure names the phase the time went into, even when phases do not gate.
    [step_failure] = [f for f in gate_failures(comparison) if f.criterion == "slower"]
    assert "slower phases: data wait +" in step_failure.message
    # Only the data changed: the data summary says so, and nothing refused the comparison.
    assert any(c.startswith("data median megapixels") for c in comparison.environment_changes)
    assert not comparison.differences


def test_few_steps_are_inconclusive_not_a_failure(baseline: RunRecord) -> None:
    few = load("few_steps.json")
    assert len(few.timing.samples) == 3
    comparison = compare_records(
        few, with_samples(few, [s.seconds * 3 for s in few.timing.samples])
    )
    assert comparison.step is not None and comparison.step.verdict == "inconclusive"
    assert "too few samples" in comparison.step.reason
    # Its own answer, not a pass and not a regression; a --fail-on without it lets it pass.
    assert gate_exit_code(comparison) == ExitCode.INCONCLUSIVE
    assert gate_exit_code(comparison, {"slower", "new-critical"}) == ExitCode.OK
    assert gate_exit_code(comparison, {"slower", "inconclusive", "new-warn"}) == (
        ExitCode.INCONCLUSIVE
    )


def test_profiled_steps_are_never_compared_with_unprofiled_ones(baseline: RunRecord) -> None:
    profiled_only = copy.deepcopy(baseline)
    for sample in profiled_only.timing.samples:
        sample.profiled = True
    comparison = compare_records(baseline, profiled_only)
    assert comparison.step is not None and comparison.step.verdict == "inconclusive"
    assert any("profiler's overhead" in note for note in comparison.notes)
    both = compare_records(profiled_only, profiled_only)
    assert both.step is not None and both.step.label == "s/it (profiled steps)"


def test_steps_without_a_valid_time_are_left_out_and_said(baseline: RunRecord) -> None:
    """A hand-edited or corrupted record (NaN, infinity, a negative time) must not bend the
    statistics: those steps are not samples, and a note says how many were left out."""
    current = copy.deepcopy(baseline)
    current.created = "2026-11-30T10:00:00+00:00"
    for sample, bad in zip(current.timing.samples, (math.nan, math.inf, -1.0), strict=False):
        sample.seconds = bad
    comparison = compare_records(baseline, current)
    valid = [s for s in baseline.timing.samples if not s.profiled]
    assert comparison.step is not None and comparison.step.n_current == len(valid) - 3
    assert any(note.startswith("3 steps with no valid time") for note in comparison.notes)


@pytest.mark.parametrize("bad", [[], [math.nan, -1.0, 0.0, math.inf]])
def test_a_record_without_a_valid_step_is_never_passed(
    baseline: RunRecord, bad: list[float]
) -> None:
    current = copy.deepcopy(baseline)
    current.created = "2026-11-30T10:00:00+00:00"
    current.timing.samples = [StepSample(index=i, seconds=v) for i, v in enumerate(bad)]
    with pytest.raises(DiagnoseError) as raised:
        compare_records(baseline, current)
    assert raised.value.code == ExitCode.BAD_INPUT
    assert "nothing to compare" in raised.value.message
    # Its twin with one valid step is compared (and says the rest were left out).
    current.timing.samples.append(StepSample(index=9, seconds=1.0))
    compare_records(baseline, current)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: setattr(r.device, "name", "NVIDIA H100 80GB HBM3"), "device name differs"),
        (lambda r: setattr(r.device, "kind", "cuda"), "device kind differs"),
        (lambda r: r.config.__setitem__("attention", "math"), "config attention differs"),
        (lambda r: r.config.__setitem__("resolution", [512]), "config resolution differs"),
        (lambda r: r.config.__setitem__("precision", "fp32"), "config precision differs"),
        (lambda r: setattr(r, "mode", "trace"), "mode differs"),
    ],
)
def test_different_device_or_config_is_refused_with_one_line(
    baseline: RunRecord, edit: object, needle: str
) -> None:
    other = copy.deepcopy(baseline)
    edit(other)  # type: ignore[operator]
    with pytest.raises(DiagnoseError) as raised:
        compare_records(baseline, other)
    assert raised.value.code == ExitCode.BAD_INPUT
    assert needle in raised.value.message and "\n" not in raised.value.message
    assert "--allow-different" in raised.value.message
    allowed = compare_records(baseline, other, CompareOptions(allow_different=True))
    assert allowed.different and needle in allowed.different_warning


def test_paths_sample_counts_and_seed_are_not_differences(baseline: RunRecord) -> None:
    other = copy.deepcopy(baseline)
    other.config.update(steps=40, warmup=5, seed=3, data_dir="/elsewhere", device="cpu")
    other.config["data"] = {"root": "/tmp/other"}
    assert record_differences(baseline, other) == []
    older = copy.deepcopy(baseline)
    del older.config["cache_latents"]  # an older record without the key ran with the default
    assert record_differences(baseline, older) == []


# --------------------------------------------------------------------------------------------
# Single numbers


def test_memory_is_threshold_only(quiet: RunRecord) -> None:
    bigger = copy.deepcopy(quiet)
    assert quiet.timing.peak_rss_bytes
    bigger.timing.peak_rss_bytes = int(quiet.timing.peak_rss_bytes * 1.5)
    comparison = compare_records(quiet, bigger)
    rss = comparison.metric("memory.peak_rss_bytes")
    assert rss is not None and rss.verdict == "larger" and rss.p_value is None
    assert "single number" in rss.method
    assert gate_exit_code(comparison) == ExitCode.OK  # memory is not in the default --fail-on
    assert gate_exit_code(comparison, {"memory"}) == ExitCode.REGRESSION
    # Not measured on a CPU: device memory rows are left out, not "inconclusive".
    assert comparison.metric("memory.peak_allocated_bytes") is None


def test_kernel_classes_compare_when_both_records_have_them(quiet: RunRecord) -> None:
    a = copy.deepcopy(quiet)
    b = copy.deepcopy(quiet)
    step = a.timing.unprofiled.median
    a.breakdown = Breakdown(device_seconds_by_kernel_class={"gemm": 0.5 * step, "misc": 1e-6})
    b.breakdown = Breakdown(
        device_seconds_by_kernel_class={"gemm": 0.8 * step, "misc": 2e-6, "attention": 0.3 * step}
    )
    comparison = compare_records(a, b)
    verdicts = {m.key: m.verdict for m in comparison.metrics if m.kind == "kernel_class"}
    assert verdicts == {
        "kernel_class.gemm": "slower",
        "kernel_class.attention": "slower",  # new class worth 30% of the step
        "kernel_class.misc": "same",  # doubled, but 1 µs is under the floor
    }
    assert gate_exit_code(comparison, {"kernel"}) == ExitCode.REGRESSION
    only_one = compare_records(quiet, b)
    assert not [m for m in only_one.metrics if m.kind == "kernel_class"]
    assert any("kernel class" in note for note in only_one.notes)


def test_a_record_from_before_counting_once_compares_its_sums(quiet: RunRecord) -> None:
    """A baseline written by an older diagnose holds summed kernel time only (schema 2): the
    gate compares sums with sums, and says so, rather than sums with counted-once times."""
    old = copy.deepcopy(quiet)
    new = copy.deepcopy(quiet)
    step = old.timing.unprofiled.median
    document = json.loads(old.to_json())
    document["schema_version"] = 2
    document["breakdown"] = {"device_seconds_by_kernel_class": {"communication": 0.6 * step}}
    old = record_from_dict(document)
    assert old.breakdown.device_seconds_by_kernel_class == {}
    # Overlapped with compute, communication counted once is far less than its sum.
    new.breakdown = Breakdown(
        device_seconds_by_kernel_class={"communication": 0.1 * step},
        kernel_seconds_summed_by_class={"communication": 0.6 * step},
    )
    comparison = compare_records(old, new)
    verdicts = {m.key: m.verdict for m in comparison.metrics if m.kind == "kernel_class"}
    assert verdicts == {"kernel_class.communication": "same"}
    assert any("summed kernel time" in note for note in comparison.notes)


# --------------------------------------------------------------------------------------------
# Findings


def _finding(fid: str, severity: str) -> Finding:
    return Finding(id=fid, severity=severity, title=f"title of {fid}", category="compute")  # type: ignore[arg-type]


def test_findings_diff_new_gone_and_regraded(quiet: RunRecord) -> None:
    a = copy.deepcopy(quiet)
    b = copy.deepcopy(quiet)
    a.findings = [_finding("kept", "warn"), _finding("gone", "critical"), _finding("up", "warn")]
    a.findings.append(_finding("down", "critical"))
    b.findings = [_finding("kept", "warn"), _finding("up", "critical"), _finding("down", "info")]
    b.findings += [_finding("new.warn", "warn"), _finding("new.info", "info")]
    changes = {
        (c.id, c.change, c.baseline_severity, c.current_severity) for c in diff_findings(a, b)
    }
    assert changes == {
        ("gone", "gone", "critical", None),
        ("up", "escalated", "warn", "critical"),
        ("down", "deescalated", "critical", "info"),
        ("new.warn", "new", None, "warn"),
        ("new.info", "new", None, "info"),
    }
    comparison = compare_records(a, b)
    # A warn finding escalated to critical is a new critical; a new warn is not.
    assert [f.subject for f in gate_failures(comparison)] == ["up"]
    # --fail-on new-warn: anything new or escalated at warn or above.
    assert {f.subject for f in gate_failures(comparison, {"new-warn"})} == {"up", "new.warn"}
    assert gate_failures(comparison, {"slower"}) == ()


def test_a_new_critical_finding_fails_even_when_s_it_held(quiet: RunRecord) -> None:
    current = copy.deepcopy(quiet)
    current.findings = [_finding("attention.math_fallback", "critical")]
    comparison = compare_records(quiet, current)
    assert comparison.step is not None and comparison.step.verdict == "same"
    assert gate_exit_code(comparison) == ExitCode.REGRESSION
    assert gate_exit_code(comparison, {"slower"}) == ExitCode.OK


def test_parse_fail_on() -> None:
    assert parse_fail_on("slower, phase,new-warn") == {"slower", "phase", "new-warn"}
    with pytest.raises(DiagnoseError) as raised:
        parse_fail_on("slower,faster")
    assert raised.value.code == ExitCode.USAGE and "faster" in raised.value.message


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


def quiet_runs() -> list[list[float]]:
    """The recorded runs the report would not flag as noisy (IQR at most 10% of the median)."""
    from diagnose.reports.headline import NOISY_RELATIVE_SPREAD

    return [r for r in noise_runs() if Stats.of(r).relative_spread <= NOISY_RELATIVE_SPREAD]


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


# --------------------------------------------------------------------------------------------
# Several baselines: the runner's run-to-run drift


def _noise_run(name: str) -> list[float]:
    data = json.loads((COMPARE / "noise.json").read_text(encoding="utf-8"))
    return next(
        [s["seconds"] for s in run["samples"]] for run in data["runs"] if run["name"] == name
    )


def test_a_slow_process_is_not_a_regression_when_a_baseline_was_as_slow() -> None:
    """qq_3 and qq_6 are recorded same-config runs that ran ~20% slower all the way through (this
    box's run-to-run drift). Against one quiet baseline qq_6 reads as a regression; with qq_3
    among the baselines the gate sees that drift and does not fail."""
    quiet_run, slow_run, current = _noise_run("qq_1"), _noise_run("qq_3"), _noise_run("qq_6")
    kw: dict[str, Any] = dict(key="step", kind="step", label="s/it", threshold=0.1)
    one = compare_runs([quiet_run], current, baseline_labels=["qq_1"], significance=0.01, **kw)
    assert one.verdict == "slower"
    both = compare_runs(
        [quiet_run, slow_run], current, baseline_labels=["qq_1", "qq_3"], significance=0.01, **kw
    )
    assert both.verdict == "inconclusive"
    assert "run-to-run drift" in both.reason and "qq_3" in both.reason


def test_a_slowdown_beyond_the_slowest_baseline_is_still_caught() -> None:
    """The planted twin: the current run 30% slower than a quiet run is slower than every
    baseline, the slow-process one included."""
    quiet_run, slow_run = _noise_run("qq_2"), _noise_run("qq_3")
    current = [s * 1.3 for s in _noise_run("qq_1")]
    metric = compare_runs(
        [quiet_run, slow_run],
        current,
        baseline_labels=["qq_2", "qq_3"],
        key="step",
        kind="step",
        label="s/it",
        threshold=0.1,
        significance=0.01,
    )
    assert metric.verdict == "slower"
    assert "also against the slowest baseline alone (qq_3: slower" in metric.reason


def test_three_baselines_cut_false_alarms_between_separate_runs() -> None:
    """A/A between separate same-config runs on recorded quiet noise (the 16 idle_* runs carry a
    +10% drift between runs): against one baseline run the gate false-alarms often; against
    three, the drift it can see removes most of those alarms. (bench_compare_gate.py has the
    rates; this test holds the mechanism to its direction and size.)"""
    rng = random.Random(11)
    runs = [r for r in quiet_runs() if len(r) >= 30]
    kw: dict[str, Any] = dict(key="step", kind="step", label="s/it", threshold=0.1)

    def alarms(n_baselines: int, trials: int = 400) -> float:
        hits = 0
        for _ in range(trials):
            *bases, current = (r[:30] for r in rng.sample(runs, n_baselines + 1))
            labels = [f"b{i}" for i in range(n_baselines)]
            metric = compare_runs(bases, current, baseline_labels=labels, significance=0.01, **kw)
            hits += metric.verdict == "slower"
        return hits / trials

    one, three = alarms(1), alarms(3)
    assert one > 0.05  # the drift is real: a single baseline cannot see it
    assert three < one / 1.5


def test_several_baseline_records_show_the_drift_and_pool_the_samples(baseline: RunRecord) -> None:
    first = with_samples(baseline, _noise_run("qq_1"))
    second = with_samples(baseline, _noise_run("qq_3"))
    current = with_samples(baseline, _noise_run("qq_6"))
    comparison = compare_records([first, second], current, labels=["a", "b", "c"])
    assert [side.label for side in comparison.baselines] == ["a", "b"]
    assert comparison.step is not None and comparison.step.verdict == "inconclusive"
    assert comparison.step.n_baseline == len(_noise_run("qq_1")) + len(_noise_run("qq_3"))
    assert comparison.baseline_drift == pytest.approx(
        statistics.median(_noise_run("qq_3")) / statistics.median(_noise_run("qq_1")) - 1
    )
    assert any("drifts between runs" in note for note in comparison.notes)
    assert gate_exit_code(comparison) == ExitCode.INCONCLUSIVE
    # One baseline: no drift to see, and the same current run fails the gate.
    alone = compare_records(first, current)
    assert alone.baseline_drift is None and gate_exit_code(alone) == ExitCode.REGRESSION


def test_several_baselines_must_each_be_comparable(baseline: RunRecord) -> None:
    other = copy.deepcopy(baseline)
    other.config["precision"] = "fp32"
    other.created = "2026-11-30T10:00:00+00:00"
    with pytest.raises(DiagnoseError) as raised:
        compare_records([baseline, other], baseline, labels=["one", "two", "now"])
    assert raised.value.code == ExitCode.BAD_INPUT
    assert "two: config precision differs" in raised.value.message


def test_a_baseline_run_given_twice_is_refused(baseline: RunRecord) -> None:
    with pytest.raises(DiagnoseError) as raised:
        compare_records([baseline, copy.deepcopy(baseline)], baseline, labels=["a", "b", "now"])
    assert raised.value.code == ExitCode.BAD_INPUT
    assert raised.value.message.startswith("b is the same run as a")


def _runs(record: RunRecord, count: int) -> list[RunRecord]:
    """``count`` copies of ``record`` that read as separate runs (another creation time each)."""
    out = []
    for i in range(count):
        run = copy.deepcopy(record)
        run.created = f"2026-11-30T10:{i:02d}:00+00:00"
        out.append(run)
    return out


def test_a_single_number_counts_only_beyond_every_baseline(quiet: RunRecord) -> None:
    low, high, current = _runs(quiet, 3)
    low.timing.peak_rss_bytes, high.timing.peak_rss_bytes = 1000 * 2**20, 1200 * 2**20
    current.timing.peak_rss_bytes = 1150 * 2**20  # +15% on the lower baseline, not on the other
    metric = compare_records([low, high], current).metric("memory.peak_rss_bytes")
    assert metric is not None and metric.verdict == "same" and metric.n_baseline == 2
    current.timing.peak_rss_bytes = 1400 * 2**20  # +17% on the larger baseline too
    metric = compare_records([low, high], current).metric("memory.peak_rss_bytes")
    assert metric is not None and metric.verdict == "larger"
    assert "every baseline" in metric.reason


def test_findings_change_only_outside_the_range_the_baselines_showed(quiet: RunRecord) -> None:
    a, b, now = _runs(quiet, 3)
    a.findings = [_finding("flaky", "info"), _finding("sometimes", "warn")]
    a.findings += [_finding("climbs", "warn"), _finding("always", "warn")]
    b.findings = [_finding("flaky", "warn"), _finding("climbs", "info"), _finding("always", "info")]
    now.findings = [_finding("flaky", "warn"), _finding("climbs", "critical")]
    changes = {
        (c.id, c.change, c.baseline_severity, c.current_severity)
        for c in diff_findings([a, b], now)
    }
    # "flaky" was info in one baseline and warn in the other: warn now is within that range.
    # "sometimes" was in one baseline only: its absence now is within the range too.
    assert changes == {
        ("climbs", "escalated", "warn", "critical"),
        ("always", "gone", "info", None),  # in both baselines (info at least), not now
    }
    # One baseline: the same "flaky" reads as escalated.
    assert ("flaky", "escalated") in {(c.id, c.change) for c in diff_findings(a, now)}


def test_comparison_is_deterministic(baseline: RunRecord) -> None:
    first = compare_records(baseline, load("slow_data.json"))
    second = compare_records(baseline, load("slow_data.json"))
    assert first == second
    assert isinstance(first, Comparison)


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
