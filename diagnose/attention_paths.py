"""One classification of attention ops and kernels, shared by the attention probe and trace rule.

Both ``diagnose run`` (the ``attention`` probe, which profiles one step of its own) and
``diagnose trace`` (the ``attention`` rule, which reads any Kineto trace) answer the same
question, "which attention implementation ran?", from the same names:

- **ops** (host side): ``aten::_scaled_dot_product_flash_attention`` (CUDA/ROCm flash),
  ``..._flash_attention_for_cpu`` (the CPU's fused kernel), ``..._efficient_attention``,
  ``..._cudnn_attention``, ``..._attention_math`` (the unfused fallback), xFormers and flash-attn
  ops;
- **kernels** (device side): FlashAttention (``pytorch_flash::``, ``flash::``), CUTLASS fmha
  (memory-efficient), cuDNN SDPA, ROCm AOTriton (``attn_fwd``, ``attn_bwd*``, ``bwd_kernel_*``),
  Composable Kernel fmha, xFormers;
- a hand-written ``matmul → softmax → matmul`` outside any SDPA op.

The ROCm architecture rule lives here too. The finding ids, their wording and the fixes in users'
words are in :mod:`diagnose.catalogs.attention_catalog`. This module imports nothing heavy (no
torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Path names, as records store them.
MATH = "math"
FLASH = "flash"
EFFICIENT = "memory-efficient"
CUDNN = "cudnn"
FUSED_OTHER = "fused (other)"
MANUAL = "hand-written bmm/softmax/bmm"
FROM_KERNELS = "fused (from kernels)"

#: Paths that are fused kernels (no attention matrix in memory).
FUSED_PATHS: frozenset[str] = frozenset({FLASH, EFFICIENT, CUDNN, FUSED_OTHER, FROM_KERNELS})


@dataclass(frozen=True)
class OpKind:
    """What one attention op name says: the path and who provides it."""

    path: str
    #: "torch SDPA", "torch SDPA (CPU)", "xFormers", "flash-attn", "FlexAttention".
    provider: str


# Order matters: the first match wins (the CPU flash op before the generic flash prefix).
_OPS: list[tuple[OpKind, re.Pattern[str]]] = [
    (OpKind(MATH, "torch SDPA"), re.compile(r"^aten::_scaled_dot_product_attention_math")),
    (
        OpKind(FLASH, "torch SDPA (CPU)"),
        re.compile(r"^aten::_scaled_dot_product_flash_attention_for_cpu"),
    ),
    (
        OpKind(FLASH, "torch SDPA"),
        re.compile(
            r"^aten::_scaled_dot_product_flash_attention|^aten::_flash_attention_(forward|backward)"
        ),
    ),
    (OpKind(FLASH, "xFormers"), re.compile(r"^xformers_flash\d*::")),
    (OpKind(FLASH, "flash-attn"), re.compile(r"^_?flash_attn")),
    (
        OpKind(EFFICIENT, "torch SDPA"),
        re.compile(r"^aten::_scaled_dot_product_efficient_attention|^aten::_efficient_attention_"),
    ),
    (OpKind(EFFICIENT, "xFormers"), re.compile(r"^xformers::")),
    (OpKind(CUDNN, "torch SDPA"), re.compile(r"^aten::_scaled_dot_product_cudnn_attention")),
    (
        OpKind(FUSED_OTHER, "torch SDPA"),
        re.compile(r"^aten::_scaled_dot_product_fused_attention_overrideable"),
    ),
    (OpKind(FUSED_OTHER, "FlexAttention"), re.compile(r"flex_attention")),
]

#: Host ops of a hand-written attention (the outermost call of each is what the user wrote).
MATMUL_OPS: frozenset[str] = frozenset(
    {"aten::bmm", "aten::baddbmm", "aten::matmul", "aten::einsum"}
)
SOFTMAX_OPS: frozenset[str] = frozenset({"aten::softmax", "aten::_softmax", "aten::_safe_softmax"})


def classify_op(name: str) -> OpKind | None:
    """The attention path of a host op name, or None when it is no attention op."""
    for kind, pattern in _OPS:
        if pattern.search(name):
            return kind
    return None


def op_path(name: str) -> str | None:
    """Shorthand for ``classify_op(name).path``."""
    kind = classify_op(name)
    return kind.path if kind else None


@dataclass(frozen=True)
class KernelFamily:
    """Which library's fused attention kernel a device kernel is."""

    label: str
    #: The path it implies on its own, or None when the kernel serves several paths (ROCm's
    #: AOTriton runs both SDPA flash and memory-efficient).
    path: str | None


_KERNELS: list[tuple[KernelFamily, re.Pattern[str]]] = [
    (KernelFamily("cuDNN SDPA", CUDNN), re.compile(r"cudnn.*(sdpa|fmha|flash_[fb]prop)")),
    (KernelFamily("FlashAttention (torch SDPA)", FLASH), re.compile(r"pytorch_flash::")),
    (
        KernelFamily("FlashAttention", FLASH),
        re.compile(r"(^|[^_a-z])flash::|flash_?fwd|flash_?bwd|flashattn|flash_attn"),
    ),
    (KernelFamily("Composable Kernel fmha", None), re.compile(r"ck_tile::fmha|fmha_(fwd|bwd)_")),
    (
        KernelFamily("CUTLASS fmha (memory-efficient)", EFFICIENT),
        re.compile(
            r"fmha_cutlass|attention_kernel_batched|attentionkernel|attentionbackwardkernel"
            r"|efficient_attention|mem_eff|cutlass\w*attention"
        ),
    ),
    (
        KernelFamily("AOTriton", None),
        re.compile(r"^attn_fwd|^attn_bwd|bwd_kernel_dk_dv|bwd_kernel_dq|bwd_preprocess"),
    ),
    (KernelFamily("FlexAttention (Triton)", FUSED_OTHER), re.compile(r"flex_attention")),
    (KernelFamily("xFormers", None), re.compile(r"xformers")),
    (KernelFamily("fused attention kernel", None), re.compile(r"fmha|_sdpa|sdpa_|fused_attention")),
]


def kernel_family(name: str) -> KernelFamily | None:
    """The fused-attention library of a device kernel name, or None when it is none of them."""
    lowered = name.lower()
    if lowered.startswith("void "):
        lowered = lowered[5:]
    for family, pattern in _KERNELS:
        if pattern.search(lowered):
            return family
    return None


# --------------------------------------------------------------------------------------------
# ROCm: consumer architectures need the experimental AOTriton switch

ROCM_EXPERIMENTAL_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
#: gfx11xx (RDNA3/3.5) and gfx12xx (RDNA4): AOTriton's flash and memory-efficient kernels are
#: behind ROCM_EXPERIMENTAL_ENV; without it SDPA reports "No available kernel" and uses math.
#: gfx90a (MI200), gfx94x (MI300) and gfx95x (MI350) are supported without it.
_EXPERIMENTAL_ARCH = re.compile(r"^gfx1[12]\d\d")


def rocm_needs_experimental(arch: str) -> bool:
    """Whether SDPA's fused kernels on this gfx target need ``ROCM_EXPERIMENTAL_ENV=1``."""
    return bool(_EXPERIMENTAL_ARCH.match(arch.strip().lower()))


def env_enabled(value: str | None) -> bool:
    """How c10::utils::check_env reads a switch: 1/ON/TRUE/YES/Y (any case) turn it on."""
    return (value or "").strip().upper() in {"1", "ON", "TRUE", "YES", "Y"}


#: The path each benchmark backend stands for, when it ran (provider-specific ones first).
_PATH_BACKEND: dict[tuple[str, str], str] = {
    (FLASH, "xFormers"): "xformers",
    (EFFICIENT, "xFormers"): "xformers",
    (FLASH, "flash-attn"): "flash_attn",
}
_PATH_DEFAULT_BACKEND: dict[str, str] = {
    MATH: "math",
    FLASH: "flash",
    EFFICIENT: "efficient",
    CUDNN: "cudnn",
    MANUAL: "manual",
}


def backend_for_path(path: str, provider: str = "torch SDPA") -> str | None:
    """The benchmark backend name of a path that ran, or None when none corresponds."""
    return _PATH_BACKEND.get((path, provider)) or _PATH_DEFAULT_BACKEND.get(path)


__all__ = [
    "CUDNN",
    "EFFICIENT",
    "FLASH",
    "FROM_KERNELS",
    "FUSED_OTHER",
    "FUSED_PATHS",
    "MANUAL",
    "MATH",
    "MATMUL_OPS",
    "ROCM_EXPERIMENTAL_ENV",
    "SOFTMAX_OPS",
    "KernelFamily",
    "OpKind",
    "backend_for_path",
    "classify_op",
    "env_enabled",
    "kernel_family",
    "op_path",
    "rocm_needs_experimental",
]
