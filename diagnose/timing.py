"""Phase timing of one training step.

A step is split into phases (see :data:`diagnose.record.PHASES`). Each phase is timed with the
device synchronised at both ends, so GPU work queued in a phase is charged to that phase and not
to the next one that happens to block. Each phase is also a ``record_function`` range named
``diagnose::<phase>`` so the profiler trace carries the same labels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def timed_calls(
    call: Callable[[], object],
    sync: Callable[[], None],
    *,
    min_calls: int,
    max_calls: int,
    budget_s: float,
    deadline: float | None = None,
) -> list[float]:
    """Device-synchronised seconds of repeated ``call()``s: at least ``min_calls``, then more
    while the budget lasts and ``deadline`` (``time.perf_counter()``) has not passed, at most
    ``max_calls``."""
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_calls and (
        len(samples) < min_calls
        or (
            time.perf_counter() - started < budget_s
            and (deadline is None or time.perf_counter() < deadline)
        )
    ):
        sync()
        begin = time.perf_counter()
        call()
        sync()
        samples.append(time.perf_counter() - begin)
    return samples


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits until all queued work on ``device`` is done (no-op on the CPU)."""
    if device.type == "cuda":  # also ROCm: torch exposes HIP devices as "cuda"
        index = device.index if device.index is not None else torch.cuda.current_device()

        def sync() -> None:
            torch.cuda.synchronize(index)

        return sync
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return torch.xpu.synchronize
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


class PhaseTimer:
    """Collects seconds per phase for one step.

    ``with timer.phase("forward"): ...`` adds the synchronised wall time of the block to
    ``seconds["forward"]``; a phase entered twice in one step accumulates.
    """

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._synchronize()
        start = time.perf_counter()
        with torch.profiler.record_function(f"diagnose::{name}"):
            try:
                yield
            finally:
                self._synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}
