"""What this device sustains, measured here: dense matrix multiply FLOP/s per dtype and memory
bandwidth, each from a short microbenchmark.

The matrix rate is the best of two shapes: the step's own largest GEMM (what its biggest ops can
reach) and a square one large enough to fill the device. A peak that is the best rate the device
showed is an upper bound for every op of the step, so the time at peak it gives is a lower bound.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from diagnose.timing import device_synchronizer, timed_calls

#: Square GEMM edge that fills the device: a GPU needs thousands of rows to reach its peak, a CPU
#: core reaches its own with far less.
SQUARE_EDGE = {"cpu": 512, "gpu": 4096}
#: The smallest square edge a slow dtype is shrunk to (see :func:`square_edge`).
MIN_SQUARE_EDGE = 128
#: Bytes of the tensor copied to measure memory bandwidth: well past the last-level cache.
COPY_BYTES = {"cpu": 64 << 20, "gpu": 1 << 30}
#: Wall seconds one shape may take (after its warm-up call), and its repetitions.
SECONDS_PER_SHAPE = 0.25
MIN_REPEATS, MAX_REPEATS = 3, 50

#: torch dtypes by the names the FLOPs count uses.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass
class GemmRate:
    """One measured GEMM shape: m x k times k x n."""

    dtype: str
    m: int
    n: int
    k: int
    #: Median FLOP/s over the repetitions.
    flops_per_s: float
    repeats: int

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k} @ {self.k}x{self.n}"


@dataclass
class MeasuredPeaks:
    """The device's measured matrix peak per dtype and its copy bandwidth."""

    #: Best median rate per dtype, FLOP/s.
    flops_per_s: dict[str, float] = field(default_factory=dict)
    #: Every shape measured (what each peak was read from).
    gemms: list[GemmRate] = field(default_factory=list)
    #: Bytes read plus written per second by a device-to-device copy.
    memory_bytes_per_s: float | None = None
    #: Why a dtype or the bandwidth could not be measured.
    notes: list[str] = field(default_factory=list)


def _median_seconds(run: Callable[[], object], sync: Callable[[], None]) -> tuple[float, int]:
    """Median wall seconds of ``run`` after one warm-up call, within the per-shape budget."""
    run()
    sync()
    times = timed_calls(
        run, sync, min_calls=MIN_REPEATS, max_calls=MAX_REPEATS, budget_s=SECONDS_PER_SHAPE
    )
    return statistics.median(times), len(times)


def gemm_rate(
    device: torch.device, dtype: str, m: int, n: int, k: int, sync: Callable[[], None]
) -> GemmRate:
    """The median FLOP/s of ``torch.mm`` at one shape and dtype on ``device``."""
    torch_dtype = DTYPES[dtype]
    a = torch.randn(m, k, device=device).to(torch_dtype)
    b = torch.randn(k, n, device=device).to(torch_dtype)
    out = torch.empty(m, n, device=device, dtype=torch_dtype)
    seconds, repeats = _median_seconds(lambda: torch.mm(a, b, out=out), sync)
    return GemmRate(dtype, m, n, k, 2.0 * m * n * k / max(seconds, 1e-12), repeats)


def square_edge(device: torch.device, dtype: str, largest: int, sync: Callable[[], None]) -> int:
    """The square edge to measure ``dtype`` at: ``largest``, halved while one call would leave no
    room in the per-shape budget for its repetitions.

    A dtype the device only emulates (bfloat16 on a CPU without bf16 instructions) multiplies
    hundreds of times slower than its float32; its rate is as flat in the size as it is low, so a
    smaller square measures the same rate in a fraction of the time. The cost of one call is
    extrapolated (cubically) from a call at the smallest edge.
    """
    torch_dtype = DTYPES[dtype]
    small = min(MIN_SQUARE_EDGE, largest)
    a = torch.randn(small, small, device=device).to(torch_dtype)
    torch.mm(a, a)  # the first call pays for dispatch and allocation
    sync()
    # The fastest of a few calls: one call preempted on a busy machine would halve the edge.
    small_seconds = math.inf
    for _ in range(3):
        started = time.perf_counter()
        torch.mm(a, a)
        sync()
        small_seconds = min(small_seconds, time.perf_counter() - started)
    allowed = SECONDS_PER_SHAPE / (MIN_REPEATS + 1)  # the warm-up call and the repeats
    edge = largest
    while edge > small and small_seconds * (edge / small) ** 3 > allowed:
        edge //= 2
    return max(edge, small)


def copy_bandwidth(device: torch.device, size_bytes: int, sync: Callable[[], None]) -> float:
    """Bytes read plus written per second by one device-to-device tensor copy."""
    elements = size_bytes // 4
    source = torch.ones(elements, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds, _ = _median_seconds(lambda: target.copy_(source), sync)
    return 2.0 * elements * 4 / max(seconds, 1e-12)


def measure_peaks(
    device: torch.device,
    dtypes: Sequence[str],
    step_gemm: tuple[int, int, int] | None = None,
) -> MeasuredPeaks:
    """Measure the matrix peak of each dtype (best of the step's largest GEMM and a square one)
    and the copy bandwidth. A dtype the device cannot multiply is noted, not measured."""
    sync = device_synchronizer(device)
    kind = "cpu" if device.type == "cpu" else "gpu"
    peaks = MeasuredPeaks()
    for dtype in dict.fromkeys(dtypes):
        if dtype not in DTYPES:
            peaks.notes.append(f"{dtype}: no matrix microbenchmark for this dtype")
            continue
        try:
            edge = square_edge(device, dtype, SQUARE_EDGE[kind], sync)
        except (RuntimeError, TypeError):
            edge = SQUARE_EDGE[kind]  # the measurement below notes what fails
        shapes: list[tuple[int, int, int]] = [(edge, edge, edge)]
        if step_gemm is not None and all(d > 0 for d in step_gemm) and step_gemm not in shapes:
            shapes.insert(0, step_gemm)
        for m, n, k in shapes:
            try:
                rate = gemm_rate(device, dtype, m, n, k, sync)
            except (RuntimeError, TypeError) as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                peaks.notes.append(f"{dtype} {m}x{k}@{k}x{n}: {type(exc).__name__}: {first}")
                continue
            peaks.gemms.append(rate)
            if math.isfinite(rate.flops_per_s):
                peaks.flops_per_s[dtype] = max(peaks.flops_per_s.get(dtype, 0.0), rate.flops_per_s)
    try:
        peaks.memory_bytes_per_s = copy_bandwidth(device, COPY_BYTES[kind], sync)
    except RuntimeError as exc:  # out of memory on a crowded device
        peaks.notes.append(f"bandwidth: {type(exc).__name__}: {str(exc)[:200]}")
    return peaks


__all__ = [
    "COPY_BYTES",
    "DTYPES",
    "MIN_SQUARE_EDGE",
    "SQUARE_EDGE",
    "GemmRate",
    "MeasuredPeaks",
    "copy_bandwidth",
    "gemm_rate",
    "measure_peaks",
    "square_edge",
]
