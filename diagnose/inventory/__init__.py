"""The machine inventory (`diagnose env`): what a reader of a ticket needs to know about the box.

OS and kernel, Python, CPU and RAM, the torch build, the versions of the packages a LoRA trainer
leans on and whether each imports, the SDPA backends, the environment variables that change
performance, and whether GPU telemetry (pynvml / amdsmi) can be read. Every string passes
through :mod:`diagnose.redact` before it is stored; the host name is never collected.

Importing some of these packages prints to the terminal (bitsandbytes, xformers, amdsmi), or can
hang or crash the interpreter on a broken build (xformers, flash-attn). Imports run with stdout
and stderr captured at the descriptor level, the text is kept (redacted) in the inventory, and
the two dangerous ones are imported in a child interpreter with a timeout.

One module per concern: :mod:`~diagnose.inventory.packages` (versions and import status),
:mod:`~diagnose.inventory.machine` (OS, Python, CPU), :mod:`~diagnose.inventory.torch_build`
(the torch build, its switches, the SDPA backends), :mod:`~diagnose.inventory.env_vars`
(environment variables), :mod:`~diagnose.inventory.telemetry_check` (whether telemetry can be
read), :mod:`~diagnose.inventory.gpu` (GPU hardware seen without torch), and
:mod:`~diagnose.inventory.printed` (what libraries printed, kept as text). This module assembles
them (:func:`collect_inventory`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from diagnose.device import total_ram_bytes
from diagnose.inventory.env_vars import ENV_NAMES, ENV_PREFIXES, collect_env
from diagnose.inventory.gpu import (
    PCI_VENDORS,
    PCIE_GENERATIONS,
    collect_drivers,
    collect_gpu,
    collect_kfd_nodes,
    collect_pci_display_devices,
    collect_torch_devices,
    cuda_driver_api_version,
    gfx_target_name,
    parse_kfd_properties,
    parse_link_speed,
    pcie_generation,
)
from diagnose.inventory.machine import collect_cpu, collect_os, collect_python, parse_os_release
from diagnose.inventory.packages import (
    ISOLATED_IMPORT_TIMEOUT_S,
    PACKAGE_STATUSES,
    PACKAGES,
    PackageSpec,
    collect_packages,
)
from diagnose.inventory.telemetry_check import collect_telemetry
from diagnose.inventory.torch_build import collect_sdpa, collect_torch
from diagnose.offline import user_environ
from diagnose.redact import redactor_for

#: Bump when a key changes meaning or moves; readers treat missing keys as unknown.
INVENTORY_VERSION = 1


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
    # Before any import below: imported packages set variables of their own. The user's, not
    # the hub's offline switches diagnose's own process runs under.
    environ = user_environ()
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
