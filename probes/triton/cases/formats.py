"""What a kernel holds and multiplies its values in: floating-point formats, and the precision a
dot's operands are rounded to on each backend (Triton's ``tl.dot`` defaults, torch's TF32 switch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from diagnose.probes.triton.cases.api import CheckEnv

Rounding = Literal["nearest-even", "nearest-away", "truncate"]


@dataclass(frozen=True)
class Format:
    """A floating-point format a kernel holds or multiplies values in."""

    name: str
    #: Explicit mantissa bits: fp32 23, tf32 10, fp16 10, bf16 7.
    mantissa_bits: int
    rounding: Rounding = "nearest-even"
    #: The absolute error floor of a rounding into it: fp16's subnormal spacing, the smallest
    #: normal fp32 (GPUs flush fp32 subnormals to zero).
    min_spacing: float = 0.0
    #: The torch dtype that holds it; None for tf32 / xf32 (fp32 bits with the low ones dropped).
    storage: torch.dtype | None = None
    #: False where the hardware's rounding mode is not documented: the reference rounds to
    #: nearest and the bound allows one unit in the last place for the difference.
    rounding_known: bool = True

    @property
    def ulp(self) -> float:
        """The spacing of values in [1, 2)."""
        return 2.0**-self.mantissa_bits

    @property
    def unit(self) -> float:
        """The largest relative error of one rounding into this format."""
        return self.ulp if self.rounding == "truncate" else self.ulp / 2

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float64) rounded into this format, returned as float64."""
        if self.storage is torch.float64:
            return x
        # Device values reach a narrower format from fp32, so round through fp32 first.
        single = x.to(torch.float32)
        if self.storage is not None:
            return single.to(self.storage).to(torch.float64)
        dropped = 23 - self.mantissa_bits
        bits = single.view(torch.int32)
        half = 1 << (dropped - 1)
        # IEEE floats are sign and magnitude: adding to the bit pattern rounds the magnitude.
        if self.rounding == "nearest-away":
            bits = bits + half
        elif self.rounding == "nearest-even":
            bits = bits + (half - 1) + ((bits >> dropped) & 1)
        bits = bits & ~((1 << dropped) - 1)
        return bits.view(torch.float32).to(torch.float64)


FP64 = Format("fp64", 52, storage=torch.float64)
FP32 = Format("fp32", 23, min_spacing=2.0**-126, storage=torch.float32)
#: NVIDIA tensor cores read fp32 operands as TF32 by ignoring the 13 low mantissa bits (Triton's
#: tl.dot documents that its "tf32" inputs "may be truncated ... without rounding"; the H200's
#: recorded errors match truncation, not rounding).
TF32 = Format("tf32", 10, "truncate", 2.0**-126)
#: ``cvt.rna.tf32.f32``: Triton's tf32x3 splits its operands with it.
TF32_RNA = Format("tf32 (rounded)", 10, "nearest-away", 2.0**-126)
#: MI300's xf32 (and cuBLAS's TF32): 10 bits, rounding mode not documented.
XF32 = Format("xf32", 10, "nearest-even", 2.0**-126, rounding_known=False)
FP16 = Format("fp16", 10, min_spacing=2.0**-24, storage=torch.float16)
BF16 = Format("bf16", 7, min_spacing=2.0**-133, storage=torch.bfloat16)
FP8E4M3 = Format("fp8e4m3", 3, min_spacing=2.0**-9, storage=torch.float8_e4m3fn)
FP8E5M2 = Format("fp8e5m2", 2, min_spacing=2.0**-16, storage=torch.float8_e5m2)

_BY_DTYPE = {
    torch.float64: FP64,
    torch.float32: FP32,
    torch.float16: FP16,
    torch.bfloat16: BF16,
    torch.float8_e4m3fn: FP8E4M3,
    torch.float8_e5m2: FP8E5M2,
}


def format_of(dtype: torch.dtype) -> Format | None:
    """The format of a floating dtype (None for integers and booleans)."""
    return _BY_DTYPE.get(dtype)


# --- what a dot multiplies ------------------------------------------------------------------------


@dataclass(frozen=True)
class DotPrecision:
    """What a dot does to its operands on one backend."""

    #: The format fp32 operands are rounded to (None: taken as stored).
    operand: Format | None
    #: Precision recovered by splitting each operand into pieces (Triton's tf32x3, bf16x3, bf16x6).
    pieces: int = 1
    #: The format the pieces after the first are rounded to.
    piece_format: Format | None = None
    #: Relative error the splitting leaves (the dropped cross products, the pieces' rounding).
    residual: float = 0.0
    label: str = "as stored"


def triton_fp32_precision(env: CheckEnv, requested: str | None) -> DotPrecision:
    if env.mode == "interpreter":
        # The interpreter multiplies in numpy's float32 whatever input_precision asks for.
        return DotPrecision(FP32, label="fp32 (Triton's interpreter)")
    precision = (requested or os.environ.get("TRITON_F32_DEFAULT") or "").lower()
    sm = env.arch.removeprefix("sm_")
    tensor_cores = env.backend == "cuda" and not (sm.isdigit() and int(sm) < 80)
    if env.backend == "hip":
        tensor_cores = env.arch == "gfx942"
    if not precision:
        precision = "tf32" if tensor_cores else "ieee"
    if precision == "ieee" or not tensor_cores:
        return DotPrecision(FP32, label="fp32 (ieee)")
    if precision == "tf32":
        if env.backend == "hip":
            return DotPrecision(XF32, label="xf32 (MI300; rounding mode not documented)")
        return DotPrecision(TF32, label="tf32, truncated (NVIDIA tensor cores)")
    if precision == "tf32x3":
        return DotPrecision(
            TF32_RNA, 2, TF32, residual=2.0 * TF32.ulp**2, label="tf32x3 (3 tf32 products)"
        )
    if precision in ("bf16x3", "bf16x6"):
        pieces = 2 if precision == "bf16x3" else 3
        left = 2.0 * BF16.ulp**pieces
        return DotPrecision(BF16, pieces, BF16, residual=left, label=precision)
    raise ValueError(f"unknown tl.dot input_precision {precision!r}")


def torch_fp32_precision(env: CheckEnv) -> DotPrecision:
    """fp32 matmuls of torch (and inductor's kernels for them) follow torch's TF32 switches."""
    if env.mode == "device" and (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    ):
        return DotPrecision(XF32, label="tf32 (torch allows TF32 matmuls; rounding not documented)")
    return DotPrecision(FP32, label="fp32")


__all__ = [
    "BF16",
    "FP8E4M3",
    "FP8E5M2",
    "FP16",
    "FP32",
    "FP64",
    "TF32",
    "TF32_RNA",
    "XF32",
    "DotPrecision",
    "Format",
    "format_of",
    "torch_fp32_precision",
    "triton_fp32_precision",
]
