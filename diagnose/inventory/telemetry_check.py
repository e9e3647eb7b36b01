"""Whether GPU telemetry can be sampled (pynvml or amdsmi) on this machine, and why not."""

from __future__ import annotations

import importlib
from typing import Any

from diagnose.inventory.printed import (
    _exception_text,
    _format_warnings,
    _one_line,
    _recorded_warnings,
    _trim_printed,
)
from diagnose.quiet import capture_output


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
