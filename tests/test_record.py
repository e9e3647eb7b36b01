"""RunRecord: JSON round trip, forgiving load of older/partial records, clear errors on bad ones."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from diagnose.cli import main
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
from diagnose.record_io import load_record, record_from_dict
from diagnose.verdicts import ranked
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
    loaded = load_record(path)
    assert loaded == record
    assert load_record(tmp_path) == record  # a run folder works too


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
    assert record_from_dict(data).timing.unprofiled.median == pytest.approx(0.6)


def test_profiler_overhead_compares_steps_of_the_same_input_shape() -> None:
    # Small steps 0.2 s and large 1.4 s, unprofiled; the two profiled steps drew the large
    # bucket and took 10% longer. The pooled medians would call that +250%.
    plain = [
        StepSample(index=i, seconds=0.2 if i % 2 else 1.4, bucket="64x64" if i % 2 else "128x128")
        for i in range(8)
    ]
    profiled = [
        StepSample(index=8 + i, seconds=1.54, profiled=True, bucket="128x128") for i in range(2)
    ]
    timing = Timing(samples=[*plain, *profiled])
    timing.summarize()
    assert timing.profiler_overhead == pytest.approx(0.1)
    # A profiled shape no unprofiled step had cannot be compared.
    odd = Timing(samples=[*plain, StepSample(index=9, seconds=3.0, profiled=True, bucket="9x9")])
    odd.summarize()
    assert odd.profiler_overhead is None
    # One shape: the pooled medians, as before.
    same = Timing(samples=[StepSample(index=0, seconds=1.0), StepSample(1, 1.2, profiled=True)])
    same.summarize()
    assert same.profiler_overhead == pytest.approx(0.2)


def test_stats_of_nothing_is_nan_and_serialises_as_null() -> None:
    assert math.isnan(Stats.of([]).median)
    text = new_record("trace").to_json()
    assert "NaN" not in text
    assert record_from_dict(json.loads(text)).timing.unprofiled.n == 0


def test_ranked_findings_by_severity_then_saving() -> None:
    ids = [f.id for f in ranked(_sample_record().findings)]
    assert ids == ["c.none", "a.small", "b.big"]


def test_unknown_fields_are_ignored_and_missing_ones_defaulted() -> None:
    data = _sample_record().to_dict()
    data["a_field_from_the_future"] = {"x": 1}
    data["findings"][0]["another_new_field"] = True
    del data["notes"]
    del data["top_ops"]
    record = record_from_dict(data)
    assert record.notes == []
    assert record.top_ops == []
    assert record.findings[0].id == "a.small"


def test_checks_round_trip() -> None:
    record = _sample_record()
    probe = ProbeResult(name="trace")
    probe.add_not_judged("optimizer.sync_in_step", "syncs: no device kernels", "trace:syncs")
    probe.add_ok("compute.launch_bound", "host overhead: 2% of the step", "trace:launch")
    record.probes = [probe]
    again = record_from_dict(json.loads(record.to_json()))
    assert again.probes[0].checks == probe.checks


def test_oldest_supported_record_fixture_loads() -> None:
    """A record of the first schema with only the fields the design asked for still loads."""
    record = load_record(FIXTURES / "records" / "v1_minimal.json")
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
        load_record(path)
    assert message in info.value.message
    assert str(path) in info.value.message
    assert "\n" not in info.value.message
    assert info.value.code == ExitCode.BAD_INPUT


def test_missing_record_file(tmp_path: Path) -> None:
    with pytest.raises(DiagnoseError, match="no such file"):
        load_record(tmp_path / "nope.json")


def test_schema_version_constant_matches_fixture() -> None:
    # When SCHEMA_VERSION is bumped, a migration for the old version must exist and this fixture
    # keeps proving that old records load.
    data = json.loads((FIXTURES / "records" / "v1_minimal.json").read_text())
    assert data["schema_version"] <= SCHEMA_VERSION


def test_a_version_1_record_gets_its_lines_and_findings_as_checks() -> None:
    data = json.loads((FIXTURES / "records" / "v1_minimal.json").read_text())
    data["probes"][0]["checked_ok"] = ["optimizer: no sync inside the step"]
    data["probes"][0]["data"] = {"not_judged": ["optimizer: bitsandbytes missing"]}
    record = record_from_dict(data)
    assert record.schema_version == SCHEMA_VERSION
    by_outcome = {c.outcome: c for c in record.all_checks()}
    assert by_outcome["ok"].text == "optimizer: no sync inside the step"
    assert by_outcome["not_judged"].text == "optimizer: bitsandbytes missing"
    assert by_outcome["finding"].id == "attention.math_fallback"
    assert "not_judged" not in record.probes[0].data


# --------------------------------------------------------------------------------------------
# Loading hostile or corrupt files (diagnose.record_io)


def _one_line_error(path: Path) -> str:
    with pytest.raises(DiagnoseError) as info:
        load_record(path)
    assert info.value.code == ExitCode.BAD_INPUT
    assert "\n" not in info.value.message and str(path) in info.value.message
    return info.value.message


def _with_steps(tmp_path: Path, seconds: list[str]) -> Path:
    """The v1 fixture with its step times replaced by JSON literals (NaN, Infinity, 1e308...)."""
    text = (FIXTURES / "records" / "v1_minimal.json").read_text()
    for old, new in zip(("1.80", "1.84", "1.90"), seconds, strict=True):
        text = text.replace(f'"seconds": {old}', f'"seconds": {new}', 1)
    path = tmp_path / "record.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("literal", "reason"),
    [
        ("-1.0", "zero or negative"),
        ("0", "zero or negative"),
        ("null", "not a finite number"),
        ("NaN", "not a finite number"),
        ("Infinity", "not a finite number"),
        ("-Infinity", "not a finite number"),
        ("1e308", "longer than a day"),
    ],
)
def test_impossible_step_times_are_left_out_and_counted(
    tmp_path: Path, literal: str, reason: str
) -> None:
    record = load_record(_with_steps(tmp_path, ["1.80", literal, "1.90"]))
    assert [s.seconds for s in record.timing.samples] == [1.80, 1.90]
    assert record.timing.unprofiled.median == pytest.approx(1.85)
    assert record.notes[-1] == (
        f"Left out when the record was read: 1 step sample with an impossible time (1 {reason}); "
        "2 valid steps remain."
    )
    # The clean twin: every step kept, nothing noted.
    clean = load_record(_with_steps(tmp_path, ["1.80", "1.84", "1.90"]))
    assert len(clean.timing.samples) == 3 and not clean.notes


def test_a_record_of_only_impossible_steps_reports_no_step_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "−1.00 s/it" for negative steps, and an OverflowError (in math.fsum) for 1e308."""
    path = _with_steps(tmp_path, ["-1.0", "1e308", "NaN"])
    record = load_record(path)
    assert record.timing.samples == [] and record.timing.unprofiled.n == 0
    assert "3 step samples with an impossible time" in record.notes[-1]
    capsys.readouterr()
    assert main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 0
    out, err = capsys.readouterr()
    assert "s/it (median" not in out and "-1.00" not in out and "−1.00" not in out
    assert "note: Left out when the record was read: 3 step samples" in out
    assert err == ""
    assert "3 step samples with an impossible time" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested more than 100 deep"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested more than 100 deep"),
        (
            b'{"schema_version": 1, "mode": "run", "config": {"x": '
            + b"[" * 150
            + b"]" * 150
            + b"}}",
            "nested more than 100 deep",
        ),
        (b'{"schema_version": 1, "mode": "run", "config": {"seed": 1' + b"0" * 30 + b"}}", "range"),
        (b'{"schema_version": 1' + b"0" * 5000 + b', "mode": "run"}', "thousands of digits"),
        (b'{"schema_version": 1, "mode": "run"}\xff', "not UTF-8"),
        ('{"schema_version": 1, "mode": "run"}'.encode("utf-16"), "not UTF-8"),
        (b'{"schema_version": 1, "mode": "run", "probes": [{"name": [1]}]}', "malformed record"),
        (
            b'{"schema_version": 1, "mode": "run", "probes": [{"checked_ok": 3}]}',
            "malformed record",
        ),
        (
            b'{"schema_version": 2, "mode": "run",'
            b' "findings": [{"est_seconds_saved_per_it": 1e308}]}',
            "findings[0].est_seconds_saved_per_it is 1e+308",
        ),
        (
            b'{"schema_version": 2, "mode": "run", "breakdown": {"seconds": {"forward": "fast"}}}',
            "breakdown.seconds['forward'] is str",
        ),
        (
            b'{"schema_version": 2, "mode": "run", "inventory": {"x": Infinity}}',
            "inventory['x'] is inf",
        ),
        (
            b'{"schema_version": 2, "mode": "run", "timing": {"samples": [{"seconds": 1,'
            b' "phases": {"forward": NaN}}]}}',
            "timing.samples[0].phases['forward'] is nan",
        ),
    ],
)
def test_hostile_records_are_one_line_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "record.json"
    path.write_bytes(content)
    assert message in _one_line_error(path)


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    plain = FIXTURES / "records" / "v1_minimal.json"
    marked = tmp_path / "record.json"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_record(marked) == load_record(plain)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    assert "not a regular file" in _one_line_error(fifo)
    loop = tmp_path / "loop.json"
    loop.symlink_to(tmp_path / "loop2.json")
    (tmp_path / "loop2.json").symlink_to(loop)
    assert "Too many levels of symbolic links" in _one_line_error(loop)
    if Path("/dev/zero").exists():
        zero = tmp_path / "zero.json"
        zero.symlink_to("/dev/zero")
        assert "not a regular file" in _one_line_error(zero)
    folder = tmp_path / "run"
    folder.mkdir()
    os.mkfifo(folder / "record.json")
    assert "not a regular file" in _one_line_error(folder)


def test_every_fixture_record_loads_as_before() -> None:
    """The validation changes nothing in a valid record: loading equals building from the JSON."""
    paths = [*(FIXTURES / "compare").glob("*.json"), FIXTURES / "records" / "v1_minimal.json"]
    for path in paths:
        data = json.loads(path.read_text())
        if "schema_version" not in data:  # noise.json holds step times, not a record
            continue
        assert load_record(path) == record_from_dict(data), path
