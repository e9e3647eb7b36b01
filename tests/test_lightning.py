"""Real PyTorch Lightning runs on the CPU (Trainer(precision="bf16-mixed"), AdamW), traced by
Lightning's own profiler and profiled by ``diagnose profile``: the phases are what ran whether
Lightning steps the optimizer with a closure (automatic optimization) or the module steps it
(manual), gradient accumulation reads as micro-batches, a planted fp32 block is found (its twin
stays quiet), and the fixes are written in Lightning's words."""

from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.record import RunRecord
from diagnose.trace.analysis import StepStat, TraceAnalysis, analysis_to_record, analyze_trace

pytest.importorskip("lightning")

SCRIPT = Path(__file__).parent / "data" / "lightning_train.py"
UPCAST_ID = "precision.fp32_compute_in_low_precision_run"


@pytest.fixture(scope="module")
def analyses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("lightning")
    # One process trains every variant, one after another (Lightning's import is most of a small
    # run's time), each traced by its own profiler.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--variants", str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    out: dict[str, TraceAnalysis] = {}
    for name in ("closure", "manual", "accumulate", "upcast", "plain"):
        (trace,) = (folder / name).glob("*.json")
        out[name] = analyze_trace(trace)
    return out


@pytest.fixture(scope="module")
def records(analyses: dict[str, TraceAnalysis]) -> dict[str, RunRecord]:
    return {name: analysis_to_record(a, Path(a.path)) for name, a in analyses.items()}


@pytest.mark.parametrize("run", ["closure", "manual", "plain"])
def test_forward_and_backward_are_what_they_are_and_the_phases_add_up(
    analyses: dict[str, TraceAnalysis], run: str
) -> None:
    # Step by step, each phase against the ops that must lie in it, both read off one trace: a
    # busy machine stretches an op and the phase that holds it alike. (Phases compared with one
    # another, or a sum of per-phase medians with the median step, are what load flips.)
    events = _events(Path(analyses[run].path))
    linears = [e for e in events if e["name"] == "aten::linear"]
    addmm_backward = [
        e for e in events if e["name"] == "autograd::engine::evaluate_function: AddmmBackward0"
    ]
    assert len(analyses[run].steps) >= 2
    for step in analyses[run].steps:
        phases = step.phases
        assert phases.get("optimizer", 0.0) > 0
        # Before closures were split, a closure's forward and backward were charged to the
        # optimizer: the forward and backward phases then missed their own ops.
        assert phases.get("forward", 0.0) >= 0.99 * _inside(linears, step), phases
        assert phases.get("backward", 0.0) >= 0.99 * _inside(addmm_backward, step), phases
        assert sum(phases.values()) == pytest.approx(step.wall_seconds, rel=1e-6)


def _events(trace: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


def _inside(events: list[dict[str, Any]], step: StepStat) -> float:
    """Seconds of the step the events cover (autocast's linear holds the cast inputs' linear:
    nested events count once)."""
    spans = sorted(
        (max(float(e["ts"]), step.start_us), min(float(e["ts"]) + float(e["dur"]), step.end_us))
        for e in events
    )
    covered, reached = 0.0, step.start_us
    for start, end in spans:
        if end > max(start, reached):
            covered += end - max(start, reached)
            reached = end
    assert covered > 0, step.label
    return covered / 1e6


def _updates(trace: Path) -> list[tuple[float, float, Any]]:
    """The optimizer's own work in each step, from the raw events in plain Python: each
    optimizer step's range from the end of the last backward op inside it (a closure's) to its
    end, as (start, end, thread). A step range the profiler's stop cut (it ends with the trace)
    is left out."""
    events = _events(trace)
    last = max(float(e["ts"]) + float(e["dur"]) for e in events if e.get("cat") != "Trace")
    backward = [
        e
        for e in events
        if e["name"].startswith("autograd::engine::evaluate_function")
        or e["name"].endswith("Backward0")
    ]
    updates = []
    for step in (e for e in events if e["name"].startswith("Optimizer.step#")):
        start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        if end > last - 1.0:
            continue
        inside = [
            float(b["ts"]) + float(b["dur"])
            for b in backward
            if b["tid"] == step["tid"] and start <= float(b["ts"]) < end
        ]
        updates.append((max(inside, default=start), end, step["tid"]))
    return updates


def _update_referee(trace: Path) -> float:
    """Seconds per step of the optimizer's own work: the median update (:func:`_updates`) plus
    the median zero_grad range."""
    updates = [end - start for start, end, _ in _updates(trace)]
    zero = [float(e["dur"]) for e in _events(trace) if e["name"].startswith("Optimizer.zero_grad#")]
    return (statistics.median(updates) + statistics.median(zero or [0.0])) / 1e6


@pytest.mark.parametrize("run", ["closure", "manual", "plain"])
def test_the_optimizer_phase_is_the_update_alone(records: dict[str, RunRecord], run: str) -> None:
    phase = records[run].breakdown.seconds["optimizer"]
    referee = _update_referee(Path(records[run].trace_path))
    # One trace, two readings of it: whatever the machine's load, they agree.
    assert phase == pytest.approx(referee, rel=0.2), (phase, referee)
    # (That the last step keeps its forward, though the profiler stops inside a step's
    # optimizer.step(closure) with the forward recorded and not the backward, is held by
    # test_forward_and_backward_are_what_they_are_and_the_phases_add_up, step by step.)


@pytest.mark.parametrize("run", ["closure", "manual"])
def test_the_update_read_is_a_plain_loops_update(records: dict[str, RunRecord], run: str) -> None:
    # The optimizer phase is held against the update read off the raw events (above); that
    # update, in a Lightning run, is a plain loop's with the same parameters, gradients and
    # AdamW, op for op. Counted, not timed: two runs' times differ by whatever the machine did
    # between them (benchmarks/bench_lightning_phases.py interleaves rounds to compare times).
    lightning = _ops_per_update(Path(records[run].trace_path))
    plain = _ops_per_update(Path(records["plain"].trace_path))
    assert lightning, run
    # Lightning's own bookkeeping adds an op or so (it detaches the closure's loss).
    for name in set(lightning) | set(plain):
        assert abs(lightning.get(name, 0) - plain.get(name, 0)) <= 1, (name, lightning, plain)


def _ops_per_update(trace: Path) -> dict[str, int]:
    """The aten ops that start in the optimizer's updates, by name, per update (the median)."""
    events = [e for e in _events(trace) if e["name"].startswith("aten::")]
    per_update = [
        collections.Counter(
            e["name"] for e in events if e["tid"] == tid and start <= float(e["ts"]) < end
        )
        for start, end, tid in _updates(trace)
    ]
    names = {n for counts in per_update for n in counts}
    return {n: round(statistics.median(c[n] for c in per_update)) for n in names}


def test_accumulated_batches_read_as_one_step_of_two(
    records: dict[str, RunRecord], analyses: dict[str, TraceAnalysis]
) -> None:
    accumulated, single = records["accumulate"], records["closure"]
    assert accumulated.breakdown.micro_batches_per_step == 2
    assert single.breakdown.micro_batches_per_step == 1
    assert any("mark micro-batches" in note for note in accumulated.notes)
    assert not any("mark micro-batches" in note for note in single.notes)
    # Two forward and backward passes, one update, in every step: counted in each step the
    # analysis read (timing the two runs against each other is what load flips).
    for run, passes in (("accumulate", 2), ("closure", 1)):
        events = _events(Path(analyses[run].path))
        for step in analyses[run].steps:
            assert _count(events, "SingleDeviceStrategy.training_step", step) == passes, run
            assert _count(events, "Optimizer.step#", step) == 1, run


def _count(events: list[dict[str, Any]], name: str, step: StepStat) -> int:
    return sum(
        1 for e in events if name in e["name"] and step.start_us <= float(e["ts"]) < step.end_us
    )


def test_the_planted_fp32_block_is_found_and_its_twin_stays_quiet(
    records: dict[str, RunRecord],
) -> None:
    found = [f for f in records["upcast"].findings if f.id == UPCAST_ID]
    assert found, [f.id for f in records["upcast"].findings]
    assert not [f for f in records["closure"].findings if f.id == UPCAST_ID]
    # In Lightning's words only.
    fix = found[0].fix
    assert 'Trainer(precision="bf16-mixed")' in fix
    assert "kohya" not in fix and "diffusers scripts" not in fix and "OneTrainer" not in fix


def test_the_run_is_named_lightnings(records: dict[str, RunRecord]) -> None:
    for name in ("closure", "manual", "accumulate", "upcast"):
        assert records[name].config.get("trainer") == "lightning"
        assert any(n.startswith("Trainer: Lightning") for n in records[name].notes)
    assert "trainer" not in records["plain"].config


def _profile_record(out: Path) -> dict[str, Any]:
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


def test_diagnose_profile_of_a_lightning_run_with_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "profile",
            "--out",
            str(out),
            "--skip-steps",
            "1",
            "--steps",
            "3",
            "--profile-steps",
            "2",
            "--",
            sys.executable,
            str(SCRIPT),
            "--accumulate",
            "2",
            "--steps",
            "8",
        ]
    )
    assert code == 0
    record = _profile_record(out)
    assert record["breakdown"]["micro_batches_per_step"] == 2
    assert record["config"]["trainer"] == "lightning"
    html = (out / "report.html").read_text()
    assert "Trainer(accumulate_grad_batches=2)" in html
