"""One way to run extra training steps without changing the workload.

Probes re-run the step (to profile it, audit its dtypes, catch its gradients) between the steps
the report times. Such a step must leave everything as it found it: the LoRA weights and the
optimizer state (the optimizer is swapped for a stand-in that updates nothing), the GradScaler's
scale, the gradients, and the random number generators (so the timed run draws the same noise and
timesteps whether or not a probe ran in between).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class NoUpdate(torch.optim.Optimizer):
    """Stands in for the workload's optimizer: ``step()`` updates nothing."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        # torch refuses an optimizer without parameters; a frozen model still gets a stand-in.
        super().__init__(params or [torch.nn.Parameter(torch.zeros(1))], {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class GradientCatcher(NoUpdate):
    """A stand-in that keeps a copy of the gradients of the last ``step()``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params)
        self.caught: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.caught = [
            None if p.grad is None else p.grad.detach().clone()
            for group in self.param_groups
            for p in group["params"]
        ]


def trained_parameters(workload: Any) -> list[torch.nn.Parameter]:
    """The parameters the workload's optimizer updates."""
    return [p for group in workload.optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def steps_without_update(workload: Any, stand_in: type[NoUpdate] = NoUpdate) -> Iterator[NoUpdate]:
    """Swap the workload's optimizer for ``stand_in`` while the block runs extra steps; put back
    the optimizer, the GradScaler's state, the RNG states, and clear the gradients afterwards.
    Yields the stand-in (a :class:`GradientCatcher` holds the gradients it saw)."""
    optimizer = workload.optimizer
    scaler = getattr(workload, "scaler", None)
    scaler_state = scaler.state_dict() if scaler is not None else {}
    params = trained_parameters(workload)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    noise = getattr(workload, "noise_generator", None)
    noise_state = noise.get_state() if isinstance(noise, torch.Generator) else None
    substitute = stand_in(params)
    workload.optimizer = substitute
    try:
        yield substitute
    finally:
        workload.optimizer = optimizer
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        for p in params:
            p.grad = None
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if isinstance(noise, torch.Generator) and noise_state is not None:
            noise.set_state(noise_state)


__all__ = ["GradientCatcher", "NoUpdate", "steps_without_update", "trained_parameters"]
