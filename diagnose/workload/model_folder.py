"""A local diffusers model folder (``--model DIR``): read offline into :class:`Components`, or
written from them.

The folder is read with ``local_files_only``, never downloaded. The family follows from the
denoiser class; what the folder does not carry comes from the family's full preset. Captions are
tokenised by the folder's own tokenizer when it has one, otherwise hashed
(:class:`~diagnose.workload.tokenizers.HashTokenizer`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from diagnose.errors import DiagnoseError, ExitCode, first_line
from diagnose.workload.models import (
    DENOISER_FAMILIES,
    VAE_CLASSES,
    Components,
    PrecisionPolicy,
    build_scheduler,
    count_parameters,
    diffusers_class,
    freeze_components,
    model_config,
    transformers_class,
)
from diagnose.workload.presets import load_preset
from diagnose.workload.tokenizers import CaptionTokenizer, HashTokenizer, PretrainedTokenizer

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


def _bad(model_dir: Path, message: str) -> DiagnoseError:
    return DiagnoseError(f"--model {model_dir}: {message}", ExitCode.BAD_INPUT)


def _json_object(root: Path, name: str) -> dict[str, Any]:
    """The JSON object in the file ``name`` (relative to ``root``); DiagnoseError(BAD_INPUT)
    naming the file when it cannot be read or holds anything else."""
    try:
        content = json.loads((root / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(root, f"{name} is unreadable: {first_line(exc)}") from None
    if not isinstance(content, dict):
        raise _bad(root, f"{name} is not a JSON object")
    return content


def _read_index(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise _bad(root, "not a folder")
    if not (root / "model_index.json").is_file():
        raise _bad(root, "no model_index.json (not a diffusers model folder)")
    return _json_object(root, "model_index.json")


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
    if not (root / folder / "config.json").is_file():
        raise _bad(root, f"{folder}/config.json is missing")
    return _json_object(root, f"{folder}/config.json")


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
    denoiser_cls = diffusers_class(class_name, tuple(DENOISER_FAMILIES), "denoiser")

    vae_class = _index_class(root, index, "vae")
    if vae_class is None:
        raise _bad(root, "model_index.json names no 'vae' component")
    vae_cls = diffusers_class(vae_class, VAE_CLASSES, "VAE")
    vae_dtype = policy.vae_dtype(bool(_component_config(root, "vae").get("force_upcast", True)))

    roles = FAMILY_TEXT_ROLES[family]
    encoder_classes: list[Any] = []
    for folder, spec in zip(TEXT_ENCODER_FOLDERS, defaults.text_encoders, strict=False):
        encoder_class = _index_class(root, index, folder)
        if encoder_class is None:
            raise _bad(root, f"model_index.json names no {folder!r} ({spec.class_name}) component")
        encoder_classes.append(transformers_class(encoder_class))

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
    scheduler_file = "scheduler/scheduler_config.json"
    if (root / scheduler_file).is_file():
        # The folder's betas / shift, in the training scheduler class of the family.
        folder_config = _json_object(root, scheduler_file)
        scheduler_config.update({k: v for k, v in folder_config.items() if not k.startswith("_")})

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
    freeze_components(components, policy)
    return components


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


__all__ = ["FAMILY_TEXT_ROLES", "TEXT_ENCODER_FOLDERS", "load_components", "save_model_folder"]
