"""Pure: the statistics of a window of samples against the device's limits, a summary replayed
from raw library values, and the thinning of a long run's samples."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from diagnose.telemetry.parsing import amdsmi_limits, amdsmi_sample, nvml_limits, nvml_sample
from diagnose.telemetry.readings import (
    DEFAULT_INTERVAL_S,
    MAX_SAMPLES,
    DeviceLimits,
    TelemetrySample,
    TelemetryStats,
    TelemetrySummary,
)

#: A sample counts as "busy" (the GPU was working) at or above this utilisation.
BUSY_UTILIZATION_PCT = 50.0
#: Power at or above this fraction of the limit counts as "at the limit".
AT_LIMIT_FRACTION = 0.95


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
    others = _max(s.other_processes for s in samples)
    stats.other_processes_max = None if others is None else int(others)
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
