"""GPU telemetry of a profiled command, sampled by ``diagnose profile`` itself.

The user's processes must not pay for it, and this process must not initialise CUDA (a context
costs memory on the user's GPU): NVML and amdsmi read the driver without one. A rank's first
capture file names its GPU (kind, index, PCI address); from then on this process samples that GPU,
until every rank has written its final facts or the command has ended. Each rank's timed steps
are then cut out of its GPU's samples by wall-clock time, so the environment rules judge the same
steps as the s/it (``inventory.telemetry.during_steps``, as ``diagnose run`` records it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnose.profile.capture_contract import FACTS_SUFFIX, STATUS_RUNNING
from diagnose.record import DeviceInfo
from diagnose.telemetry import TelemetrySampler, TelemetrySummary
from diagnose.telemetry.parsing import format_pci_bus_id
from diagnose.telemetry.readings import unavailable
from diagnose.telemetry.summary import summarize

#: The device kinds whose driver can be read without torch (the others have no telemetry).
GPU_KINDS = ("cuda", "rocm")

SamplerFactory = Callable[[DeviceInfo], TelemetrySampler]


@dataclass(frozen=True)
class DeviceWindow:
    """What one GPU's sampler saw, and when (wall clock) its sample times start."""

    summary: TelemetrySummary
    started_unix: float


def device_key(device: Mapping[str, Any]) -> str | None:
    """``cuda:1`` for a rank's device facts; None for a device without telemetry."""
    kind = device.get("kind")
    index = device.get("index")
    if kind not in GPU_KINDS or not isinstance(index, int):
        return None
    return f"{kind}:{index}"


def _device_info(device: Mapping[str, Any]) -> DeviceInfo:
    extra: dict[str, Any] = {}

    def number(key: str) -> int | None:
        value = device.get(key)
        return value if isinstance(value, int) else None

    bus_id = format_pci_bus_id(
        number("pci_domain_id"), number("pci_bus_id"), number("pci_device_id")
    )
    if bus_id:
        # The surest match: a launcher may set CUDA_VISIBLE_DEVICES for its ranks only.
        extra["pci_bus_id"] = bus_id
    return DeviceInfo(
        kind=str(device["kind"]),
        name=str(device.get("name") or ""),
        torch_device=f"cuda:{device['index']}",
        extra=extra,
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # being written (the first file is not replaced atomically): next poll
    return data if isinstance(data, dict) else None


class CommandTelemetry:
    """Samples the GPUs the command's ranks train on, as the capture files name them.

    Call :meth:`poll` from the launcher's wait loop (the main thread: opening a library captures
    the process's output for a moment) and :meth:`finish` once the command has ended.
    """

    def __init__(self, capture_dir: Path, sampler_factory: SamplerFactory | None = None) -> None:
        self.capture_dir = capture_dir
        self._factory: SamplerFactory = sampler_factory or TelemetrySampler
        self._samplers: dict[str, TelemetrySampler] = {}
        self._final: set[str] = set()
        self._windows: dict[str, DeviceWindow] = {}
        self._stopped = False

    def poll(self) -> None:
        if self._stopped:
            return
        running = 0
        for path in sorted(self.capture_dir.glob(f"rank*{FACTS_SUFFIX}")):
            if path.name in self._final:
                continue
            facts = _read(path)
            if facts is None:
                running += 1
                continue
            self._watch(facts.get("device") or {})
            if facts.get("status") == STATUS_RUNNING:
                running += 1
            else:
                self._final.add(path.name)
        if self._final and not running:
            self._stop()  # every rank's capture is written: the training after it is not ours

    def _watch(self, device: Mapping[str, Any]) -> None:
        key = device_key(device)
        if key is None or key in self._samplers:
            return
        sampler = self._factory(_device_info(device))
        sampler.start()
        self._samplers[key] = sampler

    def _stop(self) -> None:
        self._stopped = True
        for key, sampler in self._samplers.items():
            self._windows[key] = DeviceWindow(sampler.stop(), sampler.started_unix)

    def finish(self) -> dict[str, DeviceWindow]:
        """Stop sampling (if still running) and return each GPU's window, by device key."""
        if not self._stopped:
            self.poll()
            self._stop()
        return dict(self._windows)


def steps_window(window: DeviceWindow, facts: Mapping[str, Any]) -> TelemetrySummary:
    """The telemetry of one rank's timed steps: its GPU's samples between the facts'
    ``timed_started_unix`` and ``timed_ended_unix``."""
    summary = window.summary
    if not summary.available:
        return summary
    start, end = facts.get("timed_started_unix"), facts.get("timed_ended_unix")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return unavailable("the timed steps did not end: no window to read the telemetry in")
    low, high = start - window.started_unix, end - window.started_unix
    samples = [s for s in summary.samples if low <= s.t <= high]
    if not samples:
        return unavailable(
            f"no telemetry sample fell inside the timed steps ({end - start:.2f} s; one every "
            f"{summary.interval_s:g} s)"
        )
    return dataclasses.replace(
        summary,
        samples=samples,
        stats=summarize(samples, summary.limits),
    )


def rank_telemetry(
    facts: Mapping[str, Any], windows: Mapping[str, DeviceWindow]
) -> TelemetrySummary:
    """The telemetry of the timed steps of the rank whose capture facts these are."""
    device = facts.get("device") or {}
    key = device_key(device)
    if key is None:
        kind = device.get("kind") or "unknown"
        return unavailable(f"no GPU telemetry for a {kind} device")
    window = windows.get(key)
    if window is None:
        return unavailable(f"{key} was not sampled (the command ended before it was seen)")
    return steps_window(window, facts)


__all__ = [
    "CommandTelemetry",
    "DeviceWindow",
    "device_key",
    "rank_telemetry",
    "steps_window",
]
