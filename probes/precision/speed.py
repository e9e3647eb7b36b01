"""How fast this device runs the model's own matmul/conv signatures in one dtype against another,
and what a switch would save per iteration of the run the report leads with.

A :class:`SpeedComparison` re-runs the largest signatures of the audited step (their shapes,
strides and arguments) in two dtypes, calls alternating. Its A/B verdict comes from
:mod:`diagnose.stats`: per round, the signatures' times weighted by their calls per step make one
sample of "those signatures' share of a step" in each dtype, and the U test's interval on the two
sample sets says how sure the difference is.

A saving is only ever derived from that measured difference, as a fraction of the time of the
signatures it measured, and applied to the time those same signatures take in the headline run
(their audited time, scaled down to the headline run's compute phases: the audit times every op
alone with the device synchronised, which inflates it). So it can never be more than the compute
the comparison re-measured, nor more than the run's compute phases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose.catalogs.precision_catalog import COMPUTE_PHASES
from diagnose.probes.precision.audit_log import AuditLog, ReplaySpec
from diagnose.probes.precision.replay import BenchResult
from diagnose.record import RunRecord, phase_bound, step_seconds
from diagnose.stats import SAVING_SIGNIFICANCE, clearly_faster, ratio_interval, sure_saving

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def round_or_none(value: float | None, digits: int = 6) -> float | None:
    return round(value, digits) if value is not None and math.isfinite(value) else None


# --------------------------------------------------------------------------------------------
# Expressing audited time per iteration of the headline run


@dataclass(frozen=True)
class HeadlineScale:
    """Turns audited seconds into seconds per iteration of the run the report leads with."""

    #: Headline seconds per audited second (at most 1: the audit only ever inflates op times).
    factor: float
    #: The headline run's compute-phase seconds per iteration (None: not measured).
    compute_seconds: float | None
    #: The audited seconds of the same phases.
    audited_seconds: float

    def __call__(self, audited: float) -> float:
        seconds = audited * self.factor
        if self.compute_seconds is not None:
            seconds = min(seconds, self.compute_seconds)
        return seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "factor": round_or_none(self.factor, 4),
            "headline_compute_seconds_per_it": round_or_none(self.compute_seconds),
            "audited_compute_seconds": round_or_none(self.audited_seconds),
            "how": (
                "audited op seconds times the headline run's "
                + "+".join(COMPUTE_PHASES)
                + " seconds per iteration over the audited step's (never above 1)"
            ),
        }


def headline_scale(log: AuditLog, record: RunRecord) -> HeadlineScale:
    """The scale from ``log``'s audited seconds to the headline run of ``record``: its compute
    phases when the breakdown has them, else its whole step."""
    audited = sum(g.seconds for g in log.groups if g.phase in COMPUTE_PHASES)
    if not audited:  # a workload without phase labels: everything it ran is the step's compute
        audited = sum(g.seconds for g in log.groups)
    headline = phase_bound(record, COMPUTE_PHASES)
    if headline is None:
        headline = step_seconds(record)
    factor = 1.0
    if headline is not None and audited > 0:
        factor = min(1.0, headline / audited)
    return HeadlineScale(factor=factor, compute_seconds=headline, audited_seconds=audited)


# --------------------------------------------------------------------------------------------
# The comparison


@dataclass
class SignatureBench:
    """One op signature of the model, timed in a base dtype (fp32) and a low-precision one."""

    op: str
    shapes: str
    recorded_dtype: str | None
    calls: int
    base: BenchResult
    low: BenchResult
    #: The signature's audited seconds per step (all its calls, in the dtype it ran in).
    audited_seconds: float = 0.0

    @property
    def timed(self) -> bool:
        return bool(self.base.samples and self.low.samples) and self.low.median > 0

    @property
    def speedup(self) -> float:
        """Base time / low-precision time (above 1: the low precision is faster)."""
        if not self.timed:
            return math.nan
        return float(self.base.median / self.low.median)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "shapes": self.shapes,
            "recorded_dtype": self.recorded_dtype,
            "calls_per_step": self.calls,
            f"{self.base.dtype}_ms": round_or_none(self.base.median * 1e3, 4),
            f"{self.low.dtype}_ms": round_or_none(self.low.median * 1e3, 4),
            "speedup": round_or_none(self.speedup, 3),
            "audited_seconds_per_step": round_or_none(self.audited_seconds),
            "error": self.base.error or self.low.error,
        }


@dataclass
class SpeedComparison:
    """A base dtype (fp32) against a low-precision one over the model's largest op signatures."""

    base: str
    low: str
    rows: list[SignatureBench] = field(default_factory=list)

    def timed_rows(self) -> list[SignatureBench]:
        return [r for r in self.rows if r.timed]

    def totals(self) -> tuple[float, float]:
        """(base, low) benchmark seconds per step summed over the signatures timed in both."""
        base = low = 0.0
        for row in self.timed_rows():
            base += row.calls * row.base.median
            low += row.calls * row.low.median
        return base, low

    def step_samples(self) -> tuple[list[float], list[float]]:
        """(base, low) samples of the timed signatures' seconds per step: round i sums every
        signature's i-th call times its calls per step (rounds every signature completed)."""
        rows = self.timed_rows()
        if not rows:
            return [], []
        rounds = min(min(len(r.base.samples), len(r.low.samples)) for r in rows)
        base = [sum(r.calls * r.base.samples[i] for r in rows) for i in range(rounds)]
        low = [sum(r.calls * r.low.samples[i] for r in rows) for i in range(rounds)]
        return base, low

    @property
    def speedup(self) -> float:
        """Call-weighted base time / low-precision time (nan when nothing could be timed)."""
        base, low = self.totals()
        return base / low if low > 0 and base > 0 else math.nan

    def speedup_interval(self) -> tuple[float, float] | None:
        """The interval of base / low-precision time from the rounds' per-step samples (the A/B's
        own level), None with too few rounds."""
        base, low = self.step_samples()
        if not base or not low:
            return None
        return ratio_interval(low, base, SAVING_SIGNIFICANCE)

    @property
    def clearly_slower(self) -> bool:
        """The U test is sure the low precision is slower than the base."""
        base, low = self.step_samples()
        return bool(base and low) and clearly_faster(base, low)

    @property
    def clearly_faster(self) -> bool:
        """The U test is sure the low precision is faster than the base."""
        base, low = self.step_samples()
        return bool(base and low) and clearly_faster(low, base)

    def saving_fractions(self, current: str) -> tuple[float, float]:
        """(central, sure) fraction of the timed signatures' time in ``current`` (``base`` or
        ``low``) that running them in the other dtype saves, from the measured difference; the
        sure fraction is the low end of its interval. Negative central: the switch costs time."""
        base_total, low_total = self.totals()
        base, low = self.step_samples()
        if current == self.low:
            now, other, now_samples, other_samples = low_total, base_total, low, base
        else:
            now, other, now_samples, other_samples = base_total, low_total, base, low
        if now <= 0 or not now_samples:
            return math.nan, 0.0
        return (now - other) / now, sure_saving(other_samples, now_samples) / now

    def headline_saving(
        self, current: str, scale: HeadlineScale
    ) -> tuple[float | None, float | None, float]:
        """(saving, sure saving, headline seconds of the measured signatures) per iteration of
        the headline run if the signatures timed here ran in the other dtype instead of
        ``current``. None when nothing was timed or the switch saves nothing."""
        measured = scale(sum(r.audited_seconds for r in self.timed_rows()))
        central, sure = self.saving_fractions(current)
        if not math.isfinite(central) or central <= 0 or measured <= 0:
            return None, None, measured
        return measured * central, measured * max(0.0, sure), measured

    def to_dict(self) -> dict[str, Any]:
        base, low = self.totals()
        return {
            "base": self.base,
            "low": self.low,
            "speedup": round_or_none(self.speedup, 3),
            "conclusive": self.clearly_faster or self.clearly_slower,
            f"{self.base}_seconds_per_step": round_or_none(base),
            f"{self.low}_seconds_per_step": round_or_none(low),
            "signatures": [r.to_dict() for r in self.rows],
            "method": (
                "the signatures with the most multiply-adds per step, each re-run (op, shapes, "
                "strides) on random data in both dtypes, calls alternating, device-synchronised; "
                "medians weighted by calls per step; conclusive when the Mann-Whitney U test's "
                "interval on the per-round sums excludes no difference"
            ),
        }


#: Times a signature in two dtypes, interleaved: (spec, base, low) -> (base result, low result).
Bencher = Callable[[ReplaySpec, torch.dtype, torch.dtype], tuple[BenchResult, BenchResult]]


def compare_speed(
    specs: Sequence[ReplaySpec], base: str, low: str, bench: Bencher
) -> SpeedComparison:
    """Time each signature in ``base`` and in ``low`` ("fp32", "bf16", "fp16")."""
    comparison = SpeedComparison(base=base, low=low)
    for spec in specs:
        base_result, low_result = bench(spec, TORCH_DTYPES[base], TORCH_DTYPES[low])
        comparison.rows.append(
            SignatureBench(
                op=spec.op,
                shapes=spec.shapes,
                recorded_dtype=spec.dtype,
                calls=spec.calls,
                base=base_result,
                low=low_result,
                audited_seconds=spec.seconds,
            )
        )
    return comparison


def speed_summary(comparison: SpeedComparison) -> str:
    """ "at this model's matmul/conv shapes bf16 runs 1.74x slower than fp32 here" """
    speedup = comparison.speedup
    if not math.isfinite(speedup):
        errors = [e for r in comparison.rows if (e := r.base.error or r.low.error)]
        why = f" ({errors[0]})" if errors else ""
        return f"{comparison.low} against {comparison.base}: could not be timed here{why}"
    how = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    spread = (
        ""
        if comparison.clearly_faster or comparison.clearly_slower
        else " (within the measurement spread: inconclusive)"
    )
    return (
        f"at this model's matmul/conv shapes {comparison.low} runs {how} than "
        f"{comparison.base} here{spread}"
    )


def largest_signatures(log: AuditLog, count: int) -> list[ReplaySpec]:
    """The signatures with the most estimated work per step (shapes x calls, not audited time:
    a single call's time on a busy machine is too noisy to rank by)."""
    return sorted(log.replays.values(), key=lambda s: (-s.work * s.calls, s.key))[:count]


__all__ = [
    "TORCH_DTYPES",
    "Bencher",
    "HeadlineScale",
    "SignatureBench",
    "SpeedComparison",
    "compare_speed",
    "headline_scale",
    "largest_signatures",
    "round_or_none",
    "speed_summary",
]
