"""Pure parsing: raw NVML and amdsmi values (the plain dicts the backends copy out of the
libraries, or the recorded fixtures) into samples and device limits. No library is imported."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from diagnose.telemetry.readings import DeviceLimits, TelemetrySample


def format_pci_bus_id(domain: int | None, bus: int | None, device: int | None) -> str:
    """The PCI address ("0000:03:00.0") from the numbers torch or a telemetry library reports;
    function 0 is the GPU."""
    if bus is None or device is None:
        return ""
    return f"{domain or 0:04x}:{bus:02x}:{device:02x}.0"


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


def other_processes(raw: Mapping[str, Any]) -> int | None:
    """How many processes on the GPU are not this job's, from the pids the library listed
    (``process_pids``) and this job's pids (``own_pids``). In a container the library may list
    the host's pids, where none of ours appears: then all but one (ours) are others."""
    pids = raw.get("process_pids")
    own = raw.get("own_pids") or []
    if not isinstance(pids, list):
        return None
    listed = {int(p) for p in pids if isinstance(p, int) and not isinstance(p, bool)}
    ours = listed & {int(p) for p in own if isinstance(p, int)}
    return len(listed - ours) if ours else max(0, len(listed) - 1)


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
        other_processes=other_processes(raw),
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
        other_processes=other_processes(raw),
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
