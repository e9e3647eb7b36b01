"""How each architecture trains: captions into conditioning, latents noised, the denoiser called.

One :class:`Family` per architecture (SD1.5, SDXL, Flux, SD3, Z-Image), following each model's
diffusers training script and pipeline: its text encoders' outputs, its noise schedule and
training target, and the arguments its denoiser takes. :data:`FAMILIES` holds one instance of
each by name. The conditioning helpers split a batch's conditioning per sample and put it back
together, for the caches of :class:`~diagnose.workload.step.Workload`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from diagnose.workload.models import Components, model_config
from diagnose.workload.tokenizers import TokenBatch

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


def list_keys(cond: Conditioning) -> frozenset[str]:
    """The keys whose values are lists of per-sample tensors: :func:`merge_conditioning` keeps
    them lists."""
    return frozenset(k for k, v in cond.items() if isinstance(v, list))


__all__ = [
    "FAMILIES",
    "Conditioning",
    "Family",
    "Noised",
    "conditioning_to",
    "latent_image_ids",
    "list_keys",
    "merge_conditioning",
    "pack_latents",
    "split_conditioning",
    "unpack_latents",
]
