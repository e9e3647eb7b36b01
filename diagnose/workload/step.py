"""The LoRA training step: what a trainer does per iteration, in timed phases.

``build_workload(config, device)`` builds the models (preset or ``--model DIR``), wraps the
denoiser in a LoRA adapter, makes the optimizer, the dataset and its DataLoader, and returns a
:class:`Workload`. ``Workload.step(batch, timer)`` runs one iteration, each part inside
``timer.phase(...)``:

- ``h2d``: the batch (pixels, or cached latents / text embeddings) to the device;
- ``encode``: VAE encode of the pixels and the text encoders over the captions (absent when both
  are cached);
- ``forward``: noise, timesteps, the denoiser's forward and the MSE loss;
- ``backward``: the backward pass (outside autocast, as accelerate does it);
- ``optimizer``: ``step()`` and ``zero_grad(set_to_none=True)`` (through a GradScaler in fp16).

The architecture-specific parts (how captions become conditioning, how the denoiser is called,
what the training target is) live in :mod:`diagnose.workload.families`; the optimizer in
:mod:`diagnose.workload.optimizers`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from diagnose.config import RunConfig
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import ModelInfo
from diagnose.timing import PhaseTimer
from diagnose.workload.attention import (
    AttentionBackend,
    attention_context,
    attention_head_dims,
    use_xformers,
)
from diagnose.workload.data import DatasetInfo, ImageBatch, PreparedData, make_loader, prepare_data
from diagnose.workload.families import (
    FAMILIES,
    Conditioning,
    conditioning_to,
    list_keys,
    merge_conditioning,
    split_conditioning,
)
from diagnose.workload.model_folder import load_components
from diagnose.workload.models import (
    Components,
    PrecisionPolicy,
    apply_lora,
    build_components,
    cast_frozen,
    model_config,
    model_info,
    precision_policy,
    trainable_parameters,
)
from diagnose.workload.optimizers import build_optimizer
from diagnose.workload.presets import load_preset
from diagnose.workload.quantize import FLOAT_BASES, quantize_linears


def _check_resolutions(family: str, resolutions: Sequence[int], components: Components) -> None:
    scale = components.vae_scale_factor
    if family in ("flux", "sd3", "zimage"):
        multiple = scale * 2  # latents are cut into 2x2 patches
        for side in resolutions:
            if side % multiple:
                raise DiagnoseError(
                    f"resolution {side} is not a multiple of {multiple}, which {family} needs",
                    ExitCode.USAGE,
                )
    if family == "sd3":
        limit = int(model_config(components.denoiser).pos_embed_max_size) * scale * 2
        for side in resolutions:
            if side > limit:
                raise DiagnoseError(
                    f"resolution {side} exceeds this SD3 model's position embedding ({limit} px)",
                    ExitCode.USAGE,
                )


class Workload:
    """One LoRA training setup, ready to step. Made by :func:`build_workload`."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device,
        components: Components,
        policy: PrecisionPolicy,
        optimizer: torch.optim.Optimizer,
        info: ModelInfo,
        data: PreparedData,
        attention: AttentionBackend,
        resolutions: list[int],
    ) -> None:
        self.config = config
        self.device = device
        self.components = components
        self.family = FAMILIES[components.family]
        self.policy = policy
        self.optimizer = optimizer
        self.model_info = info
        self.data = data
        self.data_info: DatasetInfo = data.info
        self.attention = attention
        self.resolutions = resolutions
        self.scaler = torch.amp.GradScaler(device.type, enabled=policy.grad_scaler)
        self.pin_memory = device.type == "cuda"
        self.loader = make_loader(
            data, config.batch, config.workers, self.pin_memory, seed=config.seed
        )
        #: The RNG behind the noise and the VAE sample of every step. Public so that a probe that
        #: runs extra steps can save and restore it (WorkloadSnapshot does) and later steps see
        #: the same noise as they would without that probe.
        self.noise_generator = torch.Generator(device=device)
        self.noise_generator.manual_seed(config.seed)
        self._latent_cache: dict[tuple[str, int], torch.Tensor] = {}
        self._text_cache: dict[str, Conditioning] = {}
        self._text_list_keys: frozenset[str] = frozenset()
        self._batches: Iterator[ImageBatch] | None = None
        self._iterator: Any = None
        self.epochs_started = 0
        self._closed = False

    # The models, under the names the runner and probes use.
    @property
    def denoiser(self) -> torch.nn.Module:
        return self.components.denoiser

    @property
    def vae(self) -> torch.nn.Module:
        return self.components.vae

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return self.components.text_encoders

    def snapshot(self) -> WorkloadSnapshot:
        """The state a probe's extra steps would change; ``.restore()`` puts it back."""
        return WorkloadSnapshot.take(self)

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return trainable_parameters(self.components.denoiser)

    def wrap_denoiser(self, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        """Replace the denoiser by ``wrap(denoiser)`` (DDP, FSDP) and rebuild the optimizer over
        the wrapped module's trainable parameters (FSDP replaces them by shards). Call it before
        the first step: the optimizer starts afresh."""
        self.components.denoiser = wrap(self.components.denoiser)
        self.optimizer = build_optimizer(
            self.config.optimizer,
            trainable_parameters(self.components.denoiser),
            self.config.learning_rate,
            self.device,
        )

    # ---------------------------------------------------------------- data

    def batches(self) -> Iterator[ImageBatch]:
        """Endless batches: a new epoch of the DataLoader starts when one ends."""
        if self._batches is None:
            self._batches = self._endless()
        return self._batches

    def _endless(self) -> Iterator[ImageBatch]:
        while True:
            self._iterator = iter(self.loader)
            self.epochs_started += 1
            yielded = False
            for batch in self._iterator:
                yielded = True
                yield batch
            if not yielded:
                raise DiagnoseError("the data loader yielded no batch", ExitCode.BAD_INPUT)

    # ---------------------------------------------------------------- encoding

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.policy.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.policy.autocast_dtype)

    @torch.no_grad()
    def encode_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """VAE-encode device pixels in [-1, 1] to scaled latents in the weight dtype."""
        vae = self.components.vae
        dtype = next(vae.parameters()).dtype
        dist = vae.encode(pixels.to(dtype)).latent_dist  # type: ignore[operator]
        latents = dist.sample(generator=self.noise_generator)
        config = model_config(vae)
        shift = getattr(config, "shift_factor", None) or 0.0
        scaled: torch.Tensor = (latents - shift) * config.scaling_factor
        return scaled.to(self.policy.weight_dtype)

    @torch.no_grad()
    def encode_text(self, captions: Sequence[str]) -> Conditioning:
        cond = self.family.encode_text(self.components, captions, self.device)
        return conditioning_to(cond, self.device, self.policy.weight_dtype)

    def prepare_caches(self) -> None:
        """Encode one epoch of latents and/or caption embeddings into memory before timing.

        As trainers' --cache_latents / --cache_text_encoder_outputs do: the cache lives in host
        memory and is copied to the device with each batch.
        """
        if not (self.config.cache_latents or self.config.cache_text_embeddings):
            return
        for batch in self.loader:
            pixels = batch.pixels.to(self.device)
            if self.config.cache_latents:
                latents = self.encode_latents(pixels).cpu()
                for path, latent in zip(batch.paths, latents, strict=True):
                    self._latent_cache[(path, batch.resolution)] = latent
            if self.config.cache_text_embeddings:
                todo = [c for c in dict.fromkeys(batch.captions) if c not in self._text_cache]
                if todo:
                    cond = self.encode_text(todo)
                    self._text_list_keys = list_keys(cond)
                    cpu = conditioning_to(cond, torch.device("cpu"), self.policy.weight_dtype)
                    for caption, part in zip(todo, split_conditioning(cpu), strict=True):
                        self._text_cache[caption] = part
        if self.config.cache_latents:
            # With latents cached, trainers read no image per step; neither do we from here on.
            self.loader = make_loader(
                self.data,
                self.config.batch,
                self.config.workers,
                self.pin_memory,
                seed=self.config.seed,
                decode=False,
            )

    def share_caches(self, other: Workload) -> None:
        """Use ``other``'s cached latents and caption embeddings: a twin built to compare
        against ``other`` then steps on the same inputs without encoding them again."""
        self._latent_cache = other._latent_cache
        self._text_cache = other._text_cache
        self._text_list_keys = other._text_list_keys

    def cached_latents(self, batch: ImageBatch) -> torch.Tensor | None:
        if not self.config.cache_latents:
            return None
        keys = [(path, batch.resolution) for path in batch.paths]
        if not all(key in self._latent_cache for key in keys):
            return None
        return torch.stack([self._latent_cache[key] for key in keys])

    def _cached_text(self, batch: ImageBatch) -> Conditioning | None:
        if not self.config.cache_text_embeddings:
            return None
        if not all(c in self._text_cache for c in batch.captions):
            return None
        return merge_conditioning(
            [self._text_cache[c] for c in batch.captions], self._text_list_keys
        )

    # ---------------------------------------------------------------- the step

    def step(
        self, batch: ImageBatch, timer: PhaseTimer, encoded: torch.Tensor | None = None
    ) -> float:
        """One training iteration on ``batch``; returns the loss.

        ``encoded``: the batch's latents, encoded beforehand. An A/B whose arms share the VAE
        passes them: its encode is the same work in both arms, and would only add time and
        noise to the difference between them.
        """
        device, policy = self.device, self.policy
        cached_latents = encoded if encoded is not None else self.cached_latents(batch)
        cached_text = self._cached_text(batch)
        pixels: torch.Tensor | None = None
        latents: torch.Tensor | None = None
        cond: Conditioning | None = None

        with timer.phase("h2d"):
            if cached_latents is None:
                non_blocking = self.pin_memory and batch.pixels.is_pinned()
                pixels = batch.pixels.to(device, non_blocking=non_blocking)
            else:
                latents = cached_latents.to(device, non_blocking=True)
            if cached_text is not None:
                cond = conditioning_to(cached_text, device, policy.weight_dtype)

        if latents is None or cond is None:
            with timer.phase("encode"):
                if latents is None:
                    assert pixels is not None
                    latents = self.encode_latents(pixels)
                if cond is None:
                    cond = self.encode_text(batch.captions)

        assert latents is not None and cond is not None
        with self.attention:
            with timer.phase("forward"), self._autocast():
                noised = self.family.add_noise(self.components, latents, self.noise_generator)
                prediction = self.family.predict(
                    self.components, noised.noisy, noised.timesteps, cond
                )
                loss = F.mse_loss(prediction.float(), noised.target.float())
            with timer.phase("backward"):
                scaled_loss: torch.Tensor = self.scaler.scale(loss)
                scaled_loss.backward()  # type: ignore[no-untyped-call]
        with timer.phase("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        # A non-finite loss is returned, not raised: the step's time is still the measurement,
        # and the record keeps the loss for whoever reads it.
        return float(loss.detach())

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Stop the loader's workers and remove the generated dataset folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._batches is not None:
            with contextlib.suppress(Exception):
                self._batches.close()  # type: ignore[attr-defined]
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self._iterator = None
        self._batches = None
        self.loader = None  # type: ignore[assignment]
        self.data.close()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class WorkloadSnapshot:
    """What probes' extra steps change in a workload, to put back afterwards: LoRA weights and
    gradients, optimizer and grad-scaler state, the noise generator, the config and the loader.
    Probes run after the measured steps, and each must leave the workload as it found it."""

    workload: Workload

    params: list[torch.nn.Parameter]
    data: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optimizer_state: dict[str, Any]
    scaler_state: dict[str, Any] | None
    generator_state: torch.Tensor | None
    config: Any
    loader: Any

    @classmethod
    def take(cls, workload: Workload) -> WorkloadSnapshot:
        params = list(workload.lora_parameters())
        scaler = workload.scaler
        # Restoring the noise generator keeps later probes seeing the same noise as without
        # this one.
        generator = workload.noise_generator
        return cls(
            workload=workload,
            params=params,
            data=[p.detach().clone() for p in params],
            grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
            optimizer_state=copy.deepcopy(workload.optimizer.state_dict()),
            scaler_state=copy.deepcopy(scaler.state_dict()) if scaler.is_enabled() else None,
            generator_state=generator.get_state() if generator is not None else None,
            config=workload.config,
            loader=workload.loader,
        )

    @torch.no_grad()
    def restore(self) -> None:
        workload = self.workload
        workload.config = self.config
        workload.loader = self.loader
        for param, data, grad in zip(self.params, self.data, self.grads, strict=True):
            param.data.copy_(data)
            # Copies: backward accumulates into .grad in place, and load_state_dict keeps some
            # tensors (AdamW's "step") as given, which the next optimizer.step() increments.
            param.grad = None if grad is None else grad.clone()
        workload.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        if self.scaler_state is not None:
            workload.scaler.load_state_dict(self.scaler_state)
        if self.generator_state is not None:
            workload.noise_generator.set_state(self.generator_state)


def store_bases(
    components: Components, config: RunConfig, policy: PrecisionPolicy, device: torch.device
) -> None:
    """The frozen denoiser and text encoders stored as ``--base``/``--text-encoder-base`` say
    (quantized, or cast to another float dtype than the precision's)."""
    compute = policy.autocast_dtype or policy.weight_dtype
    parts = [(components.denoiser, config.base, False)] + [
        (encoder, config.text_encoder_base or config.base, True)
        for encoder in components.text_encoders
    ]
    for module, kind, encoder in parts:
        if kind is None:
            continue
        dtype = FLOAT_BASES.get(kind)
        if dtype is not None:
            cast_frozen(module, dtype, buffers=not encoder)
        else:
            quantize_linears(module, kind, compute, device)  # type: ignore[arg-type]


def build_workload(config: RunConfig, device: torch.device) -> Workload:
    """Models, LoRA adapter, optimizer, data and caches for ``config`` on ``device``.

    ``config.preset``/``config.size`` must be resolved (or ``config.model_dir`` set).
    """
    policy = precision_policy(config.precision)
    if config.model_dir is not None:
        components = load_components(config.model_dir, device, policy)
    else:
        if config.preset is None:
            raise DiagnoseError(
                "no preset chosen (internal: resolve the config first)", ExitCode.INTERNAL_ERROR
            )
        preset = load_preset(config.preset, config.size or "tiny")
        components = build_components(preset, device, policy, seed=config.seed)

    resolutions = list(config.resolution or components.resolutions)
    _check_resolutions(components.family, resolutions, components)

    attention_dtype = policy.autocast_dtype or policy.weight_dtype
    attention = attention_context(
        config.attention, device, attention_head_dims(components.denoiser), attention_dtype
    )
    if config.attention == "xformers":
        use_xformers(components.denoiser)

    store_bases(components, config, policy, device)
    targets = config.target_modules or list(components.lora_target_modules)
    lora_modules = apply_lora(
        components.denoiser, config.rank, config.alpha, targets, policy.lora_dtype
    )
    if config.grad_checkpointing:
        components.denoiser.enable_gradient_checkpointing()  # type: ignore[operator]
    optimizer = build_optimizer(
        config.optimizer, trainable_parameters(components.denoiser), config.learning_rate, device
    )
    info = model_info(components, lora_modules)

    data = prepare_data(config.data_dir, resolutions, seed=config.seed)
    try:
        workload = Workload(
            config, device, components, policy, optimizer, info, data, attention, resolutions
        )
        workload.prepare_caches()
    except BaseException:
        data.close()
        raise
    return workload


__all__ = ["Workload", "WorkloadSnapshot", "build_workload"]
