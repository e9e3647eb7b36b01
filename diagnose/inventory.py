"""The machine inventory (`diagnose env`): what a reader of a ticket needs to know about the box.

OS and kernel, Python, CPU and RAM, the torch build, the versions of the packages a LoRA trainer
leans on and whether each imports, the SDPA backends, the environment variables that change
performance, and whether GPU telemetry (pynvml / amdsmi) can be read. Every string passes
through :mod:`diagnose.redact` before it is stored; the host name is never collected.

Importing some of these packages prints to the terminal (bitsandbytes, xformers, amdsmi), or can
hang or crash the interpreter on a broken build (xformers, flash-attn). Imports run with stdout
and stderr captured at the descriptor level, the text is kept (redacted) in the inventory, and
the two dangerous ones are imported in a child interpreter with a timeout.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diagnose.device import (
    dnn_label,
    isa_of_interest,
    physical_cores,
    read_cpu_facts,
    total_ram_bytes,
    usable_cores,
)
from diagnose.quiet import capture_output
from diagnose.redact import is_secret_name, redactor_for

#: Bump when a key changes meaning or moves; readers treat missing keys as unknown.
INVENTORY_VERSION = 1

#: Seconds a child interpreter may take to import xformers or flash-attn (they import torch and
#: load large CUDA/HIP libraries; a broken build can hang in a driver call).
ISOLATED_IMPORT_TIMEOUT_S = 60.0

#: What a package entry's "status" can say.
PACKAGE_STATUSES: tuple[str, ...] = (
    "ok",
    "not installed",
    "import failed",  # the error text is kept verbatim (one line)
    "timed out",  # isolated import took longer than the timeout
    "crashed",  # the child interpreter died (segfault/abort in a native library)
    "not checked",  # a child interpreter could not be started
)

#: Longest error or printed text kept per package (the start says what went wrong).
MAX_ERROR_CHARS = 500
MAX_PRINTED_CHARS = 2000


@dataclass(frozen=True)
class PackageSpec:
    """A package whose version and importability the inventory records."""

    #: Key in the inventory (the name users know).
    name: str
    #: Top-level module to import.
    module: str
    #: Distribution names to look up, in order (ROCm wheels ship triton as pytorch-triton-rocm).
    distributions: tuple[str, ...]
    #: Import in a child interpreter with a timeout: slow to import, or may crash the process.
    isolated: bool = False
    #: Further modules to import after ``module`` (what users actually call).
    also_import: tuple[str, ...] = ()


#: In import order: dependencies before their users, so that what a package prints is charged to
#: it (peft imports bitsandbytes; importing bitsandbytes first keeps its message on its own line).
PACKAGES: tuple[PackageSpec, ...] = (
    PackageSpec("numpy", "numpy", ("numpy",)),
    PackageSpec("pillow", "PIL", ("pillow", "Pillow", "pillow-simd")),
    PackageSpec("safetensors", "safetensors", ("safetensors",)),
    PackageSpec(
        "triton", "triton", ("triton", "pytorch-triton-rocm", "pytorch-triton", "triton-rocm")
    ),
    PackageSpec("torchvision", "torchvision", ("torchvision",)),
    PackageSpec("transformers", "transformers", ("transformers",)),
    PackageSpec("accelerate", "accelerate", ("accelerate",)),
    PackageSpec("bitsandbytes", "bitsandbytes", ("bitsandbytes",)),
    PackageSpec("diffusers", "diffusers", ("diffusers",)),
    PackageSpec("peft", "peft", ("peft",)),
    # diffusers calls xformers.ops.memory_efficient_attention; a build for another torch often
    # imports "xformers" fine and fails (or warns) on xformers.ops.
    PackageSpec(
        "xformers", "xformers", ("xformers",), isolated=True, also_import=("xformers.ops",)
    ),
    PackageSpec("flash_attn", "flash_attn", ("flash-attn", "flash_attn"), isolated=True),
)

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

_CHILD_IMPORT = r"""
import importlib, json, sys, time
out = {"ok": True, "error": "", "version": None}
started = time.perf_counter()
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        break
out["seconds"] = time.perf_counter() - started
module = sys.modules.get(sys.argv[2])
version = getattr(module, "__version__", None)
out["version"] = None if version is None else str(version)
with open(sys.argv[1], "w", encoding="utf-8") as handle:
    json.dump(out, handle)
"""


def _one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _trim_printed(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    joined = "\n".join(lines)
    return joined if len(joined) <= MAX_PRINTED_CHARS else joined[: MAX_PRINTED_CHARS - 1] + "…"


def _exception_text(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}")


# --- packages -----------------------------------------------------------------------------------


def _distribution_version(spec: PackageSpec) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first installed distribution, else (None, None)."""
    for dist in spec.distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):
            return dist, importlib.metadata.version(dist)
    return None, None


def _module_present(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _package_entry(spec: PackageSpec, dist: str | None, version: str | None) -> dict[str, Any]:
    return {
        "module": spec.module,
        "distribution": dist,
        "version": version,
        "installed": False,
        "imports": None,
        "status": "not installed",
        "error": "",
        "printed": "",
        "checked": "",
        # Seconds the import took (in a child: without starting the interpreter). A first import
        # pays for shared dependencies (torch._dynamo), so the order of PACKAGES matters.
        "import_seconds": None,
    }


@contextlib.contextmanager
def _recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record warnings under Python's default filters, whatever the caller set (pytest, -W):
    keep what a user running diagnose would see, not every DeprecationWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (
            DeprecationWarning,
            PendingDeprecationWarning,
            ImportWarning,
            ResourceWarning,
        ):
            warnings.simplefilter("ignore", category)
        yield caught


def _format_warnings(caught: Iterable[warnings.WarningMessage]) -> str:
    lines = (f"{w.category.__name__}: {w.message}" for w in caught)
    return "\n".join(dict.fromkeys(lines))  # each distinct warning once, in order


def _import_in_process(modules: Iterable[str]) -> tuple[bool, str, str, float]:
    """Import ``modules`` here with output captured: (imported, error, printed, seconds)."""
    error = ""
    started = time.perf_counter()
    with _recorded_warnings() as caught, capture_output() as captured:
        for module in modules:
            try:
                importlib.import_module(module)
            except (Exception, SystemExit) as exc:
                error = _exception_text(exc)
                break
    seconds = time.perf_counter() - started
    printed = "\n".join(t for t in (captured.text, _format_warnings(caught)) if t.strip())
    return not error, error, printed, seconds


@dataclass
class _Child:
    spec: PackageSpec
    process: subprocess.Popen[bytes]
    result_path: Path


def _start_child_import(spec: PackageSpec, folder: Path) -> _Child:
    result_path = folder / f"{spec.name}.json"
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD_IMPORT, str(result_path), spec.module, *spec.also_import],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return _Child(spec, process, result_path)


@dataclass
class _ChildOutcome:
    imports: bool
    status: str
    error: str
    printed: str
    version: str | None = None
    seconds: float | None = None


def _finish_child_import(child: _Child, deadline: float, timeout_s: float) -> _ChildOutcome:
    """Wait for a child import until ``deadline`` and read what it reported."""
    try:
        output, _ = child.process.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.process.kill()
        output, _ = child.process.communicate()
        return _ChildOutcome(
            imports=False,
            status="timed out",
            error=f"importing {child.spec.module} took longer than {timeout_s:g} s",
            printed=output.decode("utf-8", errors="replace"),
        )
    printed = output.decode("utf-8", errors="replace")
    try:
        result = json.loads(child.result_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        result = None
    if isinstance(result, dict):
        ok = bool(result.get("ok"))
        seconds = result.get("seconds")
        return _ChildOutcome(
            imports=ok,
            status="ok" if ok else "import failed",
            error=_one_line(result.get("error") or ""),
            printed=printed,
            version=str(result["version"]) if result.get("version") else None,
            seconds=round(float(seconds), 3) if isinstance(seconds, (int, float)) else None,
        )
    # No report: the interpreter died before writing it (a segfault in a CUDA/HIP library).
    code = child.process.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        reason = f"the interpreter crashed ({name}) while importing {child.spec.module}"
    else:
        reason = f"the interpreter exited with status {code} while importing {child.spec.module}"
    return _ChildOutcome(imports=False, status="crashed", error=reason, printed=printed)


def collect_packages(
    packages: Sequence[PackageSpec] = PACKAGES,
    *,
    isolated_timeout_s: float = ISOLATED_IMPORT_TIMEOUT_S,
) -> dict[str, dict[str, Any]]:
    """Version and import status of each package (not yet redacted).

    Isolated packages are imported in child interpreters started first, so they run on other
    cores while this process imports the rest; each child gets ``isolated_timeout_s`` seconds
    counted from when the in-process imports are done.
    """
    entries: dict[str, dict[str, Any]] = {}
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="diagnose-imports-") as folder:
        try:
            # Children first: they run on other cores while this process imports the rest.
            for spec in packages:
                dist, version = _distribution_version(spec)
                entry = entries[spec.name] = _package_entry(spec, dist, version)
                if dist is None and not _module_present(spec.module):
                    continue
                entry["installed"] = True
                if spec.module in sys.modules and all(m in sys.modules for m in spec.also_import):
                    entry.update(imports=True, status="ok", checked="already imported")
                elif spec.isolated:
                    entry["checked"] = "child process"
                    try:
                        children.append(_start_child_import(spec, Path(folder)))
                    except OSError as exc:
                        entry.update(
                            imports=None,
                            status="not checked",
                            error=f"cannot start a child interpreter: {_exception_text(exc)}",
                        )
            for spec in packages:
                entry = entries[spec.name]
                if entry["installed"] and not entry["checked"]:
                    _check_in_process(spec, entry)
            deadline = time.monotonic() + isolated_timeout_s
            for child in children:
                entry = entries[child.spec.name]
                outcome = _finish_child_import(child, deadline, isolated_timeout_s)
                entry.update(
                    imports=outcome.imports,
                    status=outcome.status,
                    error=outcome.error,
                    printed=_trim_printed(outcome.printed),
                    import_seconds=outcome.seconds,
                )
                if entry["version"] is None and outcome.version:
                    entry["version"] = outcome.version
        finally:
            for child in children:  # interrupted (Ctrl-C): leave no interpreter behind
                if child.process.poll() is None:
                    child.process.kill()
                    child.process.wait()
    return entries


def _check_in_process(spec: PackageSpec, entry: dict[str, Any]) -> None:
    ok, error, printed, seconds = _import_in_process((spec.module, *spec.also_import))
    entry.update(
        import_seconds=round(seconds, 3),
        imports=ok,
        status="ok" if ok else "import failed",
        error=error,
        printed=_trim_printed(printed),
        checked="this process",
    )
    if entry["version"] is None and ok:
        entry["version"] = _module_version(spec.module)


def _module_version(module: str) -> str | None:
    version = getattr(sys.modules.get(module), "__version__", None)
    return None if version is None else str(version)


# --- the rest of the machine --------------------------------------------------------------------


def parse_os_release(text: str) -> dict[str, str]:
    """KEY=VALUE pairs of an os-release file, quotes removed."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.startswith("#"):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def collect_os() -> dict[str, Any]:
    release: dict[str, str] = {}
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        with contextlib.suppress(OSError):
            release = parse_os_release(Path(path).read_text(encoding="utf-8", errors="replace"))
            break
    libc = ""
    with contextlib.suppress(Exception):
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    kernel_release = platform.release()
    return {
        "system": platform.system(),
        "release": kernel_release,
        "kernel_version": platform.version(),
        "machine": platform.machine(),
        "distro": release.get("PRETTY_NAME", ""),
        "distro_id": release.get("ID", ""),
        "distro_version": release.get("VERSION_ID", ""),
        "libc": libc,
        # ROCm and CUDA under WSL2 go through a different driver path (and are slower to start).
        "wsl": "microsoft" in kernel_release.lower(),
    }


def collect_python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "virtualenv": sys.prefix != sys.base_prefix,
        "conda": bool(os.environ.get("CONDA_PREFIX")),
    }


def collect_cpu() -> dict[str, Any]:
    facts = read_cpu_facts()
    return {
        "model": facts.model,
        "vendor": facts.vendor,
        "logical_cores": os.cpu_count(),
        "physical_cores": physical_cores(),
        "usable_cores": usable_cores(),
        "isa": isa_of_interest(facts.flags) if facts.flags_known else None,
    }


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


def _probe_nvml() -> tuple[bool, str]:
    try:
        pynvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return False, "pynvml is not installed (pip install nvidia-ml-py)"
    pynvml.nvmlInit()
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        return False, "NVML sees no NVIDIA GPU"
    return True, f"NVML sees {count} GPU{'s' if count != 1 else ''}"


def _probe_amdsmi() -> tuple[bool, str]:
    try:
        amdsmi: Any = importlib.import_module("amdsmi")
    except ImportError:
        return False, "amdsmi is not installed (it ships with ROCm: /opt/rocm/share/amd_smi)"
    amdsmi.amdsmi_init()
    try:
        count = len(amdsmi.amdsmi_get_processor_handles())
    finally:
        amdsmi.amdsmi_shut_down()
    if count == 0:
        return False, "amdsmi sees no AMD GPU"
    return True, f"amdsmi sees {count} GPU{'s' if count != 1 else ''}"


def collect_telemetry(prefer: str | None = None) -> dict[str, Any]:
    """Whether GPU telemetry can be sampled (pynvml or amdsmi), and why not.

    Cheap: an import and an init/shut-down per library. amdsmi raises KeyError on import without
    a driver and prints to stdout, so everything runs captured and every exception is caught.
    """
    probes = [("amdsmi", _probe_amdsmi), ("nvml", _probe_nvml)]
    if prefer != "rocm":
        probes.reverse()
    details: dict[str, str] = {}
    printed: list[str] = []
    backend: str | None = None
    for name, probe in probes:
        with _recorded_warnings() as caught, capture_output() as captured:
            try:
                ok, reason = probe()
            except (Exception, SystemExit) as exc:
                ok, reason = False, _exception_text(exc)
        printed.extend(t for t in (captured.text, _format_warnings(caught)) if t.strip())
        details[name] = _one_line(reason)
        if ok and backend is None:
            backend = name
    reason = "" if backend else "; ".join(f"{name}: {text}" for name, text in details.items())
    return {
        "available": backend is not None,
        "backend": backend,
        "reason": reason,
        "details": details,
        "printed": _trim_printed("\n".join(printed)),
    }


# --- GPU hardware, seen without torch -----------------------------------------------------------
#
# A CPU-only torch on a machine with a GPU, or a driver that does not load, is the most expensive
# mistake there is (a step takes minutes instead of a second); torch itself cannot say that a GPU
# is there. The PCI bus, the driver's /proc and /sys files and the KFD topology (AMD) can.

#: PCI vendor ids of the GPU makers the report names.
PCI_VENDORS: dict[int, str] = {0x10DE: "NVIDIA", 0x1002: "AMD", 0x8086: "Intel", 0x1A03: "ASPEED"}
#: PCIe link speed per lane (GT/s) -> generation.
PCIE_GENERATIONS: dict[float, int] = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def pcie_generation(gt_per_s: float | None) -> int | None:
    """PCIe generation of a per-lane rate in GT/s (16.0 -> 4); None when unknown."""
    if gt_per_s is None:
        return None
    for rate, generation in PCIE_GENERATIONS.items():
        if abs(gt_per_s - rate) < 0.3:
            return generation
    return None


def parse_link_speed(text: str) -> float | None:
    """GT/s from a sysfs link speed ("16.0 GT/s PCIe", "8 GT/s", "2.5 GT/s"); None if unknown."""
    match = re.match(r"\s*(\d+(?:\.\d+)?)\s*GT/s", text)
    return float(match.group(1)) if match else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def collect_pci_display_devices(root: Path = Path("/")) -> list[dict[str, Any]]:
    """Display controllers (PCI class 0x03) on the PCI bus, with their link state.

    The link is what the OS reports at the moment of reading: an idle NVIDIA GPU trains its link
    down to a lower generation to save power, so a low generation here is not a finding by
    itself (the telemetry sampled under load decides); a narrow width is.
    """
    devices: list[dict[str, Any]] = []
    base = root / "sys" / "bus" / "pci" / "devices"
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return devices
    for entry in entries:
        pci_class = _read_int(entry / "class", 16)
        if pci_class is None or pci_class >> 16 != 0x03:
            continue
        vendor_id = _read_int(entry / "vendor", 16)
        device_id = _read_int(entry / "device", 16)
        driver = ""
        with contextlib.suppress(OSError):
            driver = os.path.basename(os.readlink(entry / "driver"))
        current_speed = parse_link_speed(_read_text(entry / "current_link_speed") or "")
        max_speed = parse_link_speed(_read_text(entry / "max_link_speed") or "")
        devices.append(
            {
                "slot": entry.name,
                "vendor_id": f"0x{vendor_id:04x}" if vendor_id is not None else None,
                "vendor": PCI_VENDORS.get(vendor_id or -1, ""),
                "device_id": f"0x{device_id:04x}" if device_id is not None else None,
                "class": f"0x{pci_class:06x}",
                "driver": driver,
                "boot_vga": _read_int(entry / "boot_vga") == 1,
                "link": {
                    "current_gt_s": current_speed,
                    "current_gen": pcie_generation(current_speed),
                    "current_width": _read_int(entry / "current_link_width"),
                    "max_gt_s": max_speed,
                    "max_gen": pcie_generation(max_speed),
                    "max_width": _read_int(entry / "max_link_width"),
                },
            }
        )
    return devices


def gfx_target_name(gfx_target_version: int) -> str:
    """KFD's gfx_target_version (110000, 90010, 90402) -> "gfx1100", "gfx90a", "gfx942"."""
    major, rest = divmod(gfx_target_version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor}{stepping:x}"


def parse_kfd_properties(text: str) -> dict[str, int]:
    """``key value`` lines of a KFD topology node's properties file."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        with contextlib.suppress(ValueError):
            values[key] = int(value.strip())
    return values


def collect_kfd_nodes(root: Path = Path("/")) -> list[dict[str, Any]]:
    """The AMD GPUs the kernel's KFD driver exposes to ROCm, with their real gfx target.

    The real target is what HSA_OVERRIDE_GFX_VERSION hides from torch: the override acts in the
    user-space runtime, KFD still reports the chip.
    """
    nodes: list[dict[str, Any]] = []
    base = root / "sys" / "class" / "kfd" / "kfd" / "topology" / "nodes"
    try:
        entries = sorted(base.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    except OSError:
        return nodes
    for entry in entries:
        props = parse_kfd_properties(_read_text(entry / "properties") or "")
        simds = props.get("simd_count", 0)
        target = props.get("gfx_target_version", 0)
        if not simds or not target:
            continue  # a CPU node
        location = props.get("location_id")
        bdf = ""
        if location is not None:
            bus, devfn = divmod(location, 256)
            bdf = f"{props.get('domain', 0):04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7:x}"
        nodes.append(
            {
                "node": int(entry.name) if entry.name.isdigit() else entry.name,
                "gfx_target": gfx_target_name(target),
                "simd_count": simds,
                # An APU's node carries both CPU cores and SIMDs.
                "integrated": props.get("cpu_cores_count", 0) > 0,
                "pci_bus_id": bdf,
            }
        )
    return nodes


def collect_drivers(root: Path = Path("/")) -> dict[str, Any]:
    """Kernel driver and ROCm versions from their files (no library is loaded)."""
    from diagnose.device import parse_nvidia_proc_version

    nvidia_text = _read_text(root / "proc" / "driver" / "nvidia" / "version") or ""
    amdgpu_loaded = (root / "sys" / "module" / "amdgpu").is_dir()
    rocm = _read_text(root / "opt" / "rocm" / ".info" / "version") or ""
    return {
        "nvidia": parse_nvidia_proc_version(nvidia_text),
        "amdgpu_loaded": amdgpu_loaded,
        # Present for the DKMS amdgpu that ROCm installs; the in-tree (distribution) driver has
        # no version file of its own: it is the kernel's.
        "amdgpu": _read_text(root / "sys" / "module" / "amdgpu" / "version") or "",
        "rocm": rocm,
    }


def cuda_driver_api_version() -> str:
    """The CUDA version the installed NVIDIA driver supports ("12.4"), through libcuda's
    cuDriverGetVersion (needs no GPU context); "" without an NVIDIA driver."""
    import ctypes

    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        try:
            if library.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
                return ""
        except AttributeError:
            return ""
        major, minor = divmod(version.value, 1000)
        return f"{major}.{minor // 10}"
    return ""


def collect_torch_devices() -> list[dict[str, Any]]:
    """Every GPU this torch sees (the run measures one; the rules compare it with the others)."""
    from diagnose.device import gpu_info, is_integrated_gpu, read_gpu_properties

    if not _safe(torch.cuda.is_available, False):
        return []
    devices: list[dict[str, Any]] = []
    for index in range(int(_safe(torch.cuda.device_count, 0))):
        props = _safe(lambda i=index: read_gpu_properties(torch.device("cuda", i)))
        if props is None:
            continue
        info = gpu_info(props)
        devices.append(
            {
                "index": index,
                "name": info.name,
                "arch": info.arch,
                "memory_bytes": info.memory_bytes,
                "integrated": is_integrated_gpu(info),
                "pci_bus_id": info.extra.get("pci_bus_id", ""),
            }
        )
    return devices


def collect_gpu(root: Path = Path("/"), *, include_torch: bool = True) -> dict[str, Any]:
    """GPUs on the PCI bus, their drivers, AMD's KFD nodes and the GPUs torch sees."""
    return {
        "pci": collect_pci_display_devices(root),
        "drivers": collect_drivers(root),
        "cuda_driver_api": cuda_driver_api_version() if root == Path("/") else "",
        "kfd_nodes": collect_kfd_nodes(root),
        "torch_devices": collect_torch_devices() if include_torch else [],
    }


# --- assembly -----------------------------------------------------------------------------------


def _sorted_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted_keys(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_sorted_keys(v) for v in obj]
    return obj


def collect_inventory(
    device_kind: str | None = None,
    *,
    redact_paths: bool = False,
    packages: Sequence[PackageSpec] = PACKAGES,
) -> dict[str, Any]:
    """The inventory of this machine as a JSON-serialisable dict with sorted keys.

    ``device_kind`` ("cuda", "rocm", "cpu"; from DeviceInfo.kind) decides which telemetry library
    is tried first; the device itself is described once, in RunRecord.device.
    ``redact_paths`` also replaces the home folder and the user name (``--redact-paths``).
    ``packages`` is the list of packages to check (:data:`PACKAGES`).
    Nothing is printed: what libraries print while being imported is kept under their entry.
    """
    started = time.perf_counter()
    # Before any import below: imported packages set variables of their own.
    environ = dict(os.environ)
    raw: dict[str, Any] = {
        "inventory_version": INVENTORY_VERSION,
        "os": collect_os(),
        "python": collect_python(),
        "cpu": collect_cpu(),
        "memory": {"total_bytes": total_ram_bytes()},
        "torch": collect_torch(),
        "packages": collect_packages(packages),
        "sdpa": collect_sdpa(),
        "env": collect_env(environ),
        "gpu": collect_gpu(),
        "telemetry": collect_telemetry(device_kind),
    }
    raw["collect_seconds"] = round(time.perf_counter() - started, 3)
    redacted = redactor_for(redact_paths).obj(raw)
    return _sorted_keys(redacted)  # type: ignore[no-any-return]


__all__ = [
    "ENV_NAMES",
    "ENV_PREFIXES",
    "INVENTORY_VERSION",
    "ISOLATED_IMPORT_TIMEOUT_S",
    "PACKAGES",
    "PACKAGE_STATUSES",
    "PCIE_GENERATIONS",
    "PCI_VENDORS",
    "PackageSpec",
    "collect_cpu",
    "collect_drivers",
    "collect_env",
    "collect_gpu",
    "collect_inventory",
    "collect_kfd_nodes",
    "collect_os",
    "collect_packages",
    "collect_pci_display_devices",
    "collect_python",
    "collect_sdpa",
    "collect_telemetry",
    "collect_torch",
    "collect_torch_devices",
    "cuda_driver_api_version",
    "gfx_target_name",
    "parse_kfd_properties",
    "parse_link_speed",
    "parse_os_release",
    "pcie_generation",
]
