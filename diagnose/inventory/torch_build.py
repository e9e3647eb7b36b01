"""The torch build and its global switches (BLAS, cuDNN, TF32, TunableOp), and which
scaled_dot_product_attention backends torch may pick."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from diagnose.device import dnn_label
from diagnose.inventory.printed import _format_warnings, _recorded_warnings


def _safe(getter: Any, default: Any = None) -> Any:
    """getter(), or ``default`` when it raises (torch APIs differ between versions and builds)."""
    try:
        return getter()
    except Exception:
        return default


def _enum_name(value: Any) -> Any:
    return getattr(value, "name", None) or (None if value is None else str(value))


def _parallel_backend() -> str:
    info = _safe(torch.__config__.parallel_info, "")
    match = re.search(r"ATen parallel backend:\s*(.+)", info or "")
    return match.group(1).strip() if match else ""


def collect_torch() -> dict[str, Any]:
    hip = torch.version.hip
    cuda_available = bool(_safe(torch.cuda.is_available, False))
    cudnn_version = _safe(torch.backends.cudnn.version)
    # On ROCm, asking for the BLAS library decides it, and on a GPU hipBLASLt does not support
    # torch warns "Attempting to use hipBLASLt on an unsupported architecture!": keep the
    # warning in the record instead of on the terminal.
    with _recorded_warnings() as caught:
        preferred_blas = _enum_name(_safe(torch.backends.cuda.preferred_blas_library))
    return {
        "version": str(torch.__version__),
        "git_version": str(getattr(torch.version, "git_version", "") or ""),
        "cuda": torch.version.cuda,
        "hip": hip,
        "debug": bool(torch.version.debug),
        "built_with_cuda": bool(torch.version.cuda) and not hip,
        "built_with_rocm": bool(hip),
        "cuda_available": cuda_available,
        "device_count": int(_safe(torch.cuda.device_count, 0)) if cuda_available else 0,
        # The GPU targets the build has kernels for: an AMD card outside this list needs
        # HSA_OVERRIDE_GFX_VERSION (or another build).
        "arch_list": list(_safe(torch.cuda.get_arch_list, []) or []),
        "cudnn_available": bool(_safe(torch.backends.cudnn.is_available, False)),
        "cudnn_version": cudnn_version,
        "cudnn": dnn_label(cudnn_version, hip=bool(hip)),
        "mkldnn_available": bool(_safe(torch.backends.mkldnn.is_available, False)),
        "mkl_available": bool(_safe(torch.backends.mkl.is_available, False)),
        "cpu_capability": str(_safe(torch.backends.cpu.get_cpu_capability, "")),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "parallel_backend": _parallel_backend(),
        "flags": {
            "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": _safe(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
            "cudnn_enabled": _safe(lambda: bool(torch.backends.cudnn.enabled)),
            "cudnn_benchmark": _safe(lambda: bool(torch.backends.cudnn.benchmark)),
            "cudnn_deterministic": _safe(lambda: bool(torch.backends.cudnn.deterministic)),
            "cudnn_allow_tf32": _safe(lambda: bool(torch.backends.cudnn.allow_tf32)),
            "preferred_blas_library": preferred_blas,
            "preferred_blas_library_warning": _format_warnings(caught),
            # TunableOp can be switched on in code as well as by PYTORCH_TUNABLEOP_ENABLED.
            "tunableop_enabled": _safe(lambda: bool(torch.cuda.tunable.is_enabled())),
            "tunableop_tuning": _safe(lambda: bool(torch.cuda.tunable.tuning_is_enabled())),
        },
    }


def collect_sdpa() -> dict[str, Any]:
    """Which scaled_dot_product_attention backends torch may pick (global switches)."""
    backends = torch.backends.cuda

    def flag(name: str) -> bool | None:
        getter = getattr(backends, name, None)
        return None if getter is None else _safe(lambda: bool(getter()))

    return {
        "flash_enabled": flag("flash_sdp_enabled"),
        "mem_efficient_enabled": flag("mem_efficient_sdp_enabled"),
        "math_enabled": flag("math_sdp_enabled"),
        "cudnn_enabled": flag("cudnn_sdp_enabled"),
        # Whether this build has the kernels at all (a switch on a missing kernel does nothing).
        "flash_attention_available": flag("is_flash_attention_available"),
        "ck_available": flag("is_ck_sdpa_available"),
        "preferred_rocm_fa_library": (
            _enum_name(_safe(backends.preferred_rocm_fa_library))
            if torch.version.hip and hasattr(backends, "preferred_rocm_fa_library")
            else None
        ),
        # On ROCm, AOTriton's flash/mem-efficient kernels for consumer GPUs (RDNA3/4) are behind
        # this switch; without it SDPA falls back to the math path.
        "rocm_aotriton_experimental": (
            os.environ.get("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL") if torch.version.hip else None
        ),
    }
