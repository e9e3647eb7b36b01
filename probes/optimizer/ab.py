"""The A/B of optimizers: the same LoRA parameters and the same real gradients stepped by each
candidate, timed alone, and the rule that says when another one is worth switching to.

The step timed alone is not the optimizer phase of the report's phase bar (that one is step and
zero_grad inside the unprofiled training steps, with the rest of the step around them): the
finding quotes the phase bar and scales its saving by the A/B's ratio, so it never claims more
of the step than the phase holds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diagnose import contention
from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.errors import first_line
from diagnose.record import Finding, Stats
from diagnose.stats import (
    SAVING_SIGNIFICANCE,
    at_line,
    clearly_faster,
    ratio_interval,
    sure_saving,
)
from diagnose.timing import timed_calls
from diagnose.units import ms_value
from diagnose.verdicts import borderline_at

#: Timed calls per optimizer: at least MIN_CALLS, then more until the budget is spent.
MIN_CALLS = 5
MAX_CALLS = 30
TIME_BUDGET_S = 0.5


@dataclass
class ABRow:
    """One optimizer stepped on the same parameters and gradients."""

    optimizer: str
    key: str
    configured: bool = False
    step_seconds: list[float] = field(default_factory=list)
    #: Derived: the record's s/it - the configured step + this step (None without a record).
    implied_s_per_it: float | None = None
    state_bytes: dict[str, int] = field(default_factory=dict)
    host_syncs_per_step: float | None = None
    scalar_reads_per_step: float | None = None
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    #: Whether the probe's time budget had run out before its calls reached the most it takes.
    stopped_by_budget: bool = False

    @property
    def stats(self) -> Stats:
        return Stats.of(self.step_seconds)

    def to_dict(self) -> dict[str, Any]:
        stats = self.stats
        row = asdict(self)
        row.update(
            step_ms_median=ms_value(stats.median),
            step_ms_q1=ms_value(stats.q1),
            step_ms_q3=ms_value(stats.q3),
            step_ms_iqr=ms_value(stats.iqr),
            samples=stats.n,
            state_bytes_total=sum(self.state_bytes.values()),
        )
        return row


def implied_s_per_it(
    s_per_it: float | None, configured_step: float | None, this_step: float | None
) -> float | None:
    """s/it with this optimizer: the measured s/it with the configured step swapped for this one."""
    if s_per_it is None or configured_step is None or this_step is None:
        return None
    if not all(math.isfinite(v) for v in (s_per_it, configured_step, this_step)):
        return None
    return max(0.0, s_per_it - configured_step + this_step)


def clearly_faster_alternative(
    rows: Sequence[ABRow],
    *,
    min_relative: float = catalog.MIN_RELATIVE_GAIN,
    min_absolute_s: float = catalog.MIN_ABSOLUTE_GAIN_S,
) -> ABRow | None:
    """The fastest row the A/B is sure beats the configured one, or None.

    Sure: the low end of the interval of its saving (:func:`diagnose.stats.clearly_faster`)
    clears both ``min_absolute_s`` and ``min_relative`` of the configured median, so the verdict
    does not flip on a rerun. A row of the configured optimizer's own kind is never picked.
    """
    configured = next((r for r in rows if r.configured and not r.error and r.step_seconds), None)
    if configured is None:
        return None
    base = configured.stats
    margin = max(min_absolute_s, min_relative * base.median)
    best: ABRow | None = None
    for row in rows:
        if row.configured or row.error or not row.step_seconds or row.key == configured.key:
            continue
        if not clearly_faster(row.step_seconds, configured.step_seconds, min_saving=margin):
            continue
        if best is None or row.stats.median < best.stats.median:
            best = row
    return best


def ab_saving(configured: ABRow, faster: ABRow, phase_seconds: float | None) -> tuple[float, float]:
    """(saving, the part the A/B is sure of), seconds per iteration.

    With the optimizer phase of the record, the phase scaled by the A/B's ratio of step times
    (and by the ratio interval's upper end for the sure part); without it, the difference of the
    steps timed alone (and the low end of its interval).
    """
    base, fast = configured.stats.median, faster.stats.median
    if phase_seconds is not None and phase_seconds > 0 and base > 0:
        saving = phase_seconds * (1.0 - fast / base)
        ratios = ratio_interval(configured.step_seconds, faster.step_seconds, SAVING_SIGNIFICANCE)
        sure = phase_seconds * (1.0 - ratios[1]) if ratios is not None else 0.0
        return saving, max(0.0, min(sure, saving))
    return base - fast, min(sure_saving(faster.step_seconds, configured.step_seconds), base - fast)


def slower_than_alternative_rule(
    rows: Sequence[ABRow],
    s_per_it: float | None,
    *,
    phase_seconds: float | None = None,
    min_relative: float = catalog.MIN_RELATIVE_GAIN,
    min_absolute_s: float = catalog.MIN_ABSOLUTE_GAIN_S,
    min_share: float = catalog.MIN_SHARE_OF_S_PER_IT,
) -> Finding | None:
    """``optimizer.slower_than_alternative`` when another optimizer is clearly faster
    (:func:`clearly_faster_alternative`) and saves at least ``min_share`` of s/it (when s/it is
    known). ``phase_seconds`` is the record's optimizer phase (the phase bar's number)."""
    best = clearly_faster_alternative(
        rows, min_relative=min_relative, min_absolute_s=min_absolute_s
    )
    configured = next((r for r in rows if r.configured), None)
    if best is None or configured is None:
        return None
    saving, sure = ab_saving(configured, best, phase_seconds)
    share = saving / s_per_it if s_per_it else None
    worth = (
        at_line(share, min_share, interval=(sure / s_per_it, share))
        if share is not None and s_per_it
        else None
    )
    if worth is not None and worth.below:
        return None
    base, fastest = configured.stats, best.stats
    evidence: dict[str, Any] = {
        "configured": configured.optimizer,
        "configured_step_ms_timed_alone": ms_value(base.median),
        "configured_step_ms_iqr": [ms_value(base.q1), ms_value(base.q3)],
        "fastest": best.optimizer,
        "fastest_step_ms_timed_alone": ms_value(fastest.median),
        "fastest_step_ms_iqr": [ms_value(fastest.q1), ms_value(fastest.q3)],
        "optimizer_phase_ms_in_the_step": ms_value(phase_seconds) if phase_seconds else None,
        "saving_ms_per_it": ms_value(saving),
        "saving_ms_per_it_low": ms_value(sure),
        "saving_interval_confidence": 1 - SAVING_SIGNIFICANCE,
        "s_per_it": s_per_it,
        "implied_s_per_it": best.implied_s_per_it,
        "table": [
            {"optimizer": r.optimizer, "step_ms_median": ms_value(r.stats.median)}
            for r in rows
            if r.step_seconds and not r.error
        ],
    }
    if share is not None and s_per_it:
        evidence["share_of_s_per_it"] = round(share, 4)
        evidence["share_of_s_per_it_low"] = round(sure / s_per_it, 4)
    finding = catalog.slower_than_alternative(
        running=configured.key,
        fastest=best.key,
        running_alone_seconds=base.median,
        fastest_alone_seconds=fastest.median,
        phase_seconds=phase_seconds,
        step_seconds=s_per_it,
        saving=saving,
        sure_saving=sure,
        evidence=evidence,
        confidence=1 - SAVING_SIGNIFICANCE,
    )
    if worth is not None and worth.borderline:
        finding.borderline = borderline_at(worth, "saving", " of s/it")
    return finding


# --------------------------------------------------------------------------------------------
# Timing the candidates


def time_steps(
    step: Callable[[], object],
    sync: Callable[[], None],
    *,
    min_calls: int = MIN_CALLS,
    max_calls: int = MAX_CALLS,
    budget_s: float = TIME_BUDGET_S,
    deadline: float | None = None,
) -> list[float]:
    """Device-synchronised seconds of repeated ``step()`` calls, within the optimizer A/B's
    bounds and the probe's ``deadline``."""
    contention.mark_rounds()
    return timed_calls(
        step, sync, min_calls=min_calls, max_calls=max_calls, budget_s=budget_s, deadline=deadline
    )


def warning_texts(caught: Sequence[warnings.WarningMessage], printed: str) -> list[str]:
    lines = [f"{w.category.__name__}: {first_line(str(w.message))}" for w in caught]
    lines += [line for line in printed.splitlines() if line.strip()]
    return list(dict.fromkeys(lines))[:10]


def leaf_copies(
    params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]
) -> list[torch.nn.Parameter]:
    leaves = []
    for param, grad in zip(params, grads, strict=True):
        leaf = torch.nn.Parameter(param.detach().clone(), requires_grad=True)
        leaf.grad = None if grad is None else grad.clone()
        leaves.append(leaf)
    return leaves


def _adamw_factory(**options: Any) -> Callable[[list[torch.nn.Parameter], float], Any]:
    def make(params: list[torch.nn.Parameter], lr: float) -> Any:
        return torch.optim.AdamW(params, lr=lr, **options)

    return make


def _adamw8bit(params: list[torch.nn.Parameter], lr: float) -> Any:
    import bitsandbytes

    return getattr(bitsandbytes.optim, "AdamW8bit")(params, lr=lr)  # noqa: B009 - untyped


def _adafactor(params: list[torch.nn.Parameter], lr: float) -> Any:
    from transformers.optimization import Adafactor

    adafactor: Any = Adafactor  # untyped constructor
    # Fixed learning rate, as kohya's and OneTrainer's LoRA presets set it.
    return adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


@dataclass(frozen=True)
class Candidate:
    """An optimizer the A/B tries: ``make(params, lr)`` builds it the way trainers do."""

    key: str
    label: str
    make: Callable[[list[torch.nn.Parameter], float], Any]
    #: Import name it needs (skipped with the reason when it does not import).
    needs: str = ""


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("adamw-foreach", catalog.LABELS["adamw-foreach"], _adamw_factory(foreach=True)),
    Candidate("adamw-fused", catalog.LABELS["adamw-fused"], _adamw_factory(fused=True)),
    Candidate("adamw8bit", catalog.LABELS["adamw8bit"], _adamw8bit, needs="bitsandbytes"),
    Candidate("adafactor", catalog.LABELS["adafactor"], _adafactor, needs="transformers"),
)


__all__ = [
    "CANDIDATES",
    "MAX_CALLS",
    "MIN_CALLS",
    "TIME_BUDGET_S",
    "ABRow",
    "Candidate",
    "ab_saving",
    "clearly_faster_alternative",
    "implied_s_per_it",
    "leaf_copies",
    "slower_than_alternative_rule",
    "time_steps",
    "warning_texts",
]
