"""Model presets: the architectures LoRA users train, each in a ``full`` and a ``tiny`` size.

``full`` is the published configuration of the real model, so the compute and memory of a step
equal the real model's and a GPU user's measured s/it is their real s/it. ``tiny`` is the same
architecture (same block types, conditioning and call signature) shrunk until one training step
takes a fraction of a second on a laptop CPU.

The configurations live in ``configs/<preset>/<size>.json``; each file has a ``_sources`` object
saying where its numbers come from (the model repositories' ``config.json`` files). This module
only reads them: it imports nothing heavy, so the CLI can list and validate presets cheaply.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from diagnose.config import PRESETS, SIZES
from diagnose.errors import DiagnoseError, ExitCode

#: Below this much device memory a GPU gets full SD1.5 instead of full SDXL by default.
#: SDXL LoRA at 1024 px, batch 1, bf16, without gradient checkpointing (our default) peaks at
#: about 13-16 GB measured by users (UNet 5.1 GB in bf16 + both CLIP encoders 1.6 GB + the
#: activations of 10-block transformer stages at 128x128 latents); kohya and diffusers document
#: needing gradient checkpointing to fit it in 12-16 GB. 24 GB-class cards (which report about
#: 23.6-24 GiB) run it comfortably, 16 GB cards do not, so the line sits between them. Full SD1.5
#: at 512 px peaks around 6-8 GB, which every GPU worth diagnosing has.
SDXL_MIN_MEMORY_BYTES = 20 * 1024**3

#: Text-encoder roles, which decide how captions are tokenised and how the outputs are used.
TEXT_ENCODER_ROLES: tuple[str, ...] = ("clip_l", "clip_g", "t5", "qwen3")


@dataclass(frozen=True)
class ComponentSpec:
    """A component built from a config: its diffusers/transformers class name and kwargs."""

    class_name: str
    config: dict[str, Any]


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text encoder of a preset."""

    #: "clip_l", "clip_g", "t5" or "qwen3" (see :data:`TEXT_ENCODER_ROLES`).
    role: str
    class_name: str
    config: dict[str, Any]
    #: Tokens per caption: padded to this for CLIP/T5, an upper bound for Qwen3.
    max_length: int


@dataclass(frozen=True)
class Preset:
    """Everything needed to build a model and train a LoRA on it."""

    name: str
    size: str
    denoiser: ComponentSpec
    vae: ComponentSpec
    text_encoders: tuple[TextEncoderSpec, ...]
    #: The training noise schedule: DDPMScheduler (epsilon) for UNets, FlowMatchEulerDiscrete
    #: (rectified flow) for the transformers.
    scheduler: ComponentSpec
    #: Default square resolution buckets in pixels.
    resolutions: tuple[int, ...]
    #: Module-name suffixes the LoRA adapter wraps by default (the attention projections).
    lora_target_modules: tuple[str, ...]
    #: Where the numbers come from, per component.
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def family(self) -> str:
        """The architecture family; for a preset it is its name."""
        return self.name

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config["latent_channels"])


@cache
def load_preset(name: str, size: str) -> Preset:
    """Read ``configs/<name>/<size>.json``. Unknown names raise DiagnoseError(USAGE)."""
    if name not in PRESETS:
        raise DiagnoseError(
            f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}", ExitCode.USAGE
        )
    if size not in SIZES:
        raise DiagnoseError(
            f"unknown size {size!r}; choose one of {', '.join(SIZES)}", ExitCode.USAGE
        )
    resource = resources.files("diagnose.workload") / "configs" / name / f"{size}.json"
    try:
        data = json.loads(resource.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:  # a broken installation, not a user error
        raise DiagnoseError(
            f"preset {name}/{size}: cannot read its config ({exc})", ExitCode.INTERNAL_ERROR
        ) from None
    return _preset_from_dict(name, size, data)


def _preset_from_dict(name: str, size: str, data: dict[str, Any]) -> Preset:
    encoders = tuple(
        TextEncoderSpec(
            role=str(e["role"]),
            class_name=str(e["class"]),
            config=dict(e["config"]),
            max_length=int(e["max_length"]),
        )
        for e in data["text_encoders"]
    )
    for encoder in encoders:
        if encoder.role not in TEXT_ENCODER_ROLES:
            raise DiagnoseError(
                f"preset {name}/{size}: unknown text-encoder role {encoder.role!r}",
                ExitCode.INTERNAL_ERROR,
            )
    return Preset(
        name=name,
        size=size,
        denoiser=ComponentSpec(data["denoiser"]["class"], dict(data["denoiser"]["config"])),
        vae=ComponentSpec(data["vae"]["class"], dict(data["vae"]["config"])),
        text_encoders=encoders,
        scheduler=ComponentSpec(data["scheduler"]["class"], dict(data["scheduler"]["config"])),
        resolutions=tuple(int(r) for r in data["resolutions"]),
        lora_target_modules=tuple(str(m) for m in data["lora_target_modules"]),
        sources={str(k): str(v) for k, v in data.get("_sources", {}).items()},
    )


def default_preset(device_kind: str, memory_bytes: int | None) -> tuple[str, str]:
    """The (preset, size) a run uses when the user names none.

    A GPU (any device kind but "cpu"/"unknown") gets the model most LoRA users train, full SDXL,
    unless its memory is known to be under :data:`SDXL_MIN_MEMORY_BYTES`, where full SD1.5 is
    what such a card trains. Without a GPU, tiny SD1.5: seconds per step on a laptop CPU.
    """
    if device_kind in ("cpu", "unknown", ""):
        return ("sd15", "tiny")
    if memory_bytes is not None and memory_bytes < SDXL_MIN_MEMORY_BYTES:
        return ("sd15", "full")
    return ("sdxl", "full")


#: The LoRA rank the counts' trainable parameters are counted at (the runs' default): a LoRA's
#: parameters grow in proportion to its rank, so other ranks are scaled from it.
COUNTED_RANK = 16


@dataclass(frozen=True)
class ComponentCount:
    """A frozen model's parameters, and how many of them are the weights of the linear layers a
    quantized ``--base`` stores in its own bytes (see ``diagnose.workload.quantize``)."""

    parameters: int
    stored_linear_weights: int


@dataclass(frozen=True)
class PresetCount:
    """A preset's models counted on the meta device: what ``diagnose presets`` lists (the
    denoiser's class, its parameters and those the default LoRA trains: rank
    :data:`COUNTED_RANK` on the preset's target modules) and what its weights' memory is counted
    from before a run builds anything (the quantizable share of the denoiser, the VAE, the text
    encoders)."""

    class_name: str
    parameters: int
    trainable_parameters: int
    stored_linear_weights: int
    vae_parameters: int
    text_encoders: tuple[ComponentCount, ...]

    def at_rank(self, rank: int) -> PresetCount:
        """These counts with the default LoRA at ``rank``."""
        return dataclasses.replace(
            self, trainable_parameters=self.trainable_parameters * rank // COUNTED_RANK
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.class_name,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "stored_linear_weights": self.stored_linear_weights,
            "vae_parameters": self.vae_parameters,
            "text_encoders": [dataclasses.asdict(e) for e in self.text_encoders],
        }

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> PresetCount:
        return cls(
            class_name=str(entry["class"]),
            parameters=int(entry["parameters"]),
            trainable_parameters=int(entry["trainable_parameters"]),
            stored_linear_weights=int(entry["stored_linear_weights"]),
            vae_parameters=int(entry["vae_parameters"]),
            text_encoders=tuple(
                ComponentCount(int(e["parameters"]), int(e["stored_linear_weights"]))
                for e in entry["text_encoders"]
            ),
        )


#: The counts' file beside the configs: written by ``scripts/preset_counts`` from the models
#: built on the meta device, and held against a fresh count by tests/test_presets.py.
COUNTS_FILE = "counts.json"


@cache
def preset_counts() -> dict[tuple[str, str], PresetCount]:
    """Every preset's counts, read from :data:`COUNTS_FILE`: listing the presets, or saying
    whether a full-size one fits a GPU, imports no torch and builds no model."""
    resource = resources.files("diagnose.workload") / "configs" / COUNTS_FILE
    try:
        data = json.loads(resource.read_text(encoding="utf-8"))
        return {
            (name, size): PresetCount.from_dict(entry)
            for name, sizes in data.items()
            for size, entry in sizes.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DiagnoseError(
            f"presets: cannot read their counts ({exc})", ExitCode.INTERNAL_ERROR
        ) from None


def all_presets() -> list[tuple[str, str]]:
    """Every (preset, size) pair shipped."""
    return [(name, size) for name in PRESETS for size in SIZES]


__all__ = [
    "COUNTED_RANK",
    "COUNTS_FILE",
    "SDXL_MIN_MEMORY_BYTES",
    "TEXT_ENCODER_ROLES",
    "ComponentCount",
    "ComponentSpec",
    "Preset",
    "PresetCount",
    "TextEncoderSpec",
    "all_presets",
    "default_preset",
    "load_preset",
    "preset_counts",
]
