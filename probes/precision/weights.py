"""The models a workload runs and the weights they hold in fp32: which are left in fp32 by mistake
in a bf16-full run, and which a model keeps in fp32 on purpose (``_keep_in_fp32_modules``, a VAE
under ``force_upcast``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose.probes.precision.audit_log import Site


def workload_components(workload: Any) -> dict[str, torch.nn.Module]:
    """The models a workload runs, by the folder names of a diffusers model."""
    components: dict[str, torch.nn.Module] = {}
    denoiser = getattr(workload, "denoiser", None)
    if isinstance(denoiser, torch.nn.Module):
        components["denoiser"] = denoiser
    vae = getattr(workload, "vae", None)
    if isinstance(vae, torch.nn.Module):
        components["vae"] = vae
    for i, encoder in enumerate(getattr(workload, "text_encoders", None) or []):
        if isinstance(encoder, torch.nn.Module):
            components["text_encoder" if i == 0 else f"text_encoder_{i + 1}"] = encoder
    return components


def keep_fp32_parts(components: Mapping[str, torch.nn.Module]) -> dict[str, frozenset[str]]:
    """Per component, the module-name parts a model keeps in fp32 (``_keep_in_fp32_modules``)."""
    parts: dict[str, frozenset[str]] = {}
    for name, module in components.items():
        keep = getattr(module, "_keep_in_fp32_modules", None)
        if keep:
            parts[name] = frozenset(str(k) for k in keep)
    return parts


def component_reasons(
    components: Mapping[str, torch.nn.Module], requested_low: str | None
) -> dict[str, str]:
    """Components kept in fp32 on purpose: a VAE whose config says ``force_upcast``."""
    reasons: dict[str, str] = {}
    vae = components.get("vae")
    if requested_low is None or vae is None:
        return reasons
    config = getattr(vae, "config", None)
    force_upcast = bool(getattr(config, "force_upcast", False))
    weights_fp32 = any(p.dtype == torch.float32 for p in vae.parameters())
    if force_upcast and weights_fp32:
        reasons["vae"] = "VAE kept in fp32, force_upcast in its config"
    return reasons


@dataclass
class Fp32Weights:
    """fp32 parameters of one module (its own, not its children's)."""

    component: str
    module: str
    module_class: str
    tensors: int = 0
    elements: int = 0
    bytes: int = 0
    #: LoRA (trainable) weights rather than frozen base weights.
    trainable: bool = False
    names: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return str(Site(self.component, self.module, self.module_class).where)

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.where,
            "module_class": self.module_class,
            "kind": "LoRA" if self.trainable else "base",
            "tensors": self.tensors,
            "elements": self.elements,
            "bytes": self.bytes,
            "parameters": self.names[:8],
        }


def fp32_parameters(
    components: Mapping[str, torch.nn.Module],
    keep_fp32_parts: Mapping[str, frozenset[str]] | None = None,
) -> list[Fp32Weights]:
    """Modules holding fp32 parameters, largest first; modules a model keeps in fp32 on purpose
    (``_keep_in_fp32_modules``) are left out."""
    rows: list[Fp32Weights] = []
    for component, root in components.items():
        keep = (keep_fp32_parts or {}).get(component, frozenset())
        for path, module in root.named_modules():
            if keep and any(part in keep for part in path.split(".")):
                continue
            for trainable in (False, True):
                row = Fp32Weights(component, path, type(module).__name__, trainable=trainable)
                for name, param in module.named_parameters(recurse=False):
                    if param.dtype != torch.float32 or param.requires_grad != trainable:
                        continue
                    row.tensors += 1
                    row.elements += param.numel()
                    row.bytes += param.numel() * param.element_size()
                    row.names.append(f"{path}.{name}" if path else name)
                if row.tensors:
                    rows.append(row)
    rows.sort(key=lambda r: -r.bytes)
    return rows


__all__ = [
    "Fp32Weights",
    "component_reasons",
    "fp32_parameters",
    "keep_fp32_parts",
    "workload_components",
]
