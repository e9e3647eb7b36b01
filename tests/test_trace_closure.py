"""An optimizer that runs the step's forward and backward itself, through a closure
(``optimizer.step(closure)``: LBFGS, Lightning's automatic optimization): the phases are what
ran, not the outermost range. Real CPU traces of one loop stepped both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.trace.analysis import TraceAnalysis, analyze_trace

STEPS = 4


def _capture(path: Path, *, closure: bool) -> TraceAnalysis:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(32, 3, 3, padding=1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    images = torch.randn(4, 3, 48, 48)

    def loss_and_grads() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (model(images) - images).pow(2).mean()
        loss.backward()
        return loss

    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=STEPS, repeat=1),
    ) as prof:
        for _ in range(STEPS + 1):
            if closure:
                optimizer.step(loss_and_grads)
            else:
                loss_and_grads()
                optimizer.step()
            prof.step()
    prof.export_chrome_trace(str(path))
    return analyze_trace(path)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("closure")
    return {
        "closure": _capture(folder / "closure.json", closure=True),
        "plain": _capture(folder / "plain.json", closure=False),
    }


@pytest.mark.parametrize("how", ["closure", "plain"])
def test_forward_and_backward_are_not_charged_to_the_optimizer(
    stepped: dict[str, TraceAnalysis], how: str
) -> None:
    seconds = stepped[how].breakdown.seconds
    step = sorted(s.wall_seconds for s in stepped[how].steps)[len(stepped[how].steps) // 2]
    forward, backward = seconds.get("forward", 0.0), seconds.get("backward", 0.0)
    optimizer = seconds.get("optimizer", 0.0)
    # Convolutions dominate the step; AdamW over a few tensors is a small part of it.
    assert forward > optimizer and backward > optimizer, seconds
    assert forward + backward > 0.6 * step, seconds
    assert sum(seconds.values()) == pytest.approx(step, rel=0.05)


def test_the_update_reads_the_same_with_and_without_a_closure(
    stepped: dict[str, TraceAnalysis],
) -> None:
    closure = stepped["closure"].breakdown.seconds.get("optimizer", 0.0)
    plain = stepped["plain"].breakdown.seconds.get("optimizer", 0.0)
    assert closure > 0 and plain > 0
    # The same update, timed in two captures: within the noise of a shared machine, not the
    # whole step the closure's range spans.
    assert 0.33 < closure / plain < 3.0, (closure, plain)
