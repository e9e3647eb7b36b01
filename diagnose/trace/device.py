"""Which device a trace was captured on: vendor, name, memory, arch, runtime versions, rank.

Evidence, strongest first: the trace's top-level metadata (``roctracer_version`` /
``hip_runtime_version`` mean ROCm, ``cupti_version`` / ``cuda_runtime_version`` mean CUDA), the
runtime API names that were called (``hip*`` vs ``cuda*``/``cu*``), ``deviceProperties`` (name,
``gcnArchName``), and last the kernel names (Tensile ``Cijk_*``, MIOpen, ``nccl``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diagnose.record import DeviceInfo
from diagnose.trace.reader import ParsedTrace


@dataclass
class DeviceSummary:
    """The device plus what the evidence was, and the distributed setup if the trace says."""

    info: DeviceInfo
    #: Why the vendor was decided ("metadata: hip_runtime_version", "runtime calls: hipMalloc").
    evidence: list[str] = field(default_factory=list)
    rank: int | None = None
    world_size: int | None = None
    backend: str = ""
    #: Index (into ParsedTrace.devices) of the device with the most activity, or -1.
    primary_device: int = -1
    #: Other devices with activity (raw ids), when the trace covers several.
    other_devices: list[Any] = field(default_factory=list)


_AMD_NAME_HINTS = ("amd", "radeon", "instinct", "mi300", "mi250", "mi210", "mi100", "gfx")
_NVIDIA_NAME_HINTS = (
    "nvidia",
    "tesla",
    "geforce",
    "quadro",
    "rtx",
    "titan",
    "a100",
    "h100",
    "h200",
    "l40",
    "b200",
)


def detect_device(trace: ParsedTrace) -> DeviceSummary:
    top = trace.top_level
    evidence: list[str] = []
    votes: Counter[str] = Counter()

    for key in ("roctracer_version", "hip_runtime_version", "hip_driver_version"):
        if key in top:
            votes["rocm"] += 10
            evidence.append(f"metadata: {key}")
    for key in ("cupti_version", "cuda_runtime_version", "cuda_driver_version"):
        if key in top:
            votes["cuda"] += 10
            evidence.append(f"metadata: {key}")

    runtime_names = Counter(trace.names[i] for i in np.unique(trace.runtime.name).tolist())
    hip = sorted(n for n in runtime_names if n.startswith("hip"))
    cuda = sorted(n for n in runtime_names if n.startswith("cuda") or _is_driver_api(n))
    if hip:
        votes["rocm"] += 5
        evidence.append(f"runtime calls: {hip[0]}")
    if cuda:
        votes["cuda"] += 5
        evidence.append(f"runtime calls: {cuda[0]}")

    props = _device_properties(top)
    primary, others = _primary_device(trace)
    prop = _matching_properties(props, trace.devices[primary] if primary >= 0 else None)
    name = str(prop.get("name", "")) if prop else ""
    lowered = name.lower()
    if prop and "gcnArchName" in prop:
        votes["rocm"] += 5
        evidence.append("deviceProperties: gcnArchName")
    if any(h in lowered for h in _AMD_NAME_HINTS):
        votes["rocm"] += 3
        evidence.append(f"device name: {name}")
    elif any(h in lowered for h in _NVIDIA_NAME_HINTS):
        votes["cuda"] += 3
        evidence.append(f"device name: {name}")

    has_device_work = len(trace.device) > 0
    if not votes and has_device_work:
        kernel_names = [trace.names[i] for i in np.unique(trace.device.name).tolist()]
        if any(k.startswith(("Cijk_", "MIOpen", "miopen")) or "rccl" in k for k in kernel_names):
            votes["rocm"] += 1
            evidence.append("kernel names (Tensile/MIOpen/RCCL)")
        elif any(
            k.startswith(("volta_", "ampere_", "sm80_", "sm90_", "turing_")) for k in kernel_names
        ):
            votes["cuda"] += 1
            evidence.append("kernel names (cuBLAS/cuDNN)")

    if votes:
        kind = votes.most_common(1)[0][0]
    elif has_device_work or props:
        kind = "unknown"
    else:
        kind = "cpu"
        evidence.append("no device activity, runtime calls or device properties")

    info = DeviceInfo(kind=kind)
    if kind == "rocm":
        info.vendor = "AMD"
    elif kind == "cuda":
        info.vendor = "NVIDIA"
    if kind == "cpu":
        info.name = "CPU"
        info.torch_device = "cpu"
    else:
        info.name = name or ("unknown GPU" if kind == "unknown" else f"unknown {info.vendor} GPU")
        index = prop.get("id", 0) if prop else 0
        info.torch_device = f"cuda:{index}" if isinstance(index, int) else "cuda"
    if prop:
        info.arch = _arch(prop, kind)
        memory = prop.get("totalGlobalMem")
        if isinstance(memory, int) and memory > 0:
            info.memory_bytes = memory
        for src, dst in (("numSms", "multiprocessors"), ("warpSize", "warp_size")):
            if isinstance(prop.get(src), int):
                info.extra[dst] = prop[src]
    info.runtime = _runtime_version(top, kind)
    info.driver = _driver_version(top, kind)
    info.extra["detected_from"] = evidence
    if len(props) > 1:
        info.extra["gpus_in_device_properties"] = [str(p.get("name", "?")) for p in props]

    summary = DeviceSummary(info=info, evidence=evidence, primary_device=primary)
    summary.other_devices = [trace.devices[i] for i in others]
    dist = top.get("distributedInfo")
    if isinstance(dist, dict):
        rank, world = dist.get("rank"), dist.get("world_size")
        summary.rank = rank if isinstance(rank, int) else None
        summary.world_size = world if isinstance(world, int) else None
        summary.backend = str(dist.get("backend", "")) if dist.get("backend") else ""
        if summary.rank is not None:
            info.extra["rank"] = summary.rank
        if summary.world_size is not None:
            info.extra["world_size"] = summary.world_size
        if summary.backend:
            info.extra["distributed_backend"] = summary.backend
    return summary


def _is_driver_api(name: str) -> bool:
    """CUDA driver API names: cuLaunchKernel, cuMemcpyAsync... ("cu" + a capital letter)."""
    return name.startswith("cu") and name[2:3].isupper()


def _device_properties(top: dict[str, Any]) -> list[dict[str, Any]]:
    props = top.get("deviceProperties")
    if not isinstance(props, list):
        return []
    return [p for p in props if isinstance(p, dict)]


def _primary_device(trace: ParsedTrace) -> tuple[int, list[int]]:
    """The device index with the most busy time, and the other active ones."""
    if not len(trace.device):
        return -1, []
    busy = np.bincount(trace.device.device, weights=trace.device.dur, minlength=len(trace.devices))
    order = [int(i) for i in np.argsort(-busy) if busy[i] > 0 or len(trace.devices) == 1]
    if not order:
        return int(np.argmax(busy)), []
    return order[0], order[1:]


def _matching_properties(props: list[dict[str, Any]], raw_device: Any) -> dict[str, Any]:
    if not props:
        return {}
    if len(props) == 1:
        return props[0]
    for prop in props:
        if prop.get("id") == raw_device:
            return prop
    # ROCm numbers devices after the CPU agents (device 2 is GPU 0 on a 2-socket host): when ids
    # do not match, the first listed GPU is the best guess.
    return props[0]


def _arch(prop: dict[str, Any], kind: str) -> str:
    gcn = prop.get("gcnArchName")
    if isinstance(gcn, str) and gcn:
        return gcn.split(":")[0]
    major, minor = prop.get("computeMajor"), prop.get("computeMinor")
    if not (isinstance(major, int) and isinstance(minor, int)):
        return ""
    if kind == "rocm":
        # HIP reports e.g. 9.4 for gfx942 and 9.0 for gfx90a: the exact target is not recoverable.
        return f"HIP compute {major}.{minor}"
    return f"sm_{major}{minor}"


def _runtime_version(top: dict[str, Any], kind: str) -> str:
    if kind == "rocm" and isinstance(top.get("hip_runtime_version"), int):
        return f"HIP {_hip_version(top['hip_runtime_version'])}"
    if kind == "cuda" and isinstance(top.get("cuda_runtime_version"), int):
        return f"CUDA {_cuda_version(top['cuda_runtime_version'])}"
    return ""


def _driver_version(top: dict[str, Any], kind: str) -> str:
    if kind == "rocm" and isinstance(top.get("hip_driver_version"), int):
        return f"HIP {_hip_version(top['hip_driver_version'])}"
    if kind == "cuda" and isinstance(top.get("cuda_driver_version"), int):
        return f"CUDA {_cuda_version(top['cuda_driver_version'])}"
    return ""


def _hip_version(value: int) -> str:
    # HIP_VERSION = major * 10_000_000 + minor * 100_000 + patch
    return f"{value // 10_000_000}.{(value // 100_000) % 100}.{value % 100_000}"


def _cuda_version(value: int) -> str:
    # CUDA_VERSION = major * 1000 + minor * 10
    return f"{value // 1000}.{(value % 1000) // 10}"
