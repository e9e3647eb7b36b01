"""Every record the tool writes agrees with itself: no check id with two outcomes, no saving above
its step or phases, findings ranked critical → warn → info then by saving, and every check that
could not be judged shown in the report. Run over every trace fixture, every shared real GPU
trace, and real runs of the workload with planted slow-downs."""

from __future__ import annotations

import html
from pathlib import Path

import pytest

from diagnose.cli import main
from diagnose.record import SEVERITIES, Check, RunRecord
from diagnose.reports import render_html
from diagnose.reports.view import build_view
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from diagnose.verdicts import contradictions, settle
from tests.conftest import FIXTURES, QUICK, SHARED_TRACES


def _trace_files() -> list[Path]:
    files = sorted((FIXTURES / "traces").glob("*.json*"))
    if SHARED_TRACES.is_dir():
        files += sorted(SHARED_TRACES.rglob("*.json.gz"))
    return files


def assert_consistent(record: RunRecord) -> None:
    problems = contradictions(record)
    assert not problems, [str(p) for p in problems]
    # The report ranks what the record ranks: critical, then warn, then info, larger saving first.
    shown = build_view(record).findings
    order = {s: i for i, s in enumerate(SEVERITIES)}
    saving = {f.id: f.est_seconds_saved_per_it or 0.0 for f in record.findings}
    keys = [(-order[f.severity], -saving[f.id]) for f in shown]
    assert keys == sorted(keys)
    # Every question that could not be judged is said on the page.
    page = html.unescape(render_html(record))
    for check in record.all_checks():
        if check.outcome == "not_judged":
            assert check.text.strip().splitlines()[0].strip() in page, check


@pytest.mark.parametrize("trace", _trace_files(), ids=lambda p: p.name)
def test_every_trace_record_is_consistent(trace: Path) -> None:
    record = analysis_to_record(analyze_trace(trace), trace)
    settle(record)
    assert_consistent(record)


def test_a_planted_contradiction_is_caught_on_a_real_record() -> None:
    trace = FIXTURES / "traces" / "cpu_train_loop_math_attention.json.gz"
    record = analysis_to_record(analyze_trace(trace), trace)
    settle(record)
    assert record.findings, "the math-attention fixture must raise a finding"
    finding = record.findings[0]
    record.probes[0].checks.append(Check(finding.id, "ok", "found fine after all", "planted"))
    assert contradictions(record)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """One real run with the slow-downs users hit together: SDPA forced onto the math path, two
    resolution buckets, an 8-bit optimizer (each made a report contradict itself before)."""
    out = tmp_path_factory.mktemp("runs") / "planted"
    argv = [
        "run",
        "--out",
        str(out),
        *QUICK,
        "--precision",
        "fp32",
        "--attention",
        "math",
        "--resolution",
        "256,384",
        "--optimizer",
        "adamw8bit",
    ]
    assert main(argv) == 0
    return RunRecord.load(out)


def test_a_real_run_with_planted_slow_downs_is_consistent(planted_run: RunRecord) -> None:
    assert_consistent(planted_run)
    # The run really asked each question.
    ids = {c.id for c in planted_run.all_checks()}
    assert any(i.startswith("attention.") for i in ids)
    assert any(i.startswith("dataloader.") for i in ids)
    assert any(i.startswith("optimizer.") for i in ids)
    # The tiny model's LoRA tensors are below bitsandbytes' 8-bit threshold, the real SD1.5's
    # are not: no advice drawn from the shrunk model.
    state = [c for c in planted_run.all_checks() if c.id == "optimizer.8bit_state_mostly_fp32"]
    assert [c.outcome for c in state] == ["ok"] and "artefact of the shrunk" in state[0].text


def test_the_default_run_is_consistent(default_run: Path) -> None:
    assert_consistent(RunRecord.load(default_run))
