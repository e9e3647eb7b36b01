"""The backends, thin: copy values out of NVML (pynvml) and amdsmi into plain dicts, and open the
one that reads a device with the library's output captured and every exception caught."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from typing import Any, Protocol

from diagnose.contention import job_pids
from diagnose.quiet import capture_output
from diagnose.record import DeviceInfo
from diagnose.telemetry.parsing import amdsmi_limits, amdsmi_sample, nvml_limits, nvml_sample
from diagnose.telemetry.readings import DeviceLimits, TelemetrySample


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


def _nvml_pids(nvml: Any, handle: Any) -> list[int]:
    """Pids with a compute or graphics context on the GPU."""
    found = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    graphics = getattr(nvml, "nvmlDeviceGetGraphicsRunningProcesses", None)
    if graphics is not None:
        found += list(graphics(handle))
    return sorted({int(p.pid) for p in found if getattr(p, "pid", None) is not None})


def _amdsmi_pids(smi: Any, handle: Any) -> list[int]:
    """Pids using the GPU. Newer amdsmi lists dicts with a ``pid``; older releases list process
    handles to look up one by one."""
    pids = set()
    for item in smi.amdsmi_get_gpu_process_list(handle):
        info = item if isinstance(item, dict) else smi.amdsmi_get_gpu_process_info(handle, item)
        pid = info.get("pid") if isinstance(info, dict) else None
        if isinstance(pid, int):
            pids.add(pid)
    return sorted(pids)


class _LibraryBackend:
    """What both vendor backends share: the library, the device's handle and how it was matched,
    a reader that turns a failing call into "unreadable", and the vendor's parsers of a reading."""

    name = ""

    def __init__(self, library: Any, handle: Any, matched_by: str) -> None:
        self.library = library
        self.handle = handle
        self.matched_by = matched_by
        self.reader = _Reader()
        self.unreadable = self.reader.unreadable

    def read_static(self) -> dict[str, Any]:
        raise NotImplementedError

    def read_raw(self) -> dict[str, Any]:
        raise NotImplementedError

    def shut_down(self) -> None:
        raise NotImplementedError

    def limits_from(self, static: dict[str, Any]) -> DeviceLimits:
        """The vendor's parser of :meth:`read_static`."""
        raise NotImplementedError

    def sample_from(self, raw: dict[str, Any], t: float) -> TelemetrySample:
        """The vendor's parser of :meth:`read_raw`."""
        raise NotImplementedError

    def limits(self) -> DeviceLimits:
        return self.limits_from(self.read_static())

    def sample(self, t: float) -> TelemetrySample:
        return self.sample_from(self.read_raw(), t)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.shut_down()


class NvmlBackend(_LibraryBackend):
    """NVML through pynvml (package nvidia-ml-py)."""

    name = "nvml"

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
        n, h, get = self.library, self.handle, self.reader.get
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
        n, h, get = self.library, self.handle, self.reader.get
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
            "process_pids": get("processes", lambda: _nvml_pids(n, h)),
            "own_pids": job_pids(),
        }

    def limits_from(self, static: dict[str, Any]) -> DeviceLimits:
        return nvml_limits(static)

    def sample_from(self, raw: dict[str, Any], t: float) -> TelemetrySample:
        return nvml_sample(raw, t)

    def shut_down(self) -> None:
        self.library.nvmlShutdown()


class AmdSmiBackend(_LibraryBackend):
    """amdsmi (ROCm's AMD SMI Python bindings)."""

    name = "amdsmi"

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
        return getattr(self.library.AmdSmiClkType, name)

    def read_static(self) -> dict[str, Any]:
        s, h, get = self.library, self.handle, self.reader.get
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
        s, h, get = self.library, self.handle, self.reader.get

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
            "process_pids": get("processes", lambda: _amdsmi_pids(s, h)),
            "own_pids": job_pids(),
        }

    def limits_from(self, static: dict[str, Any]) -> DeviceLimits:
        return amdsmi_limits(static)

    def sample_from(self, raw: dict[str, Any], t: float) -> TelemetrySample:
        return amdsmi_sample(raw, t)

    def shut_down(self) -> None:
        self.library.amdsmi_shut_down()


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
