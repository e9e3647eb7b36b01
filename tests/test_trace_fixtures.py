"""The small traces kept in fixtures/traces (always present, unlike ../shared/gpu-traces): the
inputs CLI and report tests can rely on."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose.trace.analysis import analysis_to_record, analyze_trace
from tests.conftest import ok_lines

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
#: The findings each trace raises, borderline ones aside (a value straddling its line: the CPU
#: loops wait for data about 9% of their steps, at the 10% line).
EXPECTED = {
    "cpu_train_loop.json.gz": set(),
    "cpu_train_loop_math_attention.json.gz": {"attention.math_fallback"},
    "gpu_synthetic_optimizer_sync.json.gz": {"optimizer.sync_in_step"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_trace(name: str) -> None:
    analysis = analyze_trace(TRACES / name)
    assert {f.id for f in analysis.findings if f.borderline is None} == EXPECTED[name]
    assert all(f.severity == "info" for f in analysis.findings if f.borderline is not None)
    assert len(analysis.steps) == 3
    record = analysis_to_record(analysis, TRACES / name)
    assert record.mode == "trace" and record.timing.profiled.n == 3
    assert ok_lines(record.probes[0])
