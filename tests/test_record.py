"""RunRecord: JSON round trip, forgiving load of older/partial records, clear errors on bad ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import (
    SCHEMA_VERSION,
    Finding,
    ProbeResult,
    RunRecord,
    Stats,
    StepSample,
    Timing,
    new_record,
)
from tests.conftest import FIXTURES


def _sample_record() -> RunRecord:
    record = new_record("run")
    record.device.kind = "cpu"
    record.device.name = "Test CPU"
    record.timing = Timing(
        warmup_steps=1,
        samples=[
            StepSample(index=i, seconds=s, profiled=p, phases={"forward": s / 2, "other": s / 2})
            for i, (s, p) in enumerate([(0.5, False), (0.7, False), (0.6, False), (0.9, True)])
        ],
    )
    record.timing.summarize()
    record.findings = [
        Finding(id="a.small", title="small", est_seconds_saved_per_it=0.01, severity="warn"),
        Finding(id="b.big", title="big", est_seconds_saved_per_it=0.2, saving_basis="measured"),
        Finding(id="c.none", title="unknown saving", severity="critical"),
    ]
    record.probes = [ProbeResult(name="x", status="error", reason="boom", traceback="Traceback...")]
    return record


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    record = _sample_record()
    path = tmp_path / "record.json"
    record.save(path)
    loaded = RunRecord.load(path)
    assert loaded == record
    assert RunRecord.load(tmp_path) == record  # a run folder works too


def test_stats_are_derived_from_samples() -> None:
    record = _sample_record()
    assert record.timing.unprofiled.n == 3
    assert record.timing.unprofiled.median == pytest.approx(0.6)
    assert record.timing.unprofiled.q1 == pytest.approx(0.55)
    assert record.timing.unprofiled.q3 == pytest.approx(0.65)
    assert record.timing.profiled.median == pytest.approx(0.9)
    assert record.timing.profiler_overhead == pytest.approx(0.5)
    # Summaries written in a file are ignored in favour of the samples.
    data = record.to_dict()
    data["timing"]["unprofiled"]["median"] = 123.0
    assert RunRecord.from_dict(data).timing.unprofiled.median == pytest.approx(0.6)


def test_stats_of_nothing_is_nan_and_serialises_as_null() -> None:
    assert math.isnan(Stats.of([]).median)
    text = new_record("trace").to_json()
    assert "NaN" not in text
    assert RunRecord.from_dict(json.loads(text)).timing.unprofiled.n == 0


def test_ranked_findings_by_saving_then_severity() -> None:
    ids = [f.id for f in _sample_record().ranked_findings()]
    assert ids == ["b.big", "a.small", "c.none"]


def test_unknown_fields_are_ignored_and_missing_ones_defaulted() -> None:
    data = _sample_record().to_dict()
    data["a_field_from_the_future"] = {"x": 1}
    data["findings"][0]["another_new_field"] = True
    del data["notes"]
    del data["top_ops"]
    record = RunRecord.from_dict(data)
    assert record.notes == []
    assert record.top_ops == []
    assert record.findings[0].id == "a.small"


def test_not_judged_lines_round_trip_and_older_records_keep_theirs() -> None:
    record = _sample_record()
    record.probes = [ProbeResult(name="trace", not_judged=["optimizer: no device kernels"])]
    again = RunRecord.from_dict(json.loads(record.to_json()))
    assert again.probes[0].not_judged == ["optimizer: no device kernels"]
    # Records written before the field existed kept the lines in the probe's data.
    data = record.to_dict()
    del data["probes"][0]["not_judged"]
    data["probes"][0]["data"] = {"not_judged": ["launch overhead: one step only"], "x": 1}
    old = RunRecord.from_dict(data)
    assert old.probes[0].not_judged == ["launch overhead: one step only"]
    assert old.probes[0].data == {"x": 1}


def test_oldest_supported_record_fixture_loads() -> None:
    """A record of the first schema with only the fields the design asked for still loads."""
    record = RunRecord.load(FIXTURES / "records" / "v1_minimal.json")
    assert record.mode == "run"
    assert record.timing.unprofiled.n == 3
    assert record.findings[0].id == "attention.math_fallback"
    assert record.probes[0].status == "skipped"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "invalid JSON"),
        ("[]", "not a diagnose record"),
        ('{"hello": 1}', "not a diagnose record"),
        ('{"schema_version": 99, "mode": "run"}', "newer than this diagnose"),
        ('{"schema_version": 1, "mode": "bogus"}', "malformed record"),
        (
            '{"schema_version": 1, "mode": "run", "timing": {"samples": [{"seconds": "x"}]}}',
            "number",
        ),
        ('{"schema_version": 1, "mode": "run", "findings": {}}', "must be a list"),
    ],
)
def test_bad_records_give_one_line_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "record.json"
    path.write_text(content)
    with pytest.raises(DiagnoseError) as info:
        RunRecord.load(path)
    assert message in info.value.message
    assert str(path) in info.value.message
    assert "\n" not in info.value.message
    assert info.value.code == ExitCode.BAD_INPUT


def test_missing_record_file(tmp_path: Path) -> None:
    with pytest.raises(DiagnoseError, match="no such file"):
        RunRecord.load(tmp_path / "nope.json")


def test_schema_version_constant_matches_fixture() -> None:
    # When SCHEMA_VERSION is bumped, a migration for the old version must exist and this fixture
    # keeps proving that old records load.
    data = json.loads((FIXTURES / "records" / "v1_minimal.json").read_text())
    assert data["schema_version"] <= SCHEMA_VERSION


def _record_with_step(seconds: float, saving: float) -> RunRecord:
    record = RunRecord()
    record.timing.samples = [StepSample(index=i, seconds=seconds) for i in range(5)]
    record.timing.summarize()
    record.findings = [Finding(id="x.y", est_seconds_saved_per_it=saving)]
    return record


def test_a_saving_larger_than_the_step_is_capped_at_the_step() -> None:
    record = _record_with_step(1.44, 2.62)
    record.bound_savings()
    finding = record.findings[0]
    assert finding.est_seconds_saved_per_it == 1.44
    assert finding.evidence["saving_before_cap_seconds"] == 2.62


def test_a_saving_within_the_step_is_left_alone() -> None:
    record = _record_with_step(1.44, 0.6)
    record.bound_savings()
    assert record.findings[0].est_seconds_saved_per_it == 0.6
    assert "saving_before_cap_seconds" not in record.findings[0].evidence
