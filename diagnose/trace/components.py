"""Which model component pays a finding, in the words and evidence every trace rule shares.

A rule splits its cost by component with :mod:`diagnose.trace.modules` (host ops it charged, or
stretches of time the host spent somewhere) and says it through the functions here, so a finding
reads "in the text encoder (T5EncoderModel)" and carries the same ``components`` evidence
whichever rule raised it. When the trace has no module ranges (captured without ``with_stack`` /
``with_modules`` and without component labels) every function returns nothing, so a rule reads
exactly as it does without attribution: no "unknown component" lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from diagnose.catalogs import in_trainers
from diagnose.catalogs.dataloader_catalog import CACHE_LATENTS_ADVICE
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import Intervals
from diagnose.trace.modules import ModuleScopes, ModuleShare, attribute, attribute_time
from diagnose.units import pct

#: Frozen components whose per-step work can be computed once before training.
ENCODERS: frozenset[str] = frozenset({"text_encoder", "vae"})

#: The smallest share :func:`breakdown` prints: below it ``pct`` would show "0.0%".
_SHOWN_SHARE = 0.0005

#: Cached text encoder outputs, in the trainers' words (a clause, no final stop).
CACHE_TEXT_ENCODER_ADVICE = (
    "cache the text encoder's outputs so no caption is encoded per step ("
    + in_trainers(
        kohya="--cache_text_encoder_outputs (--cache_text_encoder_outputs_to_disk)",
        diffusers="precompute the prompt embeddings (encode_prompt) before the training loop",
    )
    + ")"
)


def op_shares(ctx: TraceContext, ops: Sequence[int], seconds: Sequence[float]) -> list[ModuleShare]:
    """The components that ran host ``ops`` (``seconds`` each), costliest first; empty when the
    trace names no component."""
    scopes = ctx.modules()
    if not scopes.found or not len(ops):
        return []
    return attribute(scopes, ctx.trace, ops, seconds)


def time_shares(ctx: TraceContext, intervals: Intervals) -> list[ModuleShare]:
    """The components the host was inside during ``intervals``, by time, costliest first; empty
    when the trace names no component or the intervals are empty."""
    scopes = ctx.modules()
    if not scopes.found or not intervals.total:
        return []
    return attribute_time(scopes, intervals, _component_thread(ctx, scopes))


def _component_thread(ctx: TraceContext, scopes: ModuleScopes) -> int:
    """The thread whose module ranges say where the training loop is: the main thread, unless
    the components ran on another one (a trainer that steps on a worker thread)."""
    main = ctx.structure.main_thread
    owners = scopes.owner == np.arange(len(scopes.names))
    if not owners.any() or (owners & (scopes.thread == main)).any():
        return main
    threads, counts = np.unique(scopes.thread[owners], return_counts=True)
    return int(threads[int(np.argmax(counts))])


def named(shares: Iterable[ModuleShare]) -> list[ModuleShare]:
    """The shares of known components (the text encoder, the VAE...), in their order."""
    return [s for s in shares if s.role]


def where(shares: Sequence[ModuleShare]) -> str:
    """``the text encoder (T5EncoderModel)``, or ``the denoiser (…) and the text encoder (…)``;
    "" when no known component pays."""
    labels = [s.label for s in named(shares)]
    more = f" and {len(labels) - 2} more" if len(labels) > 2 else ""
    return " and ".join(labels[:2]) + more


def breakdown(shares: Sequence[ModuleShare]) -> str:
    """``the VAE (Encoder) 80%, code outside any known component 20%``: each share of the total,
    unknown code included so the percentages add up; a share that would print as 0% is left
    out (a stray op outside the component says nothing about where the cost is)."""
    total = sum(s.seconds for s in shares)
    if not total:
        return ""
    shown = [s for s in shares if s.seconds / total >= _SHOWN_SHARE] or list(shares[:1])
    return ", ".join(f"{s.label} {pct(s.seconds / total)}" for s in shown)


def top_share(shares: Sequence[ModuleShare]) -> float:
    """The largest share's part of the total (0 when there is none)."""
    total = sum(s.seconds for s in shares)
    return shares[0].seconds / total if shares and total else 0.0


def evidence(ctx: TraceContext, shares: Sequence[ModuleShare]) -> dict[str, Any]:
    """``{"components": [...]}`` for a finding's evidence, each with its share of the total;
    empty when no known component pays, so an unattributed trace's evidence is unchanged."""
    if not named(shares):
        return {}
    total = sum(s.seconds for s in shares)
    return {
        "components": [
            {**s.as_evidence(ctx.n_steps), "share": s.seconds / total if total else None}
            for s in shares
        ]
    }


def frozen_encoders(ctx: TraceContext) -> bool:
    """Whether the text encoder and the VAE read as a diffusion step's conditioning, which a LoRA
    run keeps frozen: only when a denoiser runs in the same trace. Alone, an encoder is the
    workload itself (a BERT trace), and caching its outputs is no fix."""
    return "denoiser" in ctx.modules().role


def cache_advice(role: str) -> str:
    """How to stop running a frozen encoder every step (a clause), or "" for other roles."""
    if role == "text_encoder":
        return CACHE_TEXT_ENCODER_ADVICE
    if role == "vae":
        return CACHE_LATENTS_ADVICE
    return ""


__all__ = [
    "CACHE_TEXT_ENCODER_ADVICE",
    "ENCODERS",
    "breakdown",
    "cache_advice",
    "evidence",
    "frozen_encoders",
    "named",
    "op_shares",
    "time_shares",
    "top_share",
    "where",
]
