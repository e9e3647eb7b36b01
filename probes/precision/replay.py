"""Re-running one recorded compute-op signature on random data in another dtype: the
microbenchmark behind the probe's bf16/fp16/fp32 speed comparisons.

The shapes, strides and non-tensor arguments are the model's own (kept by the audit), so the
comparison is of this model's work on this device, not of a generic GEMM.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose import contention
from diagnose.probes.budgets import budget_spent
from diagnose.probes.precision.audit_log import ReplaySpec, TensorSpec, dtype_name
from diagnose.record import Stats
from diagnose.stats import SAVING_SIGNIFICANCE, minimum_samples
from diagnose.torch_compat import tree_map

#: Calls per dtype a benchmark makes even past its budget: fewer and no A/B on them can ever be
#: sure of a difference (see :func:`diagnose.stats.minimum_samples`).
MIN_CALLS = max(3, minimum_samples(SAVING_SIGNIFICANCE))


def _materialise(
    spec: TensorSpec, dtype: torch.dtype, generators: dict[torch.device, torch.Generator]
) -> torch.Tensor:
    """A tensor of the spec's shape and strides (overlapping strides included) with random
    values, in ``dtype``, made on its device with a private generator (the run's global random
    state is not touched)."""
    if any(n == 0 for n in spec.shape):
        extent = 0
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True))
    if dtype.is_floating_point or dtype.is_complex:
        generator = generators.get(spec.device)
        if generator is None:
            generator = generators[spec.device] = torch.Generator(device=spec.device)
            generator.manual_seed(0)
        flat = torch.randn(extent, generator=generator, dtype=torch.float32, device=spec.device).to(
            dtype
        )
    else:
        flat = torch.zeros(extent, dtype=dtype, device=spec.device)
    return flat.as_strided(spec.shape, spec.stride)


def replay_arguments(spec: ReplaySpec, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """(args, kwargs) for one call of ``spec`` with its ``spec.torch_dtype`` inputs in ``dtype``
    (others as recorded)."""
    generators: dict[torch.device, torch.Generator] = {}

    def make(value: Any) -> Any:
        if isinstance(value, TensorSpec):
            target = value.dtype
            if dtype is not None and value.dtype == spec.torch_dtype:
                target = dtype
            return _materialise(value, target, generators)
        return value

    args, kwargs = tree_map(make, spec.template, is_leaf=lambda v: isinstance(v, TensorSpec))
    return args, kwargs


@dataclass
class BenchResult:
    """Device-synchronised seconds per call of one signature in one dtype."""

    dtype: str
    samples: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan


def _prepared(spec: ReplaySpec, dtype: torch.dtype) -> tuple[Callable[[], Any], str]:
    """A zero-argument call of ``spec`` in ``dtype``, warmed up once; or the error it raised."""
    try:
        args, kwargs = replay_arguments(spec, dtype)
        with torch.no_grad():
            spec.func(*args, **kwargs)  # warm-up: kernel selection, first-call allocation
    except Exception as exc:  # a dtype this op or device does not take
        return (lambda: None), f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"

    def call() -> Any:
        with torch.no_grad():
            return spec.func(*args, **kwargs)

    return call, ""


def bench_pair(
    spec: ReplaySpec,
    base: torch.dtype,
    low: torch.dtype,
    sync: Callable[[], None],
    *,
    repeats: int = 15,
    budget_s: float = 0.25,
    deadline: float | None = None,
) -> tuple[BenchResult, BenchResult]:
    """Time ``spec`` in ``base`` and in ``low``, alternating calls so that a busy machine slows
    both alike; up to ``repeats`` synchronised calls each: at least :data:`MIN_CALLS` (enough
    for the U test behind the probe's A/B verdicts to be conclusive), then until the budget or
    the probe's ``deadline``."""
    first = BenchResult(dtype=dtype_name(base) or str(base))
    second = BenchResult(dtype=dtype_name(low) or str(low))
    call_a, first.error = _prepared(spec, base)
    call_b, second.error = _prepared(spec, low)
    if first.error or second.error:
        return first, second
    sync()
    contention.mark_rounds()
    until = time.perf_counter() + budget_s
    try:
        for i in range(max(repeats, MIN_CALLS)):
            for call, result in ((call_a, first), (call_b, second)):
                start = time.perf_counter()
                call()
                sync()
                result.samples.append(time.perf_counter() - start)
            if i + 1 >= MIN_CALLS and (time.perf_counter() > until or budget_spent(deadline)):
                break
    except Exception as exc:  # a failure after the warm-up: report it, keep nothing
        text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        for result in (first, second):
            result.error, result.samples = text, []
    return first, second


__all__ = ["MIN_CALLS", "BenchResult", "bench_pair", "replay_arguments"]
