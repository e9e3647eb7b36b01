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
what the training target is) live in one :class:`Family` per architecture, following each
model's diffusers training script and pipeline.
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
from diagnose.workload.models import (
    Components,
    PrecisionPolicy,
    TokenBatch,
    apply_lora,
    build_components,
    cast_frozen,
    load_components,
    model_config,
    model_info,
    precision_policy,
    trainable_parameters,
)
from diagnose.workload.presets import load_preset
from diagnose.workload.quantize import FLOAT_BASES, quantize_linears

#: Per-sample conditioning: name -> tensor with a leading batch dim, or a list of per-sample
#: tensors (Z-Image's captions keep their own lengths).
Conditioning = dict[str, Any]

#: FLUX.1-dev's distilled guidance value used in training (train_dreambooth_lora_flux.py default).
FLUX_TRAINING_GUIDANCE = 3.5


@dataclass
class Noised:
    """The noisy input of one step, its timesteps and the training target."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor


# --------------------------------------------------------------------------------------------
# Text encoders


def _clip_outputs(
    encoder: torch.nn.Module, tokens: TokenBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(last hidden state, penultimate hidden state, pooled) of a CLIP text encoder.

    Pooled is the projected ``text_embeds`` of a CLIPTextModelWithProjection, else the
    ``pooler_output`` (the EOS token's state), as the pipelines read them.
    """
    out = encoder(tokens.input_ids.to(device), output_hidden_states=True)
    pooled = getattr(out, "text_embeds", None)
    if pooled is None:
        pooled = out.pooler_output
    return out.last_hidden_state, out.hidden_states[-2], pooled


def _clip_pair(
    components: Components, captions: Sequence[str], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDXL's and SD3's two CLIP encoders (CLIP-L, then CLIP-G): their penultimate hidden states
    side by side, and each one's pooled output (L's, G's)."""
    _, hidden_l, pooled_l = _clip_outputs(
        components.text_encoders[0], components.tokenizers[0](captions), device
    )
    _, hidden_g, pooled_g = _clip_outputs(
        components.text_encoders[1], components.tokenizers[1](captions), device
    )
    return torch.cat([hidden_l, hidden_g], dim=-1), pooled_l, pooled_g


def _t5_outputs(encoder: torch.nn.Module, tokens: TokenBatch, device: torch.device) -> torch.Tensor:
    # The Flux and SD3 pipelines call T5 without an attention mask: padding is attended.
    out = encoder(tokens.input_ids.to(device))
    hidden: torch.Tensor = out.last_hidden_state
    return hidden


def _qwen_outputs(
    encoder: torch.nn.Module, tokens: TokenBatch, device: torch.device
) -> list[torch.Tensor]:
    """Z-Image: hidden_states[-2] of Qwen3, keeping only each caption's real tokens."""
    if device.type == "meta":
        # Counting memory needs only the shapes: Qwen3's mask code reads the mask's values,
        # which the meta device does not have. Each caption's token count is known on the host.
        counts = tokens.attention_mask.bool().sum(dim=1).tolist()
        hidden_size = int(encoder.config.hidden_size)  # type: ignore[union-attr,arg-type]
        dtype = next(encoder.parameters()).dtype
        return [torch.empty(int(n), hidden_size, device=device, dtype=dtype) for n in counts]
    mask = tokens.attention_mask.to(device).bool()
    out = encoder(
        input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True
    )
    hidden = out.hidden_states[-2]
    return [hidden[i][mask[i]] for i in range(hidden.shape[0])]


# --------------------------------------------------------------------------------------------
# Families


class Family:
    """How one architecture turns captions into conditioning, noises latents and is called."""

    name = ""

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        raise NotImplementedError

    def add_noise(
        self, components: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> Noised:
        raise NotImplementedError

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        raise NotImplementedError


class _EpsilonUNet(Family):
    """DDPM noise-prediction training, as train_text_to_image_lora(_sdxl).py does it."""

    def add_noise(
        self, components: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> Noised:
        scheduler = components.scheduler
        noise = torch.randn(
            latents.shape, generator=generator, device=latents.device, dtype=latents.dtype
        )
        timesteps = torch.randint(
            0,
            int(scheduler.config.num_train_timesteps),
            (latents.shape[0],),
            generator=generator,
            device=latents.device,
        )
        noisy = scheduler.add_noise(latents, noise, timesteps)
        if scheduler.config.prediction_type == "v_prediction":
            target = scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        return Noised(noisy, timesteps, target)


class SD15Family(_EpsilonUNet):
    name = "sd15"

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        last, _, _ = _clip_outputs(
            components.text_encoders[0], components.tokenizers[0](captions), device
        )
        return {"prompt_embeds": last}

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        out: torch.Tensor = components.denoiser(
            noisy, timesteps, encoder_hidden_states=cond["prompt_embeds"], return_dict=False
        )[0]
        return out


class SDXLFamily(_EpsilonUNet):
    name = "sdxl"

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        # Both encoders' penultimate layers, concatenated; pooled from the projected bigG.
        hidden, _, pooled_g = _clip_pair(components, captions, device)
        return {"prompt_embeds": hidden, "pooled": pooled_g}

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        scale = components.vae_scale_factor
        # add_time_ids: original size, crop top-left, target size (no crop, no resize here).
        time_ids = torch.tensor(
            [height * scale, width * scale, 0, 0, height * scale, width * scale],
            device=noisy.device,
            dtype=noisy.dtype,
        ).repeat(batch, 1)
        out: torch.Tensor = components.denoiser(
            noisy,
            timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            added_cond_kwargs={"text_embeds": cond["pooled"], "time_ids": time_ids},
            return_dict=False,
        )[0]
        return out


class _RectifiedFlow(Family):
    """Rectified-flow training as in diffusers' SD3/Flux LoRA scripts.

    Timesteps drawn logit-normally (the SD3 paper's default) and looked up in the scheduler's
    (shifted) schedule; ``noisy = (1 - sigma) * x + sigma * noise``; target ``noise - x`` (the
    velocity), or its negative for a model that predicts ``x - noise`` (Z-Image).
    """

    target_sign = 1.0

    def add_noise(
        self, components: Components, latents: torch.Tensor, generator: torch.Generator
    ) -> Noised:
        from diffusers.training_utils import compute_density_for_timestep_sampling

        scheduler = components.scheduler
        batch = latents.shape[0]
        u = compute_density_for_timestep_sampling(
            "logit_normal",
            batch,
            logit_mean=0.0,
            logit_std=1.0,
            device=latents.device,
            generator=generator,
        )
        count = int(scheduler.config.num_train_timesteps)
        indices = (u * count).long().clamp(0, count - 1).cpu()
        timesteps = scheduler.timesteps[indices].to(latents.device)
        sigmas = scheduler.sigmas[indices].to(device=latents.device, dtype=latents.dtype)
        sigmas = sigmas.view(batch, *([1] * (latents.ndim - 1)))
        noise = torch.randn(
            latents.shape, generator=generator, device=latents.device, dtype=latents.dtype
        )
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        return Noised(noisy, timesteps, self.target_sign * (noise - latents))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C*4): Flux's 2x2 patch tokens, the layout of
    ``FluxPipeline._pack_latents`` (not imported: the pipeline module pulls in image processors)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for latents of ``height`` x ``width``."""
    b, _, channels = tokens.shape
    grid = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(b, channels // 4, height, width)


def latent_image_ids(
    height: int, width: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(height*width, 3) RoPE positions (0, row, col) of the packed tokens, as
    ``FluxPipeline._prepare_latent_image_ids``."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).to(dtype)


class FluxFamily(_RectifiedFlow):
    name = "flux"

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        _, _, pooled = _clip_outputs(
            components.text_encoders[0], components.tokenizers[0](captions), device
        )
        embeds = _t5_outputs(
            components.text_encoders[1], components.tokenizers[1](captions), device
        )
        return {"prompt_embeds": embeds, "pooled": pooled}

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        batch, _, height, width = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        packed = pack_latents(noisy)
        img_ids = latent_image_ids(height // 2, width // 2, device, dtype)
        prompt_embeds = cond["prompt_embeds"]
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if model_config(components.denoiser).guidance_embeds:
            guidance = torch.full((batch,), FLUX_TRAINING_GUIDANCE, device=device)
        out = components.denoiser(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return unpack_latents(out, height, width)


class SD3Family(_RectifiedFlow):
    name = "sd3"

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        # As StableDiffusion3Pipeline.encode_prompt: CLIP-L and CLIP-G penultimate states
        # side by side, zero-padded to T5's width, then T5's tokens appended along the sequence.
        clip, pooled_l, pooled_g = _clip_pair(components, captions, device)
        t5 = _t5_outputs(components.text_encoders[2], components.tokenizers[2](captions), device)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip, t5], dim=-2),
            "pooled": torch.cat([pooled_l, pooled_g], dim=-1),
        }

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        out: torch.Tensor = components.denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]
        return out


class ZImageFamily(_RectifiedFlow):
    name = "zimage"
    # ZImagePipeline negates the transformer's output to get the scheduler's velocity, so the
    # model itself predicts x - noise.
    target_sign = -1.0

    def encode_text(
        self, components: Components, captions: Sequence[str], device: torch.device
    ) -> Conditioning:
        return {
            "prompt_embeds": _qwen_outputs(
                components.text_encoders[0], components.tokenizers[0](captions), device
            )
        }

    def predict(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        # One (C, F=1, H, W) tensor per image, timestep as 1 - sigma, as ZImagePipeline calls it.
        images = list(noisy.unsqueeze(2).unbind(dim=0))
        t = (1000 - timesteps.float()) / 1000  # fp32: the timestep embedding's input
        out = components.denoiser(images, t, list(cond["prompt_embeds"]), return_dict=False)[0]
        return torch.stack(list(out), dim=0).squeeze(2)


FAMILIES: dict[str, Family] = {
    f.name: f for f in (SD15Family(), SDXLFamily(), FluxFamily(), SD3Family(), ZImageFamily())
}


# --------------------------------------------------------------------------------------------
# Conditioning helpers (caching splits per sample and re-assembles batches)


def split_conditioning(cond: Conditioning) -> list[Conditioning]:
    """One conditioning per sample (tensors lose their batch dim; lists are indexed)."""
    sizes = {len(v) for v in cond.values()}
    if len(sizes) != 1:
        raise ValueError("conditioning entries disagree on the batch size")
    (count,) = sizes
    return [{k: v[i] for k, v in cond.items()} for i in range(count)]


def merge_conditioning(parts: Sequence[Conditioning], lists: frozenset[str]) -> Conditioning:
    """Inverse of :func:`split_conditioning`; keys in ``lists`` stay lists."""
    merged: Conditioning = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        merged[key] = list(values) if key in lists else torch.stack(values)
    return merged


def conditioning_to(cond: Conditioning, device: torch.device, dtype: torch.dtype) -> Conditioning:
    moved: Conditioning = {}
    for key, value in cond.items():
        if isinstance(value, list):
            moved[key] = [v.to(device=device, dtype=dtype, non_blocking=True) for v in value]
        else:
            moved[key] = value.to(device=device, dtype=dtype, non_blocking=True)
    return moved


def _list_keys(cond: Conditioning) -> frozenset[str]:
    return frozenset(k for k, v in cond.items() if isinstance(v, list))


# --------------------------------------------------------------------------------------------
# Optimizers


def build_optimizer(
    name: str, params: list[torch.nn.Parameter], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer a trainer would make for ``--optimizer name``."""
    if name == "adamw":
        if device.type == "cuda":  # CUDA and ROCm: one fused kernel for all LoRA tensors
            try:
                return torch.optim.AdamW(params, lr=lr, fused=True)
            except (RuntimeError, ValueError):
                pass  # a dtype/device the fused kernel does not take: foreach below
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except Exception as exc:  # ImportError, or a broken build raising anything at import
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DiagnoseError(
                f"--optimizer adamw8bit needs bitsandbytes ({first}); "
                "install it: pip install bitsandbytes",
                ExitCode.UNSUPPORTED,
            ) from None
        adamw8bit: Any = getattr(bitsandbytes.optim, "AdamW8bit")  # noqa: B009 - untyped package
        optimizer: torch.optim.Optimizer = adamw8bit(params, lr=lr)
        return optimizer
    if name == "adafactor":
        from transformers.optimization import Adafactor

        adafactor: Any = Adafactor  # untyped constructor
        # Fixed learning rate, as kohya's and OneTrainer's LoRA presets set it.
        fixed: torch.optim.Optimizer = adafactor(
            params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
        return fixed
    raise DiagnoseError(f"unknown optimizer {name!r}", ExitCode.USAGE)


# --------------------------------------------------------------------------------------------
# The workload


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
                    self._text_list_keys = _list_keys(cond)
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


__all__ = [
    "FAMILIES",
    "Conditioning",
    "Family",
    "Noised",
    "Workload",
    "WorkloadSnapshot",
    "build_optimizer",
    "build_workload",
    "conditioning_to",
    "merge_conditioning",
    "split_conditioning",
]
