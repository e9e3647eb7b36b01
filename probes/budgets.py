"""How long each probe may take: a budget per probe and device kind, which the runner hands to the
probe (``ProbeContext.deadline``) and holds its result against.

On a GPU the A/B rounds of even a full-size model take milliseconds; what takes tens of seconds is
set-up (building twins, compiling, decoding a dataset), so the default run's probes together stay
within :data:`GPU_RUN_S`. A probe that ends past its budget still reports what it measured, and
its result says it ran out (a ``<probe>.time_budget`` check, not judged), so a slow probe is seen
as slow instead of stretching every run unnoticed. The CPU budgets are for the tiny default run on
a small machine, where every probe is slower.

Inside a probe, an A/B that takes rounds until its interval decides takes no new round once the
budget has ended (:func:`budget_spent`), past the fewest rounds it always takes; a comparison it
leaves unsure is inconclusive and says the budget is why (:data:`BUDGET_STOPPED`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

#: The default GPU run's probes together (environment, precision, attention, dataloader,
#: optimizer, roofline, triton) stay within this many seconds.
GPU_RUN_S = 30.0

#: Seconds each probe may take on a GPU (cuda, rocm).
GPU_BUDGET_S: Mapping[str, float] = {
    "environment": 0.5,
    "precision": 4.0,
    "attention": 5.0,
    "dataloader": 6.0,
    "optimizer": 5.0,
    # Only with a quantized base: not part of the default run's sum.
    "quantization": 10.0,
    "roofline": 1.0,
    "triton": 8.0,
}

#: Seconds each probe may take on a CPU (the tiny models; Triton runs in a run on a GPU only).
CPU_BUDGET_S: Mapping[str, float] = {
    "environment": 1.0,
    "precision": 5.0,
    "attention": 8.0,
    "dataloader": 12.0,
    "optimizer": 8.0,
    "quantization": 60.0,
    "roofline": 3.0,
    "triton": 60.0,
}


def budget_s(probe: str, device_kind: str) -> float | None:
    """The seconds ``probe`` may take on a device of ``device_kind``; None for a probe without one
    (a user's own)."""
    table = CPU_BUDGET_S if device_kind == "cpu" else GPU_BUDGET_S
    return table.get(probe)


def budget_spent(deadline: float | None) -> bool:
    """Whether the running probe's budget (``ProbeContext.deadline``, ``time.perf_counter()``)
    has ended; never without one."""
    return deadline is not None and time.perf_counter() >= deadline


#: Why a measurement was not taken: the probe's budget had ended before it.
BUDGET_RAN_OUT = "the probe's time budget ran out"
#: Why an A/B stopped taking rounds before it was sure: the clause its inconclusive answer carries.
BUDGET_STOPPED = f"{BUDGET_RAN_OUT} before the A/B was sure"


def over_budget_text(probe: str, seconds: float, budget: float, device_kind: str) -> str:
    """The line a probe's result carries when it ran out of its budget."""
    where = "a CPU" if device_kind == "cpu" else "a GPU"
    return (
        f"{probe}: ran out of its time budget on {where} ({seconds:.1f} s of {budget:g} s); "
        "what it measured stands, but its set-up is the part to make shorter"
    )


__all__ = [
    "BUDGET_RAN_OUT",
    "BUDGET_STOPPED",
    "CPU_BUDGET_S",
    "GPU_BUDGET_S",
    "GPU_RUN_S",
    "budget_s",
    "budget_spent",
    "over_budget_text",
]
