"""The GPU hardware the machine inventory sees without torch: PCI devices, their links and
drivers, and the KFD nodes, read from a constructed /sys and /proc tree (real files, the layout
Linux uses) and from this machine, and the parsers behind them. The rest of the inventory is
``test_inventory.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diagnose.inventory import (
    collect_gpu,
    gfx_target_name,
    parse_kfd_properties,
    parse_link_speed,
    pcie_generation,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _pci_device(root: Path, slot: str, cls: str, vendor: str, device: str, **files: str) -> Path:
    folder = root / "sys" / "bus" / "pci" / "devices" / slot
    for name, text in {"class": cls, "vendor": vendor, "device": device, **files}.items():
        _write(folder / name, text + "\n")
    return folder


def test_gpu_hardware_from_a_sysfs_tree(tmp_path: Path) -> None:
    """A constructed /sys and /proc (real files, the layout Linux uses): an RTX 4090 in an x4
    slot, a desktop Ryzen iGPU, a NIC; KFD nodes for a CPU, a discrete and an integrated GPU."""
    nvidia = _pci_device(
        tmp_path,
        "0000:01:00.0",
        "0x030000",
        "0x10de",
        "0x2684",
        current_link_speed="2.5 GT/s PCIe",
        current_link_width="4",
        max_link_speed="16.0 GT/s PCIe",
        max_link_width="16",
        boot_vga="0",
    )
    (tmp_path / "drivers" / "nvidia").mkdir(parents=True)
    (nvidia / "driver").symlink_to(tmp_path / "drivers" / "nvidia")
    _pci_device(tmp_path, "0000:11:00.0", "0x030000", "0x1002", "0x164e", boot_vga="1")
    _pci_device(tmp_path, "0000:05:00.0", "0x020000", "0x8086", "0x125c")  # Ethernet: not a GPU
    _write(
        tmp_path / "proc" / "driver" / "nvidia" / "version",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.07  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Fri Mar 14 06:46:35 UTC 2025\nGCC version:  gcc 12\n",
    )
    _write(tmp_path / "sys" / "module" / "amdgpu" / "version", "6.12.12\n")
    _write(tmp_path / "opt" / "rocm" / ".info" / "version", "6.4.1-83\n")
    nodes = tmp_path / "sys" / "class" / "kfd" / "kfd" / "topology" / "nodes"
    _write(nodes / "0" / "properties", "cpu_cores_count 16\nsimd_count 0\ngfx_target_version 0\n")
    _write(
        nodes / "1" / "properties",
        "cpu_cores_count 0\nsimd_count 192\ngfx_target_version 110000\nlocation_id 768\ndomain 0\n",
    )
    _write(
        nodes / "2" / "properties",
        "cpu_cores_count 0\nsimd_count 4\ngfx_target_version 100306\nlocation_id 4352\n",
    )
    _write(
        nodes / "10" / "properties",
        "cpu_cores_count 8\nsimd_count 24\ngfx_target_version 110003\nlocation_id 50176\n",
    )

    gpu = collect_gpu(tmp_path, include_torch=False)
    assert [d["slot"] for d in gpu["pci"]] == ["0000:01:00.0", "0000:11:00.0"]
    card = gpu["pci"][0]
    assert (card["vendor"], card["device_id"], card["driver"]) == ("NVIDIA", "0x2684", "nvidia")
    assert card["link"] == {
        "current_gt_s": 2.5,
        "current_gen": 1,
        "current_width": 4,
        "max_gt_s": 16.0,
        "max_gen": 4,
        "max_width": 16,
    }
    assert gpu["pci"][1]["vendor"] == "AMD" and gpu["pci"][1]["boot_vga"] is True
    assert gpu["drivers"] == {
        "nvidia": "570.133.07",
        "amdgpu_loaded": True,
        "amdgpu": "6.12.12",
        "rocm": "6.4.1-83",
    }
    assert gpu["cuda_driver_api"] == ""  # only read for the real root
    assert [
        (n["node"], n["gfx_target"], n["integrated"], n["pci_bus_id"]) for n in gpu["kfd_nodes"]
    ] == [
        (1, "gfx1100", False, "0000:03:00.0"),
        (2, "gfx1036", False, "0000:11:00.0"),
        (10, "gfx1103", True, "0000:c4:00.0"),
    ]
    json.dumps(gpu, allow_nan=False)


def test_gpu_hardware_of_this_machine() -> None:
    gpu = collect_gpu()
    assert set(gpu) == {"pci", "drivers", "cuda_driver_api", "kfd_nodes", "torch_devices"}
    if not torch.cuda.is_available():
        assert gpu["torch_devices"] == []


def test_gpu_hardware_parsers() -> None:
    assert gfx_target_name(90010) == "gfx90a"
    assert gfx_target_name(90402) == "gfx942"
    assert gfx_target_name(100300) == "gfx1030"
    assert gfx_target_name(120001) == "gfx1201"
    assert parse_link_speed("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed("8 GT/s") == 8.0
    assert parse_link_speed("Unknown") is None
    assert [pcie_generation(v) for v in (2.5, 5.0, 8.0, 16.0, 32.0, 64.0, None, 3.0)] == [
        1,
        2,
        3,
        4,
        5,
        6,
        None,
        None,
    ]
    assert parse_kfd_properties("simd_count 4\nname gfx1036\n\n") == {"simd_count": 4}
