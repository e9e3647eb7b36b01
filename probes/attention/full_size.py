"""Attention kernel advice at the real model's shapes, for a run that trained a shrunk one.

Which attention kernel is fastest depends on the shapes: at the tiny stand-in's sequence lengths
(tens to hundreds of tokens) and head dims (8-32) a kernel's fixed costs decide, at the real
model's (thousands of tokens, head dims 40-128) its arithmetic does. A tiny run's winner is
therefore no advice for the real model. This module:

1. **The real shapes** — the preset's full-size denoiser is built on the meta device (nothing
   allocated) and called once under a ``TorchFunctionMode`` that records every
   ``scaled_dot_product_attention`` call: per attention layer its heads, sequence lengths and
   head dim at the preset's own resolution and the run's batch.
2. **The kernel choice there** — the backend that ran and every other one that runs are timed at
   the largest real shape (forward+backward, one real SDPA call per sample, interleaved,
   :func:`diagnose.stats.ab_verdict` decides) when that fits a time budget on this device: a
   pilot call at a slice of the shape (one head, a 64th of the queries) estimates the cost
   first. Where it does not fit (a CPU), nothing is measured and the caller withholds the advice
   with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from diagnose import stats
from diagnose.catalogs.attention_catalog import BACKEND_LABELS
from diagnose.probes.attention.bench import (
    SignatureTrials,
    attention_call,
    benchmark_signature,
    make_inputs,
    try_backend,
)
from diagnose.probes.attention.calls import Signature, sdpa_signature
from diagnose.probes.attention.judging import comparisons_decided, faster_verdict

#: Seconds the full-size measurement may take, pilot included. A comparison whose estimated
#: MIN_ROUNDS rounds do not fit is not measured. A GPU does a full-size round in milliseconds;
#: a CPU fast enough to fit a larger budget still spends most of a default run on it (the math
#: path alone takes seconds a call at SD1.5's 4096 tokens), for advice about a GPU it is not.
FULL_SIZE_BUDGET_S = 5.0
#: Rounds (one call of each backend) a full-size comparison takes at least.
MIN_ROUNDS = 5
MAX_ROUNDS = 20
#: The pilot slices of the largest shape: one head and 1/PILOT_QUERY_SHARE (then four times as
#: many) of its queries: cheap enough on a CPU to find out that the whole shape is not affordable
#: there.
PILOT_QUERY_SHARE = 64


# --------------------------------------------------------------------------------------------
# The real shapes, from the preset built on the meta device


@dataclass(frozen=True)
class RealShapes:
    """The attention calls of one forward of a preset's full-size denoiser."""

    preset: str
    resolution: int
    batch: int
    #: One signature per SDPA call, in call order (training calls: forward+backward).
    signatures: tuple[Signature, ...] = ()
    #: Why the shapes could not be had, when they could not.
    error: str = ""

    def largest(self) -> Signature | None:
        """The most expensive call: the one whose kernel choice weighs most in the step."""
        return max(self.signatures, key=attention_flops, default=None)

    def summary(self) -> str:
        """``32 attention calls at 512 px: Lq 64–4096, heads 8, head dims 40/80/160``."""
        if not self.signatures:
            return f"no attention calls at {self.resolution} px"
        lengths = sorted({s.q_len for s in self.signatures})
        heads = "/".join(str(h) for h in sorted({s.heads for s in self.signatures}))
        dims = "/".join(str(d) for d in sorted({s.head_dim for s in self.signatures}))
        return (
            f"{len(self.signatures)} attention calls at {self.resolution} px: Lq "
            f"{lengths[0]}–{lengths[-1]}, heads {heads}, head dims {dims}"
        )

    def to_dict(self) -> dict[str, Any]:
        largest = self.largest()
        return {
            "preset": self.preset,
            "size": "full",
            "resolution": self.resolution,
            "batch": self.batch,
            "calls": len(self.signatures),
            "distinct_shapes": sorted({s.label() for s in self.signatures}),
            "largest": largest.label() if largest else "",
            "error": self.error,
            "basis": "one forward of the full-size preset built on the meta device (no memory "
            "used), every scaled_dot_product_attention call recorded",
        }


def attention_flops(signature: Signature) -> float:
    """Multiply-adds of one call's two matrix products, times 3.5 with its backward (the
    backward recomputes and differentiates both)."""
    s = signature
    forward = 2.0 * s.batch * s.heads * s.q_len * s.kv_len * (s.head_dim + s.value_dim)
    return forward * (3.5 if s.backward else 1.0)


class _SdpaShapes(TorchFunctionMode):
    """Records the signature of every ``scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.signatures: list[Signature] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p")
            bound = dict(zip(names, args, strict=False))
            bound.update(kwargs)
            self.signatures.append(
                sdpa_signature(
                    bound["query"],
                    bound["key"],
                    bound["value"],
                    bound.get("attn_mask"),
                    float(bound.get("dropout_p", 0.0)),
                    bool(bound.get("is_causal", False)),
                    backward=True,
                )
            )
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def real_attention_shapes(preset: str, batch: int, dtype: str) -> RealShapes:
    """Every attention call of the full-size ``preset``'s denoiser at its own (largest)
    resolution and ``batch``, q/k/v in ``dtype``: built and called on the meta device."""
    from diagnose.workload.families import FAMILIES
    from diagnose.workload.models import meta_components
    from diagnose.workload.presets import load_preset

    spec = load_preset(preset, "full")
    resolution = max(spec.resolutions)
    meta = torch.device("meta")
    try:
        components = meta_components(preset, "full", lora=False)
        family = FAMILIES[spec.family]
        latent = resolution // components.vae_scale_factor
        with torch.no_grad():
            cond = family.encode_text(components, ["a photo"] * batch, meta)
            noisy = torch.empty(batch, spec.latent_channels, latent, latent, device=meta)
            timesteps = torch.full((batch,), 500.0, device=meta)
            recorder = _SdpaShapes()
            with recorder:
                family.predict(components, noisy, timesteps, cond)
    except Exception as exc:  # an op without a meta kernel, data-dependent code
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return RealShapes(preset, resolution, batch, error=f"{type(exc).__name__}: {text}"[:300])
    signatures = tuple(s.with_dtype(dtype) for s in recorder.signatures)
    return RealShapes(preset, resolution, batch, signatures)


# --------------------------------------------------------------------------------------------
# The kernel choice at the largest real shape


@dataclass
class FullSizeJudgement:
    """The backend that ran against every other one that runs, at the largest real shape."""

    shapes: RealShapes
    ran: str
    #: Per other backend: is it surely faster than ``ran`` there (diagnose.stats.ab_verdict)?
    verdicts: dict[str, stats.ABVerdict] = field(default_factory=dict)
    #: Estimated seconds of one round (one call of each backend) at the largest shape.
    estimated_round_seconds: float | None = None
    #: Why it was not measured (empty when it was).
    not_measured: str = ""
    trials: SignatureTrials | None = None

    @property
    def measured(self) -> bool:
        return bool(self.verdicts)

    @property
    def faster(self) -> list[str]:
        """Backends surely faster than the one that ran, at full size."""
        return [b for b, v in self.verdicts.items() if v.outcome == "faster"]

    @property
    def none_faster(self) -> bool:
        """Every other backend is surely not faster at full size."""
        return self.measured and all(v.outcome == "not_faster" for v in self.verdicts.values())

    def shape_text(self) -> str:
        largest = self.shapes.largest()
        return (
            f"{self.shapes.preset}'s full size (largest attention {largest.label()})"
            if (largest)
            else f"{self.shapes.preset}'s full size"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "shapes": self.shapes.to_dict(),
            "ran": self.ran,
            "verdicts": {
                b: {"outcome": v.outcome, "ratio": v.text()} for b, v in self.verdicts.items()
            },
            "estimated_round_seconds": self.estimated_round_seconds,
            "budget_seconds": FULL_SIZE_BUDGET_S,
            "not_measured": self.not_measured,
            "trials": self.trials.to_dict() if self.trials else None,
        }


def judge_at_full_size(
    shapes: RealShapes,
    ran: str,
    backends: Sequence[str],
    device: torch.device,
    sync: Callable[[], None],
    *,
    budget_s: float = FULL_SIZE_BUDGET_S,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    deadline: float | None = None,
) -> FullSizeJudgement:
    """``ran`` against every other of ``backends`` at the largest of ``shapes``, when the
    pilot's estimate fits ``budget_s`` on this device; otherwise the reason it was not. Past the
    probe's ``deadline`` no round is taken beyond ``min_rounds``."""
    judgement = FullSizeJudgement(shapes, ran)
    largest = shapes.largest()
    if largest is None:
        judgement.not_measured = shapes.error or "the full-size model makes no attention call"
        return judgement
    began = time.perf_counter()
    runnable: list[str] = []
    round_seconds = 0.0
    for backend in dict.fromkeys([ran, *backends]):
        seconds = _pilot_estimate(backend, largest, device, sync)
        if seconds is not None:
            runnable.append(backend)
            round_seconds += seconds
    judgement.estimated_round_seconds = round_seconds
    if ran not in runnable or len(runnable) < 2:
        judgement.not_measured = (
            f"{BACKEND_LABELS.get(ran, ran)} and another backend do not both run at "
            f"{largest.label()} here"
        )
        return judgement
    needed = round_seconds * (min_rounds + 1)
    left = budget_s - (time.perf_counter() - began)
    if needed > left:
        judgement.not_measured = (
            f"one call of each backend at {largest.label()} would take about "
            f"{round_seconds:.3g} s here, so {min_rounds} interleaved rounds need about "
            f"{needed:.0f} s, over the {budget_s:.0f} s this measurement may take"
        )
        return judgement
    trials = benchmark_signature(
        largest,
        device,
        sync,
        runnable,
        min_samples=min_rounds,
        max_samples=max_rounds,
        budget_s=max(0.0, left - round_seconds),
        decided=comparisons_decided([ran]),
        deadline=deadline,
    )
    judgement.trials = trials
    ran_trial = trials.trial(ran)
    if ran_trial is None or not ran_trial.samples:
        judgement.not_measured = f"{BACKEND_LABELS.get(ran, ran)} failed at {largest.label()}"
        return judgement
    for trial in trials.trials:
        if trial.backend != ran and trial.samples:
            judgement.verdicts[trial.backend] = faster_verdict(ran_trial, trial)
    if not judgement.verdicts:
        judgement.not_measured = f"no other backend ran at {largest.label()} here"
    return judgement


def _timed(call: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def _pilot_estimate(
    backend: str, shape: Signature, device: torch.device, sync: Callable[[], None]
) -> float | None:
    """Seconds one call of ``backend`` at ``shape`` would take here, from pilot calls at two
    slices of it (one head; 1/PILOT_QUERY_SHARE and four times that of the queries; the least of
    three calls each, as load from other processes only adds time) fitted as fixed cost + cost
    per multiply-add; None when it does not run at the slice."""
    points: list[tuple[float, float]] = []
    small = max(1, shape.q_len // PILOT_QUERY_SHARE)
    for q_len in dict.fromkeys((small, min(shape.q_len, 4 * small))):
        pilot = dataclasses.replace(shape, batch=1, heads=1, kv_heads=1, q_len=q_len)
        inputs = make_inputs(pilot, device)
        trial, _ = try_backend(backend, pilot, device, inputs)  # also the warm-up call
        if not trial.runs:
            return None
        call = attention_call(backend, inputs, pilot)
        points.append((attention_flops(pilot), min(_timed(call, sync) for _ in range(3))))
        del inputs
    target = attention_flops(shape)
    (f1, t1), (f2, t2) = points[0], points[-1]
    if f2 > f1 and t2 > t1:
        return t1 + (t2 - t1) * (target - f1) / (f2 - f1)
    return t2 * target / f2


__all__ = [
    "FULL_SIZE_BUDGET_S",
    "FullSizeJudgement",
    "RealShapes",
    "attention_flops",
    "judge_at_full_size",
    "real_attention_shapes",
]
