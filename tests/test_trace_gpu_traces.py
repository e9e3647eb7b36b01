"""Real NVIDIA and AMD traces from public projects (../shared/gpu-traces): every rule's behaviour
on traces nobody wrote for this tool."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from diagnose.catalogs import specs
from diagnose.record import PHASES
from diagnose.record_io import load_record
from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from diagnose.verdicts import settle
from tests.conftest import SHARED_TRACES as SHARED
from tests.conftest import ok_lines, unjudged_lines

#: file -> (device kind, device name as the trace records it)
EXPECTED_DEVICES = {
    "cuda/a100_alexnet_train.json.gz": ("cuda", "NVIDIA A100-PG509-200"),
    "cuda/a100_triton_example.json.gz": ("cuda", "NVIDIA A100-PG509-200"),
    "cuda/h100_bert_small_infer.json.gz": ("cuda", "NVIDIA H100 80GB HBM3"),
    "cuda/v100_resnet50_num_workers_0.json.gz": ("cuda", "Tesla V100-DGXS-32GB"),
    "cuda/v100_resnet50_num_workers_4.json.gz": ("cuda", "Tesla V100-DGXS-32GB"),
    "edge/cpu_only.json.gz": ("cpu", "CPU"),
    "edge/mi210_gpu_only.json.gz": ("rocm", "AMD Instinct MI210"),
    "rocm/mi250_minitoy_train.json.gz": ("rocm", "AMD Radeon Graphics"),
    "rocm/mi300x_bert_small_infer.json.gz": ("rocm", "AMD Instinct MI300X VF"),
    "rocm/mi300x_normalization_train.json.gz": ("rocm", "AMD Instinct MI300X"),
    "rocm/mi300x_resnet_ddp_bf16_train.json.gz": ("rocm", "AMD Instinct MI300X"),
    "rocm/mi300x_torch_compile_triton.json.gz": ("rocm", "AMD Instinct MI300X"),
}


@pytest.fixture(scope="module")
def traces() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"real GPU traces not present at {SHARED}")
    return SHARED


@cache
def _analysis(path: str) -> TraceAnalysis:
    return analyze_trace(Path(path))


def analysis(traces: Path, name: str) -> TraceAnalysis:
    return _analysis(str(traces / name))


def ids(a: TraceAnalysis) -> set[str]:
    return {f.id for f in a.findings}


def test_every_shared_trace_is_covered(traces: Path) -> None:
    present = {str(p.relative_to(traces)) for p in traces.glob("*/*.json.gz")}
    assert present >= set(EXPECTED_DEVICES), "a trace named in this test is missing"


@pytest.mark.parametrize("name", sorted(EXPECTED_DEVICES))
def test_analyses_with_device_and_a_valid_record(traces: Path, name: str, tmp_path: Path) -> None:
    a = analysis(traces, name)
    kind, device_name = EXPECTED_DEVICES[name]
    assert (a.device.kind, a.device.name) == (kind, device_name)
    assert a.device.vendor == {"cuda": "NVIDIA", "rocm": "AMD", "cpu": ""}[kind]
    assert a.steps and all(s.wall_seconds > 0 for s in a.steps)
    # Each step's phases account for its wall time.
    for step in a.steps:
        assert set(step.phases) <= set(PHASES)
        assert sum(step.phases.values()) == pytest.approx(step.wall_seconds, rel=1e-6, abs=1e-9)
    if kind != "cpu":
        assert a.kernel_classes, "a GPU trace must show kernel classes"
        assert sum(c.share for c in a.kernel_classes) == pytest.approx(1.0)
        assert a.top_kernels
    # No rule may crash on a real trace.
    assert not [line for line in unjudged_lines(a) if "rule failed" in line]
    for finding in a.findings:
        assert finding.fix and finding.title and finding.evidence
        assert finding.saving_basis in ("estimated", "trace", "none")
    # The record round-trips through JSON.
    record = analysis_to_record(a, traces / name)
    path = tmp_path / "record.json"
    record.save(path)
    loaded = load_record(path)
    assert loaded.mode == "trace"
    assert loaded.device.name == device_name
    assert [s.profiled for s in loaded.timing.samples] == [True] * len(a.steps)
    assert loaded.probes[0].name == "trace"
    json.dumps(loaded.probes[0].data)


def test_vendor_runtime_and_memory(traces: Path) -> None:
    h100 = analysis(traces, "cuda/h100_bert_small_infer.json.gz").device
    assert (h100.arch, h100.runtime, h100.memory_bytes) == ("sm_90", "CUDA 12.4", 85018279936)
    mi300 = analysis(traces, "rocm/mi300x_bert_small_infer.json.gz").device
    assert mi300.runtime.startswith("HIP 6.4") and mi300.memory_bytes == 205571227648
    # No version metadata at all in the 2021 schema: the runtime calls decide.
    v100 = analysis(traces, "cuda/v100_resnet50_num_workers_0.json.gz").device
    assert v100.kind == "cuda" and v100.arch == "sm_70"
    ddp = analysis(traces, "rocm/mi300x_resnet_ddp_bf16_train.json.gz")
    assert ddp.device.extra["rank"] == 0 and ddp.device.extra["world_size"] == 8
    assert any("rank 0 of 8" in note for note in ddp.notes)


def test_fused_attention_is_recognised(traces: Path) -> None:
    for name, kernel in (
        ("cuda/h100_bert_small_infer.json.gz", "pytorch_flash::flash_fwd_kernel"),
        ("rocm/mi300x_bert_small_infer.json.gz", "attn_fwd"),
    ):
        a = analysis(traces, name)
        classes = {c.name for c in a.kernel_classes}
        assert "attention_fused" in classes
        assert not ids(a) & {"attention.math_fallback", "attention.unfused_manual"}
        line = next(line for line in ok_lines(a) if line.startswith("attention:"))
        assert "flash" in line and kernel in line
        paths = a.rule_data["attention"]["paths"]
        assert paths[0]["path"] == "flash" and paths[0]["calls_per_step"] == 4


def test_dataloader_before_and_after(traces: Path) -> None:
    starved = analysis(traces, "cuda/v100_resnet50_num_workers_0.json.gz")
    fed = analysis(traces, "cuda/v100_resnet50_num_workers_4.json.gz")
    record = analysis_to_record(starved, Path(starved.path))
    settle(record, specs())
    finding = next(f for f in record.findings if f.id == "dataloader.gpu_starved")
    assert finding.severity in ("warn", "critical")
    assert finding.evidence["num_workers_zero"] is True
    # The share judged is the one the phase bar shows: data_wait over the median step.
    share = finding.evidence["data_wait_share_of_step"]
    assert 0.2 < share < 0.6
    phases = record.breakdown.seconds
    assert share == pytest.approx(
        phases["data_wait"] / max(record.timing.headline.median, sum(phases.values()))
    )
    assert finding.est_seconds_saved_per_it and finding.est_seconds_saved_per_it > 0.01
    assert "dataloader.gpu_starved" not in ids(fed)
    assert any(line.startswith("data loading:") for line in ok_lines(fed))
    # The breakdown shows the wait: data_wait is a large phase with 0 workers, tiny with 4.
    assert starved.breakdown.seconds["data_wait"] > 10 * fed.breakdown.seconds.get("data_wait", 0)
    assert len(starved.steps) == 6 and {s.number for s in starved.steps} == set(range(5, 11))


def test_training_phases_on_a_gpu_trace(traces: Path) -> None:
    a = analysis(traces, "cuda/v100_resnet50_num_workers_4.json.gz")
    for phase in ("forward", "backward", "optimizer"):
        assert a.breakdown.seconds[phase] > 0
    assert a.breakdown.seconds["backward"] > a.breakdown.seconds["forward"]
    assert a.breakdown.device_seconds_by_kernel_class["conv"] > 0
    assert {o.name for o in a.top_ops[:10]} & {
        "aten::cudnn_convolution",
        "aten::cudnn_convolution_backward_input",
        "aten::cudnn_convolution_backward_weight",
        "aten::cudnn_batch_norm_backward",
    }


def test_bf16_traces_raise_no_upcast_finding(traces: Path) -> None:
    for name in (
        "cuda/h100_bert_small_infer.json.gz",
        "rocm/mi300x_bert_small_infer.json.gz",
        "rocm/mi300x_resnet_ddp_bf16_train.json.gz",
        "rocm/mi300x_torch_compile_triton.json.gz",
    ):
        a = analysis(traces, name)
        assert not any(f.category == "precision" for f in a.findings), name
        assert any(line.startswith("precision:") and "bf16" in line for line in ok_lines(a))


def test_fp32_training_is_reported_as_such(traces: Path) -> None:
    for name in ("rocm/mi250_minitoy_train.json.gz", "cuda/v100_resnet50_num_workers_0.json.gz"):
        a = analysis(traces, name)
        record = analysis_to_record(a, Path(a.path))
        settle(record, specs())
        finding = next(f for f in record.findings if f.category == "precision")
        # Its saving is an estimate (a typical low-precision speed-up), never critical.
        assert finding.id == "precision.fp32_training" and finding.saving_basis == "estimated"
        assert finding.severity in ("info", "warn")
    v100 = analysis(traces, "cuda/v100_resnet50_num_workers_0.json.gz")
    fix = next(f.fix for f in v100.findings if f.id == "precision.fp32_training")
    assert "fp16" in fix  # a V100 has no fast bf16


def test_no_dtypes_means_not_judged(traces: Path) -> None:
    a = analysis(traces, "cuda/a100_alexnet_train.json.gz")
    assert any("record_shapes" in line for line in unjudged_lines(a))
    assert a.whole_trace_window and any("No ProfilerStep" in n for n in a.notes)


def test_cpu_only_trace(traces: Path) -> None:
    a = analysis(traces, "edge/cpu_only.json.gz")
    assert a.device.kind == "cpu" and not a.kernel_classes
    assert any("No GPU kernels" in n for n in a.notes)
    assert any(line.startswith("launch overhead") for line in unjudged_lines(a))
    assert "idle" not in a.breakdown.seconds


def test_gpu_only_trace(traces: Path) -> None:
    a = analysis(traces, "edge/mi210_gpu_only.json.gz")
    assert a.kernel_classes and not a.top_ops
    assert any("No CPU ops" in n for n in a.notes)
    assert any(line.startswith("precision") for line in unjudged_lines(a))
    assert any(line.startswith("data loading") for line in unjudged_lines(a))
    # Without ops the device time is placed by its kernels: the backward kernels name
    # themselves, the work between two of them is backward too; what stays unknown is named so.
    assert a.breakdown.seconds["backward"] > a.breakdown.seconds["forward"] > 0
    assert "other" not in a.breakdown.seconds
    assert any(n.startswith("GPU work of unknown phase") for n in a.notes)


def test_kernel_classes_of_both_vendors(traces: Path) -> None:
    expect = {
        "rocm/mi300x_torch_compile_triton.json.gz": {"gemm", "attention_fused", "triton"},
        "rocm/mi300x_resnet_ddp_bf16_train.json.gz": {"communication", "conv", "norm"},
        "cuda/v100_resnet50_num_workers_0.json.gz": {"conv", "norm", "gemm", "softmax"},
        "rocm/mi250_minitoy_train.json.gz": {"gemm", "optimizer", "memcpy"},
    }
    for name, classes in expect.items():
        found = {c.name for c in analysis(traces, name).kernel_classes}
        assert classes <= found, (name, found)


def test_launch_bound_small_inference(traces: Path) -> None:
    """BERT-small at batch 1: tens of 5 µs kernels with launch gaps between them."""
    a = analysis(traces, "cuda/h100_bert_small_infer.json.gz")
    finding = next(f for f in a.findings if f.id == "compute.launch_bound")
    assert finding.evidence["share_of_step"] > 0.5
    assert "kernel launches" in finding.title
    busy = analysis(traces, "rocm/mi300x_torch_compile_triton.json.gz")
    assert "compute.launch_bound" not in ids(busy)


def test_exposed_communication_is_judged(traces: Path) -> None:
    """DDP on 8 MI300X: most of each step the device runs only RCCL kernels; a single-GPU trace
    has no collectives and is not asked."""
    a = analysis(traces, "rocm/mi300x_resnet_ddp_bf16_train.json.gz")
    finding = next(f for f in a.findings if f.id == "distributed.exposed_communication")
    assert "% of the step" in finding.title
    single = analysis(traces, "cuda/v100_resnet50_num_workers_4.json.gz")
    assert not any(c.id == "distributed.exposed_communication" for c in single.checks)
