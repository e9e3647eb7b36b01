"""An optimizer that runs the step's forward and backward itself, through a closure
(``optimizer.step(closure)``: LBFGS, Lightning's automatic optimization): the phases are what
ran, not the outermost range. Real CPU traces of one loop stepped both ways."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.trace.analysis import TraceAnalysis, analyze_trace
from tests.conftest import one_torch_thread

#: Recorded steps, half of each kind: enough that the quickest of each is the update's own time.
STEPS = 12


@pytest.fixture(scope="module")
def alternating(tmp_path_factory: pytest.TempPathFactory) -> TraceAnalysis:
    """One loop whose steps alternate: stepped with a closure, then plainly, and so on. Both
    kinds of step see the same machine at the same time, so their update times compare."""
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

    path = tmp_path_factory.mktemp("closure") / "alternating.json"
    with (
        one_torch_thread(),  # a two-thread op beside a busy core stalls tenfold at random
        profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=2, active=STEPS, repeat=1),
        ) as prof,
    ):
        for step in range(STEPS + 2):
            if step % 2 == 0:
                optimizer.step(loss_and_grads)
            else:
                loss_and_grads()
                optimizer.step()
            prof.step()
    prof.export_chrome_trace(str(path))
    return analyze_trace(path)


def _kinds(analysis: TraceAnalysis) -> dict[str, list[dict[str, float]]]:
    """Each step's phases, by how it was stepped (the warm-up took steps 0 and 1, so the
    recorded steps start with a closure step)."""
    steps = sorted(analysis.steps, key=lambda s: s.start_us)
    assert len(steps) == STEPS
    return {
        "closure": [s.phases for s in steps[0::2]],
        "plain": [s.phases for s in steps[1::2]],
    }


@pytest.mark.parametrize("how", ["closure", "plain"])
def test_forward_and_backward_are_not_charged_to_the_optimizer(
    alternating: TraceAnalysis, how: str
) -> None:
    steps = _kinds(alternating)[how]

    def least(phase: str) -> float:
        # Another process can only add time to a phase: the least over the steps is its own.
        return min(p.get(phase, 0.0) for p in steps)

    forward, backward, optimizer = least("forward"), least("backward"), least("optimizer")
    step = min(sum(p.values()) for p in steps)
    # Convolutions dominate the step; AdamW over a few tensors is a small part of it.
    assert forward > optimizer and backward > optimizer, steps
    assert forward + backward > 0.6 * step, steps


def test_the_update_reads_the_same_with_and_without_a_closure(
    alternating: TraceAnalysis,
) -> None:
    kinds = _kinds(alternating)
    # The quickest of each kind: another process can only add time to a step, so the least of
    # several interleaved ones is the update's own cost on either side.
    closure = min(p.get("optimizer", 0.0) for p in kinds["closure"])
    plain = min(p.get("optimizer", 0.0) for p in kinds["plain"])
    assert closure > 0 and plain > 0
    # The same update, read the same way: far from the whole step the closure's range spans
    # (its forward and backward are over ten times the update).
    assert 1 / 3 < closure / plain < 3, (closure, plain)
