"""The quantization probe: the same LoRA step on a quantized base and on the unquantized one,
timed interleaved; their outputs; the memory each holds against its prediction.

Real bitsandbytes 4-bit layers (its CPU build) under a real peft LoRA on the tiny SD1.5. The
compute dtype is fp32: on a CPU without bf16 units a bf16 step is emulated many times slower,
and the base's storage, not the compute dtype, is under test.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.catalogs.quantization_catalog import DEQUANT_COST, NUMERICS
from diagnose.catalogs.quantization_catalog import MIN_SHARE as DEQUANT_COST_MIN_SHARE
from diagnose.config import RunConfig
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.environment.probe import preset_memory
from diagnose.probes.quantization.ab import compare_outputs, held_bytes
from diagnose.probes.quantization.probe import QuantizationProbe
from diagnose.quantized_base import KINDS
from diagnose.record import DeviceInfo, ProbeResult, RunRecord, new_record
from diagnose.units import per_it
from diagnose.workload import Workload, build_workload
from diagnose.workload.synthetic_images import generate_images
from tests.conftest import one_torch_thread

pytest.importorskip("bitsandbytes")
CPU = torch.device("cpu")


def _config(folder: Path, **changes: Any) -> RunConfig:
    config = RunConfig(
        preset="sd15",
        size="tiny",
        precision="fp32",
        resolution=[64],
        data_dir=str(folder),
        workers=0,
        steps=2,
        warmup=1,
    )
    return dataclasses.replace(config, **changes)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=3, seed=1, size=(96, 80))
    return folder


@pytest.fixture(scope="module")
def nf4(images: Path) -> Iterator[Workload]:
    workload = build_workload(_config(images, base="nf4"), CPU)
    try:
        yield workload
    finally:
        workload.close()


def _probe(workload: Workload, record: RunRecord | None = None) -> ProbeResult:
    ctx = ProbeContext(
        config=workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=record or new_record("run"),
        workload=workload,
    )
    with one_torch_thread():  # its A/B times steps (see one_torch_thread)
        # Without a time budget: what the probe reports is under test, not how long it took.
        return run_probe(QuantizationProbe(), ctx, budgets={})


def _lora_state(workload: Workload) -> list[torch.Tensor]:
    return [p.detach().clone() for p in workload.lora_parameters()]


@pytest.fixture(scope="module")
def probed(nf4: Workload) -> tuple[ProbeResult, bool]:
    """The probe run once on the NF4 workload, and whether it left the LoRA weights as it found
    them (its extra steps must not change the run)."""
    before = _lora_state(nf4)
    result = _probe(nf4)
    after = _lora_state(nf4)
    return result, all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _slow_record() -> RunRecord:
    """A record whose s/it is so slow that rounds of both bases would outlast the A/B's budget,
    as at a real model's size."""
    from diagnose.probes.quantization.ab import BUDGET_S, MIN_ROUNDS
    from diagnose.record import Stats

    record = new_record("run")
    slow = BUDGET_S / MIN_ROUNDS  # two steps a round: twice the budget
    record.timing.unprofiled = Stats.of([slow, slow, slow])
    return record


def test_a_quantized_base_costs_a_measured_share_of_the_step(
    probed: tuple[ProbeResult, bool],
) -> None:
    result, untouched = probed
    assert result.status == "ok", result.reason or result.traceback
    ab = result.data["ab"]
    # bitsandbytes expands every 4-bit weight on every call: the fp32 base is surely faster,
    # unless the machine's load swung enough to explain the gap (the probe then says it could
    # not be sure, and counts the comparison it set aside: the design, not a miss).
    load = result.host_load
    set_aside = load is not None and load.comparisons_set_aside > 0
    assert ab["outcome"] == "faster" or (ab["outcome"] == "inconclusive" and set_aside), ab
    if ab["outcome"] == "inconclusive":
        pytest.skip(f"the load's swings set the A/B aside: {ab['ratio']}")
    (finding,) = [f for f in result.findings if f.id == DEQUANT_COST.id]
    stored = sorted(ab["stored_step_seconds"])[len(ab["stored_step_seconds"]) // 2]
    assert finding.saving_basis == "measured"
    assert finding.est_seconds_saved_per_it is not None
    assert 0 < finding.est_seconds_saved_per_it < stored
    assert 0 <= (finding.sure_seconds_saved_per_it or 0) <= finding.est_seconds_saved_per_it
    assert "NF4" in finding.title and "fp32" in finding.title
    assert untouched  # the probe's extra steps left the run's LoRA weights as they were


def test_the_outputs_agree_within_the_documented_bound(probed: tuple[ProbeResult, bool]) -> None:
    result, _ = probed
    errors = result.data["relative_error"]
    assert set(errors) == {"denoiser", "text encoders"}
    # Rounding to 4 bits moves the outputs, but only as far as the kind's bound.
    assert all(0 < e < KINDS["nf4"].relative_error_bound for e in errors.values()), errors
    outcomes = {c.id: c.outcome for c in result.checks}
    assert outcomes[NUMERICS.id] == "ok"


def test_a_broken_quantized_kernel_is_a_critical_finding(images: Path) -> None:
    """Planted: the stored 4-bit codes overwritten, as a build whose kernel reads them wrong
    would compute; the quantized base then computes something else, not just less exactly."""
    workload = build_workload(_config(images, base="nf4"), CPU)
    try:
        generator = torch.Generator().manual_seed(0)
        for module in workload.denoiser.modules():
            if type(module).__name__ == "Linear4bit":
                data = module.weight.data
                data.copy_(torch.randint(0, 256, data.shape, generator=generator).to(data.dtype))
        result = _probe(workload, _slow_record())  # the outputs are compared, steps not timed
    finally:
        workload.close()
    (finding,) = [f for f in result.findings if f.id == NUMERICS.id]
    assert finding.severity == "critical"
    assert result.data["relative_error"]["denoiser"] > KINDS["nf4"].relative_error_bound
    assert "denoiser" in finding.title


def test_an_unquantized_base_is_not_probed(images: Path) -> None:
    """The clean twin: the base stored in the compute dtype has nothing to expand."""
    for base in (None, "fp32"):
        workload = build_workload(_config(images, base=base), CPU)
        try:
            result = _probe(workload)
        finally:
            workload.close()
        assert result.status == "skipped"
        assert "not stored quantized" in result.reason
        assert not result.findings


@pytest.mark.parametrize("base", ["nf4", "int8", "fp8", None])
def test_the_memory_prediction_matches_the_weights_held(images: Path, base: str | None) -> None:
    """The full-size memory comes from parameter counts; at tiny size the same counting must
    match the bytes the built base really holds (quantization constants included)."""
    config = _config(images, base=base)
    workload = build_workload(config, CPU)
    try:
        held = held_bytes([workload.denoiser, *workload.text_encoders, workload.vae])
    finally:
        workload.close()
    predicted = preset_memory(config, "sd15", size="tiny")
    assert predicted is not None
    assert abs(predicted.frozen_bytes - held) / held < 0.05, (predicted.frozen_bytes, held)


def test_the_t5_and_fp8_bases_of_a_flow_model_compute_what_they_store(images: Path) -> None:
    """Regressions the probe found: T5 casts its feed-forward input to ``wo``'s weight dtype (a
    4-bit weight's is uint8, so ``wo`` stays unquantized, as transformers leaves it), and
    diffusers casts timestep embeddings to a linear layer's weight dtype (an fp8-stored weight
    reads as the compute dtype)."""
    config = _config(images, preset="flux", resolution=None)
    reference = build_workload(config, CPU)
    try:
        for kind in ("nf4", "fp8"):
            stored = build_workload(dataclasses.replace(config, base=kind), CPU)
            try:
                errors = compare_outputs(stored, reference)
            finally:
                stored.close()
            assert set(errors) == {"denoiser", "text encoders"}
            bound = KINDS[kind].relative_error_bound  # type: ignore[index]
            assert all(0 < e < bound for e in errors.values()), (kind, errors)
    finally:
        reference.close()


def test_steps_too_slow_for_the_budget_are_not_timed_but_still_compared(nf4: Workload) -> None:
    """At a real model's s/it, rounds of both bases would outlast the A/B's budget: the outputs
    are still compared, the steps are not timed, and the page says why."""
    result = _probe(nf4, _slow_record())
    assert result.status == "ok", result.reason or result.traceback
    assert "ab" not in result.data and "relative_error" in result.data
    outcomes = {c.id: (c.outcome, c.text) for c in result.checks}
    outcome, text = outcomes[DEQUANT_COST.id]
    assert outcome == "not_judged" and "over the" in text
    assert not result.findings
    # What each base needs is measured, not timed: the page still says it, and what it advises.
    assert "Here the frozen weights held" in text and "At full size the model needs" in text
    assert result.data["memory_text"] and result.data["memory_text"].rstrip(".") in text


def test_a_step_that_is_mostly_the_vaes_encode_is_still_timed_and_judged_whole(
    nf4: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VAE is not stored quantized: its encode is the same work in both arms. A step that is
    mostly that encode (bf16 convolutions on a CPU without bf16 units, at 1024 px) is timed
    past it, and a difference is still judged as a share of the whole step.

    Planted: an encode that also sleeps, and an A/B budget that rounds of the whole step would
    overrun but rounds past the encode fit, by half an encode's sleep whatever the machine's
    load (an encode the probe measures takes at least the sleep)."""
    from diagnose.probes.quantization import probe as quantization
    from diagnose.record import Stats
    from diagnose.timing import PhaseTimer

    vae_seconds = 0.3
    encode = nf4.encode_latents
    encodes: list[int] = []

    def slow_encode(pixels: torch.Tensor) -> torch.Tensor:
        encodes.append(1)
        time.sleep(vae_seconds)
        return encode(pixels)

    monkeypatch.setattr(nf4, "encode_latents", slow_encode)
    snapshot = nf4.snapshot()
    steps = []
    with one_torch_thread():
        for _ in range(3):
            start = time.perf_counter()
            nf4.step(next(nf4.batches()), PhaseTimer(lambda: None))
            steps.append(time.perf_counter() - start)
    snapshot.restore()
    record = new_record("run")
    record.timing.unprofiled = Stats.of(steps)
    headline = statistics.median(steps)
    steps_of_both = 2 * quantization.MIN_ROUNDS
    monkeypatch.setattr(quantization, "BUDGET_S", steps_of_both * (headline - vae_seconds / 2))
    encodes.clear()

    result = _probe(nf4, record)
    assert result.status == "ok", result.reason or result.traceback
    ab = result.data["ab"]
    assert ab["vae_encode_seconds"] >= vae_seconds
    # The timed steps left the encode out, every one of them: the probe encoded the batches it
    # shares between the arms, once each, and timed more steps than that.
    assert 1 <= len(encodes) <= 2 < len(ab["stored_step_seconds"])
    stored_step = statistics.median(ab["stored_step_seconds"])
    # A difference is judged as a share of the step the page leads with, the encode in it.
    assert ab["judged_against_seconds"] == pytest.approx(headline)
    found = [f for f in result.findings if f.id == DEQUANT_COST.id]
    if ab["outcome"] == "faster":
        (finding,) = found
        saving = finding.est_seconds_saved_per_it
        assert saving is not None and 0 < saving < stored_step
        assert saving / headline > 0.5 * DEQUANT_COST_MIN_SHARE
        assert "ran once before the timing" in finding.detail
        text = finding.title
    else:
        assert not found
        (check,) = [c for c in result.checks if c.id == DEQUANT_COST.id]
        text = check.text
    # The page says the steps were timed past the encode, with their own numbers.
    assert per_it(stored_step) in text and "past the VAE's encode" in text, text


def test_past_its_time_budget_the_a_b_takes_no_new_round_and_says_why(
    nf4: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round of each base can never decide the A/B (the U test needs five a side), so only
    the probe's time budget, planted spent, stops the rounds at the first; the answer says it."""
    from diagnose.probes.quantization import ab

    monkeypatch.setattr(ab, "MIN_ROUNDS", 1)
    ctx = ProbeContext(
        config=nf4.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=new_record("run"),
        workload=nf4,
    )
    with one_torch_thread():
        result = run_probe(QuantizationProbe(), ctx, budgets={"quantization": 0.0})
    assert result.status == "ok", result.reason or result.traceback
    ab = result.data["ab"]
    assert len(ab["stored_step_seconds"]) == len(ab["unquantized_step_seconds"]) == 1
    assert ab["outcome"] == "inconclusive" and ab["stopped_by_budget"]
    (check,) = [c for c in result.checks if c.id == DEQUANT_COST.id]
    assert check.outcome == "not_judged" and BUDGET_STOPPED in check.text
    assert not [f for f in result.findings if f.id == DEQUANT_COST.id]


def test_the_a_b_steps_on_batches_of_one_bucket(images: Path) -> None:
    """With two resolution buckets, a round of a small batch and a large one would mix two
    step times in one sample: the A/B's batches are all of the first batch's bucket."""
    from diagnose.probes.quantization.ab import shared_latents

    workload = build_workload(_config(images, base="nf4", resolution=[64, 128]), CPU)
    try:
        seen = {next(workload.batches()).resolution for _ in range(6)}
        assert seen == {64, 128}  # the loader really mixes them
        shared = shared_latents(workload)
    finally:
        workload.close()
    assert len(shared.batches) == 2
    assert len({batch.resolution for batch in shared.batches}) == 1
    pairs = zip(shared.latents, shared.batches, strict=True)
    assert all(latent.shape[-1] * 8 == batch.resolution for latent, batch in pairs)
    assert shared.encode_seconds > 0


def test_the_budget_is_judged_on_the_a_b_buckets_own_step() -> None:
    """With a small and a large bucket, the run's mixed s/it is not what a round of the A/B's
    bucket costs: the budget is judged on that bucket's own s/it."""
    from diagnose.probes.quantization.probe import _bucket_seconds
    from diagnose.record import StepSample
    from diagnose.workload.data import ImageBatch

    record = new_record("run")
    for index, (bucket, seconds) in enumerate(
        [("512x512", 16.0), ("1024x1024", 75.0), ("512x512", 16.4), ("1024x1024", 76.0)]
    ):
        record.timing.samples.append(StepSample(index=index, seconds=seconds, bucket=bucket))
    record.timing.summarize()

    def batch(side: int) -> ImageBatch:
        return ImageBatch(torch.zeros(1, 3, side, side), ["a photo"], ["a.png"])

    assert _bucket_seconds(record, batch(512)) == pytest.approx(16.2)
    assert _bucket_seconds(record, batch(1024)) == pytest.approx(75.5)
    assert _bucket_seconds(record, batch(768)) is None  # not a bucket of this run


def test_the_advice_follows_what_fits_the_gpu() -> None:
    """bf16 when it fits, fp8 when only it fits, the quantized base when nothing else does."""
    from diagnose.probes.quantization.probe import _memory_text

    gib = 2**30
    memory = {
        "stored_full_size_bytes": 7 * gib,
        "unquantized_full_size_bytes": 16 * gib,
        "fp8_full_size_bytes": 10 * gib,
    }
    said = {
        size: _memory_text("NF4", "bf16", {**memory, "device_bytes": size * gib})
        for size in (24, 12, 8)
    }
    assert "the bf16 base fits" in said[24] and "store the base unquantized" in said[24]
    assert "fp8 storage does" in said[12]
    assert "only the quantized base fits" in said[8]
    assert "7.00 GiB" in said[8] and "16.00 GiB" in said[8] and "10.00 GiB as fp8" in said[8]
    # Without a GPU's size (a CPU run) the rule is said, not applied.
    assert "only where the unquantized one does not fit" in _memory_text("NF4", "bf16", memory)


def test_without_an_a_b_the_trace_rules_reading_stands_and_says_why(nf4: Workload) -> None:
    """A share the trace rule read as too small to be a finding is still an answer: a probe
    that could not time its A/B adds the reason to it instead of setting it aside."""
    record = _slow_record()
    trace = ProbeResult(name="trace")
    trace.add_ok(DEQUANT_COST.id, "quantization: its quantized layers take 3% of each step")
    record.probes = [trace]
    result = _probe(nf4, record)
    assert not [c for c in result.checks if c.id == DEQUANT_COST.id]
    (read,) = trace.checks
    assert read.text.startswith("quantization: its quantized layers take 3%")
    assert "not measured against the unquantized base" in read.text and "over the" in read.text
