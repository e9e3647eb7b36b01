"""Choosing the torch device to measure on, and describing it for the record.

torch exposes AMD GPUs (ROCm/HIP builds) under the device type "cuda"; ``torch.version.hip`` is
what tells the two vendors apart. The GPU branches cannot run on a machine without a GPU, so they
are split in two: :func:`read_gpu_properties` only copies values out of torch, and the pure
helpers (:func:`gpu_info`, :func:`parse_gcn_arch`, :func:`bf16_native`, ...) turn them into a
:class:`~diagnose.record.DeviceInfo`; the helpers are tested on values recorded from real GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diagnose.bf16_hardware import (
    amd_bf16_native,
    bf16_native,
    cpu_bf16_native,
    nvidia_bf16_native,
)
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.quiet import capture_output
from diagnose.record import DeviceInfo
from diagnose.telemetry.parsing import format_pci_bus_id

# --- selecting ----------------------------------------------------------------------------------

_SPEC = re.compile(r"(auto|cpu|cuda|rocm|hip)(?::(\d+))?")
#: Device types torch knows but diagnose does not measure.
_OTHER_TORCH_TYPES = frozenset(
    {"mps", "xpu", "mtia", "npu", "hpu", "xla", "meta", "vulkan", "ipu", "privateuseone", "gpu"}
)
_ACCEPTED = "auto, cpu, cuda, cuda:N, rocm or rocm:N"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def available_devices() -> list[str]:
    """The device strings usable here, with GPU names: ["cpu", "cuda:0 (NVIDIA H100 ...)"]."""
    devices = ["cpu"]
    try:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                try:
                    name = _one_line(torch.cuda.get_device_name(index))
                except Exception:
                    name = ""
                devices.append(f"cuda:{index} ({name})" if name else f"cuda:{index}")
    except Exception:  # a broken driver must not turn an error message into a traceback
        pass
    return devices


def _why_no_gpu() -> str:
    version = torch.__version__
    hip, cuda = torch.version.hip, torch.version.cuda
    if hip:
        return (
            f"this torch ({version}, HIP {hip}) sees no AMD GPU (amdgpu driver or ROCm missing, "
            "no access to /dev/kfd and /dev/dri, or HIP_VISIBLE_DEVICES hides it)"
        )
    if cuda:
        return (
            f"this torch ({version}, CUDA {cuda}) sees no NVIDIA GPU (driver missing or too old, "
            "or CUDA_VISIBLE_DEVICES hides it)"
        )
    return f"this torch ({version}) is a CPU-only build"


def select_device(spec: str = "auto") -> torch.device:
    """The torch device for ``spec``: "auto", "cpu", "cuda", "cuda:N", "rocm"/"hip"[":N"].

    "auto" is the first GPU when torch sees one (NVIDIA or AMD), else the CPU. "rocm" and "hip"
    are aliases of "cuda" on a HIP build of torch. Raises DiagnoseError (USAGE) on a malformed
    spec and (UNSUPPORTED) for a device that is not there, naming what is.
    """
    text = spec.strip().lower()
    match = _SPEC.fullmatch(text)
    if match is None or (match.group(1) == "auto" and match.group(2) is not None):
        if text.split(":", 1)[0] in _OTHER_TORCH_TYPES:
            raise DiagnoseError(
                f"device {spec!r} is not supported: diagnose measures cpu, cuda (NVIDIA) and "
                f"rocm (AMD) devices; available: {', '.join(available_devices())}",
                ExitCode.UNSUPPORTED,
            )
        raise DiagnoseError(f"invalid device {spec!r}; expected {_ACCEPTED}", ExitCode.USAGE)
    kind, index_text = match.group(1), match.group(2)
    index = int(index_text) if index_text is not None else 0

    if kind == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if kind == "cpu":
        if index != 0:
            raise DiagnoseError(f"invalid device {spec!r}; the CPU is 'cpu'", ExitCode.USAGE)
        return torch.device("cpu")

    if kind in ("rocm", "hip") and torch.version.cuda and not torch.version.hip:
        raise DiagnoseError(
            f"device {spec!r} asks for an AMD GPU, but this torch ({torch.__version__}) is a "
            f"CUDA (NVIDIA) build; use 'cuda'; available: {', '.join(available_devices())}",
            ExitCode.UNSUPPORTED,
        )
    if not torch.cuda.is_available():
        raise DiagnoseError(
            f"device {spec!r} is not available: {_why_no_gpu()}; available: "
            f"{', '.join(available_devices())}",
            ExitCode.UNSUPPORTED,
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DiagnoseError(
            f"device {spec!r} is not available: torch sees {count} GPU"
            f"{'' if count == 1 else 's'}; available: {', '.join(available_devices())}",
            ExitCode.UNSUPPORTED,
        )
    return torch.device("cuda", index)


# --- describing: pure helpers ---------------------------------------------------------------------


def gpu_kind(hip_version: str | None) -> str:
    """The device kind: "rocm" on a HIP build of torch (AMD), else "cuda" (NVIDIA)."""
    return "rocm" if hip_version else "cuda"


def gpu_vendor(kind: str) -> str:
    return {"rocm": "AMD", "cuda": "NVIDIA"}.get(kind, "")


def nvidia_arch(major: int, minor: int) -> str:
    """Compute capability (9, 0) -> "sm_90", (12, 0) -> "sm_120"."""
    return f"sm_{major}{minor}"


def parse_gcn_arch(gcn_arch_name: str) -> tuple[str, list[str]]:
    """Split a gcnArchName: "gfx90a:sramecc+:xnack-" -> ("gfx90a", ["sramecc+", "xnack-"]).

    torch reports ``gcnArchName`` as the gfx target followed by the target features (the
    "target ID" of LLVM's AMDGPU back end); the features matter for which code objects load, not
    for speed, so they go to ``extra``.
    """
    parts = [p.strip() for p in gcn_arch_name.strip().split(":")]
    return parts[0], [p for p in parts[1:] if p]


def _leading_version(version: str) -> str:
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return match.group(0) if match else version.strip()


def runtime_label(cuda_version: str | None, hip_version: str | None) -> str:
    """The runtime: "HIP 6.4.43482" (git hash dropped), "CUDA 12.8", or "" on a CPU build."""
    if hip_version:
        return f"HIP {_leading_version(hip_version)}"
    if cuda_version:
        return f"CUDA {cuda_version}"
    return ""


def dnn_label(version: int | None, *, hip: bool) -> str:
    """The cuDNN or MIOpen version as text, from ``torch.backends.cudnn.version()``.

    cuDNN 9 encodes major*10000 + minor*100 + patch (90100), cuDNN 8 and older major*1000 +
    minor*100 + patch (8906); on ROCm torch reports MIOpen as major*1000000 + minor*1000 + patch
    (torch/csrc/cuda/shared/cudnn.cpp).
    """
    if not version:
        return ""
    if hip:
        major, rest = divmod(version, 1_000_000)
        minor, patch = divmod(rest, 1000)
        return f"MIOpen {major}.{minor}.{patch}"
    if version >= 10000:
        major, rest = divmod(version, 10000)
    else:
        major, rest = divmod(version, 1000)
    minor, patch = divmod(rest, 100)
    return f"cuDNN {major}.{minor}.{patch}"


#: x86 flags that decide bf16 speed on a CPU (and the vector width the rest runs at).
X86_ISA_OF_INTEREST = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)
#: aarch64 "Features" that matter: SVE widths and the BF16/I8MM matrix extensions.
ARM_ISA_OF_INTEREST = ("asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm", "sme")


@dataclass
class GpuProperties:
    """Raw values read from torch for one GPU; everything :func:`gpu_info` needs."""

    index: int = 0
    name: str = ""
    major: int = 0
    minor: int = 0
    total_memory: int = 0
    multi_processor_count: int = 0
    #: ROCm only, e.g. "gfx1100" or "gfx90a:sramecc+:xnack-".
    gcn_arch_name: str = ""
    warp_size: int | None = None
    l2_cache_bytes: int | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    dnn_version: int | None = None
    #: What torch.cuda.is_bf16_supported() said (recorded, not trusted: see bf16_native).
    torch_bf16_supported: bool | None = None
    hsa_override_gfx_version: str | None = None
    #: Whether the GPU shares system memory with the CPU (an APU or laptop iGPU); None if unknown.
    is_integrated: bool | None = None
    #: PCI address "0000:03:00.0", used to find the same GPU in NVML/amdsmi; "" if unknown.
    pci_bus_id: str = ""


#: AMD gfx targets of integrated GPUs (APUs), from LLVM's AMDGPUUsage processor table: used when
#: torch does not report ``is_integrated``. gfx1151 (Strix Halo) is integrated but often the only
#: and intended GPU of its machine.
AMD_APU_TARGETS: frozenset[str] = frozenset(
    {
        "gfx801",  # Carrizo
        "gfx902",  # Raven Ridge
        "gfx909",  # Raven2
        "gfx90c",  # Renoir, Cezanne, Lucienne
        "gfx1013",  # Cyan Skillfish
        "gfx1033",  # Van Gogh (Steam Deck)
        "gfx1035",  # Rembrandt (680M)
        "gfx1036",  # Raphael, Granite Ridge (desktop Ryzen iGPU)
        "gfx1037",  # Mendocino
        "gfx1103",  # Phoenix, Hawk Point (780M)
        "gfx1150",  # Strix Point (890M)
        "gfx1151",  # Strix Halo (8060S)
        "gfx1152",  # Krackan Point
        "gfx1153",
    }
)


def is_integrated_gpu(info: DeviceInfo) -> bool | None:
    """Whether the device is an integrated GPU: what torch said, else the AMD APU target list."""
    said = info.extra.get("is_integrated")
    if isinstance(said, bool):
        return said
    if info.kind == "rocm" and info.arch:
        return info.arch.lower() in AMD_APU_TARGETS
    return None


def gpu_info(props: GpuProperties, *, driver: str = "") -> DeviceInfo:
    """A DeviceInfo from recorded GPU properties (pure)."""
    kind = gpu_kind(props.hip_version)
    extra: dict[str, Any] = {"multiprocessor_count": props.multi_processor_count}
    if kind == "rocm":
        arch, features = parse_gcn_arch(props.gcn_arch_name)
        extra["gcn_arch_name"] = props.gcn_arch_name
        extra["gcn_arch_features"] = features
        if props.hsa_override_gfx_version:
            # The override makes the runtime report (and load kernels for) another target.
            extra["hsa_override_gfx_version"] = props.hsa_override_gfx_version
    else:
        arch = nvidia_arch(props.major, props.minor)
        extra["compute_capability"] = f"{props.major}.{props.minor}"
    if props.warp_size is not None:
        extra["warp_size"] = props.warp_size
    if props.l2_cache_bytes is not None:
        extra["l2_cache_bytes"] = props.l2_cache_bytes
    extra["dnn"] = dnn_label(props.dnn_version, hip=kind == "rocm")
    extra["dnn_version"] = props.dnn_version
    extra["torch_is_bf16_supported"] = props.torch_bf16_supported
    if props.is_integrated is not None:
        extra["is_integrated"] = props.is_integrated
    if props.pci_bus_id:
        extra["pci_bus_id"] = props.pci_bus_id
    info = DeviceInfo(
        kind=kind,
        vendor=gpu_vendor(kind),
        name=_one_line(props.name),
        arch=arch,
        memory_bytes=props.total_memory or None,
        runtime=runtime_label(props.cuda_version, props.hip_version),
        driver=driver,
        torch_device=f"cuda:{props.index}",
        extra=extra,
    )
    info.extra["bf16_native"] = bf16_native(info)
    return info


# --- describing: the CPU ------------------------------------------------------------------------

#: "CPU implementer" codes in /proc/cpuinfo on aarch64 (Linux arch/arm64 cputype.h).
_ARM_IMPLEMENTERS = {
    0x41: "ARM",
    0x42: "Broadcom",
    0x43: "Cavium",
    0x46: "Fujitsu",
    0x48: "HiSilicon",
    0x4E: "NVIDIA",
    0x50: "APM",
    0x51: "Qualcomm",
    0x61: "Apple",
    0x69: "Intel",
    0xC0: "Ampere",
}
#: A few ARM "CPU part" codes seen on training machines (Grace is Neoverse V2).
_ARM_PARTS = {
    0xD08: "Cortex-A72",
    0xD0B: "Cortex-A76",
    0xD0C: "Neoverse N1",
    0xD40: "Neoverse V1",
    0xD49: "Neoverse N2",
    0xD4F: "Neoverse V2",
}
_X86_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}


@dataclass
class CpuFacts:
    model: str = ""
    vendor: str = ""
    #: All ISA flags the OS reports (x86 "flags", aarch64 "Features"); empty when unknown.
    flags: frozenset[str] = field(default_factory=frozenset)
    #: Whether flags could be read at all (None ISA is "unknown", not "none").
    flags_known: bool = False


def parse_cpuinfo(text: str) -> CpuFacts:
    """Model, vendor and ISA flags from the text of /proc/cpuinfo (x86 or aarch64)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key and key not in fields:  # first processor only
            fields[key] = value.strip()
    facts = CpuFacts()
    flag_text = fields.get("flags") or fields.get("features")
    if flag_text is not None:
        facts.flags = frozenset(flag_text.split())
        facts.flags_known = True
    facts.vendor = _X86_VENDORS.get(fields.get("vendor_id", ""), fields.get("vendor_id", ""))
    facts.model = _one_line(fields.get("model name", "") or fields.get("cpu model", ""))
    implementer = _hex_field(fields.get("cpu implementer"))
    if implementer is not None:
        facts.vendor = facts.vendor or _ARM_IMPLEMENTERS.get(implementer, f"0x{implementer:x}")
        part = _hex_field(fields.get("cpu part"))
        if not facts.model:
            part_name = _ARM_PARTS.get(part, f"part 0x{part:x}") if part is not None else ""
            facts.model = f"{facts.vendor} {part_name}".strip()
    return facts


def _hex_field(value: str | None) -> int | None:
    if not value:
        return None
    try:
        return int(value, 0)
    except ValueError:
        return None


def isa_of_interest(flags: frozenset[str]) -> list[str]:
    wanted = X86_ISA_OF_INTEREST + ARM_ISA_OF_INTEREST
    return sorted(f for f in wanted if f in flags)


def read_cpu_facts() -> CpuFacts:
    """CpuFacts for this machine: /proc/cpuinfo on Linux, sysctl on macOS, platform elsewhere."""
    facts = CpuFacts()
    with contextlib.suppress(OSError):
        facts = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    if not facts.model and sys.platform == "darwin":
        with contextlib.suppress(Exception):
            facts.model = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=2,
                check=False,
            ).stdout.strip()
    if not facts.model:
        facts.model = _one_line(platform.processor() or platform.machine())
    return facts


def physical_cores() -> int | None:
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
        return int(count) if count else None
    except Exception:
        return None


def usable_cores() -> int | None:
    """Cores this process may run on (container and taskset limits), where the OS tells."""
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            return len(os.sched_getaffinity(0))
    return os.cpu_count()


def total_ram_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    with contextlib.suppress(Exception):
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    return None


def cpu_info() -> DeviceInfo:
    facts = read_cpu_facts()
    isa: list[str] | None = isa_of_interest(facts.flags) if facts.flags_known else None
    capability = ""
    with contextlib.suppress(Exception):
        capability = str(torch.backends.cpu.get_cpu_capability())
    info = DeviceInfo(
        kind="cpu",
        vendor=facts.vendor,
        name=facts.model,
        arch=platform.machine(),
        memory_bytes=total_ram_bytes(),
        runtime="",
        driver="",
        torch_device="cpu",
        extra={
            "logical_cores": os.cpu_count(),
            "physical_cores": physical_cores(),
            "usable_cores": usable_cores(),
            "isa": isa,
            "torch_cpu_capability": capability,
            "torch_threads": torch.get_num_threads(),
        },
    )
    info.extra["bf16_native"] = bf16_native(info)
    return info


# --- describing: GPUs (thin: values copied out of torch) ------------------------------------------


def read_gpu_properties(device: torch.device) -> GpuProperties:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    dnn_version: int | None = None
    with contextlib.suppress(Exception):  # raises on a cuDNN/MIOpen version mismatch
        raw_version: Any = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        dnn_version = int(raw_version) if raw_version is not None else None
    bf16: bool | None = None
    with contextlib.suppress(Exception):
        bf16 = bool(torch.cuda.is_bf16_supported())
    l2 = getattr(props, "L2_cache_size", None)
    warp = getattr(props, "warp_size", None)
    integrated = getattr(props, "is_integrated", None)

    def pci_number(name: str) -> int | None:
        value = getattr(props, name, None)
        return int(value) if isinstance(value, int) else None

    return GpuProperties(
        index=index,
        name=str(props.name),
        major=int(props.major),
        minor=int(props.minor),
        total_memory=int(props.total_memory),
        multi_processor_count=int(props.multi_processor_count),
        gcn_arch_name=str(getattr(props, "gcnArchName", "") or ""),
        warp_size=int(warp) if warp is not None else None,
        l2_cache_bytes=int(l2) if l2 is not None else None,
        cuda_version=torch.version.cuda,
        hip_version=torch.version.hip,
        dnn_version=dnn_version,
        torch_bf16_supported=bf16,
        hsa_override_gfx_version=os.environ.get("HSA_OVERRIDE_GFX_VERSION"),
        is_integrated=bool(integrated) if integrated is not None else None,
        pci_bus_id=format_pci_bus_id(
            pci_number("pci_domain_id"), pci_number("pci_bus_id"), pci_number("pci_device_id")
        ),
    )


def _read_first_line(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    return ""


def nvidia_driver_version() -> str:
    """The NVIDIA driver version through pynvml, else /proc/driver/nvidia/version, else ""."""
    version = ""
    with contextlib.suppress(Exception), capture_output():
        pynvml: Any = importlib.import_module("pynvml")
        pynvml.nvmlInit()
        try:
            raw = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        version = raw.decode() if isinstance(raw, bytes) else str(raw)
    if not version:
        version = parse_nvidia_proc_version(_read_first_line("/proc/driver/nvidia/version"))
    return version


def parse_nvidia_proc_version(text: str) -> str:
    """The driver version from /proc/driver/nvidia/version; both the proprietary ("Kernel Module
    550.54.14") and the open ("Open Kernel Module for x86_64  570.133.07") spellings."""
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else ""


def amd_driver_version() -> str:
    """The amdgpu driver version through amdsmi, else the DKMS module's version file, else ""."""
    version = ""
    with contextlib.suppress(Exception), capture_output():  # amdsmi prints to stdout
        amdsmi: Any = importlib.import_module("amdsmi")
        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            if handles:
                driver = amdsmi.amdsmi_get_gpu_driver_info(handles[0])
                version = str(driver.get("driver_version", ""))
        finally:
            amdsmi.amdsmi_shut_down()
    if not version:
        # Present for the DKMS (ROCm installer) amdgpu; the in-tree kernel driver has none.
        version = _read_first_line("/sys/module/amdgpu/version")
    return version


def describe_device(device: torch.device) -> DeviceInfo:
    """What the record says about ``device``: kind, vendor, name, arch, memory, runtime, driver."""
    if device.type == "cpu":
        return cpu_info()
    if device.type == "cuda":
        props = read_gpu_properties(device)
        kind = gpu_kind(props.hip_version)
        driver = amd_driver_version() if kind == "rocm" else nvidia_driver_version()
        return gpu_info(props, driver=_one_line(driver))
    return DeviceInfo(kind="unknown", name=str(device), torch_device=str(device))


__all__ = [
    "AMD_APU_TARGETS",
    "CpuFacts",
    "GpuProperties",
    "amd_bf16_native",
    "amd_driver_version",
    "available_devices",
    "bf16_native",
    "cpu_bf16_native",
    "cpu_info",
    "describe_device",
    "dnn_label",
    "format_pci_bus_id",
    "gpu_info",
    "gpu_kind",
    "gpu_vendor",
    "is_integrated_gpu",
    "isa_of_interest",
    "nvidia_arch",
    "nvidia_bf16_native",
    "nvidia_driver_version",
    "parse_cpuinfo",
    "parse_gcn_arch",
    "parse_nvidia_proc_version",
    "physical_cores",
    "read_cpu_facts",
    "read_gpu_properties",
    "runtime_label",
    "select_device",
    "total_ram_bytes",
    "usable_cores",
]
