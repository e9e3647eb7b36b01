"""Syncs anywhere in the step: each planted one named where it happens, its clean twin quiet, and
the cost on the basis it says; then the two real GPU traces of the project's first GPU run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diagnose.catalogs import specs
from diagnose.record import Finding, RunRecord
from diagnose.reports import terminal_summary
from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from diagnose.trace.context import SAVING_ON_UNPROFILED_STEPS
from diagnose.verdicts import settle
from tests.conftest import FIXTURES, ok_lines, unjudged_lines
from tests.synthetic_gpu import Fault, KinetoWriter, lora_loop

SYNC_IDS = {"optimizer.sync_in_step", "compute.sync_in_step"}
PARAMS, BLOCKS = 24, 4


def _record(path: Path, unprofiled: float | None = None) -> RunRecord:
    analysis = analyze_trace(path, unprofiled_step_seconds=unprofiled)
    record = analysis_to_record(analysis, path)
    settle(record, specs())
    return record


def _sync_findings(record: RunRecord) -> list[Finding]:
    return [f for f in record.findings if f.id in SYNC_IDS]


@pytest.mark.parametrize(
    ("fault", "finding_id", "place", "what", "per_step", "said"),
    [
        ("loss_logging", "compute.sync_in_step", "logging", ".item()", 1, "(logging)"),
        ("clipping", "compute.sync_in_step", "clipping", ".item()", PARAMS, "gradient norms"),
        ("in_step", "optimizer.sync_in_step", "optimizer", ".item()", PARAMS, "optimizer.step()"),
        ("forward_cpu", "compute.sync_in_step", "forward", ".cpu()", BLOCKS, "in the forward"),
    ],
)
def test_each_planted_sync_is_named_where_it_happens(
    tmp_path: Path, fault: Fault, finding_id: str, place: str, what: str, per_step: int, said: str
) -> None:
    record = _record(lora_loop(tmp_path / f"{fault}.json", fault, params=PARAMS, blocks=BLOCKS))
    [finding] = _sync_findings(record)
    assert finding.id == finding_id
    [where] = finding.evidence["places"]
    assert (where["place"], where["what"], where["syncs_per_step"]) == (place, what, per_step)
    assert said in finding.title and f"{per_step}" in finding.title
    # A device .item() copies and then waits: one sync, named by its wait.
    assert set(where["calls_in_profiled_steps"]) == {"cudaStreamSynchronize"}
    assert 0 < finding.evidence["read_off_seconds_per_step"] <= finding.est_seconds_saved_per_it
    step = record.timing.profiled.median
    assert finding.est_seconds_saved_per_it is not None and finding.est_seconds_saved_per_it < step
    assert "lower bound" in finding.title  # trace-only: the read-off part says what it is
    if fault == "forward_cpu":
        assert "Block" in finding.title  # the module the .cpu() ran in
    if fault == "clipping":
        assert "clip_grad_norm_" in finding.fix
    if fault == "in_step":
        assert "does not synchronise by itself" in finding.fix  # torch AdamW: look at the code


def test_the_clean_twin_is_quiet(tmp_path: Path) -> None:
    record = _record(lora_loop(tmp_path / "clean.json", "none", params=PARAMS, blocks=BLOCKS))
    assert not _sync_findings(record)
    said = ok_lines(record.probes[0])
    assert any(line.startswith("optimizer: no host-device syncs") for line in said)
    assert any(line.startswith("syncs: none outside the optimizer's step") for line in said)


def test_scalar_reads_on_cpu_tensors_are_not_syncs(tmp_path: Path) -> None:
    """torch AdamW's step counters and a loop's CPU scalars: .item() with no blocking call."""
    path = lora_loop(tmp_path / "cpu.json", "cpu_scalars", params=PARAMS, blocks=BLOCKS)
    analysis = analyze_trace(path)
    reading = analysis.rule_data["syncs"]
    assert reading["syncs_per_step"] == 0
    assert not [f for f in analysis.findings if f.id in SYNC_IDS]


def test_a_synchronize_that_closes_the_step_is_not_the_steps_work(tmp_path: Path) -> None:
    path = lora_loop(tmp_path / "timed.json", "closing_sync", params=PARAMS, blocks=BLOCKS)
    record = _record(path)
    assert not _sync_findings(record)
    assert any("1 closing the step not counted" in line for line in ok_lines(record.probes[0]))


def test_cost_grows_with_the_syncs_and_the_unprofiled_step_takes_the_profiler_out(
    tmp_path: Path,
) -> None:
    few = _record(lora_loop(tmp_path / "few.json", "clipping", params=12))
    many = _record(lora_loop(tmp_path / "many.json", "clipping", params=48))
    [a], [b] = _sync_findings(few), _sync_findings(many)
    assert b.evidence["syncs_per_step"] == 4 * a.evidence["syncs_per_step"]
    assert b.est_seconds_saved_per_it is not None and a.est_seconds_saved_per_it is not None
    assert b.est_seconds_saved_per_it > 3 * a.est_seconds_saved_per_it

    path = tmp_path / "known.json"
    lora_loop(path, "clipping", params=48)
    profiled = many.timing.profiled.median
    known = _record(path, unprofiled=profiled * 0.7)
    [c] = _sync_findings(known)
    # The profiler's per-launch time is taken out of the windows: less read off than profiled.
    assert c.evidence["profiler_us_per_launch_taken_out"] > 0
    assert c.evidence["read_off_seconds_per_step"] < b.evidence["read_off_seconds_per_step"]
    assert c.evidence[SAVING_ON_UNPROFILED_STEPS] is True
    assert "per unprofiled step" in c.title and "lower bound" not in c.title


def test_a_cpu_trace_has_no_syncs_to_judge() -> None:
    analysis = analyze_trace(FIXTURES / "traces" / "cpu_train_loop.json.gz")
    lines = unjudged_lines(analysis)
    assert any("syncs: a trace without device activity" in line for line in lines)
    assert not [f for f in analysis.findings if f.id in SYNC_IDS]


# --------------------------------------------------------------------------------------------
# The project's first GPU run (../shared/gpu-evidence): two real traces of the same LoRA loop


@pytest.fixture(scope="module")
def foreach(shared_evidence: Path) -> tuple[TraceAnalysis, RunRecord]:
    path = shared_evidence / "traces" / "lora_adamw_foreach.json.gz"
    analysis = analyze_trace(path)
    record = analysis_to_record(analysis, path)
    settle(record, specs())
    return analysis, record


@pytest.fixture(scope="module")
def bnb(shared_evidence: Path) -> RunRecord:
    return _record(shared_evidence / "traces" / "lora_bnb_adamw8bit.json.gz")


def test_torch_adamw_reading_its_cpu_step_counters_makes_no_sync(
    foreach: tuple[TraceAnalysis, RunRecord],
) -> None:
    analysis, record = foreach
    assert analysis.rule_data["syncs"]["syncs_per_step"] == 0
    assert not _sync_findings(record)
    assert "148 ms" not in json.dumps(record.to_dict())


#: Measured without the profiler on the H200: the 8-bit optimizer's loop against the foreach one.
BNB_COST_S = 0.054 - 0.0347


def test_bitsandbytes_per_parameter_synchronize_is_found_and_costed(bnb: RunRecord) -> None:
    [finding] = _sync_findings(bnb)
    assert finding.id == "optimizer.sync_in_step"
    [place] = finding.evidence["places"]
    assert place["optimizer"] == "Optimizer.step#AdamW8bit.step"
    assert place["syncs_per_step"] == 96
    assert place["calls_in_profiled_steps"] == {"cudaDeviceSynchronize": 3 * 96}
    assert "96 cudaDeviceSynchronize" in finding.title
    assert finding.severity in ("warn", "critical")
    saving: Any = finding.est_seconds_saved_per_it
    assert saving == pytest.approx(BNB_COST_S, rel=0.3)
    assert "without the profiler" in finding.title
    assert "bitsandbytes" in finding.fix and "fused=True" in finding.fix


def test_a_real_trace_names_its_blocking_copies_to_the_device(shared_traces: Path) -> None:
    """The 2021 V100 ResNet loop copies each batch from pageable memory: torch waits on the
    stream after each copy."""
    analysis = analyze_trace(shared_traces / "cuda" / "v100_resnet50_num_workers_0.json.gz")
    [finding] = [f for f in analysis.findings if f.id == "compute.sync_in_step"]
    [place] = finding.evidence["places"]
    assert (place["place"], place["what"], place["syncs_per_step"]) == ("h2d", ".to(device)", 2)
    assert "pin_memory=True" in finding.fix and "non_blocking=True" in finding.fix


# --------------------------------------------------------------------------------------------
# Input shapes: read from the data that enters the model


def test_the_input_shape_is_the_batch_copys_not_the_samplers(tmp_path: Path) -> None:
    """A new epoch's sampler draws a permutation inside the DataLoader's range in one step: its
    ops are no image size (the first GPU trace read "shape 1" and "24" off them)."""
    path = lora_loop(tmp_path / "epoch.json", steps=3, new_epoch_at=2)
    analysis = analyze_trace(path)
    assert [s.bucket for s in analysis.steps] == ["8x3x64x64"] * 3
    assert any("one input shape (8x3x64x64" in note for note in analysis.notes)
    record = analysis_to_record(analysis, path)
    assert record.timing.buckets() == {}
    assert "one input shape, 8x3x64x64" in terminal_summary(record)


def test_buckets_of_a_gpu_loop_are_its_batch_shapes(tmp_path: Path) -> None:
    small, large = [2, 3, 64, 64], [2, 3, 128, 96]
    path = lora_loop(tmp_path / "two.json", steps=4, batches=(small, large), new_epoch_at=3)
    analysis = analyze_trace(path)
    assert [s.bucket for s in analysis.steps] == ["2x3x64x64", "2x3x128x96"] * 2
    assert any("read from the batch's host→device copy" in note for note in analysis.notes)


def test_the_real_trace_trained_one_input_shape(
    foreach: tuple[TraceAnalysis, RunRecord],
) -> None:
    analysis, record = foreach
    assert {s.bucket for s in analysis.steps} == {"8x3x256x256"}
    summary = terminal_summary(record)
    assert "one input shape, 8x3x256x256" in summary
    assert "shape 1" not in summary and "24 " not in summary.split("\n")[0]


def test_diagnose_runs_own_phase_timer_syncs_are_not_the_codes(tmp_path: Path) -> None:
    """diagnose run synchronises at the edges of its diagnose::<phase> ranges to time them; a
    .item() of the code inside a phase is still the code's."""
    w = KinetoWriter()
    for number in range(3):
        with w.label(f"ProfilerStep#{number}"):
            for phase in ("forward", "backward", "optimizer"):
                w.synchronize("cudaDeviceSynchronize")
                with w.label(f"diagnose::{phase}"):
                    for _ in range(5):
                        with w.op("aten::mm", [[64, 64], [64, 64]]):
                            w.kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 50.0)
                    if phase == "forward":
                        w.item(on_device=True)
                    w.synchronize("cudaDeviceSynchronize")
    analysis = analyze_trace(w.save(tmp_path / "run.json"))
    reading = analysis.rule_data["syncs"]
    assert reading["harness_syncs_per_step"] == 6
    [finding] = [f for f in analysis.findings if f.id in SYNC_IDS]
    assert finding.evidence["syncs_per_step"] == 1 and "1 .item()" in finding.title
