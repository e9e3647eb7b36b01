"""GPU telemetry sampled in a background thread while the timed steps run.

What the driver says about the GPU under load: memory used against the total, graphics (SM/GFX)
and memory clocks against their maxima, power against its limit, temperature, the reasons the
clocks are held back (throttling), GPU utilisation, and the PCIe link generation and width
against what the GPU and the slot can do. NVIDIA GPUs are read through NVML (``pynvml``, from
the ``nvidia-ml-py`` package), AMD GPUs through ``amdsmi`` (shipped with ROCm).

Each backend is split in two, so that the logic is tested without hardware: a thin reader that
only copies raw values out of the library into a plain dict (``read_raw``/``read_static``), and
pure functions (:func:`nvml_sample`, :func:`amdsmi_sample`, :func:`nvml_limits`,
:func:`amdsmi_limits`, :func:`summarize`) that turn those dicts into dataclasses. The tests feed
the pure functions recorded raw dicts (``fixtures/telemetry/``).

Both libraries fail in their own ways on a machine without the driver: pynvml raises
``NVMLError_LibraryNotFound`` from ``nvmlInit``; ``import amdsmi`` raises ``KeyError`` and prints
to stdout. Opening a backend therefore runs with stdout/stderr captured at the descriptor level and
every exception caught; the summary then says ``available=False`` and why.

Usage (the sampler never raises)::

    sampler = TelemetrySampler(device_info)
    sampler.start()
    ...  # the timed steps
    summary = sampler.stop()  # TelemetrySummary; summary.to_dict() goes into the record
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from diagnose.quiet import capture_output
from diagnose.record import DeviceInfo

#: Seconds between two samples. NVML answers in microseconds except the PCIe throughput counters,
#: which integrate over 20 ms each; amdsmi's metrics table takes about a millisecond.
DEFAULT_INTERVAL_S = 0.25
#: Samples kept in the summary; beyond this, every other sample is dropped (and the interval
#: doubled), so a long run keeps an even coverage in a bounded record.
MAX_SAMPLES = 600
#: A sample counts as "busy" (the GPU was working) at or above this utilisation.
BUSY_UTILIZATION_PCT = 50.0
#: Power at or above this fraction of the limit counts as "at the limit".
AT_LIMIT_FRACTION = 0.95

# --- data -----------------------------------------------------------------------------------------


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


# --- pure parsing: NVML ---------------------------------------------------------------------------

#: NVML's clocks event (throttle) reason bits (nvml.h, nvmlClocksEventReason*).
NVML_THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_nvml_throttle(mask: int | None) -> list[str]:
    """Names of the reason bits set in an NVML clocks event reasons mask."""
    if not mask:
        return []
    return [name for bit, name in NVML_THROTTLE_REASONS.items() if mask & bit]


def _number(value: Any) -> float | None:
    """A finite number out of a library value ("N/A", None, "42 W" -> 42.0)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, Mapping):  # amd-smi's {"value": 42, "unit": "%"}
        return _number(value.get("value"))
    if isinstance(value, str):
        try:
            value = float(value.strip().split()[0])
        except (ValueError, IndexError):
            return None
    if not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


#: "Not available" markers in amdgpu's gpu_metrics (all bits set in a 16/32/64-bit field).
_AMD_SENTINELS = frozenset({float(0xFFFF), float(0xFFFFFFFF), float(2**64 - 1)})


def _amd_number(value: Any) -> float | None:
    number = _number(value)
    return None if number is None or number in _AMD_SENTINELS else number


def _amd_int(value: Any) -> int | None:
    number = _amd_number(value)
    return None if number is None else int(number)


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def nvml_sample(raw: Mapping[str, Any], t: float = 0.0) -> TelemetrySample:
    """A sample from raw NVML values (the dict :class:`NvmlBackend` reads; units as NVML's)."""
    memory = raw.get("memory") or {}
    utilization = raw.get("utilization") or {}
    power_mw = _number(raw.get("power_mw"))
    rx_kb = _number(raw.get("pcie_rx_kb_s"))
    tx_kb = _number(raw.get("pcie_tx_kb_s"))
    return TelemetrySample(
        t=t,
        memory_used_bytes=_int(memory.get("used")),
        memory_total_bytes=_int(memory.get("total")),
        gfx_clock_mhz=_number(raw.get("clock_sm_mhz")),
        mem_clock_mhz=_number(raw.get("clock_mem_mhz")),
        power_w=None if power_mw is None else power_mw / 1000.0,
        temperature_c=_number(raw.get("temperature_c")),
        utilization_pct=_number(utilization.get("gpu")),
        throttle_reasons=decode_nvml_throttle(_int(raw.get("clocks_event_reasons"))),
        pcie_gen=_int(raw.get("pcie_gen")),
        pcie_width=_int(raw.get("pcie_width")),
        # NVML reports KB/s (1024 bytes).
        pcie_rx_bytes_per_s=None if rx_kb is None else rx_kb * 1024.0,
        pcie_tx_bytes_per_s=None if tx_kb is None else tx_kb * 1024.0,
    )


def _cuda_version_text(version: int | None) -> str:
    """12040 -> "12.4" (NVML and cuDriverGetVersion encode major*1000 + minor*10)."""
    if not version:
        return ""
    major, minor = divmod(int(version), 1000)
    return f"{major}.{minor // 10}"


def nvml_limits(raw: Mapping[str, Any]) -> DeviceLimits:
    """The GPU's maxima from raw NVML values read once (see :meth:`NvmlBackend.read_static`)."""
    limit_mw = _number(raw.get("power_limit_mw"))
    default_mw = _number(raw.get("power_default_limit_mw"))
    name = raw.get("name") or ""
    driver = raw.get("driver_version") or ""
    return DeviceLimits(
        name=name.decode() if isinstance(name, bytes) else str(name),
        memory_total_bytes=_int(raw.get("memory_total")),
        gfx_clock_max_mhz=_number(raw.get("max_clock_sm_mhz")),
        mem_clock_max_mhz=_number(raw.get("max_clock_mem_mhz")),
        power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
        power_default_limit_w=None if default_mw is None else default_mw / 1000.0,
        pcie_gen_max=_int(raw.get("pcie_gen_max")),
        pcie_width_max=_int(raw.get("pcie_width_max")),
        pcie_gen_max_gpu=_int(raw.get("pcie_gen_max_gpu")),
        driver_version=driver.decode() if isinstance(driver, bytes) else str(driver),
        cuda_driver_version=_cuda_version_text(_int(raw.get("cuda_driver_version"))),
        matched_by=str(raw.get("matched_by") or ""),
    )


# --- pure parsing: amdsmi -------------------------------------------------------------------------

#: Categories of the ASIC-independent throttler bits of amdgpu's gpu_metrics
#: (``indep_throttle_status``; linux drivers/gpu/drm/amd/pm/swsmu/inc/amdgpu_smu.h): power limits
#: in bits 0-15 (PPT0-3, SPL, FPPT, SPPT), current limits in 16-31 (TDC, EDC, APCC), temperature
#: in 32-47 (GPU, core, memory, edge, hotspot, VR, liquid, VRHOT, PROCHOT), others (PPM, FIT) above.
_AMD_THROTTLER_NAMES: dict[int, str] = {
    0: "ppt0",
    1: "ppt1",
    2: "ppt2",
    3: "ppt3",
    4: "spl",
    5: "fppt",
    6: "sppt",
    7: "sppt_apu",
    16: "tdc_gfx",
    17: "tdc_soc",
    18: "tdc_mem",
    19: "tdc_vdd",
    20: "tdc_cvip",
    21: "edc_cpu",
    22: "edc_gfx",
    23: "apcc",
    32: "temp_gpu",
    33: "temp_core",
    34: "temp_mem",
    35: "temp_edge",
    36: "temp_hotspot",
    37: "temp_soc",
    38: "temp_vr_gfx",
    39: "temp_vr_soc",
    40: "temp_vr_mem0",
    41: "temp_vr_mem1",
    42: "temp_liquid0",
    43: "temp_liquid1",
    44: "vrhot0",
    45: "vrhot1",
    46: "prochot_cpu",
    47: "prochot_gfx",
    56: "ppm",
    57: "fit",
}


def amd_throttle_category(bit: int) -> str:
    """The category of a bit of ``indep_throttle_status``: power, current, thermal or other."""
    if bit < 16:
        return "power"
    if bit < 32:
        return "current"
    if bit < 48:
        return "thermal"
    return "other"


def decode_amd_throttle(indep_throttle_status: int | None) -> list[str]:
    """Reasons from amdgpu's ASIC-independent throttle mask, named "<category>:<throttler>"
    ("power:ppt0", "thermal:temp_hotspot") so the rules can judge by category."""
    if not indep_throttle_status:
        return []
    reasons = []
    for bit in range(64):
        if indep_throttle_status >> bit & 1:
            name = _AMD_THROTTLER_NAMES.get(bit, f"bit{bit}")
            reasons.append(f"{amd_throttle_category(bit)}:{name}")
    return reasons


def _first_number(mapping: Mapping[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` that holds a number: amdsmi renamed fields between releases."""
    for key in keys:
        number = _amd_number(mapping.get(key))
        if number is not None:
            return number
    return None


def _watts(value: float | None) -> float | None:
    """amdsmi reported power in W before ROCm 7 and in µW since for some fields."""
    if value is None:
        return None
    return value / 1e6 if value > 100_000 else value


def pcie_speed_to_gen(speed: float | None) -> int | None:
    """PCIe generation from amdsmi's link speed: MT/s (16000) or GT/s (16), per its release."""
    if speed is None or speed <= 0:
        return None
    gt_s = speed / 1000.0 if speed > 100 else speed
    for rate, generation in ((2.5, 1), (5.0, 2), (8.0, 3), (16.0, 4), (32.0, 5), (64.0, 6)):
        if abs(gt_s - rate) < 0.3:
            return generation
    return None


def amdsmi_sample(raw: Mapping[str, Any], t: float = 0.0) -> TelemetrySample:
    """A sample from raw amdsmi values (the dict :class:`AmdSmiBackend` reads).

    Accepts the field names of amdsmi 6.x and 7.x: the current clock is ``clk`` (``cur_clk``
    before), socket power ``socket_power`` (``current_socket_power``/``average_socket_power``
    before); unsupported fields read "N/A".
    """
    vram = raw.get("vram_usage") or {}
    gfx = raw.get("clock_gfx") or {}
    mem = raw.get("clock_mem") or {}
    power = raw.get("power") or {}
    activity = raw.get("activity") or {}
    metrics = raw.get("metrics") or {}
    pcie_metric = (raw.get("pcie") or {}).get("pcie_metric") or {}
    used_mb = _amd_number(vram.get("vram_used"))
    total_mb = _amd_number(vram.get("vram_total"))
    temperature = _amd_number(raw.get("temperature_hotspot"))
    if temperature is None:
        temperature = _amd_number(raw.get("temperature_edge"))
    bandwidth_mbit = _amd_number(pcie_metric.get("pcie_bandwidth"))
    return TelemetrySample(
        t=t,
        memory_used_bytes=None if used_mb is None else int(used_mb * 1024 * 1024),
        memory_total_bytes=None if total_mb is None else int(total_mb * 1024 * 1024),
        gfx_clock_mhz=_first_number(gfx, "clk", "cur_clk"),
        mem_clock_mhz=_first_number(mem, "clk", "cur_clk"),
        power_w=_watts(
            _first_number(power, "socket_power", "current_socket_power", "average_socket_power")
        ),
        temperature_c=temperature,
        utilization_pct=_first_number(activity, "gfx_activity"),
        throttle_reasons=decode_amd_throttle(_amd_int(metrics.get("indep_throttle_status"))),
        pcie_gen=pcie_speed_to_gen(_amd_number(pcie_metric.get("pcie_speed"))),
        pcie_width=_amd_int(pcie_metric.get("pcie_width")),
        # amdsmi reports one instantaneous bandwidth (Mb/s), not rx/tx: kept as rx.
        pcie_rx_bytes_per_s=None if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8,
    )


def amdsmi_limits(raw: Mapping[str, Any]) -> DeviceLimits:
    """The GPU's maxima from raw amdsmi values read once (see :meth:`AmdSmiBackend.read_static`)."""
    gfx = raw.get("clock_gfx") or {}
    mem = raw.get("clock_mem") or {}
    power = raw.get("power") or {}
    power_cap = raw.get("power_cap") or {}
    vram = raw.get("vram_usage") or {}
    pcie_static = (raw.get("pcie") or {}).get("pcie_static") or {}
    total_mb = _amd_number(vram.get("vram_total"))
    gen_max = _amd_int(pcie_static.get("max_pcie_interface_version"))
    if gen_max is None:
        gen_max = pcie_speed_to_gen(_amd_number(pcie_static.get("max_pcie_speed")))
    asic = raw.get("asic") or {}
    driver = raw.get("driver") or {}
    return DeviceLimits(
        name=str(asic.get("market_name") or ""),
        memory_total_bytes=None if total_mb is None else int(total_mb * 1024 * 1024),
        gfx_clock_max_mhz=_first_number(gfx, "max_clk"),
        mem_clock_max_mhz=_first_number(mem, "max_clk"),
        power_limit_w=_watts(
            _first_number(power_cap, "power_cap") or _first_number(power, "power_limit")
        ),
        power_default_limit_w=_watts(_first_number(power_cap, "default_power_cap")),
        pcie_gen_max=gen_max,
        pcie_width_max=_amd_int(pcie_static.get("max_pcie_width")),
        driver_version=str(driver.get("driver_version") or ""),
        matched_by=str(raw.get("matched_by") or ""),
    )


# --- pure: summary --------------------------------------------------------------------------------


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize(samples: Sequence[TelemetrySample], limits: DeviceLimits) -> TelemetryStats:
    """Statistics over the samples, compared with the limits (pure)."""
    stats = TelemetryStats(n=len(samples))
    if not samples:
        return stats
    stats.duration_s = max(s.t for s in samples) - min(s.t for s in samples)
    busy = [
        s for s in samples if s.utilization_pct is None or s.utilization_pct >= BUSY_UTILIZATION_PCT
    ]
    stats.busy_n = len(busy)
    stats.utilization_median_pct = _median(s.utilization_pct for s in samples)

    used = _max(s.memory_used_bytes for s in samples)
    stats.memory_used_max_bytes = None if used is None else int(used)
    total = limits.memory_total_bytes or _max(s.memory_total_bytes for s in samples)
    if used is not None and total:
        stats.memory_used_max_fraction = used / total

    stats.gfx_clock_median_mhz = _median(s.gfx_clock_mhz for s in busy)
    if stats.gfx_clock_median_mhz is not None and limits.gfx_clock_max_mhz:
        stats.gfx_clock_fraction_of_max = stats.gfx_clock_median_mhz / limits.gfx_clock_max_mhz
    stats.mem_clock_median_mhz = _median(s.mem_clock_mhz for s in busy)
    stats.power_median_w = _median(s.power_w for s in busy)
    stats.power_max_w = _max(s.power_w for s in samples)
    powered = [s.power_w for s in busy if s.power_w is not None]
    if powered and limits.power_limit_w:
        at_limit = sum(1 for p in powered if p >= AT_LIMIT_FRACTION * limits.power_limit_w)
        stats.power_at_limit_fraction = at_limit / len(powered)
    stats.temperature_max_c = _max(s.temperature_c for s in samples)
    if busy:
        counts: dict[str, int] = {}
        for sample in busy:
            for reason in sample.throttle_reasons:
                counts[reason] = counts.get(reason, 0) + 1
        stats.throttle_fractions = {
            reason: count / len(busy) for reason, count in sorted(counts.items())
        }
    gen = _max(s.pcie_gen for s in samples)
    width = _max(s.pcie_width for s in samples)
    stats.pcie_gen_seen_max = None if gen is None else int(gen)
    stats.pcie_width_seen_max = None if width is None else int(width)
    # Over all samples: a GPU that waits on the bus (spilling) is not "busy", yet its traffic
    # is the point.
    stats.pcie_rx_median_bytes_per_s = _median(s.pcie_rx_bytes_per_s for s in samples)
    stats.pcie_tx_median_bytes_per_s = _median(s.pcie_tx_bytes_per_s for s in samples)
    return stats


#: Pure parsers per backend: (limits from static values, sample from raw values).
PARSERS: dict[
    str, tuple[Callable[[Mapping[str, Any]], DeviceLimits], Callable[..., TelemetrySample]]
] = {
    "nvml": (nvml_limits, nvml_sample),
    "amdsmi": (amdsmi_limits, amdsmi_sample),
}


def summary_from_raw(
    backend: str,
    static: Mapping[str, Any],
    samples: Iterable[tuple[float, Mapping[str, Any]]],
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    allocator: Mapping[str, int] | None = None,
) -> TelemetrySummary:
    """The summary a sampler would have produced from these raw library values (replays a
    recording: the tests' fixtures, or values a user pasted)."""
    parse_limits, parse_sample = PARSERS[backend]
    limits = parse_limits(static)
    parsed = [parse_sample(raw, t) for t, raw in samples]
    return TelemetrySummary(
        available=True,
        backend=backend,
        interval_s=interval_s,
        limits=limits,
        stats=summarize(parsed, limits),
        samples=parsed,
        allocator=dict(allocator or {}),
    )


def decimate(
    samples: list[TelemetrySample], max_samples: int = MAX_SAMPLES
) -> list[TelemetrySample]:
    """Every other sample while there are more than ``max_samples`` (keeps the last one)."""
    while len(samples) > max_samples:
        last = samples[-1]
        samples = samples[::2]
        if samples[-1] is not last:
            samples.append(last)
    return samples


# --- backends (thin: copy values out of the libraries) --------------------------------------------


class TelemetryBackend(Protocol):
    name: str
    #: Field -> error text for values the library could not read.
    unreadable: dict[str, str]

    def limits(self) -> DeviceLimits: ...

    def sample(self, t: float) -> TelemetrySample: ...

    def close(self) -> None: ...


def _exception_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Reader:
    """Calls library getters; a getter that fails once is recorded and not called again."""

    def __init__(self) -> None:
        self.unreadable: dict[str, str] = {}

    def get(self, key: str, getter: Callable[[], Any]) -> Any:
        if key in self.unreadable:
            return None
        try:
            return getter()
        except Exception as exc:
            self.unreadable[key] = _exception_text(exc)
            return None


def _visible_index(index: int, variable: str) -> int:
    """The physical index of visible device ``index`` when ``variable`` lists plain numbers."""
    listed = [p.strip() for p in os.environ.get(variable, "").split(",") if p.strip()]
    if listed and all(p.isdigit() for p in listed) and index < len(listed):
        return int(listed[index])
    return index


def _torch_index(info: DeviceInfo) -> int:
    _, _, index = info.torch_device.partition(":")
    return int(index) if index.isdigit() else 0


class NvmlBackend:
    """NVML through pynvml (package nvidia-ml-py)."""

    name = "nvml"

    def __init__(self, pynvml: Any, handle: Any, matched_by: str) -> None:
        self.nvml = pynvml
        self.handle = handle
        self.matched_by = matched_by
        self.reader = _Reader()
        self.unreadable = self.reader.unreadable

    @classmethod
    def open(cls, info: DeviceInfo) -> NvmlBackend:
        pynvml: Any = importlib.import_module("pynvml")
        pynvml.nvmlInit()
        try:
            handle, matched_by = None, ""
            bus_id = info.extra.get("pci_bus_id")
            if bus_id:
                with contextlib.suppress(Exception):
                    handle, matched_by = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id), "pci bus id"
            if handle is None:
                index = _visible_index(_torch_index(info), "CUDA_VISIBLE_DEVICES")
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                matched_by = f"index {index}"
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        return cls(pynvml, handle, matched_by)

    def read_static(self) -> dict[str, Any]:
        n, h, get = self.nvml, self.handle, self.reader.get
        memory = get("memory", lambda: n.nvmlDeviceGetMemoryInfo(h))
        return {
            "name": get("name", lambda: n.nvmlDeviceGetName(h)),
            "memory_total": getattr(memory, "total", None),
            "max_clock_sm_mhz": get("max_clock_sm", lambda: n.nvmlDeviceGetMaxClockInfo(h, 1)),
            "max_clock_mem_mhz": get("max_clock_mem", lambda: n.nvmlDeviceGetMaxClockInfo(h, 2)),
            "power_limit_mw": get("power_limit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h)),
            "power_default_limit_mw": get(
                "power_default_limit", lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(h)
            ),
            "pcie_gen_max": get("pcie_gen_max", lambda: n.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            "pcie_width_max": get("pcie_width_max", lambda: n.nvmlDeviceGetMaxPcieLinkWidth(h)),
            "pcie_gen_max_gpu": get(
                "pcie_gen_max_gpu", lambda: n.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)
            ),
            "driver_version": get("driver_version", n.nvmlSystemGetDriverVersion),
            "cuda_driver_version": get("cuda_driver_version", n.nvmlSystemGetCudaDriverVersion),
            "matched_by": self.matched_by,
        }

    def read_raw(self) -> dict[str, Any]:
        n, h, get = self.nvml, self.handle, self.reader.get
        memory = get("memory", lambda: n.nvmlDeviceGetMemoryInfo(h))
        utilization = get("utilization", lambda: n.nvmlDeviceGetUtilizationRates(h))

        def reasons() -> Any:
            # nvmlDeviceGetCurrentClocksEventReasons replaced ...ThrottleReasons (driver 535+).
            getter = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
            try:
                return (getter or n.nvmlDeviceGetCurrentClocksThrottleReasons)(h)
            except Exception:
                if getter is None:
                    raise
                return n.nvmlDeviceGetCurrentClocksThrottleReasons(h)

        return {
            "memory": None
            if memory is None
            else {"used": getattr(memory, "used", None), "total": getattr(memory, "total", None)},
            "clock_sm_mhz": get("clock_sm", lambda: n.nvmlDeviceGetClockInfo(h, 1)),
            "clock_mem_mhz": get("clock_mem", lambda: n.nvmlDeviceGetClockInfo(h, 2)),
            "power_mw": get("power", lambda: n.nvmlDeviceGetPowerUsage(h)),
            "temperature_c": get("temperature", lambda: n.nvmlDeviceGetTemperature(h, 0)),
            "utilization": None
            if utilization is None
            else {
                "gpu": getattr(utilization, "gpu", None),
                "memory": getattr(utilization, "memory", None),
            },
            "clocks_event_reasons": get("clocks_event_reasons", reasons),
            "pcie_gen": get("pcie_gen", lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            "pcie_width": get("pcie_width", lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h)),
            # Each PCIe throughput counter integrates over 20 ms: fine in a background thread.
            "pcie_tx_kb_s": get("pcie_tx", lambda: n.nvmlDeviceGetPcieThroughput(h, 0)),
            "pcie_rx_kb_s": get("pcie_rx", lambda: n.nvmlDeviceGetPcieThroughput(h, 1)),
        }

    def limits(self) -> DeviceLimits:
        return nvml_limits(self.read_static())

    def sample(self, t: float) -> TelemetrySample:
        return nvml_sample(self.read_raw(), t)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


class AmdSmiBackend:
    """amdsmi (ROCm's AMD SMI Python bindings)."""

    name = "amdsmi"

    def __init__(self, amdsmi: Any, handle: Any, matched_by: str) -> None:
        self.smi = amdsmi
        self.handle = handle
        self.matched_by = matched_by
        self.reader = _Reader()
        self.unreadable = self.reader.unreadable

    @classmethod
    def open(cls, info: DeviceInfo) -> AmdSmiBackend:
        amdsmi: Any = importlib.import_module("amdsmi")
        flags = getattr(amdsmi, "AmdSmiInitFlags", None)
        # The enum member was AMD_GPUS in ROCm 5.x/6.0 and INIT_AMD_GPUS later.
        flag = getattr(flags, "INIT_AMD_GPUS", None) or getattr(flags, "AMD_GPUS", None)
        if flag is None:
            amdsmi.amdsmi_init()
        else:
            amdsmi.amdsmi_init(flag)
        try:
            handles = list(amdsmi.amdsmi_get_processor_handles())
            if not handles:
                raise RuntimeError("amdsmi sees no AMD GPU")
            handle, matched_by = None, ""
            bus_id = str(info.extra.get("pci_bus_id") or "").lower()
            if bus_id:
                for candidate in handles:
                    with contextlib.suppress(Exception):
                        if str(amdsmi.amdsmi_get_gpu_device_bdf(candidate)).lower() == bus_id:
                            handle, matched_by = candidate, "pci bus id"
                            break
            if handle is None:
                index = _visible_index(_torch_index(info), "HIP_VISIBLE_DEVICES")
                index = _visible_index(index, "ROCR_VISIBLE_DEVICES")
                handle, matched_by = handles[min(index, len(handles) - 1)], f"index {index}"
        except BaseException:
            with contextlib.suppress(Exception):
                amdsmi.amdsmi_shut_down()
            raise
        return cls(amdsmi, handle, matched_by)

    def _clock_type(self, name: str) -> Any:
        return getattr(self.smi.AmdSmiClkType, name)

    def read_static(self) -> dict[str, Any]:
        s, h, get = self.smi, self.handle, self.reader.get
        return {
            "asic": get("asic", lambda: s.amdsmi_get_gpu_asic_info(h)),
            "driver": get("driver", lambda: s.amdsmi_get_gpu_driver_info(h)),
            "vram_usage": get("vram_usage", lambda: s.amdsmi_get_gpu_vram_usage(h)),
            "clock_gfx": get(
                "clock_gfx", lambda: s.amdsmi_get_clock_info(h, self._clock_type("GFX"))
            ),
            "clock_mem": get(
                "clock_mem", lambda: s.amdsmi_get_clock_info(h, self._clock_type("MEM"))
            ),
            "power": get("power", lambda: s.amdsmi_get_power_info(h)),
            "power_cap": get("power_cap", lambda: s.amdsmi_get_power_cap_info(h)),
            "pcie": get("pcie", lambda: s.amdsmi_get_pcie_info(h)),
            "matched_by": self.matched_by,
        }

    def read_raw(self) -> dict[str, Any]:
        s, h, get = self.smi, self.handle, self.reader.get

        def temperature(sensor: str) -> Any:
            kind = getattr(s.AmdSmiTemperatureType, sensor)
            return s.amdsmi_get_temp_metric(h, kind, s.AmdSmiTemperatureMetric.CURRENT)

        return {
            "vram_usage": get("vram_usage", lambda: s.amdsmi_get_gpu_vram_usage(h)),
            "clock_gfx": get(
                "clock_gfx", lambda: s.amdsmi_get_clock_info(h, self._clock_type("GFX"))
            ),
            "clock_mem": get(
                "clock_mem", lambda: s.amdsmi_get_clock_info(h, self._clock_type("MEM"))
            ),
            "power": get("power", lambda: s.amdsmi_get_power_info(h)),
            # HOTSPOT (junction) was called JUNCTION in older releases.
            "temperature_hotspot": get(
                "temperature_hotspot",
                lambda: temperature(
                    "HOTSPOT" if hasattr(s.AmdSmiTemperatureType, "HOTSPOT") else "JUNCTION"
                ),
            ),
            "temperature_edge": get("temperature_edge", lambda: temperature("EDGE")),
            "activity": get("activity", lambda: s.amdsmi_get_gpu_activity(h)),
            "metrics": get("metrics", lambda: s.amdsmi_get_gpu_metrics_info(h)),
            "pcie": get("pcie", lambda: s.amdsmi_get_pcie_info(h)),
        }

    def limits(self) -> DeviceLimits:
        return amdsmi_limits(self.read_static())

    def sample(self, t: float) -> TelemetrySample:
        return amdsmi_sample(self.read_raw(), t)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.smi.amdsmi_shut_down()


BackendOpener = Callable[[DeviceInfo], TelemetryBackend]

#: Which backend reads which device kind.
BACKENDS: dict[str, tuple[str, BackendOpener]] = {
    "cuda": ("nvml", NvmlBackend.open),
    "rocm": ("amdsmi", AmdSmiBackend.open),
}


def open_backend(
    info: DeviceInfo, opener: BackendOpener | None = None
) -> tuple[TelemetryBackend | None, str, str]:
    """(backend, reason it is not there, what the library printed while opening).

    Never raises and never lets the library print: amdsmi prints to stdout and raises KeyError
    on import without the amdgpu driver; pynvml raises NVMLError_LibraryNotFound on init.
    """
    if opener is None:
        entry = BACKENDS.get(info.kind)
        if entry is None:
            return None, f"no GPU telemetry for a {info.kind or 'unknown'} device", ""
        library, opener = entry
    else:
        library = "telemetry"
    backend: TelemetryBackend | None = None
    reason = ""
    with capture_output() as captured:
        try:
            backend = opener(info)
        except ImportError as exc:
            hint = (
                "pip install nvidia-ml-py"
                if library == "nvml"
                else "pip install /opt/rocm/share/amd_smi"
            )
            reason = f"{library}: {_exception_text(exc)} ({hint})"
        except (Exception, SystemExit) as exc:
            reason = f"{library}: {_exception_text(exc)}"
    return backend, reason, captured.text.strip()


# --- the sampler ----------------------------------------------------------------------------------

_ALLOCATOR_KEYS = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
)


def _allocator_counters(info: DeviceInfo) -> dict[str, int] | None:
    """torch's caching-allocator counters for the device, or None off the GPU."""
    if info.kind not in ("cuda", "rocm") or not info.torch_device.startswith("cuda"):
        return None
    try:
        import torch

        stats = torch.cuda.memory_stats(info.torch_device)
    except Exception:
        return None
    return {key: int(stats[key]) for key in _ALLOCATOR_KEYS if key in stats}


class TelemetrySampler:
    """Samples GPU telemetry in a background thread between :meth:`start` and :meth:`stop`.

    Never raises and never prints: without a driver or library, :meth:`stop` returns a summary
    with ``available=False`` and the reason. Also a context manager (``summary`` is set on exit).
    """

    def __init__(
        self,
        device_info: DeviceInfo,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_samples: int = MAX_SAMPLES,
        opener: BackendOpener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device_info = device_info
        self.interval_s = interval_s
        self.max_samples = max_samples
        self._opener = opener
        self._clock = clock
        self._backend: TelemetryBackend | None = None
        self._reason = ""
        self._printed = ""
        self._limits = DeviceLimits()
        self._samples: list[TelemetrySample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._allocator_before: dict[str, int] | None = None
        self._thread_error = ""
        self.summary: TelemetrySummary | None = None

    def start(self) -> TelemetrySampler:
        """Open the library (output captured) and start sampling. Call from the main thread:
        the capture redirects the process's file descriptors for the moment of opening."""
        if self._thread is not None or self._backend is not None:
            return self
        self._backend, self._reason, self._printed = open_backend(self.device_info, self._opener)
        self._allocator_before = _allocator_counters(self.device_info)
        if self._backend is None:
            return self
        self._started_at = self._clock()
        try:
            self._limits = self._backend.limits()
            self._take_sample()
        except Exception as exc:
            self._fail(f"{self._backend.name}: {_exception_text(exc)}")
            return self
        self._thread = threading.Thread(target=self._run, name="diagnose-telemetry", daemon=True)
        self._thread.start()
        return self

    def _fail(self, reason: str) -> None:
        if self._backend is not None:
            self._backend.close()
        self._reason = reason
        self._backend = None

    def _take_sample(self) -> None:
        assert self._backend is not None
        sample = self._backend.sample(self._clock() - self._started_at)
        with self._lock:
            self._samples.append(sample)
            if len(self._samples) > self.max_samples:
                self._samples = decimate(self._samples, self.max_samples // 2)
                self.interval_s *= 2

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._take_sample()
            except Exception as exc:  # a driver hiccup ends sampling, not the run
                self._thread_error = _exception_text(exc)
                return

    def stop(self) -> TelemetrySummary:
        """Stop sampling and summarise. Safe to call more than once (returns the same summary)."""
        if self.summary is not None:
            return self.summary
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        allocator_after = _allocator_counters(self.device_info)
        allocator: dict[str, int] = {}
        if self._allocator_before is not None and allocator_after is not None:
            allocator = {
                key: allocator_after[key] - self._allocator_before.get(key, 0)
                for key in allocator_after
            }
        backend = self._backend
        if backend is None:
            self.summary = unavailable(self._reason, printed=self._printed)
            self.summary.allocator = allocator
            return self.summary
        with contextlib.suppress(Exception):
            if not self._thread_error:
                self._take_sample()  # the state at the end of the window
        backend.close()
        with self._lock:
            samples = list(self._samples)
        unreadable = dict(backend.unreadable)
        if self._thread_error:
            unreadable["sampling"] = self._thread_error
        self.summary = TelemetrySummary(
            available=True,
            backend=backend.name,
            interval_s=self.interval_s,
            limits=self._limits,
            stats=summarize(samples, self._limits),
            samples=samples,
            allocator=allocator,
            unreadable=unreadable,
            printed=self._printed,
        )
        self._backend = None
        return self.summary

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def read_telemetry_once(
    device_info: DeviceInfo, opener: BackendOpener | None = None
) -> TelemetrySummary:
    """One sample, for ``diagnose env``: the state of the GPU right now (idle, usually)."""
    sampler = TelemetrySampler(device_info, opener=opener, interval_s=3600.0)
    sampler.start()
    return sampler.stop()


__all__ = [
    "AT_LIMIT_FRACTION",
    "BACKENDS",
    "BUSY_UTILIZATION_PCT",
    "DEFAULT_INTERVAL_S",
    "MAX_SAMPLES",
    "NVML_THROTTLE_REASONS",
    "PARSERS",
    "AmdSmiBackend",
    "DeviceLimits",
    "NvmlBackend",
    "TelemetryBackend",
    "TelemetrySample",
    "TelemetrySampler",
    "TelemetryStats",
    "TelemetrySummary",
    "amd_throttle_category",
    "amdsmi_limits",
    "amdsmi_sample",
    "decimate",
    "decode_amd_throttle",
    "decode_nvml_throttle",
    "nvml_limits",
    "nvml_sample",
    "open_backend",
    "pcie_speed_to_gen",
    "read_telemetry_once",
    "summarize",
    "summary_from_raw",
    "unavailable",
]
