"""The environment variables that change performance, as set (secret-named ones never)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from diagnose.redact import is_secret_name

#: Environment variables that change performance, recorded when set.
ENV_NAMES: frozenset[str] = frozenset(
    {
        # ROCm
        "ROCR_VISIBLE_DEVICES",
        "GPU_MAX_HW_QUEUES",
        "GPU_DEVICE_ORDINAL",
        "AMD_SERIALIZE_KERNEL",
        "AMD_SERIALIZE_COPY",
        "AMD_LOG_LEVEL",
        "AMD_DIRECT_DISPATCH",
        # CUDA
        "NVIDIA_TF32_OVERRIDE",
        "NVIDIA_VISIBLE_DEVICES",
        "CUBLAS_WORKSPACE_CONFIG",
        # general
        "OPENBLAS_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "LD_PRELOAD",  # jemalloc/tcmalloc change host-side speed
    }
)
#: Any variable starting with one of these is recorded (except secret-named ones).
ENV_PREFIXES: tuple[str, ...] = (
    "PYTORCH_",  # PYTORCH_TUNABLEOP_*, PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, ...
    "TORCH_",  # TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL, TORCH_BLAS_PREFER_HIPBLASLT, TORCH_CUDNN_*
    "TORCHINDUCTOR_",
    "TRITON_",
    "XFORMERS_",
    "DIFFUSERS_",
    "ACCELERATE_",
    "BNB_",
    "HIP_",
    "HSA_",
    "ROCBLAS_",
    "HIPBLASLT_",
    "MIOPEN_",
    "CUDA_",
    "CUDNN_",
    "OMP_",
    "KMP_",
    "MKL_",
    # ROCm runtime limits: GPU_MAX_ALLOC_PERCENT, GPU_SINGLE_ALLOC_PERCENT, GPU_MAX_HEAP_SIZE...
    "GPU_",
)


def _set_by_torch(name: str, value: str) -> bool:
    """Whether torch itself set this variable: importing torch._inductor (or the profiler) sets
    TORCHINDUCTOR_CACHE_DIR to <tempdir>/torchinductor_<user>; recording it would suggest that
    the user did."""
    if name != "TORCHINDUCTOR_CACHE_DIR":
        return False
    folder, leaf = os.path.split(value.rstrip("/\\"))
    return folder == tempfile.gettempdir() and leaf.startswith("torchinductor_")


def collect_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The performance-relevant variables that are set; secret-named ones are never included."""
    env = os.environ if environ is None else environ
    return {
        name: value
        for name, value in sorted(env.items())
        if (name in ENV_NAMES or name.startswith(ENV_PREFIXES))
        and not is_secret_name(name)
        and not _set_by_torch(name, value)
    }
