"""What one attention call looks like: its signature (the inputs that decide which kernel can run
and what it costs) and what the profiled step says about it.

Shared by the recorder (:mod:`diagnose.probes.attention.capture`), the profiler attribution
(:mod:`diagnose.probes.attention.attribution`) and the benchmark
(:mod:`diagnose.probes.attention.bench`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CALL_RANGE = "diagnose::attention_call#"
OP_RANGE = "diagnose::attention_op#"
MODULE_RANGE = "diagnose::attention_module#"
#: torch.backends.cuda switches that decide SDPA's choice (on the CPU too: flash_sdp covers the
#: CPU's fused kernel).
SDPA_SWITCHES: tuple[str, ...] = (
    "flash_sdp_enabled",
    "mem_efficient_sdp_enabled",
    "cudnn_sdp_enabled",
    "math_sdp_enabled",
)

#: Profiler dtype names -> torch dtype names.
PROFILER_DTYPES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::BFloat16": "bfloat16",
    "c10::Half": "float16",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
}


# --------------------------------------------------------------------------------------------
# What one attention call looks like


@dataclass(frozen=True)
class Signature:
    """The inputs that decide which kernel can run and what it costs (one benchmark each)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    #: torch dtype name of q/k/v as the kernel saw them (after autocast).
    dtype: str
    #: Mask shape and dtype name; empty shape for no mask.
    mask_shape: tuple[int, ...] = ()
    mask_dtype: str = ""
    dropout_p: float = 0.0
    is_causal: bool = False
    #: Whether the call is differentiated (a training call: benchmark forward + backward).
    backward: bool = False
    #: q laid out as (B, L, H, D) transposed to (B, H, L, D), as diffusers' processors pass it.
    transposed: bool = False
    #: A hand-written attention over (B·H, L, D): heads folded into the batch.
    heads_folded: bool = False

    @property
    def has_mask(self) -> bool:
        return bool(self.mask_shape)

    def label(self) -> str:
        bh = f"B·H={self.batch}" if self.heads_folded else f"B={self.batch} H={self.heads}"
        if self.kv_heads != self.heads and not self.heads_folded:
            bh += f" KVH={self.kv_heads}"
        dims = f"D={self.head_dim}" + (
            f" Dv={self.value_dim}" if self.value_dim != self.head_dim else ""
        )
        parts = [bh, f"Lq={self.q_len}", f"Lk={self.kv_len}", dims, self.dtype]
        if self.has_mask:
            parts.append(f"mask {self.mask_dtype}[{','.join(map(str, self.mask_shape))}]")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.is_causal:
            parts.append("causal")
        parts.append("fwd+bwd" if self.backward else "fwd")
        return " ".join(parts)

    def with_dtype(self, dtype: str) -> Signature:
        return Signature(**{**self.__dict__, "dtype": dtype})


@dataclass
class AttentionCall:
    """One attention computation in the profiled step."""

    index: int
    #: Qualified module name ("denoiser.down_blocks.0...attn1"), "" outside attention modules.
    module: str = ""
    #: The module's processor class (diffusers), attention implementation (transformers) or
    #: module class.
    processor: str = ""
    #: How it was found: "sdpa" (a scaled_dot_product_attention call), "manual" (matmul →
    #: softmax → matmul in Python), "op" (an attention op seen only by the profiler: xFormers,
    #: flash-attn).
    entry: str = "sdpa"
    signature: Signature | None = None
    scale: float | None = None
    #: SDPA switches at the moment of the call.
    switches: dict[str, bool] = field(default_factory=dict)
    #: Path that ran (diagnose.attention_paths names), "unknown" when the profiler saw none.
    path: str = "unknown"
    provider: str = ""
    ops: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    #: Autograd nodes of this call that ran in the backward.
    backward_nodes: int = 0
    #: Run again inside the backward (gradient checkpointing recomputes the forward).
    recomputed: bool = False

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "module": self.module,
            "processor": self.processor,
            "entry": self.entry,
            "signature": self.signature.label() if self.signature else "",
            "scale": self.scale,
            "switches": dict(self.switches),
            "path": self.path,
            "provider": self.provider,
            "ops": list(self.ops),
            "kernels": list(self.kernels),
            "forward_ms": round(self.forward_seconds * 1e3, 4),
            "backward_ms": round(self.backward_seconds * 1e3, 4),
            "recomputed": self.recomputed,
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sdpa_switches() -> dict[str, bool]:
    """The SDPA switches now (they change inside ``sdpa_kernel`` contexts)."""
    backends = torch.backends.cuda
    return {
        name: bool(getattr(backends, name)()) for name in SDPA_SWITCHES if hasattr(backends, name)
    }


#: scaled_dot_product_attention's parameters, in positional order.
SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


def bind_sdpa_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An SDPA call's arguments by parameter name."""
    bound = dict(zip(SDPA_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


def tensor_or_none(value: object) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def sdpa_signature(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    backward: bool,
) -> Signature:
    """The signature of one SDPA call from its arguments ((..., H, L, D) layout)."""
    lead = query.shape[:-3]
    batch = math.prod(lead) if lead else 1
    heads = query.shape[-3] if query.dim() >= 3 else 1
    kv_heads = key.shape[-3] if key.dim() >= 3 else 1
    transposed = (
        query.dim() == 4 and not query.is_contiguous() and query.transpose(1, 2).is_contiguous()
    )
    return Signature(
        batch=int(batch),
        heads=int(heads),
        kv_heads=int(kv_heads),
        q_len=int(query.shape[-2]),
        kv_len=int(key.shape[-2]),
        head_dim=int(query.shape[-1]),
        value_dim=int(value.shape[-1]),
        dtype=dtype_name(query.dtype),
        mask_shape=tuple(int(s) for s in attn_mask.shape) if attn_mask is not None else (),
        mask_dtype=dtype_name(attn_mask.dtype) if attn_mask is not None else "",
        dropout_p=float(dropout_p),
        is_causal=bool(is_causal),
        backward=backward,
        transposed=bool(transposed),
    )


__all__ = [
    "CALL_RANGE",
    "MODULE_RANGE",
    "OP_RANGE",
    "PROFILER_DTYPES",
    "SDPA_PARAMS",
    "SDPA_SWITCHES",
    "AttentionCall",
    "Signature",
    "bind_sdpa_args",
    "dtype_name",
    "sdpa_signature",
    "sdpa_switches",
    "tensor_or_none",
]
