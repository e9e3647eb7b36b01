"""One step's memory beyond the weights, counted on the meta device, against the peak the CPU
allocator reports for a real step of the same model (the profiler's memory events); and what a
full-size run that would not fit is told before it starts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diagnose.config import RunConfig
from diagnose.errors import ExitCode
from diagnose.run import fit_before_running, out_of_memory_error
from diagnose.timing import PhaseTimer
from diagnose.workload import Workload, build_workload
from diagnose.workload.memory import step_memory
from diagnose.workload.synthetic_images import generate_images

CPU = torch.device("cpu")
GIB = 2**30


def _measured_peak(config: RunConfig, folder: Path) -> tuple[int, int]:
    """The allocator's peak over one real training step (after a warm-up step): every byte
    allocated while profiling and not yet freed, at its highest. The latents are encoded and
    the captions' embeddings cached beforehand, as the count leaves out the encoders: at a tiny
    denoiser's size the VAE's encode of the full-resolution images can hold more than the
    denoiser's whole step. Also what the workload holds between steps (after the warm-up step:
    the optimizer makes its state in its first step)."""
    workload = build_workload(dataclasses.replace(config, cache_text_embeddings=True), CPU)
    try:
        batch = next(workload.batches())
        latents = workload.encode_latents(batch.pixels)
        timer = PhaseTimer(lambda: None)
        workload.step(batch, timer, latents)
        held = _held_between_steps(workload)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            workload.step(batch, timer, latents)
        path = folder / "memory.json"
        prof.export_chrome_trace(str(path))
    finally:
        workload.close()
    events = json.loads(path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    assert totals, "the profiler recorded no memory events"
    return int(max(totals)), held


@pytest.mark.parametrize(
    ("preset", "checkpointing"), [("sd15", False), ("sd15", True), ("zimage", False)]
)
def test_the_counted_peak_matches_the_allocators_within_a_fifth(
    tmp_path: Path, preset: str, checkpointing: bool
) -> None:
    """What two more images in the batch add to the step's peak, counted and measured: the
    activations grow with the batch, while what the allocator also holds that no count covers
    (per-thread scratch of the CPU kernels, caches of earlier tests) does not."""
    generate_images(tmp_path / "images", count=3, seed=1, size=(160, 160))
    peaks: dict[int, tuple[int, int]] = {}
    for batch in (1, 3):
        config = RunConfig(
            preset=preset,
            size="tiny",
            precision="fp32",
            resolution=[128],
            batch=batch,
            data_dir=str(tmp_path / "images"),
            workers=0,
            grad_checkpointing=checkpointing,
        )
        counted = step_memory(config, preset, "tiny")
        assert not counted.error and counted.at == f"128 px, batch {batch}"
        assert counted.checkpointed_peak_bytes is not None and counted.peak_bytes is not None
        # Checkpointing keeps only the blocks' inputs: a real share of the activations goes.
        assert counted.checkpointed_peak_bytes < 0.7 * counted.peak_bytes
        predicted = counted.checkpointed_peak_bytes if checkpointing else counted.peak_bytes
        peaks[batch] = (predicted, _measured_peak(config, tmp_path)[0])
    predicted_growth = peaks[3][0] - peaks[1][0]
    measured_growth = peaks[3][1] - peaks[1][1]
    assert measured_growth > 0
    assert abs(predicted_growth - measured_growth) / measured_growth < 0.2, peaks


#: What torch says when a CUDA step runs out of memory (its first line).
TORCH_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8 GiB"


def _said(config: RunConfig, gpu: int) -> str:
    error = out_of_memory_error(config, gpu, TORCH_OOM)
    assert error.code == ExitCode.UNSUPPORTED
    assert error.message.startswith("the training step ran out of GPU memory: ")
    return error.message


def test_a_step_that_runs_out_of_memory_is_told_whether_checkpointing_would_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the first step only the weights are held against the GPU (no count: seconds of
    meta-device work every run would pay); a step that then runs out of memory is told, from the
    count, what one step peaks at and whether gradient checkpointing would make it fit. The
    run's own step is counted first, the checkpointed one only to answer that."""
    from diagnose.probes.environment.probe import preset_memory
    from diagnose.workload import memory

    config = RunConfig(preset="sd15", size="full", precision="bf16-mixed", batch=1)
    both = step_memory(config, "sd15", "full")
    static = preset_memory(config, "sd15")
    assert both.peak_bytes and both.checkpointed_peak_bytes and static is not None
    # GPUs where the plain peak fits, only the checkpointed one, neither.
    large = static.static_bytes + 2 * both.peak_bytes
    between = static.static_bytes + (both.peak_bytes + both.checkpointed_peak_bytes) // 2
    small = static.static_bytes + both.checkpointed_peak_bytes // 2

    # The counts asked for (each is kept once made, so only the first of a kind costs).
    counted: list[bool] = []
    count = memory.step_memory

    def recording(*args: Any, **kwargs: Any) -> memory.StepMemory:
        counted.extend(kwargs["checkpointing"])
        return count(*args, **kwargs)

    monkeypatch.setattr(memory, "step_memory", recording)
    checkpointed = dataclasses.replace(config, grad_checkpointing=True)
    for gpu in (large, between, small):
        assert fit_before_running(config, "cuda", gpu) == ""  # the weights fit
    assert counted == [], "counted before the first step"

    def said(run: RunConfig, gpu: int) -> tuple[str, list[bool]]:
        counted.clear()
        return _said(run, gpu), list(counted)

    text, modes = said(config, between)
    assert "512 px, batch 1" in text and "--grad-checkpointing" in text
    assert modes == [False, True]  # does not fit: would it with checkpointing?
    text, modes = said(config, small)
    assert "lower the batch or resolution" in text and modes == [False, True]
    text, modes = said(checkpointed, small)
    assert "lower the batch or resolution" in text and modes == [True]
    # The count says it fits, yet the step ran out (another process holds memory, say): torch's
    # own words, and what to lower.
    text, modes = said(config, large)
    assert TORCH_OOM in text and "--grad-checkpointing" in text and modes == [False]
    assert "--grad-checkpointing" not in said(checkpointed, large)[0]


def test_a_model_that_cannot_be_counted_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that reads a tensor's value while it runs cannot be counted on the meta device:
    the count says why instead of guessing."""
    from diagnose.workload import memory
    from diagnose.workload.families import FAMILIES

    family = FAMILIES["sd15"]
    predict = family.predict

    def reads_a_value(*args: object, **kwargs: object) -> torch.Tensor:
        out: torch.Tensor = predict(*args, **kwargs)  # type: ignore[arg-type]
        if out.sum().item() > 0:  # data-dependent control flow, as some models have
            return out
        return out

    monkeypatch.setattr(family, "predict", reads_a_value)
    memory._counted.cache_clear()
    try:
        counted = step_memory(
            RunConfig(preset="sd15", size="tiny", precision="fp32"), "sd15", "tiny"
        )
    finally:
        memory._counted.cache_clear()
    assert counted.peak_bytes is None and "meta" in counted.error


def test_a_model_whose_text_encoder_reads_its_mask_is_counted_at_full_size() -> None:
    """Z-Image's Qwen3 text encoder reads its attention mask's values, which the meta device
    lacks; the count takes the captions' token counts from the host instead. The first report
    this project was built from (Z-Image on an NF4 base, 1024 px, a 16 GB card) is then told,
    when its step runs out of memory, that one step's activations need gradient checkpointing
    to fit."""
    from diagnose.probes.environment.probe import preset_memory

    config = RunConfig(
        preset="zimage",
        size="full",
        precision="bf16-mixed",
        base="nf4",
        optimizer="adamw8bit",
        resolution=[512, 1024],
    )
    counted = step_memory(config, "zimage", "full")
    assert not counted.error and counted.at == "1024 px, batch 1"
    assert counted.peak_bytes and counted.checkpointed_peak_bytes
    static = preset_memory(config, "zimage")
    assert static is not None
    card = 16 * GIB
    assert static.static_bytes + counted.checkpointed_peak_bytes < card
    assert static.static_bytes + counted.peak_bytes > card
    assert fit_before_running(config, "cuda", card) == ""  # the weights fit
    said = _said(config, card)
    assert "1024 px, batch 1" in said and "--grad-checkpointing" in said


def _held_between_steps(workload: Workload) -> int:
    """Bytes the workload holds between steps, measured from its tensors: the frozen weights as
    stored (quantization constants included), the LoRA weights and the optimizer's state."""
    from diagnose.probes.quantization.ab import held_bytes

    frozen = held_bytes([workload.denoiser, *workload.text_encoders, workload.vae])
    lora = sum(p.numel() * p.element_size() for p in workload.lora_parameters())
    state = sum(
        value.numel() * value.element_size()
        for per_parameter in workload.optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    )
    return frozen + lora + state


#: Measures one configuration's peak in a fresh interpreter (argv: the config as JSON, a
#: folder) and prints [step peak, held]: in the suite's own process, caches that earlier tests
#: left to the CPU kernels add a few MB to a step's allocations that a user's run never has.
_MEASURE_IN_A_FRESH_PROCESS = """
import json, sys
from pathlib import Path
from diagnose.config import RunConfig
from tests.test_step_memory import _measured_peak
config = RunConfig(**json.loads(sys.argv[1]))
print(json.dumps(_measured_peak(config, Path(sys.argv[2]))))
"""


@pytest.mark.slow
def test_a_quantized_bases_whole_peak_is_predicted_within_a_fifth(tmp_path: Path) -> None:
    """The whole prediction (the weights as stored, LoRA, gradients, optimizer state and one
    step's activations) against what a real step of the tiny model holds at its peak: its
    tensors between steps plus the allocator's peak over a step, each measured in its own
    fresh process (both at once)."""
    from diagnose.probes.environment.probe import preset_memory

    generate_images(tmp_path / "images", count=3, seed=1, size=(160, 160))
    root = Path(__file__).resolve().parents[1]
    cases = {}
    for preset, base in (("sd15", "int8"), ("zimage", "nf4")):
        config = RunConfig(
            preset=preset,
            size="tiny",
            precision="fp32",
            resolution=[128],
            batch=2,
            base=base,
            data_dir=str(tmp_path / "images"),
            workers=0,
        )
        folder = tmp_path / preset
        folder.mkdir()
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _MEASURE_IN_A_FRESH_PROCESS,
                json.dumps(dataclasses.asdict(config)),
                str(folder),
            ],
            cwd=root,  # `-c` puts the folder first on the path: `tests` imports from it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        cases[preset, base] = (config, child)
    for (preset, base), (config, child) in cases.items():
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
        step_peak, held = json.loads(out.strip().splitlines()[-1])
        predicted = preset_memory(config, preset, size="tiny", activations=True)
        assert predicted is not None and predicted.activation_bytes is not None
        measured = held + step_peak
        whole = predicted.static_bytes + predicted.activation_bytes
        assert abs(whole - measured) / measured < 0.2, (preset, base, whole, held, step_peak)
