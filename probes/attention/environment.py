"""What the environment says about attention: the ROCm experimental switch against the GPU's
architecture, diffusers' attention backend, and whether xFormers and flash-attn are installed,
import, and were built for this torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diagnose import attention_paths as ap


@dataclass
class PackageStatus:
    """An optional attention package: installed, importing, built for this torch."""

    name: str
    installed: bool = False
    version: str | None = None
    #: None when the import was not checked.
    imports: bool | None = None
    #: The import error, verbatim (first lines).
    error: str = ""
    #: The torch requirement in the wheel's metadata ("torch==2.5.1"), if any.
    torch_requirement: str = ""
    #: Whether an exact pin matches the installed torch; None without an exact pin.
    matches_torch: bool | None = None
    source: str = ""

    @property
    def broken(self) -> bool:
        return self.installed and (self.imports is False or self.matches_torch is False)

    def summary(self) -> str:
        if not self.installed:
            return f"{self.name}: not installed (unavailable; SDPA is used instead)"
        text = f"{self.name} {self.version or '?'}"
        if self.imports is False:
            return f"{text}: installed but does not import: {self.error or 'unknown error'}"
        if self.matches_torch is False:
            return f"{text}: built for {self.torch_requirement}, this is torch {torch.__version__}"
        if self.imports is None:
            return f"{text}: installed (import not checked)"
        return f"{text}: imports"


_DISTRIBUTIONS = {"xformers": ("xformers",), "flash_attn": ("flash-attn", "flash_attn")}


def torch_base_version(version: str) -> str:
    return version.split("+")[0]


def torch_requirement(requirements: Sequence[str]) -> tuple[str, bool | None]:
    """The torch requirement among a wheel's ``Requires-Dist`` and whether an exact pin matches."""
    for requirement in requirements:
        text = requirement.split(";")[0].strip()
        if not re.match(r"^torch\b(?![-_.\w])", text):
            continue
        pin = re.match(r"^torch\s*==\s*([\w.+]+)", text)
        if pin is None:
            return text, None
        return text, torch_base_version(pin.group(1)) == torch_base_version(torch.__version__)
    return "", None


def package_status(name: str, inventory_packages: Mapping[str, Any] | None) -> PackageStatus:
    """Status of xformers or flash_attn, from the run's inventory when it has the entry.

    Without an inventory entry an installed package is import-checked in a child interpreter
    (diagnose.inventory does that: a broken build may crash the process that imports it).
    """
    status = PackageStatus(name)
    entry = (inventory_packages or {}).get(name)
    if not isinstance(entry, Mapping):
        try:
            present = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            present = False
        if present:
            from diagnose.inventory import PACKAGES, collect_packages

            specs = [s for s in PACKAGES if s.name == name]
            entry = collect_packages(specs).get(name) if specs else None
        status.source = "checked by the probe"
    else:
        status.source = "inventory"
    if isinstance(entry, Mapping):
        status.installed = bool(entry.get("installed"))
        status.version = entry.get("version")
        imports = entry.get("imports")
        status.imports = imports if isinstance(imports, bool) else None
        status.error = str(entry.get("error") or "")
    for dist in _DISTRIBUTIONS.get(name, (name,)):
        try:
            requirements = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        status.installed = True
        status.version = status.version or importlib.metadata.version(dist)
        status.torch_requirement, status.matches_torch = torch_requirement(requirements)
        break
    return status


def diffusers_backend(models: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """diffusers' attention backend: the environment variable, the active one, per processor."""
    info: dict[str, Any] = {"DIFFUSERS_ATTN_BACKEND": os.environ.get("DIFFUSERS_ATTN_BACKEND")}
    try:
        from diffusers.models import attention_dispatch
    except Exception:  # an old diffusers without dispatch, or none at all
        return info
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    active = getattr(registry, "_active_backend", None)
    info["active"] = getattr(active, "value", None) or (str(active) if active else None)
    per_processor: Counter[str] = Counter()
    for model in models:
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_attention_backend"):
                backend = processor._attention_backend
                per_processor[getattr(backend, "value", None) or str(backend or "default")] += 1
    info["processor_backends"] = dict(per_processor)
    return info


def rocm_facts(device_kind: str, arch: str) -> dict[str, Any]:
    """The ROCm experimental-kernel switch against this GPU's architecture."""
    if device_kind != "rocm":
        return {}
    value = os.environ.get(ap.ROCM_EXPERIMENTAL_ENV)
    facts: dict[str, Any] = {
        "arch": arch,
        "needs_experimental": ap.rocm_needs_experimental(arch),
        ap.ROCM_EXPERIMENTAL_ENV: value,
        "experimental_enabled": ap.env_enabled(value),
    }
    preferred = getattr(torch.backends.cuda, "preferred_rocm_fa_library", None)
    if callable(preferred):
        try:
            facts["preferred_rocm_fa_library"] = str(preferred())
        except Exception as exc:
            facts["preferred_rocm_fa_library"] = f"unknown ({type(exc).__name__})"
    return facts


def rocm_experimental_missing(facts: Mapping[str, Any]) -> bool:
    return bool(facts.get("needs_experimental")) and not facts.get("experimental_enabled")


__all__ = [
    "PackageStatus",
    "diffusers_backend",
    "package_status",
    "rocm_experimental_missing",
    "rocm_facts",
    "torch_base_version",
    "torch_requirement",
]
