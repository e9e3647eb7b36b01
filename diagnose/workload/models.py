"""Build the models of a LoRA training step from a preset's configs, with random weights.

Nothing here ever downloads: a preset's models are built from their configs with random weights,
whose compute and memory equal the real model's. Here too: the dtypes of each ``--precision``,
the LoRA adapter, and the record's description of the models (also of a full-size preset, built
on the meta device). A local diffusers folder (``--model DIR``) is read by
:mod:`diagnose.workload.model_folder`; captions are tokenised by
:mod:`diagnose.workload.tokenizers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from diagnose.errors import DiagnoseError, ExitCode, first_line
from diagnose.record import ModelInfo
from diagnose.workload.presets import (
    COUNTED_RANK,
    ComponentCount,
    Preset,
    PresetCount,
    TextEncoderSpec,
    load_preset,
)
from diagnose.workload.tokenizers import CaptionTokenizer, HashTokenizer

#: Denoiser classes we know how to call, and the family each one belongs to. A UNet is SDXL when
#: it takes the "text_time" added conditioning, SD1.5 (or 2.x) otherwise.
DENOISER_FAMILIES: dict[str, str] = {
    "UNet2DConditionModel": "sd15",
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "ZImageTransformer2DModel": "zimage",
}
VAE_CLASSES: tuple[str, ...] = ("AutoencoderKL",)
TEXT_ENCODER_CLASSES: dict[str, str] = {
    # class name -> role family used when a model folder does not say which CLIP it is
    "CLIPTextModel": "clip_l",
    "CLIPTextModelWithProjection": "clip_g",
    "T5EncoderModel": "t5",
    "Qwen3Model": "qwen3",
}


# --------------------------------------------------------------------------------------------
# Precision


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of a step, as LoRA trainers (diffusers examples, kohya) set them.

    The frozen weights (denoiser base, text encoders, VAE) are stored in the compute dtype; the
    trainable LoRA weights are fp32 "master" weights except in bf16-full; autocast runs the
    forward in half precision for the mixed modes; fp16 scales the loss.
    """

    name: str
    weight_dtype: torch.dtype
    lora_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    grad_scaler: bool

    def vae_dtype(self, force_upcast: bool) -> torch.dtype:
        """SD VAEs overflow in fp16 (their configs say force_upcast); trainers keep them fp32."""
        if self.weight_dtype == torch.float16 and force_upcast:
            return torch.float32
        return self.weight_dtype


def precision_policy(precision: str) -> PrecisionPolicy:
    """The policy for a ``--precision`` value (fp32, fp16, bf16-mixed, bf16-full)."""
    if precision == "fp32":
        return PrecisionPolicy("fp32", torch.float32, torch.float32, None, False)
    if precision == "fp16":
        return PrecisionPolicy("fp16", torch.float16, torch.float32, torch.float16, True)
    if precision == "bf16-mixed":
        return PrecisionPolicy("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, False)
    if precision == "bf16-full":
        return PrecisionPolicy("bf16-full", torch.bfloat16, torch.bfloat16, None, False)
    raise DiagnoseError(f"unknown precision {precision!r}", ExitCode.USAGE)


# --------------------------------------------------------------------------------------------
# Components


@dataclass
class Components:
    """The models of one workload, on their device and in their dtypes."""

    family: str
    preset: str
    size: str
    #: "config (random weights)" or the model folder.
    source: str
    denoiser: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: list[torch.nn.Module]
    text_roles: list[str]
    tokenizers: list[CaptionTokenizer]
    scheduler: Any
    resolutions: tuple[int, ...]
    lora_target_modules: tuple[str, ...]
    #: Parameters of the base denoiser (before LoRA).
    denoiser_parameters: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def vae_scale_factor(self) -> int:
        return int(2 ** (len(model_config(self.vae).block_out_channels) - 1))


def model_config(model: torch.nn.Module) -> Any:
    """The ``.config`` of a diffusers/transformers model (untyped libraries: Any)."""
    return getattr(model, "config")  # noqa: B009 - Module.__getattr__ would type it as a Tensor


@contextlib.contextmanager
def construct_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Create modules directly on ``device`` in ``dtype``.

    A 4.7B T5 or a 12B Flux initialised on the CPU in fp32 and then copied would take minutes
    and twice the memory; created under this context its weights are allocated and initialised
    where they will live, in the dtype they will have. On "meta" nothing is allocated at all.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def diffusers_class(name: str, allowed: Sequence[str], what: str) -> Any:
    if name not in allowed:
        raise DiagnoseError(
            f"{what} class {name!r} is not supported (supported: {', '.join(allowed)})",
            ExitCode.BAD_INPUT,
        )
    return _from_diffusers(name)


def _from_diffusers(name: str) -> Any:
    """``diffusers.<name>``. A diffusers made for a newer torch fails while it imports (it calls
    what this torch lacks): that is said in one line, not as a crash of diagnose."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import diffusers

        return getattr(diffusers, name)
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError) as exc:
        try:
            installed = version("diffusers")
        except PackageNotFoundError:
            installed = "(not installed)"
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DiagnoseError(
            f"diffusers {installed} cannot give {name} under torch {torch.__version__} "
            f"({type(exc).__name__}: {reason}); install a diffusers made for this torch "
            "(torch 2.4: diffusers 0.36)",
            ExitCode.UNSUPPORTED,
        ) from exc


def transformers_class(name: str) -> Any:
    import transformers

    if name not in TEXT_ENCODER_CLASSES:
        raise DiagnoseError(
            f"text encoder class {name!r} is not supported "
            f"(supported: {', '.join(TEXT_ENCODER_CLASSES)})",
            ExitCode.BAD_INPUT,
        )
    return getattr(transformers, name)


def build_text_encoder(spec: TextEncoderSpec) -> torch.nn.Module:
    """A transformers text encoder from its config (random weights), in the current context."""
    cls = transformers_class(spec.class_name)
    config = cls.config_class(**spec.config)
    model: torch.nn.Module = cls(config)
    return model


def build_denoiser(preset: Preset) -> torch.nn.Module:
    cls = diffusers_class(preset.denoiser.class_name, tuple(DENOISER_FAMILIES), "denoiser")
    model: torch.nn.Module = cls(**dict(preset.denoiser.config))
    return model


def build_vae(preset: Preset) -> torch.nn.Module:
    cls = diffusers_class(preset.vae.class_name, VAE_CLASSES, "VAE")
    model: torch.nn.Module = cls(**dict(preset.vae.config))
    return model


def build_scheduler(class_name: str, config: dict[str, Any]) -> Any:
    if class_name not in ("DDPMScheduler", "FlowMatchEulerDiscreteScheduler"):
        raise DiagnoseError(
            f"training scheduler {class_name!r} is not supported", ExitCode.BAD_INPUT
        )
    return _from_diffusers(class_name).from_config(config)


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _seed(seed: int, component: int) -> None:
    # One stream per component, so that changing one component's config leaves the others'
    # weights unchanged.
    torch.manual_seed(seed * 1009 + component)


def build_components(
    preset: Preset, device: torch.device, policy: PrecisionPolicy, seed: int = 0
) -> Components:
    """All models of ``preset``, random weights, on ``device``, frozen, in ``policy``'s dtypes."""
    _seed(seed, 0)
    with construct_on(device, policy.weight_dtype):
        denoiser = build_denoiser(preset)
    denoiser_parameters = count_parameters(denoiser)

    vae_dtype = policy.vae_dtype(bool(preset.vae.config.get("force_upcast", True)))
    _seed(seed, 1)
    with construct_on(device, vae_dtype):
        vae = build_vae(preset)

    encoders: list[torch.nn.Module] = []
    for index, spec in enumerate(preset.text_encoders):
        _seed(seed, 2 + index)
        with construct_on(device, policy.weight_dtype):
            encoders.append(build_text_encoder(spec))

    scheduler = build_scheduler(preset.scheduler.class_name, preset.scheduler.config)
    components = _preset_components(preset, denoiser, vae, encoders, scheduler, denoiser_parameters)
    freeze_components(components, policy)
    return components


def _preset_components(
    preset: Preset,
    denoiser: torch.nn.Module,
    vae: torch.nn.Module,
    encoders: list[torch.nn.Module],
    scheduler: Any,
    denoiser_parameters: int,
) -> Components:
    """The models built from ``preset``'s configs as :class:`Components`, their captions
    tokenised by :class:`HashTokenizer` (a config has no vocabulary)."""
    return Components(
        family=preset.family,
        preset=preset.name,
        size=preset.size,
        source="config (random weights)",
        denoiser=denoiser,
        vae=vae,
        text_encoders=encoders,
        text_roles=[spec.role for spec in preset.text_encoders],
        tokenizers=[
            HashTokenizer(spec.role, int(spec.config.get("vocab_size", 1000)), spec.max_length)
            for spec in preset.text_encoders
        ],
        scheduler=scheduler,
        resolutions=preset.resolutions,
        lora_target_modules=preset.lora_target_modules,
        denoiser_parameters=denoiser_parameters,
    )


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype, buffers: bool = True) -> None:
    """Cast floating weights to ``dtype`` as ``from_pretrained(torch_dtype=...)`` leaves them.

    diffusers casts the whole model, buffers included (``buffers=True``); transformers keeps
    fp32 buffers such as RoPE frequencies (``buffers=False``) and, in fp16, its
    ``_keep_in_fp32_modules`` (T5's ``wo``, which overflows in fp16). Tensors are cast in place
    rather than with ``model.to(dtype)``, which diffusers answers with a warning every time.
    """
    keep: set[str] = set()
    if dtype == torch.float16:
        keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())

    def target(name: str) -> torch.dtype:
        return torch.float32 if any(part in keep for part in name.split(".")) else dtype

    for name, param in module.named_parameters():
        if param.is_floating_point() and param.dtype != target(name):
            param.data = param.data.to(target(name))
    if buffers:
        for name, buffer in list(module.named_buffers()):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, buffer.to(dtype))


def freeze_components(components: Components, policy: PrecisionPolicy) -> None:
    """Frozen, in their dtypes; the denoiser in train mode (dropout, as a trainer has it)."""
    components.denoiser.requires_grad_(False)
    cast_frozen(components.denoiser, policy.weight_dtype)
    components.denoiser.train()
    components.vae.requires_grad_(False)
    components.vae.eval()
    for encoder in components.text_encoders:
        encoder.requires_grad_(False)
        cast_frozen(encoder, policy.weight_dtype, buffers=False)
        encoder.eval()


# --------------------------------------------------------------------------------------------
# LoRA


def apply_lora(
    denoiser: torch.nn.Module,
    rank: int,
    alpha: float | None,
    target_modules: Sequence[str],
    lora_dtype: torch.dtype,
    *,
    initialise: bool = True,
) -> int:
    """Wrap ``target_modules`` of the frozen denoiser in a peft LoRA adapter.

    The adapter is added the way diffusers' LoRA training scripts add it (``add_adapter`` with
    gaussian init), its weights are cast to ``lora_dtype`` (fp32 master weights except in
    bf16-full), and only they require grad. Returns the number of wrapped modules.
    ``initialise=False`` leaves the adapter's values as they come (a model on the meta device,
    which holds none: drawing them there only costs time when a full-size model is counted).
    """
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(
        r=rank,
        # peft annotates int but only ever divides by r: a float alpha works (kohya allows one).
        lora_alpha=cast(int, alpha if alpha is not None else rank),
        init_lora_weights="gaussian" if initialise else False,
        target_modules=list(target_modules),
    )
    try:
        denoiser.add_adapter(config)  # type: ignore[operator]
    except ValueError as exc:
        names = sorted(_linear_suffixes(denoiser))
        raise DiagnoseError(
            f"LoRA target modules {', '.join(target_modules)} match nothing in "
            f"{type(denoiser).__name__} ({first_line(exc)}); its linear layers end in: "
            f"{', '.join(names[:24])}",
            ExitCode.USAGE,
        ) from None
    for parameter in denoiser.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(lora_dtype)
    return sum(1 for m in denoiser.modules() if isinstance(m, LoraLayer))


def _linear_suffixes(module: torch.nn.Module) -> set[str]:
    out: set[str] = set()
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear):
            parts = name.split(".")
            out.add(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1])
    return out


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# Description


def format_count(n: int) -> str:
    """12_345_678 -> "12.3M"."""
    if n >= 10**9:
        return f"{n / 10**9:.2f}B"
    if n >= 10**6:
        return f"{n / 10**6:.1f}M"
    if n >= 10**3:
        return f"{n / 10**3:.1f}K"
    return str(n)


def model_info(components: Components, lora_modules: int = 0) -> ModelInfo:
    """The record's description of the built (and possibly LoRA-wrapped) components."""
    trainable = sum(p.numel() for p in components.denoiser.parameters() if p.requires_grad)
    latent = int(model_config(components.vae).latent_channels)
    return ModelInfo(
        preset=components.preset,
        size=components.size,
        class_name=type(components.denoiser).__name__,
        source=components.source,
        parameters=components.denoiser_parameters,
        trainable_parameters=trainable,
        lora_modules=lora_modules,
        text_encoders=[
            f"{type(e).__name__} ({format_count(count_parameters(e))})"
            for e in components.text_encoders
        ],
        vae=(
            f"{type(components.vae).__name__} ({format_count(count_parameters(components.vae))}, "
            f"{latent} latent channels)"
        ),
    )


def _lora_denoiser_on_meta(
    spec: Any, rank: int, target_modules: Sequence[str] | None
) -> tuple[torch.nn.Module, int, int]:
    """The preset's frozen denoiser built on the meta device (no memory used) and wrapped in
    LoRA; its parameters before LoRA, and the number of wrapped modules. Call inside
    ``construct_on(meta, ...)``."""
    denoiser = build_denoiser(spec)
    base_parameters = count_parameters(denoiser)
    return denoiser, base_parameters, _lora_on_meta(denoiser, spec, rank, target_modules)


def _lora_on_meta(
    denoiser: torch.nn.Module, spec: Any, rank: int, target_modules: Sequence[str] | None
) -> int:
    """Freeze the preset's denoiser (built on the meta device) and wrap it in LoRA as a run
    does (``target_modules``: the preset's when None); the number of wrapped modules."""
    denoiser.requires_grad_(False)
    targets = target_modules if target_modules is not None else spec.lora_target_modules
    return apply_lora(denoiser, rank, None, targets, torch.float32, initialise=False)


def _on_meta_with_lora(
    preset: str, size: str, rank: int, target_modules: Sequence[str] | None, lora: bool = True
) -> tuple[Components, int]:
    """A preset's components built on the meta device (no memory used), its denoiser wrapped in
    LoRA unless ``lora`` is false; and the number of wrapped modules."""
    spec = load_preset(preset, size)
    with construct_on(torch.device("meta"), torch.float32):
        if lora:
            denoiser, base_parameters, lora_modules = _lora_denoiser_on_meta(
                spec, rank, target_modules
            )
        else:
            denoiser = build_denoiser(spec)
            base_parameters, lora_modules = count_parameters(denoiser), 0
        vae = build_vae(spec)
        encoders = [build_text_encoder(e) for e in spec.text_encoders]
    return _preset_components(spec, denoiser, vae, encoders, None, base_parameters), lora_modules


def meta_components(
    preset: str,
    size: str,
    rank: int = 16,
    target_modules: Sequence[str] | None = None,
    *,
    lora: bool = True,
) -> Components:
    """A preset's components on the meta device, its denoiser frozen and wrapped in LoRA (unless
    ``lora`` is false), with tokenizers: what can run a step's shapes without memory."""
    return _on_meta_with_lora(preset, size, rank, target_modules, lora)[0]


def describe_preset(
    preset: str, size: str, rank: int = 16, target_modules: Sequence[str] | None = None
) -> ModelInfo:
    """Parameter counts of a preset, LoRA included, built on the meta device (no memory used)."""
    return model_info(*_on_meta_with_lora(preset, size, rank, target_modules))


def count_preset(
    preset: str,
    size: str,
    rank: int = COUNTED_RANK,
    target_modules: Sequence[str] | None = None,
) -> PresetCount:
    """A preset's models built on the meta device (each once: a full-size build takes seconds)
    and counted: what :data:`diagnose.workload.presets.COUNTS_FILE` ships for the default LoRA,
    and what a LoRA on other modules is counted from."""
    from diagnose.workload.quantize import stored_linear_weights

    spec = load_preset(preset, size)
    with construct_on(torch.device("meta"), torch.float32):
        denoiser = build_denoiser(spec)
        parameters = count_parameters(denoiser)
        # Counted before LoRA wraps the linear layers: the adapter is not stored as the base.
        linear_weights = stored_linear_weights(denoiser)
        _lora_on_meta(denoiser, spec, rank, target_modules)
        vae = count_parameters(build_vae(spec))
        encoders = [build_text_encoder(e) for e in spec.text_encoders]
    return PresetCount(
        class_name=type(denoiser).__name__,
        parameters=parameters,
        trainable_parameters=sum(p.numel() for p in trainable_parameters(denoiser)),
        stored_linear_weights=linear_weights,
        vae_parameters=vae,
        text_encoders=tuple(
            ComponentCount(count_parameters(e), stored_linear_weights(e)) for e in encoders
        ),
    )


def lora_tensor_sizes(
    preset: str, size: str, rank: int = 16, target_modules: Sequence[str] | None = None
) -> list[int]:
    """Elements of every LoRA tensor a preset trains at ``size`` (built on the meta device): what
    size-dependent advice about the real model (an 8-bit optimizer's size threshold) is judged on
    when the run itself trained a shrunk model."""
    spec = load_preset(preset, size)
    with construct_on(torch.device("meta"), torch.float32):
        denoiser, _, _ = _lora_denoiser_on_meta(spec, rank, target_modules)
    return [p.numel() for p in denoiser.parameters() if p.requires_grad]


__all__ = [
    "DENOISER_FAMILIES",
    "Components",
    "PrecisionPolicy",
    "apply_lora",
    "build_components",
    "cast_frozen",
    "construct_on",
    "count_parameters",
    "count_preset",
    "describe_preset",
    "diffusers_class",
    "format_count",
    "freeze_components",
    "meta_components",
    "model_info",
    "precision_policy",
    "trainable_parameters",
    "transformers_class",
]
