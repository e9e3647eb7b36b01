"""What telemetry reads: one sample, the device's limits, the statistics of a window, and the
summary that goes into the record (with its JSON round trip)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Seconds between two samples. NVML answers in microseconds except the PCIe throughput counters,
#: which integrate over 20 ms each; amdsmi's metrics table takes about a millisecond.
DEFAULT_INTERVAL_S = 0.25
#: Samples kept in the summary; beyond this, every other sample is dropped (and the interval
#: doubled), so a long run keeps an even coverage in a bounded record.
MAX_SAMPLES = 600


@dataclass
class TelemetrySample:
    """One reading. Every field is optional: a GPU or driver may not report it."""

    #: Seconds since the sampler started.
    t: float = 0.0
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    #: Graphics clock: NVIDIA's SM clock, AMD's GFX clock (MHz).
    gfx_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    #: Percentage of time a kernel was running over the driver's last interval.
    utilization_pct: float | None = None
    #: Reasons the clocks are held back right now (names from :data:`NVML_THROTTLE_REASONS` or
    #: :func:`decode_amd_throttle`); empty when none.
    throttle_reasons: list[str] = field(default_factory=list)
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    #: Processes with a context on the GPU that are not this job's (None: not readable).
    other_processes: int | None = None


@dataclass
class DeviceLimits:
    """What the GPU can do (read once): the maxima the samples are compared with."""

    name: str = ""
    memory_total_bytes: int | None = None
    gfx_clock_max_mhz: float | None = None
    mem_clock_max_mhz: float | None = None
    #: The power limit in force, and the board's default one (a lower limit was set by someone).
    power_limit_w: float | None = None
    power_default_limit_w: float | None = None
    #: Highest PCIe generation and width possible with this GPU in this slot.
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    #: Highest PCIe generation the GPU itself supports (above pcie_gen_max: the slot limits it).
    pcie_gen_max_gpu: int | None = None
    driver_version: str = ""
    #: CUDA version the NVIDIA driver supports ("12.4"); "" on AMD.
    cuda_driver_version: str = ""
    #: How the sampled GPU was matched to the torch device ("pci bus id", "index 0").
    matched_by: str = ""


@dataclass
class TelemetryStats:
    """Summary of the samples. Clocks, power and throttling are taken over the busy samples only
    (utilisation at or above :data:`BUSY_UTILIZATION_PCT`, or all when utilisation is unknown):
    an idle GPU clocks down by design."""

    n: int = 0
    busy_n: int = 0
    duration_s: float = 0.0
    memory_used_max_bytes: int | None = None
    #: Peak memory used / total memory.
    memory_used_max_fraction: float | None = None
    utilization_median_pct: float | None = None
    gfx_clock_median_mhz: float | None = None
    #: Median busy graphics clock / maximum graphics clock.
    gfx_clock_fraction_of_max: float | None = None
    mem_clock_median_mhz: float | None = None
    power_median_w: float | None = None
    power_max_w: float | None = None
    #: Share of busy samples with power at or above AT_LIMIT_FRACTION of the limit.
    power_at_limit_fraction: float | None = None
    temperature_max_c: float | None = None
    #: Reason -> share of busy samples in which it was active.
    throttle_fractions: dict[str, float] = field(default_factory=dict)
    #: Highest generation and width seen: a link trains down when idle, so the maximum over
    #: the run is what the link can do under load.
    pcie_gen_seen_max: int | None = None
    pcie_width_seen_max: int | None = None
    #: Median PCIe traffic over all samples (bytes/s).
    pcie_rx_median_bytes_per_s: float | None = None
    pcie_tx_median_bytes_per_s: float | None = None
    #: The most processes not of this job seen on the GPU at once (None: not readable).
    other_processes_max: int | None = None


@dataclass
class TelemetrySummary:
    """What the sampler saw; ``available=False`` with a ``reason`` when it could see nothing."""

    available: bool = False
    #: "nvml" or "amdsmi"; None when unavailable.
    backend: str | None = None
    reason: str = ""
    interval_s: float = DEFAULT_INTERVAL_S
    limits: DeviceLimits = field(default_factory=DeviceLimits)
    stats: TelemetryStats = field(default_factory=TelemetryStats)
    samples: list[TelemetrySample] = field(default_factory=list)
    #: torch's caching-allocator counters over the sampled window (GPU runs only):
    #: num_alloc_retries, num_ooms, num_device_alloc, num_device_free, num_sync_all_streams.
    allocator: dict[str, int] = field(default_factory=dict)
    #: Fields the library could not read, with the error (read once, then no longer asked).
    unreadable: dict[str, str] = field(default_factory=dict)
    #: What the library printed while being opened (captured, never shown on the terminal).
    printed: str = ""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TelemetrySummary:
        """Rebuild from :meth:`to_dict` output; unknown keys are ignored, missing ones defaulted."""
        summary: TelemetrySummary = _pick(cls, data)
        summary.limits = _pick(DeviceLimits, data.get("limits") or {})
        summary.stats = _pick(TelemetryStats, data.get("stats") or {})
        summary.samples = [
            _pick(TelemetrySample, s) for s in data.get("samples") or [] if isinstance(s, Mapping)
        ]
        return summary


def _pick(cls: Any, data: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    nested = {"limits", "stats", "samples"}
    return cls(**{k: v for k, v in data.items() if k in names and k not in nested})


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def unavailable(reason: str, *, printed: str = "") -> TelemetrySummary:
    return TelemetrySummary(available=False, reason=reason, printed=printed)
