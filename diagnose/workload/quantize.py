"""Storing a frozen base's linear layers quantized (``--base``), as the trainers do.

bitsandbytes 4-bit and 8-bit layers replace ``nn.Linear`` the way ``BitsAndBytesConfig`` loading
leaves a model (the weights are quantized when the layer reaches its device, CPU included); fp8
storage keeps ``nn.Linear`` with a float8 weight expanded to the input's dtype in each call, as
kohya's ``--fp8_base`` does. LoRA then wraps the stored layers as it wraps plain ones.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.quantized_base import BNB_KINDS, BaseKind, storage

#: The unquantized kinds: the frozen weights cast to that dtype.
FLOAT_BASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


class Float8StorageLinear(torch.nn.Linear):
    """A linear layer whose frozen weight is stored in float8 (e4m3) and upcast per call."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(input.dtype)
        return F.linear(input, self.weight.to(input.dtype), bias)


def _bnb() -> object:
    try:
        return importlib.import_module("bitsandbytes")
    except Exception as exc:  # ImportError, or a build that fails to load its library
        raise DiagnoseError(
            f"--base nf4/fp4/int8 needs bitsandbytes: {type(exc).__name__}: {exc} "
            "(pip install bitsandbytes)",
            ExitCode.USAGE,
        ) from None


def _replacement(
    layer: torch.nn.Linear, kind: BaseKind, compute_dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    weight = layer.weight.data
    bias = None if layer.bias is None else layer.bias.data
    if kind == "fp8":
        stored = Float8StorageLinear(
            layer.in_features, layer.out_features, bias=bias is not None, device="meta"
        )
        stored.weight = torch.nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
        if bias is not None:
            stored.bias = torch.nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        return stored
    bnb = _bnb()
    nn = bnb.nn  # type: ignore[attr-defined]
    if kind in ("nf4", "fp4"):
        q = nn.Linear4bit(
            layer.in_features,
            layer.out_features,
            bias=bias is not None,
            compute_dtype=compute_dtype,
            quant_type=kind,
            device="meta",
        )
        q.weight = nn.Params4bit(
            weight.to("cpu", torch.float32), requires_grad=False, quant_type=kind
        )
    else:
        q = nn.Linear8bitLt(
            layer.in_features,
            layer.out_features,
            bias=bias is not None,
            has_fp16_weights=False,
            device="meta",
        )
        q.weight = nn.Int8Params(
            weight.to("cpu", torch.float32), requires_grad=False, has_fp16_weights=False
        )
    if bias is not None:
        q.bias = torch.nn.Parameter(bias.to("cpu", compute_dtype), requires_grad=False)
    return q.to(device)  # type: ignore[no-any-return]  # quantizes the weight


def quantize_linears(
    module: torch.nn.Module, kind: BaseKind, compute_dtype: torch.dtype, device: torch.device
) -> int:
    """Replace every ``nn.Linear`` of the frozen ``module`` by its stored-``kind`` twin; returns
    how many were replaced (0 for the unquantized kinds, which the precision casts)."""
    if kind not in (*BNB_KINDS, "fp8"):
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, _replacement(child, kind, compute_dtype, device))
                replaced += 1
    return replaced


def stored_bytes(module: torch.nn.Module, kind: str | None, precision_bytes: int) -> int:
    """Bytes ``module``'s frozen parameters take stored as ``kind`` (None: the precision's
    ``precision_bytes`` each), counted from its shapes (a meta-device model will do): a float kind
    casts every parameter; a quantized one stores the linear layers' weights in its own bytes
    (:data:`diagnose.quantized_base.KINDS`) and keeps the rest in the precision's dtype."""
    if kind in FLOAT_BASES:
        weights = sum(p.numel() for p in module.parameters())
        return round(weights * storage(kind).bytes_per_weight)
    per_weight = storage(kind).bytes_per_weight if kind is not None else float(precision_bytes)
    total = 0.0
    for sub in module.modules():
        for name, parameter in sub.named_parameters(recurse=False):
            linear_weight = type(sub) is torch.nn.Linear and name == "weight"
            total += parameter.numel() * (per_weight if linear_weight else precision_bytes)
    return round(total)


__all__ = ["FLOAT_BASES", "Float8StorageLinear", "quantize_linears", "stored_bytes"]
