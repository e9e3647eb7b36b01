"""The gate reads a borderline finding as borderline, says when it cannot judge, and judges what
the machine's load cannot explain.

- Two runs that differ only by a finding that sat on its line (borderline in one, warn in the
  other) pass ``--fail-on new-warn``, and the output says why.
- A gated metric that could not be judged is INCONCLUSIVE with its own exit code, not PASS.
- Under load a change beyond what the measured load allows is a change: 128 px against 256 px
  runs with another process busy on one core is never PASS.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from diagnose.catalogs.dataloader_catalog import GPU_STARVED, STARVED_SHARE
from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.gate import compare_records, gate_exit_code
from diagnose.gate.metrics import MetricComparison
from diagnose.gate.record_metrics import judged_against_load
from diagnose.record import HostLoad, RunRecord
from diagnose.record_io import load_record
from tests.test_compare_cli import run_compare, write_record
from tests.test_verdict_lines import _judged, _run_with_wait


def _borderline_run() -> RunRecord:
    record = _judged(_run_with_wait(STARVED_SHARE, seed=1))
    [finding] = [f for f in record.findings if f.id == GPU_STARVED.id]
    assert finding.borderline is not None and finding.severity == "info"
    record.created = "2026-12-01T10:00:00+00:00"
    record.command = "diagnose run"
    return record


def _rerun_above_the_line(record: RunRecord) -> RunRecord:
    """The same run again, its wait landing above the line this time (its steps unchanged, so
    nothing but the finding differs)."""
    rerun = copy.deepcopy(record)
    rerun.created = "2026-12-01T11:00:00+00:00"
    finding = next(f for f in rerun.findings if f.id == GPU_STARVED.id)
    finding.borderline = None
    finding.severity = "warn"
    return rerun


def test_a_finding_borderline_in_the_baseline_is_no_new_warning(tmp_path: Path) -> None:
    baseline = _borderline_run()
    current = _rerun_above_the_line(baseline)
    base_path = write_record(tmp_path / "base.json", baseline)
    current_path = write_record(tmp_path / "current.json", current)
    code, out, err = run_compare([str(base_path), str(current_path), "--fail-on", "new-warn"])
    assert code == ExitCode.OK, out + err
    assert "borderline in the baseline (data wait " in out
    assert "not counted as a change" in out
    # The twin: the same change from a baseline that was not borderline is a new warning.
    sure = copy.deepcopy(baseline)
    finding = next(f for f in sure.findings if f.id == GPU_STARVED.id)
    finding.borderline = None
    sure_path = write_record(tmp_path / "sure.json", sure)
    code, out, _ = run_compare([str(sure_path), str(current_path), "--fail-on", "new-warn"])
    assert code == ExitCode.REGRESSION
    assert f"escalated warn finding {GPU_STARVED.id} (was info)" in out


def test_borderline_in_any_baseline_counts_and_the_current_side_too() -> None:
    borderline = _borderline_run()
    above = _rerun_above_the_line(borderline)
    absent = copy.deepcopy(borderline)
    absent.created = "2026-12-01T09:00:00+00:00"
    absent.findings = [f for f in absent.findings if f.id != GPU_STARVED.id]
    # Of two baselines one had no finding, the other had it borderline: warn now is no change.
    comparison = compare_records([absent, borderline], above)
    [change] = [c for c in comparison.findings if c.id == GPU_STARVED.id]
    assert change.change == "borderline" and "baseline 2" in change.note
    assert gate_exit_code(comparison, {"new-warn"}) == ExitCode.OK
    # Borderline now, warn before: no change either (and nothing said as fixed).
    back = compare_records(above, borderline)
    [change] = [c for c in back.findings if c.id == GPU_STARVED.id]
    assert change.change == "borderline" and "the current record" in change.note


def test_a_borderline_finding_does_not_excuse_a_jump_past_another_line() -> None:
    """Borderline at the warn line says nothing about the critical one."""
    baseline = _borderline_run()
    current = _rerun_above_the_line(baseline)
    next(f for f in current.findings if f.id == GPU_STARVED.id).severity = "critical"
    comparison = compare_records(baseline, current)
    [change] = [c for c in comparison.findings if c.id == GPU_STARVED.id]
    assert change.change == "escalated"
    assert gate_exit_code(comparison, {"new-critical"}) == ExitCode.REGRESSION


# --------------------------------------------------------------------------------------------
# Under load


def _slower(ci_low: float) -> MetricComparison:
    return MetricComparison(
        key="step",
        kind="step",
        label="s/it",
        unit="seconds",
        verdict="slower",
        reason="+48%",
        ratio=1.48,
        ci_low=ci_low,
        ci_high=1.54,
    )


def _loaded(share: float, swing: float = 0.05) -> RunRecord:
    record = RunRecord()
    record.timing.host_load = HostLoad(
        basis="psutil",
        seconds=10.0,
        cpus=2,
        others_cores=2 * share,
        others_cores_high=2 * share,
        competing_share=share,
        allowance=swing,
    )
    return record


def test_a_change_beyond_what_the_load_allows_is_a_change() -> None:
    # Both runs under the same load: it slowed both alike and explains none of the +29…+54%.
    alike = judged_against_load(_slower(1.29), [_loaded(0.5)], _loaded(0.5))
    assert alike.verdict == "slower" and "could explain at most" in alike.reason
    # A quiet baseline and a busy current run: half the cores taken could double the time.
    quiet = judged_against_load(_slower(1.29), [RunRecord()], _loaded(0.5))
    assert quiet.verdict == "inconclusive" and "could be the load" in quiet.reason
    # Beyond even that, a change stands.
    far = judged_against_load(
        dataclasses.replace(_slower(2.4), ci_high=2.6), [RunRecord()], _loaded(0.5)
    )
    assert far.verdict == "slower"


#: A run with enough steps to judge and no probes (the gate reads the steps only).
_STEPS_ONLY = [
    "--steps",
    "8",
    "--warmup",
    "1",
    "--profiled-steps",
    "1",
    "--no-progress",
    *(
        option
        for probe in ("precision", "attention", "dataloader", "optimizer", "roofline")
        for option in ("--skip", probe)
    ),
]


@pytest.mark.slow
def test_128_against_256_px_under_a_busy_core_is_not_pass(
    tmp_path: Path, busy_core: None, capsys: pytest.CaptureFixture[str]
) -> None:
    small, large = tmp_path / "px128", tmp_path / "px256"
    assert main(["run", "--out", str(small), "--resolution", "128", *_STEPS_ONLY]) == 0
    assert main(["run", "--out", str(large), "--resolution", "256", *_STEPS_ONLY]) == 0
    for folder in (small, large):
        load = load_record(folder).timing.host_load
        assert load is not None and load.others_cores > 0.5  # the spinner was seen
    capsys.readouterr()
    code = main(["compare", str(small), str(large), "--allow-different"])
    out = capsys.readouterr().out
    assert code in (ExitCode.REGRESSION, ExitCode.INCONCLUSIVE), out
    assert "diagnose compare: PASS" not in out
    if code == ExitCode.INCONCLUSIVE:
        assert out.startswith("diagnose compare: INCONCLUSIVE")


def test_inconclusive_is_said_and_has_its_own_exit_code(tmp_path: Path) -> None:
    record = _borderline_run()
    record.timing.samples = record.timing.samples[:3]  # too few steps to judge
    record.timing.summarize()
    other = copy.deepcopy(record)
    other.created = "2026-12-02T10:00:00+00:00"
    for sample in other.timing.samples:
        sample.seconds *= 3
    other.timing.summarize()
    a = write_record(tmp_path / "a.json", record)
    b = write_record(tmp_path / "b.json", other)
    code, out, _ = run_compare([str(a), str(b)])
    assert code == ExitCode.INCONCLUSIVE == 9
    assert out.startswith("diagnose compare: INCONCLUSIVE") and "PASS" not in out.splitlines()[0]
    code, out, _ = run_compare([str(a), str(b), "--fail-on", "slower,new-critical"])
    assert code == ExitCode.OK and out.startswith("diagnose compare: PASS")
