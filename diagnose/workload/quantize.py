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
from diagnose.quantized_base import BNB_KINDS, BaseKind, stored_bytes_of

#: The unquantized kinds (:data:`diagnose.quantized_base.FLOAT_KINDS`): the frozen weights cast
#: to that dtype.
FLOAT_BASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


class Float8StorageLinear(torch.nn.Linear):
    """A linear layer whose frozen weight is stored in float8 (e4m3) and upcast per call.

    ``weight`` reads as the upcast weight: library code asks a layer's weight for the dtype to
    cast its input to (T5's feed-forward, diffusers' timestep embeddings), and must get the
    compute dtype, not float8. The stored parameter is what ``parameters()`` and the state dict
    hold."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype
    ) -> None:
        # Set first: nn.Linear's initialisation reads the weight.
        object.__setattr__(self, "compute_dtype", compute_dtype)
        super().__init__(in_features, out_features, bias=bias, device="meta")

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        stored = self.__dict__.get("_parameters", {}).get("weight")
        if stored is None:  # before nn.Linear registers it (hasattr must say no)
            raise AttributeError("weight")
        return stored.to(self.compute_dtype)  # type: ignore[no-any-return]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        stored = self._parameters["weight"]
        assert stored is not None
        bias = None if self.bias is None else self.bias.to(input.dtype)
        return F.linear(input, stored.to(input.dtype), bias)


def _kept_names(module: torch.nn.Module) -> frozenset[str]:
    """Names of submodules the model's library keeps out of quantization (transformers'
    ``_keep_in_fp32_modules``, e.g. T5's ``wo``, whose input is cast to its weight's dtype)."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_keep_in_fp32_modules", None) or ())
    return frozenset(names)


def stored_linears(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """The linear layers a quantized base stores quantized, as (parent, name, layer): every
    plain ``nn.Linear`` but those the library keeps in full precision, as bitsandbytes loading
    through transformers or diffusers leaves them."""
    kept = _kept_names(module)
    found = []
    for qualified, parent in module.named_modules():
        path = set(qualified.split(".")) if qualified else set()
        if path & kept:
            continue
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and name not in kept:
                found.append((parent, name, child))
    return found


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
            layer.in_features, layer.out_features, bias is not None, compute_dtype
        )
        stored._parameters["weight"] = torch.nn.Parameter(
            weight.to(torch.float8_e4m3fn), requires_grad=False
        )
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
    layers = stored_linears(module)
    for parent, name, child in layers:
        setattr(parent, name, _replacement(child, kind, compute_dtype, device))
    return len(layers)


def stored_bytes(module: torch.nn.Module, kind: str | None, precision_bytes: int) -> int:
    """Bytes ``module``'s frozen parameters take stored as ``kind`` (see
    :func:`diagnose.quantized_base.stored_bytes_of`), counted from its shapes (a meta-device model
    will do)."""
    return stored_bytes_of(
        sum(p.numel() for p in module.parameters()),
        stored_linear_weights(module),
        kind,
        precision_bytes,
    )


def stored_linear_weights(module: torch.nn.Module) -> int:
    """Elements of the weights a quantized base stores in its own bytes (:func:`stored_linears`)."""
    return sum(layer.weight.numel() for _, _, layer in stored_linears(module))


__all__ = [
    "FLOAT_BASES",
    "Float8StorageLinear",
    "quantize_linears",
    "stored_bytes",
    "stored_linear_weights",
    "stored_linears",
]
