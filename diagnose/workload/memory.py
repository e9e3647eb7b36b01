"""The memory a training step needs beyond its weights: the activations saved for the backward
pass, the temporaries and the gradients, at their peak, with and without gradient checkpointing.

Counted, not modelled: one forward and backward of the LoRA denoiser runs under a dispatch mode
that adds up the bytes of every storage an op creates and takes them off when the storage is
freed (torch keeps a storage's Python object as long as the storage lives, so its finalizer runs
exactly when the memory would go back to the allocator). On the meta device nothing is allocated,
so the real model's step is counted at its real resolution and batch on any machine.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from diagnose.torch_compat import TorchDispatchMode, fused_cpu_attention_op, tree_leaves


class LiveStorageBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes of the storages ops created under the mode that are still alive, and their peak.
    An op's output that shares an input's storage (a view, an in-place op) is not new memory."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._known: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._known.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._known:
                continue
            nbytes = storage.nbytes()
            self._known.add(key)
            self.live += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def _fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a fused kernel runs it: what it keeps for the backward
    pass is the output and one float per query row, not each attention matrix."""
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(
            attn_mask.shape, dtype=query.dtype, device=attn_mask.device
        ).masked_fill(~attn_mask, float("-inf"))
    fused = fused_cpu_attention_op()
    out: torch.Tensor = fused(
        query, key, value, float(dropout_p), bool(is_causal), attn_mask=attn_mask, scale=scale
    )[0]
    return out


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Every ``scaled_dot_product_attention`` call runs as a fused kernel meanwhile. The meta
    device would take the math path, which keeps each attention matrix; the kernels a GPU runs
    (flash, memory-efficient, cuDNN) do not. Patched on the module, not through a mode: the
    backward pass recomputes checkpointed blocks on autograd's own thread."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@dataclass(frozen=True)
class StepMemory:
    """Bytes one training step of a LoRA denoiser holds at its peak beyond the weights."""

    #: Where it was counted ("1024 px, batch 1").
    at: str
    #: The peak without and with gradient checkpointing (None: could not be counted).
    peak_bytes: int | None = None
    checkpointed_peak_bytes: int | None = None
    #: Why it could not be counted (an op with no meta kernel, data-dependent code).
    error: str = ""


def step_memory(
    config: Any, preset: str, size: str, *, checkpointing: tuple[bool, ...] = (False, True)
) -> StepMemory:
    """:func:`count_step_bytes` for ``config``'s training step of ``preset`` at ``size``: at the
    largest of its resolutions (the preset's own when it names none) and its batch, in its
    compute dtype, with the attention kernel it asked for. Counted without and with gradient
    checkpointing, or only as ``checkpointing`` names (each count is seconds at full size; the
    one not asked for is None)."""
    from diagnose.workload.models import precision_policy
    from diagnose.workload.presets import load_preset

    resolution = max(config.resolution or load_preset(preset, size).resolutions)
    at = f"{resolution} px, batch {config.batch}"
    policy = precision_policy(config.precision)
    counts: dict[bool, int] = {}
    targets = tuple(config.target_modules) if config.target_modules is not None else None
    try:
        for mode in checkpointing:
            counts[mode] = _counted(
                preset,
                size,
                resolution,
                config.batch,
                config.rank,
                targets,
                policy.autocast_dtype or policy.weight_dtype,
                mode,
                config.attention != "math",
            )
    except Exception as exc:  # an op without a meta kernel, code that reads a tensor's value
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return StepMemory(at, error=f"{type(exc).__name__}: {text}"[:300])
    return StepMemory(at, counts.get(False), counts.get(True))


@functools.lru_cache(maxsize=16)
def _counted(
    preset: str,
    size: str,
    resolution: int,
    batch: int,
    rank: int,
    targets: tuple[str, ...] | None,
    dtype: torch.dtype,
    checkpointing: bool,
    fused_sdpa: bool,
) -> int:
    """One count per configuration: a run asks before it starts and again in its report."""
    return count_step_bytes(
        preset,
        size,
        resolution=resolution,
        batch=batch,
        rank=rank,
        target_modules=targets,
        compute_dtype=dtype,
        checkpointing=checkpointing,
        fused_sdpa=fused_sdpa,
    )


def count_step_bytes(
    preset: str,
    size: str,
    *,
    resolution: int,
    batch: int,
    rank: int,
    target_modules: Any,
    compute_dtype: torch.dtype,
    checkpointing: bool,
    fused_sdpa: bool = True,
) -> int:
    """Peak bytes of one forward and backward of ``preset``'s LoRA denoiser at ``size``, counted
    on the meta device: what the activations, temporaries and gradients need beyond the weights.
    Every weight is cast to ``compute_dtype`` first: the meta device has no autocast, and under
    autocast the matmuls and what they save run in that dtype."""
    from diagnose.workload.families import FAMILIES, conditioning_to
    from diagnose.workload.models import meta_components
    from diagnose.workload.presets import load_preset

    meta = torch.device("meta")
    components = meta_components(preset, size, rank, target_modules)
    components.denoiser.to(compute_dtype)
    if checkpointing:
        components.denoiser.enable_gradient_checkpointing()  # type: ignore[operator]
    components.denoiser.train()
    family = FAMILIES[components.family]
    latent = resolution // components.vae_scale_factor
    channels = load_preset(preset, size).latent_channels
    with torch.no_grad():
        cond = conditioning_to(
            family.encode_text(components, ["a photo"] * batch, meta), meta, compute_dtype
        )
    noisy = torch.empty(batch, channels, latent, latent, device=meta, dtype=compute_dtype)
    timesteps = torch.full((batch,), 500.0, device=meta)
    counter = LiveStorageBytes()
    attention = fused_attention() if fused_sdpa else contextlib.nullcontext()
    with attention, counter:
        prediction = family.predict(components, noisy, timesteps, cond)
        loss = F.mse_loss(prediction.float(), torch.empty_like(prediction, dtype=torch.float32))
        loss.backward()  # type: ignore[no-untyped-call]
        del prediction, loss
    return counter.peak


__all__ = ["LiveStorageBytes", "StepMemory", "count_step_bytes", "fused_attention", "step_memory"]
