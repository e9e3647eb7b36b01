"""Device time you can add up, on every shared real trace: the GPU's idle share against a referee
that recomputes it from the raw events, kernel classes counted once that add up to the busy time,
and no unnamed kernel of weight left in "other"."""

from __future__ import annotations

import csv
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from diagnose.trace.kernel_classes import KERNEL_CLASSES
from reports.headline import build_headline
from reports.terminal import terminal_summary
from tests.conftest import SHARED_TRACES
from tests.test_trace_synthetic import TraceBuilder

TABLE = Path(__file__).parent / "data" / "kernel_names.tsv"
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}


def _gpu_traces(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json.gz") if p.parent.name != "LICENSES")


def _raw_busy_microseconds(path: Path, windows: list[tuple[float, float]]) -> list[float]:
    """The referee: for each window, the time any kernel, copy or memset of the busiest device
    ran, from the raw events (plain Python: sort the intervals, merge, clip)."""
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    by_device: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if str(e.get("cat", "")).lower() in DEVICE_CATEGORIES and e.get("ph") == "X":
            device = (e.get("args") or {}).get("device", e.get("pid"))
            by_device[device].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    busiest = max(by_device.values(), key=lambda spans: sum(b - a for a, b in spans))
    merged: list[list[float]] = []
    for start, end in sorted(busiest):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [
        sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in merged) for lo, hi in windows
    ]


@pytest.fixture(scope="module")
def shared(request: pytest.FixtureRequest) -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real GPU traces not present at {SHARED_TRACES}")
    return SHARED_TRACES


@pytest.fixture(scope="module")
def analysed(shared: Path) -> dict[str, TraceAnalysis]:
    return {str(p.relative_to(shared)): analyze_trace(p) for p in _gpu_traces(shared)}


def test_the_idle_share_is_the_gpus_within_a_point_on_every_trace(
    analysed: dict[str, TraceAnalysis], shared: Path
) -> None:
    checked = 0
    for name, analysis in analysed.items():
        record = analysis_to_record(analysis, shared / name)
        share = record.breakdown.device_idle_share
        if not analysis.kernel_classes:  # a CPU trace: no device, nothing to share
            assert share is None and build_headline(record).device_text == "", name
            continue
        windows = [(s.start_us, s.end_us) for s in analysis.steps]
        busy = _raw_busy_microseconds(shared / name, windows)
        wall = sum(hi - lo for lo, hi in windows)
        expected = 1.0 - sum(busy) / wall
        assert share is not None and abs(share - expected) <= 0.01, (name, share, expected)
        # The first screen says it, in the words of the device.
        text = build_headline(record).device_text
        assert f"sat idle {round(expected * 100):.0f}%" in text or expected < 0.1, (name, text)
        assert "sat idle" in terminal_summary(record), name
        checked += 1
    assert checked >= 8


def test_kernel_classes_counted_once_add_up_to_the_busy_time(
    analysed: dict[str, TraceAnalysis],
) -> None:
    overlapping = 0
    for name, analysis in analysed.items():
        breakdown = analysis.breakdown
        if breakdown.device_busy_seconds is None:
            continue
        once = sum(breakdown.device_seconds_by_kernel_class.values())
        summed = sum(breakdown.kernel_seconds_summed_by_class.values())
        assert once == pytest.approx(breakdown.device_busy_seconds, rel=1e-9, abs=1e-12), name
        assert once <= summed * (1 + 1e-9), name
        assert set(breakdown.device_seconds_by_kernel_class) <= set(KERNEL_CLASSES)
        for step in analysis.steps:
            step_once = sum(step.kernel_seconds_by_class.values())
            assert step_once == pytest.approx(step.device_busy_seconds, rel=1e-9, abs=1e-12)
        overlapping += summed > once * 1.01
    # Traces with several streams at once (DDP) are where summing double-counts.
    assert overlapping >= 1


def test_no_unnamed_kernel_of_weight_in_other(analysed: dict[str, TraceAnalysis]) -> None:
    with TABLE.open(encoding="utf-8", newline="") as handle:
        reasons = {
            r["name"]: r["source"]
            for r in csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            if r["class"] == "other"
        }
    for name, analysis in analysed.items():
        busy = sum(k.total_seconds for k in analysis.top_kernels) or 1.0
        device_total = sum(c.total_seconds for c in analysis.kernel_classes) or busy
        for kernel, seconds in analysis.unclassified_kernels:
            if seconds > 0.01 * device_total:
                assert " — " in reasons.get(kernel, ""), (name, kernel)


def _two_stream_trace(path: Path, *, overlap: bool) -> TraceAnalysis:
    """One step of 1000 µs: a GEMM on one stream, an all-reduce on another, overlapping by half
    (or one after the other in the twin)."""
    b = TraceBuilder()
    b.annotation("ProfilerStep#1", 0.0, 1000.0)
    b.op_with_kernel("aten::addmm", 10.0, "sm90_xmma_gemm_bf16bf16_bf16f32", 200.0)
    gemm_start = b.gpu_free_at - 200.0
    comm_start = gemm_start + 100.0 if overlap else b.gpu_free_at
    b._x(
        "kernel",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        comm_start,
        300.0,
        0,
        9,
        device=0,
        stream=9,
    )
    return analyze_trace(b.save(path))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlapped_communication_keeps_only_its_exposed_time(
    tmp_path: Path, overlap: bool
) -> None:
    analysis = _two_stream_trace(tmp_path / "t.json", overlap=overlap)
    once = analysis.breakdown.device_seconds_by_kernel_class
    summed = analysis.breakdown.kernel_seconds_summed_by_class
    assert summed == pytest.approx({"gemm": 200e-6, "communication": 300e-6})
    exposed = 200e-6 if overlap else 300e-6  # the GEMM hides 100 µs of the all-reduce
    assert once == pytest.approx({"gemm": 200e-6, "communication": exposed})
    busy = 400e-6 if overlap else 500e-6
    assert analysis.breakdown.device_busy_seconds == pytest.approx(busy)
    assert analysis.breakdown.device_idle_seconds == pytest.approx(1000e-6 - busy)
