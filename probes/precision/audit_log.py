"""What the precision audit of one step records: op groups by site, the warnings raised, and the
call signatures kept for replay in another dtype. Plain data, filled by
:mod:`diagnose.probes.precision.audit` and read by the probe's findings and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose.precision_policy import (
    ATTENTION_FUNCTIONS,
    COMPUTE_KINDS,
    OpKind,
    Verdict,
    normalize_dtype,
)

# --------------------------------------------------------------------------------------------
# What the audit records


@dataclass(frozen=True)
class Site:
    """Where an op was issued from."""

    #: "denoiser", "vae", "text_encoder", "text_encoder_2"... ("" outside the hooked models).
    component: str = ""
    #: Module path inside the component ("down_blocks.1.attentions.0.proj_in"; "" for its root).
    module: str = ""
    module_class: str = ""

    @property
    def where(self) -> str:
        """The path a reader looks for: denoiser paths bare, others prefixed by the component."""
        if not self.component:
            return "(outside the models: noise, loss)"
        if self.component == "denoiser":
            return self.module or "(denoiser root)"
        return f"{self.component}/{self.module}" if self.module else self.component


@dataclass
class OpGroup:
    """Calls of one op signature from one site, in one phase, with one verdict."""

    op: str
    kind: OpKind
    dtype: str | None
    site: Site
    #: The step phase ("forward", "backward", "encode", ...).
    phase: str
    #: The torch function that issued it ("linear", "conv2d", "float"; "" when unknown).
    function: str
    #: Whether autocast was enabled around the issuing call (None: unknown, e.g. backward).
    autocast: bool | None
    verdict: Verdict
    deliberate: str
    #: Input shapes of the signature, e.g. "[2, 64, 32] [32, 32]".
    shapes: str
    #: Key of the :class:`ReplaySpec` of this signature ("" when none was kept).
    signature: str = ""
    calls: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "kind": self.kind,
            "dtype": self.dtype,
            "component": self.site.component,
            "module": self.site.where,
            "module_class": self.site.module_class,
            "phase": self.phase,
            "function": self.function,
            "autocast": self.autocast,
            "verdict": self.verdict,
            "deliberate": self.deliberate,
            "shapes": self.shapes,
            "calls": self.calls,
            "seconds": self.seconds,
        }


@dataclass
class CapturedWarning:
    """A warning raised during the audited step, with the call and module that raised it."""

    message: str
    category: str
    function: str = ""
    site: Site = field(default_factory=Site)
    phase: str = ""
    count: int = 0
    #: Device-synchronised seconds of the calls that raised it.
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "category": self.category,
            "function": self.function,
            "module": self.site.where,
            "phase": self.phase,
            "count": self.count,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class TensorSpec:
    """The shape, strides, dtype and device of one tensor argument, to rebuild it on replay."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class ReplaySpec:
    """One compute-op call signature, re-runnable on random data in another dtype."""

    key: str
    op: str
    func: Any
    template: Any
    #: The dtype it ran in (normalised name) and the torch dtype of its float inputs.
    dtype: str | None
    torch_dtype: torch.dtype | None
    #: Input shapes, e.g. "[2, 64, 32] [32, 32]".
    shapes: str = ""
    #: Multiply-adds of one call, estimated from the shapes (deterministic, unlike its time).
    work: float = 0.0
    calls: int = 0
    seconds: float = 0.0


@dataclass
class AuditLog:
    """Everything one audited step recorded."""

    precision: str
    requested_low: str | None
    groups: list[OpGroup] = field(default_factory=list)
    warnings: list[CapturedWarning] = field(default_factory=list)
    replays: dict[str, ReplaySpec] = field(default_factory=dict)
    #: Wall seconds of the audited step (inflated by the audit itself: not a step time).
    wall_seconds: float = 0.0
    ops: int = 0
    #: Whether backward ops could be attributed through autograd nodes on this torch.
    node_attribution: bool = True

    def compute_groups(self) -> list[OpGroup]:
        return [g for g in self.groups if g.kind in COMPUTE_KINDS]

    def compute_seconds_by_dtype(self) -> dict[str, float]:
        """Audited seconds of matmul/conv/attention ops per dtype (not those run inside an
        attention call: the attention op itself is judged)."""
        totals: dict[str, float] = {}
        for g in self.compute_groups():
            if g.dtype and (g.kind == "attention" or g.function not in ATTENTION_FUNCTIONS):
                totals[g.dtype] = totals.get(g.dtype, 0.0) + g.seconds
        return totals

    def compute_seconds_by_component(self) -> dict[str, dict[str, float]]:
        """Audited matmul/conv/attention seconds per component ("denoiser", "vae", ...; "" for
        ops outside the models) and dtype."""
        totals: dict[str, dict[str, float]] = {}
        for g in self.compute_groups():
            if g.dtype and (g.kind == "attention" or g.function not in ATTENTION_FUNCTIONS):
                by_dtype = totals.setdefault(g.site.component, {})
                by_dtype[g.dtype] = by_dtype.get(g.dtype, 0.0) + g.seconds
        return totals

    def with_verdict(self, verdict: Verdict) -> list[OpGroup]:
        return [g for g in self.groups if g.verdict == verdict]


_DTYPE_NAMES: dict[torch.dtype, str | None] = {}


def dtype_name(dtype: torch.dtype) -> str | None:
    if dtype not in _DTYPE_NAMES:
        _DTYPE_NAMES[dtype] = normalize_dtype(str(dtype))
    return _DTYPE_NAMES[dtype]


__all__ = [
    "AuditLog",
    "CapturedWarning",
    "OpGroup",
    "ReplaySpec",
    "Site",
    "TensorSpec",
    "dtype_name",
]
