"""The machine around the GPU: OS and kernel, Python, CPU."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

from diagnose.device import isa_of_interest, physical_cores, read_cpu_facts, usable_cores


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
