"""Build the models of a LoRA training step: from a preset's configs (random weights) or from a
local diffusers model folder (``--model DIR``, offline).

Nothing here ever downloads: presets are built from their configs with random weights, whose
compute and memory equal the real model's; a model folder is read with ``local_files_only``.
Captions are tokenised by the folder's own tokenizer when it has one, otherwise by
:class:`HashTokenizer`, which gives the real token-sequence shapes without a vocabulary file.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from diagnose.errors import DiagnoseError, ExitCode, first_line
from diagnose.record import ModelInfo
from diagnose.workload.presets import Preset, TextEncoderSpec, load_preset

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
#: Text-encoder sub-folders of a diffusers model folder, in pipeline order.
TEXT_ENCODER_FOLDERS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
#: What each family's text encoders are, in folder order (used for a model folder).
FAMILY_TEXT_ROLES: dict[str, tuple[str, ...]] = {
    "sd15": ("clip_l",),
    "sdxl": ("clip_l", "clip_g"),
    "flux": ("clip_l", "t5"),
    "sd3": ("clip_l", "clip_g", "t5"),
    "zimage": ("qwen3",),
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
# Tokenizers


@dataclass
class TokenBatch:
    """Token ids of a batch of captions, padded to a common length."""

    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64, 1 = real token


class CaptionTokenizer(Protocol):
    """Turns captions into token ids the way a text encoder's pipeline does."""

    role: str
    max_length: int

    def __call__(self, captions: Sequence[str]) -> TokenBatch: ...


class HashTokenizer:
    """A deterministic stand-in for a real tokenizer, for models built from configs.

    A config has no vocabulary, and the step's cost does not depend on which ids the tokens
    carry, only on how many there are and how they are padded, so each word (or punctuation
    mark) becomes one id by a stable hash, framed and padded to ``max_length`` as the pipelines
    do: CLIP ``<bos> words <eos>`` padded with ``<eos>`` (the SD tokenizers' pad token); T5
    ``words </s>`` padded with 0; Qwen3 (Z-Image) the chat template's tokens around the words,
    padded to 512 (ZImagePipeline encodes the padded batch, then keeps the real tokens).
    """

    #: Chat-template tokens around a Z-Image prompt (enable_thinking=True adds no think block):
    #: "<|im_start|>", "user", "\n" before; "<|im_end|>", "\n", "<|im_start|>", "assistant",
    #: "\n" after.
    _QWEN_PREFIX = 3
    _QWEN_SUFFIX = 5

    def __init__(self, role: str, vocab_size: int, max_length: int) -> None:
        if vocab_size < 16:
            raise ValueError("vocab_size too small for a tokenizer")
        if max_length < self._QWEN_PREFIX + self._QWEN_SUFFIX + 1:
            raise ValueError("max_length too small for a tokenizer")
        self.role = role
        self.max_length = max_length
        self.vocab_size = vocab_size

    def _word_ids(self, caption: str) -> list[int]:
        words = _split_words(caption)
        # ids 3 .. vocab-3: clear of T5's pad/eos (0, 1) and CLIP's bos/eos (the last two ids).
        span = self.vocab_size - 5
        return [3 + zlib.crc32(w.lower().encode("utf-8")) % span for w in words]

    def _row(self, caption: str) -> tuple[list[int], int]:
        """The framed ids of one caption and the id its row is padded with."""
        words = self._word_ids(caption)
        length = self.max_length
        if self.role in ("clip_l", "clip_g"):
            eos = self.vocab_size - 1
            return [self.vocab_size - 2, *words[: length - 2], eos], eos
        if self.role == "t5":
            return [*words[: length - 1], 1], 0
        frame = self._QWEN_PREFIX + self._QWEN_SUFFIX
        return [4] * self._QWEN_PREFIX + words[: length - frame] + [5] * self._QWEN_SUFFIX, 0

    def __call__(self, captions: Sequence[str]) -> TokenBatch:
        ids = torch.zeros((len(captions), self.max_length), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, caption in enumerate(captions):
            row, pad = self._row(caption)
            ids[i] = pad
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return TokenBatch(input_ids=ids, attention_mask=mask)


class PretrainedTokenizer:
    """A model folder's own tokenizer, called the way the family's pipeline calls it."""

    def __init__(self, role: str, tokenizer: Any, max_length: int) -> None:
        self.role = role
        self.max_length = max_length
        self._tokenizer = tokenizer

    def __call__(self, captions: Sequence[str]) -> TokenBatch:
        texts = list(captions)
        if self.role == "qwen3":
            texts = [
                self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=True,
                )
                for text in texts
            ]
        encoded = self._tokenizer(
            texts,
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_tensors="pt",
        )
        return TokenBatch(
            input_ids=encoded["input_ids"].long(),
            attention_mask=encoded["attention_mask"].long(),
        )


def _split_words(caption: str) -> list[str]:
    words: list[str] = []
    current: list[str] = []
    for ch in caption:
        if ch.isalnum():
            current.append(ch)
            continue
        if current:
            words.append("".join(current))
            current = []
        if not ch.isspace():
            words.append(ch)
    if current:
        words.append("".join(current))
    return words


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


def _diffusers_class(name: str, allowed: Sequence[str], what: str) -> Any:
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


def _transformers_class(name: str) -> Any:
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
    cls = _transformers_class(spec.class_name)
    config = cls.config_class(**spec.config)
    model: torch.nn.Module = cls(config)
    return model


def build_denoiser(preset: Preset) -> torch.nn.Module:
    cls = _diffusers_class(preset.denoiser.class_name, tuple(DENOISER_FAMILIES), "denoiser")
    model: torch.nn.Module = cls(**dict(preset.denoiser.config))
    return model


def build_vae(preset: Preset) -> torch.nn.Module:
    cls = _diffusers_class(preset.vae.class_name, VAE_CLASSES, "VAE")
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
    tokenizers: list[CaptionTokenizer] = []
    for index, spec in enumerate(preset.text_encoders):
        _seed(seed, 2 + index)
        with construct_on(device, policy.weight_dtype):
            encoders.append(build_text_encoder(spec))
        vocab = int(spec.config.get("vocab_size", 1000))
        tokenizers.append(HashTokenizer(spec.role, vocab, spec.max_length))

    components = Components(
        family=preset.family,
        preset=preset.name,
        size=preset.size,
        source="config (random weights)",
        denoiser=denoiser,
        vae=vae,
        text_encoders=encoders,
        text_roles=[spec.role for spec in preset.text_encoders],
        tokenizers=tokenizers,
        scheduler=build_scheduler(preset.scheduler.class_name, preset.scheduler.config),
        resolutions=preset.resolutions,
        lora_target_modules=preset.lora_target_modules,
        denoiser_parameters=denoiser_parameters,
    )
    _freeze(components, policy)
    return components


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


def _freeze(components: Components, policy: PrecisionPolicy) -> None:
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
) -> int:
    """Wrap ``target_modules`` of the frozen denoiser in a peft LoRA adapter.

    The adapter is added the way diffusers' LoRA training scripts add it (``add_adapter`` with
    gaussian init), its weights are cast to ``lora_dtype`` (fp32 master weights except in
    bf16-full), and only they require grad. Returns the number of wrapped modules.
    """
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(
        r=rank,
        # peft annotates int but only ever divides by r: a float alpha works (kohya allows one).
        lora_alpha=cast(int, alpha if alpha is not None else rank),
        init_lora_weights="gaussian",
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
    denoiser.requires_grad_(False)
    targets = target_modules if target_modules is not None else spec.lora_target_modules
    return denoiser, base_parameters, apply_lora(denoiser, rank, None, targets, torch.float32)


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
        components = Components(
            family=spec.family,
            preset=spec.name,
            size=spec.size,
            source="config (random weights)",
            denoiser=denoiser,
            vae=build_vae(spec),
            text_encoders=[build_text_encoder(e) for e in spec.text_encoders],
            text_roles=[e.role for e in spec.text_encoders],
            tokenizers=[
                HashTokenizer(e.role, int(e.config.get("vocab_size", 1000)), e.max_length)
                for e in spec.text_encoders
            ],
            scheduler=None,
            resolutions=spec.resolutions,
            lora_target_modules=spec.lora_target_modules,
            denoiser_parameters=base_parameters,
        )
    return components, lora_modules


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


# --------------------------------------------------------------------------------------------
# A local diffusers model folder


def _bad(model_dir: Path, message: str) -> DiagnoseError:
    return DiagnoseError(f"--model {model_dir}: {message}", ExitCode.BAD_INPUT)


def _read_index(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise _bad(root, "not a folder")
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise _bad(root, "no model_index.json (not a diffusers model folder)")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(root, f"model_index.json is unreadable: {first_line(exc)}") from None
    if not isinstance(index, dict):
        raise _bad(root, "model_index.json is not a JSON object")
    return index


def _index_class(root: Path, index: dict[str, Any], key: str) -> str | None:
    entry = index.get(key)
    if entry is None:
        return None
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        raise _bad(root, f"model_index.json entry {key!r} is not [library, class]")
    return entry[1]


def _family_of(root: Path, class_name: str, config: dict[str, Any]) -> str:
    family = DENOISER_FAMILIES.get(class_name)
    if family is None:
        raise _bad(
            root,
            f"denoiser {class_name} is not supported (supported: {', '.join(DENOISER_FAMILIES)})",
        )
    if family == "sd15" and config.get("addition_embed_type") == "text_time":
        return "sdxl"
    return family


def _load_or_fail(root: Path, what: str, load: Any) -> Any:
    try:
        return load()
    except DiagnoseError:
        raise
    except Exception as exc:  # any loader failure is a problem with the folder: say which part
        raise _bad(root, f"cannot load {what}: {first_line(exc)}") from None


def _component_config(root: Path, folder: str) -> dict[str, Any]:
    """``<folder>/config.json`` of a model folder; DiagnoseError(BAD_INPUT) naming the problem."""
    path = root / folder / "config.json"
    if not path.is_file():
        raise _bad(root, f"{folder}/config.json is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(
            root,
            f"{folder}/config.json is unreadable: {first_line(exc)}",
        ) from None
    if not isinstance(config, dict):
        raise _bad(root, f"{folder}/config.json is not a JSON object")
    return config


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No per-file progress bars from transformers while a model folder loads."""
    from transformers.utils import logging as hf_logging

    logging_module: Any = hf_logging  # untyped functions
    enabled = bool(logging_module.is_progress_bar_enabled())
    logging_module.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging_module.enable_progress_bar()


def load_components(model_dir: str, device: torch.device, policy: PrecisionPolicy) -> Components:
    """Load a local diffusers model folder (model_index.json + component sub-folders), offline.

    The family (and so how the denoiser is called) follows from the denoiser class; what the
    folder does not carry (training noise schedule class, LoRA targets, default resolution) comes
    from the family's full preset. Any unusable part raises DiagnoseError(BAD_INPUT) naming it.
    """
    root = Path(model_dir).expanduser()
    index = _read_index(root)
    key = "unet" if "unet" in index else "transformer" if "transformer" in index else None
    if key is None:
        raise _bad(root, "model_index.json names no 'unet' or 'transformer' component")
    class_name = _index_class(root, index, key) or "?"
    family = _family_of(root, class_name, _component_config(root, key))
    defaults = load_preset(family, "full")
    denoiser_cls = _diffusers_class(class_name, tuple(DENOISER_FAMILIES), "denoiser")

    vae_class = _index_class(root, index, "vae")
    if vae_class is None:
        raise _bad(root, "model_index.json names no 'vae' component")
    vae_cls = _diffusers_class(vae_class, VAE_CLASSES, "VAE")
    vae_dtype = policy.vae_dtype(bool(_component_config(root, "vae").get("force_upcast", True)))

    roles = FAMILY_TEXT_ROLES[family]
    encoder_classes: list[Any] = []
    for folder, spec in zip(TEXT_ENCODER_FOLDERS, defaults.text_encoders, strict=False):
        encoder_class = _index_class(root, index, folder)
        if encoder_class is None:
            raise _bad(root, f"model_index.json names no {folder!r} ({spec.class_name}) component")
        encoder_classes.append(_transformers_class(encoder_class))

    with _quiet_loading():
        denoiser = _load_or_fail(
            root,
            key,
            lambda: denoiser_cls.from_pretrained(
                root, subfolder=key, local_files_only=True, torch_dtype=policy.weight_dtype
            ),
        )
        vae = _load_or_fail(
            root,
            "vae",
            lambda: vae_cls.from_pretrained(
                root, subfolder="vae", local_files_only=True, torch_dtype=vae_dtype
            ),
        )
        encoders: list[torch.nn.Module] = []
        for folder, cls in zip(TEXT_ENCODER_FOLDERS, encoder_classes, strict=False):
            encoders.append(
                _load_or_fail(
                    root,
                    folder,
                    lambda cls=cls, folder=folder: cls.from_pretrained(
                        root / folder, local_files_only=True, dtype=policy.weight_dtype
                    ),
                )
            )

    tokenizers: list[CaptionTokenizer] = []
    notes: list[str] = []
    for folder, role, spec, encoder in zip(
        TEXT_ENCODER_FOLDERS, roles, defaults.text_encoders, encoders, strict=False
    ):
        tokenizer_folder = root / folder.replace("text_encoder", "tokenizer")
        tokenizer = _load_tokenizer(tokenizer_folder, role, spec.max_length)
        if tokenizer is None:
            vocab = int(getattr(model_config(encoder), "vocab_size", 1000))
            tokenizer = HashTokenizer(role, vocab, spec.max_length)
            notes.append(f"{tokenizer_folder.name}: no usable tokenizer, captions hashed to ids")
        tokenizers.append(tokenizer)

    scheduler_config = dict(defaults.scheduler.config)
    if (root / "scheduler" / "scheduler_config.json").is_file():
        # The folder's betas / shift, in the training scheduler class of the family.
        scheduler_config.update(
            {k: v for k, v in _scheduler_config(root).items() if not k.startswith("_")}
        )

    components = Components(
        family=family,
        preset=family,
        size="",
        source=str(root),
        denoiser=denoiser.to(device),
        vae=vae.to(device),
        text_encoders=[e.to(device) for e in encoders],
        text_roles=list(roles),
        tokenizers=tokenizers,
        scheduler=build_scheduler(defaults.scheduler.class_name, scheduler_config),
        resolutions=defaults.resolutions,
        lora_target_modules=defaults.lora_target_modules,
        denoiser_parameters=count_parameters(denoiser),
        notes=notes,
    )
    _freeze(components, policy)
    return components


def _scheduler_config(root: Path) -> dict[str, Any]:
    path = root / "scheduler" / "scheduler_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(root, f"scheduler/scheduler_config.json: {first_line(exc)}") from None
    if not isinstance(config, dict):
        raise _bad(root, "scheduler/scheduler_config.json is not a JSON object")
    return config


def _load_tokenizer(folder: Path, role: str, max_length: int) -> CaptionTokenizer | None:
    if not folder.is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # an unusable tokenizer falls back to hashing; the step still runs
        return None
    return PretrainedTokenizer(role, tokenizer, max_length)


def save_model_folder(components: Components, folder: Path) -> None:
    """Write ``components`` as a diffusers model folder that :func:`load_components` reads."""
    folder.mkdir(parents=True, exist_ok=True)
    key = "unet" if type(components.denoiser).__name__ == "UNet2DConditionModel" else "transformer"
    index: dict[str, Any] = {"_class_name": f"{components.family}-from-diagnose"}
    with _quiet_loading():
        components.denoiser.save_pretrained(folder / key)  # type: ignore[operator]
        index[key] = ["diffusers", type(components.denoiser).__name__]
        components.vae.save_pretrained(folder / "vae")  # type: ignore[operator]
        index["vae"] = ["diffusers", type(components.vae).__name__]
        for name, encoder in zip(TEXT_ENCODER_FOLDERS, components.text_encoders, strict=False):
            encoder.save_pretrained(folder / name)  # type: ignore[operator]
            index[name] = ["transformers", type(encoder).__name__]
    if components.scheduler is not None:
        components.scheduler.save_config(folder / "scheduler")
        index["scheduler"] = ["diffusers", type(components.scheduler).__name__]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


__all__ = [
    "DENOISER_FAMILIES",
    "CaptionTokenizer",
    "Components",
    "HashTokenizer",
    "PrecisionPolicy",
    "PretrainedTokenizer",
    "TokenBatch",
    "apply_lora",
    "build_components",
    "cast_frozen",
    "construct_on",
    "count_parameters",
    "describe_preset",
    "format_count",
    "load_components",
    "meta_components",
    "model_info",
    "precision_policy",
    "save_model_folder",
    "trainable_parameters",
]
