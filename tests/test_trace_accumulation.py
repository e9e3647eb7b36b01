"""Gradient accumulation: a training step of N micro-batches (N forward and backward passes, one
optimizer step) is read as one step that says N, however the loop marked its steps. Real CPU
traces of one loop, captured with the profiler stepped per optimizer step, per micro-batch, and
not at all; an accumulation-free twin, and a loop whose optimizer skips steps now and then (as a
GradScaler does on an overflow), which is not accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.trace.analysis import TraceAnalysis, analyze_trace

STEPS = 5


def _capture(
    path: Path, *, accumulate: int, marks: str, skip_every: int = 0, steps: int = STEPS
) -> TraceAnalysis:
    """``marks``: "step" (prof.step() per optimizer step), "micro" (per micro-batch), "none"
    (no schedule, no prof.step()). ``skip_every``: leave out the optimizer step of every k-th
    iteration."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(16, 3, 3, padding=1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    images = torch.randn(2, 3, 32, 32)
    micro_total = (steps + 1) * accumulate
    kwargs = {}
    if marks == "step":
        kwargs["schedule"] = schedule(wait=0, warmup=1, active=steps, repeat=1)
    elif marks == "micro":
        kwargs["schedule"] = schedule(wait=0, warmup=1, active=micro_total - 1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
        for iteration in range(steps + 1):
            for _ in range(accumulate):
                ((model(images) - images).pow(2).mean() / accumulate).backward()
                if marks == "micro":
                    prof.step()
            if not (skip_every and iteration % skip_every == skip_every - 1):
                optimizer.step()
            optimizer.zero_grad()
            if marks == "step":
                prof.step()
    prof.export_chrome_trace(str(path))
    return analyze_trace(path)


@pytest.mark.parametrize("marks", ["step", "micro", "none"])
def test_a_step_of_three_micro_batches_says_three(tmp_path: Path, marks: str) -> None:
    analysis = _capture(tmp_path / "trace.json", accumulate=3, marks=marks)
    assert analysis.breakdown.micro_batches_per_step == 3
    steps = analysis.steps
    assert len(steps) >= 2
    # Each step holds one optimizer step: the micro-batches' time is in it, not cut into pieces.
    # Judged step by step (a sum of per-phase medians is no step's sum once load makes the steps
    # uneven).
    assert len(steps) <= STEPS + 1
    for step in steps:
        assert step.phases.get("forward", 0) > 0 and step.phases.get("backward", 0) > 0
        assert sum(step.phases.values()) == pytest.approx(step.wall_seconds, rel=1e-6)
    regrouped = any("mark micro-batches" in n for n in analysis.notes)
    assert regrouped == (marks == "micro"), analysis.notes


@pytest.mark.parametrize("marks", ["step", "micro", "none"])
def test_without_accumulation_a_step_is_one_micro_batch(tmp_path: Path, marks: str) -> None:
    analysis = _capture(tmp_path / "trace.json", accumulate=1, marks=marks)
    assert analysis.breakdown.micro_batches_per_step == 1
    assert not any("mark micro-batches" in n for n in analysis.notes)
    if marks != "none":
        assert all(s.label.startswith("ProfilerStep#") for s in analysis.steps)


def test_skipped_optimizer_steps_are_not_read_as_accumulation(tmp_path: Path) -> None:
    # One micro-batch per ProfilerStep, an optimizer step missing every third time: irregular,
    # so the ProfilerSteps stay the steps.
    analysis = _capture(tmp_path / "trace.json", accumulate=1, marks="step", skip_every=3, steps=7)
    assert analysis.breakdown.micro_batches_per_step == 1
    assert not any("mark micro-batches" in n for n in analysis.notes)
    assert all(s.label.startswith("ProfilerStep#") for s in analysis.steps)


def test_the_report_and_the_gate_say_micro_batches(tmp_path: Path) -> None:
    accumulated = tmp_path / "accumulated.json"
    single = tmp_path / "single.json"
    _capture(accumulated, accumulate=2, marks="step")
    _capture(single, accumulate=1, marks="step")
    assert main(["trace", str(accumulated), "--out", str(tmp_path / "a")]) == 0
    assert main(["trace", str(single), "--out", str(tmp_path / "b")]) == 0
    html = (tmp_path / "a" / "report.html").read_text()
    assert "each step is 2 micro-batches (gradient accumulation)" in html
    assert "micro-batches" not in (tmp_path / "b" / "report.html").read_text()
    # A step of two micro-batches is not comparable with a step of one: refused as bad input.
    code = main(
        ["compare", str(tmp_path / "b" / "record.json"), str(tmp_path / "a" / "record.json")]
    )
    assert code == ExitCode.BAD_INPUT
