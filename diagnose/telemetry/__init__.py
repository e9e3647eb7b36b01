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

One module per concern: :mod:`~diagnose.telemetry.readings` (the dataclasses and the summary's
JSON round trip), :mod:`~diagnose.telemetry.parsing` (the pure NVML and amdsmi parsers),
:mod:`~diagnose.telemetry.summary` (the statistics of a window, replaying raw values, thinning),
:mod:`~diagnose.telemetry.backends` (the thin library readers and opening one) and
:mod:`~diagnose.telemetry.sampler` (the background sampler).
"""

from __future__ import annotations

from diagnose.telemetry.backends import (
    BACKENDS,
    AmdSmiBackend,
    NvmlBackend,
    TelemetryBackend,
    open_backend,
)
from diagnose.telemetry.parsing import (
    NVML_THROTTLE_REASONS,
    amd_throttle_category,
    amdsmi_limits,
    amdsmi_sample,
    decode_amd_throttle,
    decode_nvml_throttle,
    nvml_limits,
    nvml_sample,
    other_processes,
    pcie_speed_to_gen,
)
from diagnose.telemetry.readings import (
    DEFAULT_INTERVAL_S,
    MAX_SAMPLES,
    DeviceLimits,
    TelemetrySample,
    TelemetryStats,
    TelemetrySummary,
    unavailable,
)
from diagnose.telemetry.sampler import (
    TelemetrySampler,
    read_telemetry_once,
)
from diagnose.telemetry.summary import (
    AT_LIMIT_FRACTION,
    BUSY_UTILIZATION_PCT,
    PARSERS,
    decimate,
    summarize,
    summary_from_raw,
)

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
    "other_processes",
    "pcie_speed_to_gen",
    "read_telemetry_once",
    "summarize",
    "summary_from_raw",
    "unavailable",
]
