"""The comparison behind the CI gate on records: real records compared with each other, the
single numbers, the findings diff, the gate, and several baselines (the runner's run-to-run
drift). The statistics and verdicts on samples, and the false-alarm rate on recorded noise, are
``test_compare_samples.py``."""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
from typing import Any

import pytest

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate import (
    CompareOptions,
    Comparison,
    compare_records,
    compare_runs,
    diff_findings,
    gate_exit_code,
    gate_failures,
    parse_fail_on,
    record_differences,
)
from diagnose.record import Breakdown, Finding, RunRecord, StepSample
from diagnose.record_io import record_from_dict
from tests.recorded_runs import COMPARE, load, lognormal, quiet_runs, with_samples

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


def test_a_run_compared_with_itself_says_so(baseline: RunRecord) -> None:
    """`diagnose compare my-run my-run` passes, as it should, and says that it compared no two
    runs; two runs of the same config say nothing of the kind."""
    itself = compare_records(baseline, copy.deepcopy(baseline))
    assert any(note.startswith("current is the same run as baseline") for note in itself.notes)
    [again] = _runs(baseline, 1)
    assert not any("same run" in note for note in compare_records(baseline, again).notes)


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
