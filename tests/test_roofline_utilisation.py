"""Utilisation: the step's counted FLOPs against measured and spec peaks, the probe's real
microbenchmark, the report's line and the gate's MFU metric."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from diagnose.gate import compare_records
from diagnose.gate.options import CompareOptions
from diagnose.record import DeviceInfo, RunRecord, StepSample
from diagnose.reports.utilisation import build_utilisation, format_flops
from diagnose.roofline.measure import MIN_SQUARE_EDGE, gemm_rate, measure_peaks, square_edge
from diagnose.roofline.model import Peak
from diagnose.roofline.utilisation import spec_peak_for, utilisation_of
from tests.factories import timed_record

WORK: dict[str, Any] = {
    "basis": "trace shapes",
    "steps": 2,
    "flops_per_step": 3.0e12,
    "flops_by_class": {"gemm": 2.0e12, "conv": 0.5e12, "attention": 0.5e12},
    "flops_by_phase": {"forward": 1.0e12, "backward": 2.0e12},
    "flops_by_dtype": {"bfloat16": 2.0e12, "float32": 1.0e12},
    "host_seconds_by_class": {"gemm": 0.5, "conv": 0.2, "attention": 0.1},
    "memory_bytes_per_step": 4.0e9,
    "memory_host_seconds": 0.4,
    "ops_counted": 100,
    "ops_without_shapes": 3,
    "uncounted": {},
    "largest_gemm": {"m": 64, "n": 64, "k": 64, "dtype": "bfloat16", "flops": 524288.0},
    "assumptions": [],
}


def _peak(basis: str, bf16: float, fp32: float, bandwidth: float | None = None) -> Peak:
    return Peak(
        basis=basis,
        flops_per_s={"bfloat16": bf16, "float32": fp32},
        memory_bytes_per_s=bandwidth,
        source="test",
    )


def test_each_dtype_is_held_against_its_own_peak() -> None:
    u = utilisation_of(
        WORK,
        step_seconds=2.0,
        step_basis="median",
        spec=None,
        measured=_peak("measured", 100e12, 10e12, 100e9),
    )
    assert u is not None and u.measured is not None
    # 2 TFLOP at 100 TFLOP/s + 1 TFLOP at 10 TFLOP/s = 0.02 + 0.1 s: not 3 TFLOP at the faster
    # rate (0.03 s), which would flatter the step.
    assert u.measured.seconds_at_peak == pytest.approx(0.12)
    assert u.measured.mfu == pytest.approx(0.06)
    assert u.achieved_flops_per_s == pytest.approx(1.5e12)
    assert u.headline_peak is u.measured
    gemm = next(c for c in u.classes if c.op_class == "gemm")
    assert gemm.seconds == 0.5 and gemm.seconds_basis == "host ops"
    assert gemm.achieved_per_s == pytest.approx(4e12)
    # The class's peak is the step's effective rate over its dtype mix: 3 TFLOP in 0.12 s.
    assert gemm.peak_per_s == pytest.approx(25e12)
    assert gemm.share_of_peak == pytest.approx(4 / 25)
    memory = next(c for c in u.classes if c.op_class == "memory")
    assert memory.achieved_per_s == pytest.approx(1e10) and memory.share_of_peak == pytest.approx(
        0.1
    )
    assert any("no recorded shapes" in n for n in u.notes)


def test_a_class_faster_than_the_microbenchmark_raises_the_measured_peak() -> None:
    # A CPU without native bf16: torch.mm in bf16 crawls, while the fused attention kernel
    # computes its blocks in fp32 and runs faster than that "peak". The peak is the fastest rate
    # the device was seen to reach, so no share reads above 100%.
    work = dict(WORK, flops_by_dtype={"bfloat16": 3.0e12})
    slow_mm = Peak(basis="measured", flops_per_s={"bfloat16": 1e12}, memory_bytes_per_s=1e9)
    u = utilisation_of(work, step_seconds=10.0, step_basis="m", spec=None, measured=slow_mm)
    assert u is not None and u.measured is not None
    attention = next(c for c in u.classes if c.op_class == "attention")
    assert attention.achieved_per_s == pytest.approx(5e12)  # 0.5 TFLOP in 0.1 s
    assert u.measured.flops_per_s["bfloat16"] == pytest.approx(5e12)
    assert "raised" in u.measured.source and any("faster than the torch.mm" in n for n in u.notes)
    assert u.measured.mfu == pytest.approx(3.0 / 5.0 / 10.0)
    for row in u.classes:
        assert row.share_of_peak is not None and 0 < row.share_of_peak <= 1.0, row
    # The memory class's 10 GB/s beat the copy's 1 GB/s: the bandwidth is raised the same way.
    assert u.measured.memory_bytes_per_s == pytest.approx(1e10)


def test_device_kernel_time_is_used_on_a_gpu_and_spec_leads() -> None:
    kernels = {"gemm": 0.2, "conv": 0.05, "attention_fused": 0.05, "elementwise": 0.1, "norm": 0.1}
    u = utilisation_of(
        WORK,
        step_seconds=1.0,
        step_basis="median",
        spec=_peak("spec", 1000e12, 60e12, 3e12),
        measured=_peak("measured", 700e12, 50e12, 2.5e12),
        kernel_seconds=kernels,
    )
    assert u is not None and u.spec is not None and u.measured is not None
    assert u.headline_peak is u.spec  # the spec is what MFU is usually quoted against
    assert u.spec.mfu == pytest.approx((2.0 / 1000 + 1.0 / 60) / 1.0)
    attention = next(c for c in u.classes if c.op_class == "attention")
    assert attention.seconds == 0.05 and attention.seconds_basis == "device kernels"
    memory = next(c for c in u.classes if c.op_class == "memory")
    assert memory.seconds == pytest.approx(0.2)


def test_a_dtype_without_peak_is_left_out_and_said() -> None:
    work = dict(WORK, flops_by_dtype={"bfloat16": 2.0e12, "float8": 1.0e12})
    u = utilisation_of(
        work, step_seconds=1.0, step_basis="m", spec=None, measured=_peak("measured", 1e14, 1e13)
    )
    assert u is not None and u.measured is not None
    assert u.measured.dtypes_without_peak == ["float8"]
    assert u.measured.seconds_at_peak == pytest.approx(0.02)
    assert any("float8" in n for n in u.notes)


def test_nothing_counted_gives_no_utilisation() -> None:
    for work in ({}, dict(WORK, flops_per_step=0.0), dict(WORK, flops_per_step=math.nan)):
        assert (
            utilisation_of(work, step_seconds=1.0, step_basis="", spec=None, measured=None) is None
        )
    assert utilisation_of(WORK, step_seconds=0.0, step_basis="", spec=None, measured=None) is None


def test_spec_lookup_combines_dtypes_and_skips_unknown_cards() -> None:
    class Found:
        def __init__(self, rate: float) -> None:
            self.flops_per_s, self.memory_bytes_per_s = rate, 3.35e12
            self.device, self.source = "Card X", "datasheet"

    def lookup(device: DeviceInfo, dtype: str) -> Found | None:
        return {"bfloat16": Found(989e12), "float32": Found(67e12)}.get(dtype)

    peak = spec_peak_for(DeviceInfo(kind="cuda", name="X"), ["bfloat16", "float32", "x"], lookup)
    assert peak is not None and peak.flops_per_s == {"bfloat16": 989e12, "float32": 67e12}
    assert (
        peak.memory_bytes_per_s == 3.35e12
        and peak.device == "Card X"
        and peak.source == "datasheet"
    )
    assert spec_peak_for(DeviceInfo(kind="cuda"), ["x"], lookup) is None


# --------------------------------------------------------------------------------------------
# The measured peak: a real microbenchmark on this CPU


def test_gemm_rate_counts_two_flops_per_multiply_add() -> None:
    rate = gemm_rate(torch.device("cpu"), "float32", 128, 64, 32, lambda: None)
    assert rate.shape == "128x32 @ 32x64" and rate.repeats >= 3
    assert 1e6 < rate.flops_per_s < 1e14


def test_measured_peaks_take_the_best_shape_and_note_unknown_dtypes() -> None:
    peaks = measure_peaks(torch.device("cpu"), ["float32", "int4"], step_gemm=(16, 16, 16))
    shapes = [g.shape for g in peaks.gemms]
    assert shapes[0] == "16x16 @ 16x16" and len(shapes) == 2
    # Beside the step's GEMM, a square one of at least the floor's edge (which of the two is
    # faster is the machine's business, and a busy one's: the peak is the better of them).
    edge = peaks.gemms[1]
    assert edge.m == edge.n == edge.k >= MIN_SQUARE_EDGE
    assert peaks.flops_per_s["float32"] == max(g.flops_per_s for g in peaks.gemms)
    assert peaks.memory_bytes_per_s is not None and peaks.memory_bytes_per_s > 1e8
    assert any("int4" in n for n in peaks.notes)


def test_square_edge_shrinks_a_shape_too_slow_for_its_budget() -> None:
    cpu = torch.device("cpu")
    # An 8192^3 float32 multiply takes seconds on any CPU: far past the per-shape budget.
    shrunk = square_edge(cpu, "float32", 8192, lambda: None)
    assert MIN_SQUARE_EDGE <= shrunk < 8192
    # Nothing smaller than the floor is ever asked for.
    assert square_edge(cpu, "float32", MIN_SQUARE_EDGE, lambda: None) == MIN_SQUARE_EDGE


# --------------------------------------------------------------------------------------------
# The report's line and the gate


def _record(mfu_scale: float, *, tiny: bool = False) -> RunRecord:
    record = timed_record([2.0 / mfu_scale] * 10)
    record.device = DeviceInfo(kind="cpu", name="cpu")
    record.config = {"preset": "sd15", "size": "tiny" if tiny else "full", "model_dir": None}
    record.utilisation = utilisation_of(
        WORK,
        step_seconds=2.0 / mfu_scale,
        step_basis="median s/it of the timed steps",
        spec=None,
        measured=_peak("measured", 100e12, 10e12, 100e9),
    )
    return record


def test_report_line_agrees_with_the_record() -> None:
    record = _record(1.0)
    view = build_utilisation(record)
    assert view is not None
    # WORK left 3 ops per step uncounted (no shapes): the count is a lower bound, and says so.
    assert "at least 3 TFLOP" in view.line and "6.0% model FLOPs utilisation" in view.line
    assert "120 ms" in view.line and "2.00 s" in view.line
    assert view.caution == ""
    assert [r.label for r in view.rows][-1] == "memory-bound ops (bytes)"
    tiny = build_utilisation(_record(1.0, tiny=True))
    assert tiny is not None and "tiny stand-in" in tiny.caution
    assert build_utilisation(RunRecord(mode="run")) is None
    assert format_flops(4.1e12) == "4.1 TFLOP" and format_flops(2.5e9, per_second=True) == (
        "2.5 GFLOP/s"
    )


def test_gate_says_lower_when_mfu_falls_beyond_the_threshold() -> None:
    options = CompareOptions(fail_on=frozenset({"mfu"}), allow_different=True)
    lower = compare_records([_record(1.0)], _record(0.5), options=options)
    metric = next(m for m in lower.metrics if m.key == "utilisation.mfu")
    assert metric.verdict == "lower" and metric.regressed and metric.unit == "fraction"
    same = compare_records([_record(1.0)], _record(0.98), options=options)
    assert next(m for m in same.metrics if m.key == "utilisation.mfu").verdict == "same"
    higher = compare_records([_record(1.0)], _record(2.0), options=options)
    assert next(m for m in higher.metrics if m.key == "utilisation.mfu").verdict == "higher"
    # The same step on a machine whose microbenchmark ran 30% faster this time: held against the
    # first baseline's peak, the MFU has not changed, and the gate does not say it fell.
    noisy = _record(1.0)
    assert noisy.utilisation is not None
    noisy.utilisation = utilisation_of(
        WORK,
        step_seconds=2.0,
        step_basis="median s/it of the timed steps",
        spec=None,
        measured=_peak("measured", 130e12, 13e12, 100e9),
    )
    steady = compare_records([_record(1.0)], noisy, options=options)
    metric = next(m for m in steady.metrics if m.key == "utilisation.mfu")
    assert metric.verdict == "same" and metric.current == pytest.approx(metric.baseline)
    # Records without utilisation have no MFU metric at all (older records, no shapes).
    plain = RunRecord(mode="run")
    plain.timing.samples = [StepSample(index=i, seconds=1.0) for i in range(10)]
    plain.timing.summarize()
    assert all(
        m.kind != "utilisation" for m in compare_records([plain], plain, options=options).metrics
    )


# --------------------------------------------------------------------------------------------
# The probe: measures the dtypes the step's FLOPs are in, on this CPU


def _ctx_with_work(work: dict[str, Any]) -> Any:
    from diagnose.config import RunConfig
    from diagnose.probes.base import ProbeContext
    from diagnose.record import ProbeResult

    record = RunRecord(mode="run")
    record.probes.append(ProbeResult(name="trace", data={"rules": {"roofline": work}}))
    return ProbeContext(
        config=RunConfig(),
        device=torch.device("cpu"),
        device_info=DeviceInfo(kind="cpu"),
        record=record,
    )


def test_probe_measures_the_step_dtypes_and_feeds_the_record() -> None:
    from diagnose.probes.base import run_probe
    from diagnose.probes.roofline.probe import RooflineProbe, dtypes_to_measure
    from diagnose.roofline.utilisation import settle_utilisation

    # float64 carries 1% of the FLOPs: not worth a microbenchmark; "unknown" cannot be timed.
    shares = {"float32": 0.7e12, "bfloat16": 0.29e12, "float64": 0.01e12, "unknown": 1e12}
    assert dtypes_to_measure(shares) == ["float32", "bfloat16"]
    work = dict(
        WORK,
        flops_by_dtype={"float32": 1.0e9},
        flops_per_step=1.0e9,
        flops_by_class={"gemm": 1.0e9},
    )
    ctx = _ctx_with_work(work)
    result = run_probe(RooflineProbe(), ctx)
    assert result.status == "ok", result.reason
    assert set(result.data["flops_per_s"]) == {"float32"}
    # The small square, and one large square no larger than asked (square_edge may halve it on
    # a slow machine, never below its minimum).
    shapes = {g["shape"] for g in result.data["gemms"]}
    assert "64x64 @ 64x64" in shapes and len(shapes) == 2
    (large,) = shapes - {"64x64 @ 64x64"}
    edge = int(large.split("x")[0])
    assert large == f"{edge}x{edge} @ {edge}x{edge}" and MIN_SQUARE_EDGE <= edge <= 512
    assert result.checks == []  # a measured peak is a number, not a verdict
    record = ctx.record
    record.probes.append(result)
    record.timing.samples = [StepSample(index=i, seconds=0.5) for i in range(5)]
    record.timing.summarize()
    settle_utilisation(record)
    u = record.utilisation
    assert u is not None and u.measured is not None and u.spec is None  # a CPU has no spec
    assert u.measured.mfu is not None and 0 < u.measured.mfu <= 1
    assert u.achieved_flops_per_s == pytest.approx(2.0e9)


def test_probe_skips_without_counted_flops() -> None:
    from diagnose.probes.base import run_probe
    from diagnose.probes.roofline.probe import RooflineProbe

    result = run_probe(RooflineProbe(), _ctx_with_work({}))
    assert result.status == "skipped" and "no FLOPs" in result.reason


# --------------------------------------------------------------------------------------------
# Real GPU traces: MFU against the spec of the trace's own device


GPU_TRACES = (
    "cuda/h100_bert_small_infer.json.gz",
    "cuda/v100_resnet50_num_workers_0.json.gz",
    "rocm/mi300x_bert_small_infer.json.gz",
    "rocm/mi300x_resnet_ddp_bf16_train.json.gz",
    "rocm/mi250_minitoy_train.json.gz",
)


@pytest.mark.parametrize("name", GPU_TRACES)
def test_real_gpu_traces_get_mfu_against_their_cards_spec(name: str) -> None:
    from diagnose.trace.analysis import analysis_to_record, analyze_trace
    from tests.conftest import SHARED_TRACES

    path = SHARED_TRACES / name
    if not path.is_file():
        pytest.skip(f"the shared GPU traces are not here ({SHARED_TRACES})")
    record = analysis_to_record(analyze_trace(path), path)
    u = record.utilisation
    assert u is not None and u.flops_per_step > 0 and u.measured is None
    assert u.spec is not None and u.spec.device, record.device.name
    assert u.spec.mfu is not None and 0 < u.spec.mfu <= 1
    assert u.headline_peak is u.spec
    # The time at peak and the MFU are one number seen two ways, and agree with the s/it.
    assert u.spec.seconds_at_peak == pytest.approx(u.spec.mfu * record.timing.profiled.median)
    view = build_utilisation(record)
    assert view is not None and u.spec.device in view.line and "MFU" in view.line
    for row in u.classes:
        if row.share_of_peak is not None and row.op_class != "memory":
            assert 0 < row.share_of_peak <= 1, row


def test_a_trace_without_shapes_gets_no_utilisation() -> None:
    from diagnose.trace.analysis import analysis_to_record, analyze_trace
    from tests.conftest import SHARED_TRACES

    path = SHARED_TRACES / "cuda/a100_alexnet_train.json.gz"
    if not path.is_file():
        pytest.skip(f"the shared GPU traces are not here ({SHARED_TRACES})")
    record = analysis_to_record(analyze_trace(path), path)
    assert record.utilisation is None
    assert any(
        c.id == "compute.flops_counted" and c.outcome == "not_judged" for c in record.all_checks()
    )
