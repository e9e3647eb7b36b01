"""GPU telemetry: the pure parsers on recorded library values, the sampler thread, and the
libraries' failure modes on this machine (no driver).

The fixtures in ``fixtures/telemetry/`` are constructed (see make_fixtures.py there: no GPU was
available), in the libraries' own shapes and units. The "no driver" paths run for real: pynvml
(nvidia-ml-py) is installed here and raises NVMLError_LibraryNotFound; ``import amdsmi`` is played
by a module that does what the real one does without the amdgpu driver (prints, raises KeyError).
The thin readers (NvmlBackend/AmdSmiBackend) run against stand-in modules that answer with the
recorded values, the only way to run them without the hardware.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diagnose.record import DeviceInfo
from diagnose.telemetry import (
    AmdSmiBackend,
    DeviceLimits,
    NvmlBackend,
    TelemetrySample,
    TelemetrySampler,
    TelemetrySummary,
    amdsmi_limits,
    amdsmi_sample,
    decimate,
    decode_amd_throttle,
    decode_nvml_throttle,
    nvml_limits,
    nvml_sample,
    other_processes,
    pcie_speed_to_gen,
    read_telemetry_once,
    summarize,
    summary_from_raw,
)
from tests.conftest import FIXTURES

TELEMETRY = FIXTURES / "telemetry"
NVIDIA = DeviceInfo(kind="cuda", torch_device="cuda:0", extra={"pci_bus_id": "0000:01:00.0"})
AMD = DeviceInfo(kind="rocm", torch_device="cuda:0", extra={"pci_bus_id": "0000:03:00.0"})


def fixture(name: str) -> dict[str, Any]:
    return json.loads((TELEMETRY / f"{name}.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def replay(name: str) -> TelemetrySummary:
    doc = fixture(name)
    return summary_from_raw(
        doc["backend"], doc["static"], [(s["t"], s["raw"]) for s in doc["samples"]]
    )


# --- pure parsing ---------------------------------------------------------------------------------


def test_nvml_fixture_parses_with_units_converted() -> None:
    doc = fixture("nvml_rtx4090_healthy")
    limits = nvml_limits(doc["static"])
    assert limits.name == "NVIDIA GeForce RTX 4090"
    assert limits.memory_total_bytes == 24564 * 1024 * 1024
    assert (limits.gfx_clock_max_mhz, limits.mem_clock_max_mhz) == (3120, 10501)
    assert limits.power_limit_w == 450.0 and limits.power_default_limit_w == 450.0
    assert (limits.pcie_gen_max, limits.pcie_width_max) == (4, 16)
    assert limits.cuda_driver_version == "12.8"
    idle = nvml_sample(doc["samples"][0]["raw"], 0.0)
    assert idle.throttle_reasons == ["gpu_idle"] and idle.pcie_gen == 1
    busy = nvml_sample(doc["samples"][3]["raw"], 0.75)
    assert busy.t == 0.75 and busy.power_w == 446.0
    assert busy.throttle_reasons == ["sw_power_cap"]
    assert busy.pcie_rx_bytes_per_s == 180_000 * 1024


def test_summary_judges_busy_samples_and_keeps_the_highest_link() -> None:
    summary = replay("nvml_rtx4090_healthy")
    stats = summary.stats
    assert (stats.n, stats.busy_n) == (11, 10)  # the idle sample between steps is left out
    assert stats.gfx_clock_median_mhz == 2730
    assert stats.gfx_clock_fraction_of_max == pytest.approx(2730 / 3120)
    assert stats.throttle_fractions == {"sw_power_cap": pytest.approx(0.3)}
    assert (stats.pcie_gen_seen_max, stats.pcie_width_seen_max) == (4, 16)  # idle was Gen1
    assert stats.memory_used_max_fraction == pytest.approx(17_420 / 24_564)
    assert stats.power_at_limit_fraction == pytest.approx(0.5)  # >= 95% of 450 W
    assert stats.duration_s == pytest.approx(2.5)


def test_nvml_throttle_bits() -> None:
    assert decode_nvml_throttle(0) == [] and decode_nvml_throttle(None) == []
    assert decode_nvml_throttle(0x60) == ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert decode_nvml_throttle(0x4 | 0x80) == ["sw_power_cap", "hw_power_brake_slowdown"]


def test_amd_throttle_bits_by_category() -> None:
    assert decode_amd_throttle(0) == []
    assert decode_amd_throttle((1 << 36) | 1 | (1 << 16)) == [
        "power:ppt0",
        "current:tdc_gfx",
        "thermal:temp_hotspot",
    ]
    assert decode_amd_throttle(1 << 57) == ["other:fit"]


def test_amdsmi_6x_and_7x_field_names() -> None:
    six = fixture("amdsmi_rx7900xtx_healthy")
    seven = fixture("amdsmi_w7900_rocm7_hotspot")
    limits6, limits7 = amdsmi_limits(six["static"]), amdsmi_limits(seven["static"])
    assert (limits6.gfx_clock_max_mhz, limits6.power_limit_w) == (2482, 339)
    assert limits6.pcie_gen_max == 4  # from max_pcie_speed 16000 MT/s
    assert limits7.power_limit_w == 295.0  # power_cap_info in microwatts
    assert limits7.power_default_limit_w == 295.0
    assert limits7.memory_total_bytes == 49136 * 1024 * 1024
    sample6 = amdsmi_sample(six["samples"][5]["raw"], 1.25)
    sample7 = amdsmi_sample(seven["samples"][5]["raw"], 1.25)
    assert sample6.gfx_clock_mhz == 2410  # cur_clk
    assert sample7.gfx_clock_mhz == 1550  # clk
    assert sample7.power_w == 262  # socket_power
    assert sample7.temperature_c == 104  # hotspot preferred over edge
    assert sample7.throttle_reasons == ["thermal:temp_hotspot"]
    assert sample7.pcie_rx_bytes_per_s is None  # "N/A"
    idle7 = amdsmi_sample(seven["samples"][0]["raw"])
    assert idle7.throttle_reasons == []  # indep_throttle_status "N/A"


def test_amd_not_available_markers() -> None:
    sample = amdsmi_sample(
        {
            "clock_gfx": {"clk": 0xFFFF},
            "power": {"socket_power": "N/A", "average_socket_power": 0xFFFF},
            "activity": {"gfx_activity": {"value": 97, "unit": "%"}},
            "metrics": {"indep_throttle_status": 2**64 - 1},
        }
    )
    assert sample.gfx_clock_mhz is None and sample.power_w is None
    assert sample.utilization_pct == 97  # amd-smi's {"value", "unit"} form
    assert sample.throttle_reasons == []


def test_pcie_speed_to_generation() -> None:
    assert [pcie_speed_to_gen(v) for v in (2500, 5000, 8000, 16000, 32000, 64000)] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert pcie_speed_to_gen(16) == 4 and pcie_speed_to_gen(2.5) == 1
    assert pcie_speed_to_gen(None) is None and pcie_speed_to_gen(0) is None
    assert pcie_speed_to_gen(12000) is None


def test_summary_round_trips_through_json() -> None:
    summary = replay("amdsmi_w7900_rocm7_hotspot")
    summary.allocator = {"num_alloc_retries": 1}
    text = json.dumps(summary.to_dict(), allow_nan=False)
    restored = TelemetrySummary.from_dict(json.loads(text))
    assert restored.to_dict() == summary.to_dict()
    # Forgiving: unknown keys ignored, missing ones defaulted.
    assert TelemetrySummary.from_dict({"available": False, "later": 1}).reason == ""


def test_summarize_without_samples_or_utilisation() -> None:
    assert summarize([], DeviceLimits()).n == 0
    samples = [TelemetrySample(t=i, gfx_clock_mhz=1000.0 + i) for i in range(3)]
    stats = summarize(samples, DeviceLimits(gfx_clock_max_mhz=2000.0))
    assert stats.busy_n == 3  # utilisation unknown: every sample counts
    assert stats.gfx_clock_fraction_of_max == pytest.approx(0.5005)
    nan = summarize([TelemetrySample(power_w=math.nan)], DeviceLimits())
    assert nan.power_max_w is not None  # NaN is not filtered by the stats, but by to_dict
    assert TelemetrySummary(available=True, stats=nan).to_dict()["stats"]["power_max_w"] is None


def test_decimate_keeps_coverage_and_the_last_sample() -> None:
    samples = [TelemetrySample(t=float(i)) for i in range(1001)]
    kept = decimate(samples, 300)
    assert len(kept) <= 300
    assert kept[0].t == 0 and kept[-1].t == 1000


# --- the sampler ----------------------------------------------------------------------------------


class Replay:
    """A backend that replays a fixture's raw values in a loop (no hardware here)."""

    name = "nvml"

    def __init__(self, doc: dict[str, Any], *, fail_after: int | None = None) -> None:
        self.doc = doc
        self.unreadable: dict[str, str] = {}
        self.calls = 0
        self.fail_after = fail_after
        self.closed = False
        self.threads: set[str] = set()

    def limits(self) -> DeviceLimits:
        return nvml_limits(self.doc["static"])

    def sample(self, t: float) -> TelemetrySample:
        self.threads.add(threading.current_thread().name)
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("GPU is lost")
        raw = self.doc["samples"][self.calls % len(self.doc["samples"])]["raw"]
        self.calls += 1
        return nvml_sample(raw, t)

    def close(self) -> None:
        self.closed = True


def test_sampler_samples_in_a_background_thread() -> None:
    backend = Replay(fixture("nvml_rtx4090_healthy"))
    sampler = TelemetrySampler(NVIDIA, interval_s=0.01, opener=lambda info: backend)
    with sampler:
        time.sleep(0.15)
    summary = sampler.summary
    assert summary is not None and summary.available and summary.backend == "nvml"
    assert summary.stats.n == len(summary.samples) >= 4
    assert "diagnose-telemetry" in backend.threads
    assert backend.closed
    assert summary.limits.name == "NVIDIA GeForce RTX 4090"
    assert all(a.t <= b.t for a, b in zip(summary.samples, summary.samples[1:], strict=False))
    assert sampler.stop() is summary  # idempotent
    assert not any(t.name == "diagnose-telemetry" for t in threading.enumerate())


def test_sampler_bounds_the_number_of_samples() -> None:
    backend = Replay(fixture("nvml_rtx4090_healthy"))
    sampler = TelemetrySampler(NVIDIA, interval_s=0.001, max_samples=20, opener=lambda i: backend)
    sampler.start()
    time.sleep(0.2)
    summary = sampler.stop()
    assert backend.calls > 20
    assert len(summary.samples) <= 20
    assert summary.interval_s > 0.001  # doubled on each halving


def test_a_backend_failing_mid_run_keeps_what_was_sampled() -> None:
    backend = Replay(fixture("nvml_rtx4090_healthy"), fail_after=3)
    sampler = TelemetrySampler(NVIDIA, interval_s=0.01, opener=lambda info: backend)
    sampler.start()
    time.sleep(0.1)
    summary = sampler.stop()
    assert summary.available and summary.stats.n == 3
    assert summary.unreadable["sampling"] == "RuntimeError: GPU is lost"


def test_an_opener_that_prints_and_raises_leaves_the_terminal_clean(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def opener(info: DeviceInfo) -> Replay:
        print("Unable to find amdgpu driver")
        os.write(2, b"native noise\n")
        raise KeyError("amdgpu")

    summary = TelemetrySampler(AMD, opener=opener).start().stop()
    assert summary.available is False
    assert summary.reason == "telemetry: KeyError: 'amdgpu'"
    assert "Unable to find amdgpu driver" in summary.printed and "native noise" in summary.printed
    assert capfd.readouterr() == ("", "")


def test_no_telemetry_for_a_cpu_run() -> None:
    summary = read_telemetry_once(DeviceInfo(kind="cpu", torch_device="cpu"))
    assert summary.available is False
    assert summary.reason == "no GPU telemetry for a cpu device"
    assert summary.allocator == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a driver")
def test_real_pynvml_without_a_driver(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pynvml")
    summary = TelemetrySampler(NVIDIA).start().stop()
    assert summary.available is False
    assert summary.reason.startswith("nvml: NVMLError_LibraryNotFound"), summary.reason
    assert capfd.readouterr() == ("", "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a driver")
def test_amdsmi_import_without_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # What the real amdsmi does on import without the amdgpu driver: print, then KeyError.
    (tmp_path / "amdsmi.py").write_text(
        textwrap.dedent(
            """
            print("Unable to find amdgpu driver")
            raise KeyError("amdgpu")
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    summary = TelemetrySampler(AMD).start().stop()
    sys.modules.pop("amdsmi", None)
    assert summary.available is False
    assert summary.reason == "amdsmi: KeyError: 'amdgpu'"
    assert summary.printed == "Unable to find amdgpu driver"
    assert capfd.readouterr() == ("", "")


def test_amdsmi_not_installed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import raises ImportError
    summary = read_telemetry_once(AMD)
    assert summary.reason.startswith("amdsmi: ")
    assert "pip install /opt/rocm/share/amd_smi" in summary.reason


# --- the thin readers against stand-ins answering with recorded values ----------------------------


class NvmlError(Exception):
    pass


def stand_in_pynvml(doc: dict[str, Any], calls: list[str]) -> SimpleNamespace:
    """A pynvml look-alike serving the first busy sample of a fixture; event reasons unsupported
    (an older driver), so the reader must fall back to the throttle-reasons call."""
    static, raw = doc["static"], doc["samples"][1]["raw"]

    def record(name: str, value: Any) -> Any:
        calls.append(name)
        return value

    def unsupported(handle: Any) -> int:
        calls.append("nvmlDeviceGetCurrentClocksEventReasons")
        raise NvmlError("Not Supported")

    memory = SimpleNamespace(**raw["memory"])
    return SimpleNamespace(
        nvmlInit=lambda: record("nvmlInit", None),
        nvmlShutdown=lambda: record("nvmlShutdown", None),
        nvmlDeviceGetHandleByPciBusId=lambda bus: record(f"byPciBusId({bus})", "h0"),
        nvmlDeviceGetHandleByIndex=lambda i: record(f"byIndex({i})", "h0"),
        nvmlDeviceGetName=lambda h: static["name"],
        nvmlDeviceGetMemoryInfo=lambda h: memory,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: static[
            "max_clock_sm_mhz" if kind == 1 else "max_clock_mem_mhz"
        ],
        nvmlDeviceGetEnforcedPowerLimit=lambda h: static["power_limit_mw"],
        nvmlDeviceGetPowerManagementDefaultLimit=lambda h: static["power_default_limit_mw"],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: static["pcie_gen_max"],
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: static["pcie_width_max"],
        nvmlDeviceGetGpuMaxPcieLinkGeneration=lambda h: static["pcie_gen_max_gpu"],
        nvmlSystemGetDriverVersion=lambda: static["driver_version"],
        nvmlSystemGetCudaDriverVersion=lambda: static["cuda_driver_version"],
        nvmlDeviceGetClockInfo=lambda h, kind: raw[
            "clock_sm_mhz" if kind == 1 else "clock_mem_mhz"
        ],
        nvmlDeviceGetPowerUsage=lambda h: raw["power_mw"],
        nvmlDeviceGetTemperature=lambda h, sensor: raw["temperature_c"],
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(**raw["utilization"]),
        nvmlDeviceGetCurrentClocksEventReasons=unsupported,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: raw["clocks_event_reasons"] | 0x40,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: raw["pcie_gen"],
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: raw["pcie_width"],
        nvmlDeviceGetPcieThroughput=lambda h, counter: raw[
            "pcie_tx_kb_s" if counter == 0 else "pcie_rx_kb_s"
        ],
        # This process and one stranger hold contexts on the GPU.
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 << 30),
            SimpleNamespace(pid=STRANGER, usedGpuMemory=1 << 30),
        ],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
    )


#: A pid no process of this test has (pid_max is at most 2**22 on Linux).
STRANGER = 2**22 + 7


def test_other_processes_on_the_gpu_are_counted_apart_from_the_job() -> None:
    me = os.getpid()
    assert other_processes({"process_pids": [me], "own_pids": [me]}) == 0
    assert other_processes({"process_pids": [me, STRANGER], "own_pids": [me]}) == 1
    # In a container the library lists host pids, none of them ours: all but one are others.
    assert other_processes({"process_pids": [11, 12, 13], "own_pids": [me]}) == 2
    assert other_processes({"process_pids": None, "own_pids": [me]}) is None
    samples = [
        nvml_sample({"process_pids": [me], "own_pids": [me]}, 0.0),
        nvml_sample({"process_pids": [me, STRANGER], "own_pids": [me]}, 0.5),
    ]
    assert summarize(samples, DeviceLimits()).other_processes_max == 1
    assert summarize(samples[:1], DeviceLimits()).other_processes_max == 0


def test_nvml_reader_calls_the_library_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    doc = fixture("nvml_rtx4090_healthy")
    monkeypatch.setitem(sys.modules, "pynvml", stand_in_pynvml(doc, calls))
    backend = NvmlBackend.open(NVIDIA)
    assert calls[:2] == ["nvmlInit", "byPciBusId(0000:01:00.0)"]
    assert backend.limits() == nvml_limits(doc["static"])
    expected = nvml_sample(doc["samples"][1]["raw"], 0.5)
    sample = backend.sample(0.5)
    assert sample.gfx_clock_mhz == expected.gfx_clock_mhz
    assert sample.pcie_rx_bytes_per_s == expected.pcie_rx_bytes_per_s
    assert sample.throttle_reasons == ["hw_thermal_slowdown"]  # from the fallback call
    assert sample.other_processes == 1  # the stranger, not this process
    backend.close()
    assert calls[-1] == "nvmlShutdown"


def test_amdsmi_reader_tolerates_missing_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = fixture("amdsmi_rx7900xtx_healthy")
    static, raw = doc["static"], doc["samples"][4]["raw"]

    def no_power_cap(handle: Any) -> Any:
        raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")

    stand_in = SimpleNamespace(
        AmdSmiInitFlags=SimpleNamespace(INIT_AMD_GPUS=2),
        AmdSmiClkType=SimpleNamespace(GFX="gfx", MEM="mem"),
        AmdSmiTemperatureType=SimpleNamespace(EDGE="edge", HOTSPOT="hotspot"),
        AmdSmiTemperatureMetric=SimpleNamespace(CURRENT="current"),
        amdsmi_init=lambda flag: None,
        amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: ["igpu", "dgpu"],
        amdsmi_get_gpu_device_bdf=lambda h: {"igpu": "0000:c4:00.0", "dgpu": "0000:03:00.0"}[h],
        amdsmi_get_gpu_asic_info=lambda h: static["asic"],
        amdsmi_get_gpu_driver_info=lambda h: static["driver"],
        amdsmi_get_gpu_vram_usage=lambda h: raw["vram_usage"],
        amdsmi_get_clock_info=lambda h, kind: raw["clock_gfx" if kind == "gfx" else "clock_mem"],
        amdsmi_get_power_info=lambda h: raw["power"],
        amdsmi_get_power_cap_info=no_power_cap,
        amdsmi_get_pcie_info=lambda h: static["pcie"],
        amdsmi_get_temp_metric=lambda h, kind, metric: raw[f"temperature_{kind}"],
        amdsmi_get_gpu_activity=lambda h: raw["activity"],
        amdsmi_get_gpu_metrics_info=lambda h: raw["metrics"],
        # Older amdsmi: process handles, looked up one by one.
        amdsmi_get_gpu_process_list=lambda h: ["p0", "p1"],
        amdsmi_get_gpu_process_info=lambda h, p: {
            "p0": {"pid": os.getpid()},
            "p1": {"pid": STRANGER},
        }[p],
    )
    monkeypatch.setitem(sys.modules, "amdsmi", stand_in)
    backend = AmdSmiBackend.open(AMD)
    assert backend.handle == "dgpu" and backend.matched_by == "pci bus id"
    limits = backend.limits()
    assert limits.power_limit_w == 339 and limits.name == "Radeon RX 7900 XTX"
    assert backend.unreadable == {"power_cap": "RuntimeError: AMDSMI_STATUS_NOT_SUPPORTED"}
    sample = backend.sample(1.0)
    assert sample.gfx_clock_mhz == raw["clock_gfx"]["cur_clk"]
    assert sample.temperature_c == 84 and sample.utilization_pct == 99
    assert sample.other_processes == 1
    backend.close()
