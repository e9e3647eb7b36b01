"""One step's memory beyond the weights, counted on the meta device, against the peak the CPU
allocator reports for a real step of the same model (the profiler's memory events); and what a
full-size run that would not fit is told before it starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diagnose.config import RunConfig
from diagnose.run import fit_before_running
from diagnose.timing import PhaseTimer
from diagnose.workload import build_workload
from diagnose.workload.data import generate_images
from diagnose.workload.memory import step_memory

CPU = torch.device("cpu")
GIB = 2**30


def _measured_peak(config: RunConfig, folder: Path) -> int:
    """The allocator's peak over one real training step (after a warm-up step): every byte
    allocated while profiling and not yet freed, at its highest."""
    workload = build_workload(config, CPU)
    try:
        batch = next(workload.batches())
        timer = PhaseTimer(lambda: None)
        workload.step(batch, timer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            workload.step(batch, timer)
        path = folder / "memory.json"
        prof.export_chrome_trace(str(path))
    finally:
        workload.close()
    events = json.loads(path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    assert totals, "the profiler recorded no memory events"
    return int(max(totals))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_counted_peak_matches_the_allocators_within_a_fifth(
    tmp_path: Path, checkpointing: bool
) -> None:
    """What two more images in the batch add to the step's peak, counted and measured: the
    activations grow with the batch, while what the allocator also holds that no count covers
    (per-thread scratch of the CPU kernels, caches of earlier tests) does not."""
    generate_images(tmp_path / "images", count=3, seed=1, size=(160, 160))
    peaks: dict[int, tuple[int, int]] = {}
    for batch in (1, 3):
        config = RunConfig(
            preset="sd15",
            size="tiny",
            precision="fp32",
            resolution=[128],
            batch=batch,
            data_dir=str(tmp_path / "images"),
            workers=0,
            grad_checkpointing=checkpointing,
        )
        counted = step_memory(config, "sd15", "tiny")
        assert not counted.error and counted.at == f"128 px, batch {batch}"
        assert counted.checkpointed_peak_bytes is not None and counted.peak_bytes is not None
        # Checkpointing keeps only the blocks' inputs: a real share of the activations goes.
        assert counted.checkpointed_peak_bytes < 0.7 * counted.peak_bytes
        predicted = counted.checkpointed_peak_bytes if checkpointing else counted.peak_bytes
        peaks[batch] = (predicted, _measured_peak(config, tmp_path))
    predicted_growth = peaks[3][0] - peaks[1][0]
    measured_growth = peaks[3][1] - peaks[1][1]
    assert measured_growth > 0
    assert abs(predicted_growth - measured_growth) / measured_growth < 0.2, peaks


def test_a_step_that_fits_only_with_checkpointing_is_told_so_before_running() -> None:
    config = RunConfig(preset="sd15", size="full", precision="bf16-mixed", batch=1)
    counted = step_memory(config, "sd15", "full")
    assert counted.peak_bytes and counted.checkpointed_peak_bytes
    from diagnose.probes.environment import preset_memory

    static = preset_memory(config, "sd15")
    assert static is not None
    # A GPU between the checkpointed peak and the plain one.
    between = static.static_bytes + (counted.peak_bytes + counted.checkpointed_peak_bytes) // 2
    said = fit_before_running(config, "cuda", between)
    assert "512 px, batch 1" in said and "--grad-checkpointing" in said
    # Already checkpointing: it fits, nothing to say; a GPU larger than the plain peak: neither.
    assert (
        fit_before_running(dataclasses.replace(config, grad_checkpointing=True), "cuda", between)
        == ""
    )
    assert fit_before_running(config, "cuda", static.static_bytes + 2 * counted.peak_bytes) == ""
    # Smaller than the checkpointed peak: the batch or resolution must come down.
    small = static.static_bytes + counted.checkpointed_peak_bytes // 2
    assert "lower the batch or resolution" in fit_before_running(config, "cuda", small)


def test_a_model_that_cannot_be_counted_says_why() -> None:
    """Z-Image reads tensor values while it runs (sequence lengths): the meta device has none."""
    counted = step_memory(
        RunConfig(preset="zimage", size="tiny", precision="fp32"), "zimage", "tiny"
    )
    assert counted.peak_bytes is None and "meta" in counted.error
