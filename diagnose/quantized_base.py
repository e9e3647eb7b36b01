"""What the project knows about quantized and low-precision frozen bases: the storage kinds, what
each costs in memory, how each shows in a profiler trace, and what the trainers call it.

A LoRA trainer keeps the base model frozen, so it may store the base's linear layers in fewer
bits than it computes in: bitsandbytes 4-bit (NF4, FP4) or 8-bit (LLM.int8) layers, or float8
storage upcast layer by layer (kohya's ``--fp8_base``). The weights are then expanded back to the
compute dtype on every forward and, for the gradient of the input, every backward. The run builds
such a base (``--base``), and the trace rule (:mod:`diagnose.trace.rules.quantization`) measures
that expansion in any trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

BaseKind = Literal["bf16", "fp16", "fp32", "nf4", "fp4", "int8", "fp8"]
BASE_KINDS: tuple[BaseKind, ...] = ("bf16", "fp16", "fp32", "nf4", "fp4", "int8", "fp8")
#: The kinds that store the base in fewer bits than any compute dtype.
QUANTIZED_KINDS: tuple[BaseKind, ...] = ("nf4", "fp4", "int8", "fp8")
#: The kinds that cast every frozen parameter to a float dtype (the others store only the linear
#: layers' weights in their own bytes).
FLOAT_KINDS: tuple[BaseKind, ...] = tuple(k for k in BASE_KINDS if k not in QUANTIZED_KINDS)
#: The kinds bitsandbytes stores.
BNB_KINDS: tuple[BaseKind, ...] = ("nf4", "fp4", "int8")


#: Bytes a 4-bit weight takes with its quantization constants: one absmax per 64-weight block,
#: itself quantized to a byte with one fp32 scale per 256 blocks.
_FOUR_BIT_BYTES = 0.5 + 1.0 / 64 + 4.0 / (64 * 256)


@dataclass(frozen=True)
class StorageKind:
    kind: BaseKind
    #: Bytes a stored weight takes, its quantization constants included.
    bytes_per_weight: float
    #: The documented bound on the relative L2 error of a whole model's output (a denoiser's
    #: prediction, a text encoder's conditioning) with its linear layers stored as this kind,
    #: against the same model unquantized. Rounding errors grow with depth: on the tiny presets'
    #: denoisers and encoders at most about half of it was measured (NF4 0.23, FP4 0.29, int8
    #: 0.015, fp8 0.075); a kernel that reads the stored weights wrong is off by about 1.
    relative_error_bound: float = 0.0


#: What each kind is called in the trainers (kohya --fp8_base, OneTrainer's weight dtypes,
#: ai-toolkit's quantize, diffusers' BitsAndBytesConfig) is the catalog's to say: see
#: diagnose.catalogs.quantization_catalog.FIX.
KINDS: dict[BaseKind, StorageKind] = {
    "fp32": StorageKind("fp32", 4.0),
    "bf16": StorageKind("bf16", 2.0),
    "fp16": StorageKind("fp16", 2.0),
    "fp8": StorageKind("fp8", 1.0, relative_error_bound=0.15),
    # and one fp32 scale per output row
    "int8": StorageKind("int8", 1.0, relative_error_bound=0.05),
    "nf4": StorageKind("nf4", _FOUR_BIT_BYTES, relative_error_bound=0.5),
    "fp4": StorageKind("fp4", _FOUR_BIT_BYTES, relative_error_bound=0.5),
}

#: Host ops that expand a stored weight to the compute dtype, by library. bitsandbytes registers
#: its kernels as torch ops (``bitsandbytes::dequantize_4bit`` …) since 0.45; the int8 path
#: dequantizes its int32 accumulator (``int8_mm_dequant``) and quantizes activations on the fly.
#: fp8 *compute* (``aten::_scaled_mm``, torchao's float8 training) is not a stored base and is
#: left out.
DEQUANT_OPS = re.compile(
    r"^bitsandbytes::(dequantize\w*|gemm_4bit|gemv_4bit|int8_\w+|quantize\w*)$"
    # bitsandbytes' autograd functions (the int8 CPU path expands inside them, unnamed).
    r"|^(autograd::engine::evaluate_function: )?MatMul(8bit\w*|4Bit)(Backward)?$"
)
#: Device kernels of the same work (CUDA and HIP builds of bitsandbytes, torchao's float8).
DEQUANT_KERNELS = re.compile(
    r"kDequantize\w*|kQuantize\w*|kgemm_4bit\w*|gemv_4bit\w*|kInt8VectorQuant\w*"
    r"|kdequant_mm_int32\w*|int8_mm_dequant\w*|dequantize_blockwise\w*",
    re.I,
)
#: The fp8-storage upcast: a copy from a float8 tensor (``aten::_to_copy``/``aten::to``), read
#: off the op's input dtype.
FP8_DTYPES = frozenset({"c10::Float8_e4m3fn", "c10::Float8_e5m2", "c10::Float8_e4m3fnuz"})
UPCAST_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})


def storage(kind: str) -> StorageKind:
    return KINDS[kind]  # type: ignore[index]


def stored_bytes_of(
    parameters: int, linear_weights: int, kind: str | None, precision_bytes: int
) -> int:
    """Bytes a frozen model of ``parameters`` takes stored as ``kind`` (None: the precision's
    ``precision_bytes`` each), ``linear_weights`` of them the weights of the linear layers a
    quantized kind stores in its own bytes (the rest stay in the precision's dtype); a float kind
    casts every parameter."""
    if kind in FLOAT_KINDS:
        return round(parameters * storage(kind).bytes_per_weight)
    total = float(parameters * precision_bytes)
    if kind is not None:
        total -= linear_weights * (precision_bytes - storage(kind).bytes_per_weight)
    return round(total)


__all__ = [
    "BASE_KINDS",
    "BNB_KINDS",
    "DEQUANT_KERNELS",
    "DEQUANT_OPS",
    "FLOAT_KINDS",
    "FP8_DTYPES",
    "KINDS",
    "QUANTIZED_KINDS",
    "UPCAST_OPS",
    "BaseKind",
    "StorageKind",
    "storage",
    "stored_bytes_of",
]
