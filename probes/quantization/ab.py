"""The quantization probe's A/B: the quantized base's and the unquantized twin's training steps
timed interleaved on the same batches and latents, their outputs compared on the same inputs, and
the bytes each holds (:mod:`.probe` runs it and judges what it measured).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from diagnose import contention
from diagnose import quantized_base as qb
from diagnose.catalogs import quantization_catalog as catalog
from diagnose.probes.budgets import budget_spent
from diagnose.stats import ab_verdict
from diagnose.timing import PhaseTimer, device_synchronizer
from diagnose.torch_compat import tree_leaves
from diagnose.workload.data import ImageBatch

#: Interleaved rounds (one step of each base): at least MIN_ROUNDS, then until the A/B is
#: decided, the budget is spent or MAX_ROUNDS are done.
MIN_ROUNDS = 5
MAX_ROUNDS = 30
BUDGET_S = 30.0


def stored_kinds(config: Any) -> dict[str, str]:
    """The quantized storage of each frozen part the run stores quantized (denoiser, text
    encoders)."""
    kinds = {"denoiser": config.base, "text encoders": config.text_encoder_base or config.base}
    return {part: kind for part, kind in kinds.items() if kind in qb.QUANTIZED_KINDS}


def held_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes the frozen parameters and the buffers of ``modules`` hold, measured from the tensors
    themselves (each storage once), with bitsandbytes' quantization constants (a 4-bit weight's
    absmax and code, an int8 weight's row scales), which live on the weight, not as parameters."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()

    def add_state(state: object, depth: int = 0) -> None:
        if state is None or depth > 2:
            return
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif hasattr(value, "absmax"):  # a nested quantization state
                add_state(value, depth + 1)

    for module in modules:
        for parameter in module.parameters():
            if parameter.requires_grad:
                continue
            add(parameter)
            add_state(getattr(parameter, "quant_state", None))
            scales = getattr(parameter, "SCB", None)
            if isinstance(scales, torch.Tensor):
                add(scales)
        for buffer in module.buffers():
            add(buffer)
    return total


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    reference, other = reference.detach().float(), other.detach().float()
    norm = float(torch.linalg.vector_norm(reference))
    return float(torch.linalg.vector_norm(other - reference)) / norm if norm else 0.0


@dataclasses.dataclass
class SharedLatents:
    """The A/B's batches with their latents, encoded once for both arms: the VAE is not stored
    quantized, so its encode is the same work in both and would only add time and noise. The
    batches are of one resolution bucket, so that every round's two steps do the same work."""

    batches: list[ImageBatch]
    latents: list[torch.Tensor]
    #: The VAE's encode of one batch, measured here: the quickest of the batches' encodes (the
    #: first may be the VAE's first call, and a busy machine lengthens any one of them; 0 when
    #: the run caches its latents).
    encode_seconds: float


#: Batches drawn at most while looking for ``count`` of the first one's bucket.
_BATCHES_TO_DRAW = 8


def shared_latents(workload: Any, count: int = 2) -> SharedLatents:
    sync = device_synchronizer(workload.device)
    batches: list[ImageBatch] = []
    for _, batch in zip(range(_BATCHES_TO_DRAW), workload.batches(), strict=False):
        if not batches or batch.resolution == batches[0].resolution:
            batches.append(batch)
        if len(batches) == count:
            break
    latents: list[torch.Tensor] = []
    spent: list[float] = []
    for batch in batches:
        cached = workload.cached_latents(batch)
        if cached is not None:
            latents.append(cached)
            spent.append(0.0)
            continue
        sync()
        start = time.perf_counter()
        latents.append(workload.encode_latents(batch.pixels.to(workload.device)))
        sync()
        spent.append(time.perf_counter() - start)
    return SharedLatents(batches, latents, min(spent))


@torch.no_grad()
def compare_outputs(
    stored: Any, unquantized: Any, shared: SharedLatents | None = None
) -> dict[str, float]:
    """Relative L2 error of the stored base's outputs against the unquantized one's, on the
    same inputs (the first of ``shared``'s batches, else a new one): the text encoders'
    conditioning (when they are stored quantized) and the denoiser's prediction given the
    unquantized conditioning (so its error is its own)."""
    shared = shared or shared_latents(stored, count=1)
    batch = shared.batches[0]
    latents = shared.latents[0].to(unquantized.device)
    cond = unquantized.encode_text(batch.captions)
    errors: dict[str, float] = {}
    if "text encoders" in stored_kinds(stored.config):
        stored_cond = stored.encode_text(batch.captions)
        pairs = [
            (a, b)
            for key in cond
            for a, b in zip(tree_leaves(cond[key]), tree_leaves(stored_cond[key]), strict=False)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
        ]
        if pairs:
            errors["text encoders"] = max(relative_error(a, b) for a, b in pairs)
    generator = torch.Generator(device=unquantized.device)
    predictions = []
    for workload in (unquantized, stored):
        generator.manual_seed(0)
        with workload.attention, workload._autocast():
            noised = workload.family.add_noise(workload.components, latents, generator)
            predictions.append(
                workload.family.predict(workload.components, noised.noisy, noised.timesteps, cond)
            )
    errors["denoiser"] = relative_error(predictions[0], predictions[1])
    return errors


def min_relative(stored_times: Sequence[float], whole_step: float) -> float:
    """The least difference worth a finding, as a share of the A/B's own step (which leaves out
    the VAE's encode): :data:`catalog.MIN_SHARE` of ``whole_step``, the step the page leads
    with."""
    past_vae = statistics.median(stored_times)
    if past_vae <= 0:
        return catalog.MIN_SHARE
    # Past 1 the question has no "faster" answer: no difference could be that share.
    return min(0.99, catalog.MIN_SHARE * max(whole_step, past_vae) / past_vae)


def judged_step(
    headline: float | None, stored_times: Sequence[float], encode_seconds: float
) -> float:
    """The step a difference is a share of: the headline's s/it, else the A/B's own step with
    the encode added back."""
    return headline or statistics.median(stored_times) + encode_seconds


def interleaved_steps(
    stored: Any,
    unquantized: Any,
    shared: SharedLatents,
    *,
    headline: float | None = None,
    budget_s: float = BUDGET_S,
    deadline: float | None = None,
) -> tuple[list[float], list[float], bool]:
    """Seconds of training steps of each workload on the same batches and latents, alternating
    which goes first each round; stops once the A/B is decided after MIN_ROUNDS, at ``budget_s``
    of rounds, or once the probe's ``deadline`` has passed (:func:`budget_spent`). The third
    value: whether the deadline stopped it before the A/B was decided."""
    sync = device_synchronizer(stored.device)
    timer = PhaseTimer(sync)
    rounds = list(zip(shared.batches, shared.latents, strict=True))
    for workload in (stored, unquantized):  # warm-up: first calls, allocator, caches
        workload.step(rounds[0][0], timer, rounds[0][1])
    times: dict[int, list[float]] = {0: [], 1: []}
    arms = (stored, unquantized)
    contention.mark_rounds()
    began = time.perf_counter()
    for round_index in range(MAX_ROUNDS):
        batch, latents = rounds[round_index % len(rounds)]
        order = (0, 1) if round_index % 2 == 0 else (1, 0)
        for arm in order:
            sync()
            start = time.perf_counter()
            arms[arm].step(batch, timer, latents)
            sync()
            times[arm].append(time.perf_counter() - start)
        if round_index + 1 < MIN_ROUNDS:
            continue
        whole = judged_step(headline, times[0], shared.encode_seconds)
        verdict = ab_verdict(times[0], times[1], min_relative=min_relative(times[0], whole))
        if verdict.decided or time.perf_counter() - began > budget_s:
            break
        if budget_spent(deadline) and round_index + 1 < MAX_ROUNDS:
            return times[0], times[1], True
    return times[0], times[1], False


__all__ = [
    "BUDGET_S",
    "MAX_ROUNDS",
    "MIN_ROUNDS",
    "SharedLatents",
    "compare_outputs",
    "held_bytes",
    "interleaved_steps",
    "judged_step",
    "min_relative",
    "relative_error",
    "shared_latents",
    "stored_kinds",
]
