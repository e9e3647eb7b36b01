"""The LoRA training workload: models from configs, presets, data and the timed training step.

Names are imported lazily (PEP 562), so ``import diagnose.workload.presets`` or ``.data`` does not
pull in diffusers and transformers; ``from diagnose.workload import build_workload`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diagnose.workload.attention import attention_context
    from diagnose.workload.models import describe_preset, precision_policy
    from diagnose.workload.presets import Preset, all_presets, default_preset, load_preset
    from diagnose.workload.step import Workload, build_workload

_EXPORTS: dict[str, str] = {
    "Preset": "diagnose.workload.presets",
    "Workload": "diagnose.workload.step",
    "all_presets": "diagnose.workload.presets",
    "attention_context": "diagnose.workload.attention",
    "build_workload": "diagnose.workload.step",
    "default_preset": "diagnose.workload.presets",
    "describe_preset": "diagnose.workload.models",
    "load_preset": "diagnose.workload.presets",
    "precision_policy": "diagnose.workload.models",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diagnose.workload' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Preset",
    "Workload",
    "all_presets",
    "attention_context",
    "build_workload",
    "default_preset",
    "describe_preset",
    "load_preset",
    "precision_policy",
]
