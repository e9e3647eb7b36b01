"""GPU hardware, seen without torch: display controllers on the PCI bus and their link, the
kernel drivers and ROCm, AMD's KFD nodes; and the GPUs torch sees.

A CPU-only torch on a machine with a GPU, or a driver that does not load, is the most expensive
mistake there is (a step takes minutes instead of a second); torch itself cannot say that a GPU
is there. The PCI bus, the driver's /proc and /sys files and the KFD topology (AMD) can.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from diagnose.inventory.torch_build import _safe

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
