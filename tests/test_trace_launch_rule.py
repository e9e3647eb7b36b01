"""The launch rule (``compute.launch_bound``) on real traces, judged the way a record is saved:
through :func:`diagnose.verdicts.settle` and the record's ranking."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose.catalogs.compute_catalog import RECOVERABLE
from diagnose.record import RunRecord
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from diagnose.verdicts import contradictions, settle


def _settled(path: Path) -> RunRecord:
    record = analysis_to_record(analyze_trace(path), path)
    settle(record)
    return record


def test_a_gpu_waiting_for_the_host_most_of_the_step_is_critical_and_first(
    shared_traces: Path,
) -> None:
    """Regression: on the MI250 toy step the GPU waits for the host 98% of the step, yet an
    info finding of 0.04 ms was ranked above it. The wait is read off the trace, so it is the
    saving (basis "trace"), and the one severity rule makes it critical."""
    record = _settled(shared_traces / "rocm" / "mi250_minitoy_train.json.gz")
    ranked = record.ranked_findings()
    first = ranked[0]
    assert first.id == "compute.launch_bound", [(f.id, f.severity) for f in ranked]
    assert first.severity == "critical"
    assert first.saving_basis == "trace"
    step = record.timing.headline.median
    wait = first.evidence["device_waiting_for_host_seconds_per_step"]
    assert first.evidence["share_of_step"] > 0.9
    saving = first.est_seconds_saved_per_it
    assert saving is not None and saving == pytest.approx(wait) and saving <= step
    assert first.sure_seconds_saved_per_it == pytest.approx(wait * RECOVERABLE)
    assert all(f.severity != "critical" for f in ranked[1:])
    assert contradictions(record) == []
    [check] = [c for c in record.all_checks() if c.id == "compute.launch_bound"]
    assert check.outcome == "finding" and check.source == "trace:launch"


def test_a_busy_device_answers_the_launch_question_ok(shared_traces: Path) -> None:
    record = _settled(shared_traces / "rocm" / "mi300x_torch_compile_triton.json.gz")
    assert "compute.launch_bound" not in {f.id for f in record.findings}
    [check] = [c for c in record.all_checks() if c.id == "compute.launch_bound"]
    assert check.outcome == "ok" and check.text.startswith("host overhead")
