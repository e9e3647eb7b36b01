"""Findings name the component that pays them, and the trace's steps are grouped by input shape.

Real CPU traces captured here with ``with_stack=True`` (which records an ``nn.Module:`` range per
module forward): a tiny transformers ``T5EncoderModel`` (random weights) feeding a tiny diffusers
``UNet2DConditionModel``, the way a text-to-image step runs them. One planted fault per trace and
a clean twin: hand-written attention in the text encoder (T5's eager attention, as on the
SD3.5/Flux traces), in the denoiser (diffusers' legacy ``AttnProcessor``), or nowhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.catalogs import attention_catalog as ac
from diagnose.catalogs import specs
from diagnose.record import Finding, step_seconds
from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from diagnose.trace.modules import classify
from diagnose.verdicts import WARN_SHARE, grade, settle

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

SEQ = 8
WIDTH = 16


def _text_encoder(attention: str) -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=64,
        d_model=WIDTH,
        d_kv=4,
        d_ff=2 * WIDTH,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
    )
    config._attn_implementation = attention  # "eager": matmul → softmax → matmul by hand
    return transformers.T5EncoderModel(config).eval()


def _denoiser(legacy_attention: bool) -> torch.nn.Module:
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=WIDTH,
        layers_per_block=1,
        attention_head_dim=8,
        norm_num_groups=8,
        mid_block_type=None,
    ).eval()
    unet.set_attn_processor(AttnProcessor() if legacy_attention else AttnProcessor2_0())
    return unet


def capture(path: Path, *, encoder: str, legacy_unet: bool, sizes: tuple[int, ...] = (8,)) -> Path:
    """Profile text encoder + denoiser steps (one per entry of ``sizes``, the latent size) with
    module ranges, after one profiler warm-up step, and save the trace."""
    torch.manual_seed(0)
    text_encoder, unet = _text_encoder(encoder), _denoiser(legacy_unet)
    ids = torch.randint(0, 64, (1, SEQ))
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        with_stack=True,
        schedule=schedule(wait=0, warmup=1, active=len(sizes), repeat=1),
    ) as prof:
        for size in (sizes[0], *sizes):
            with torch.no_grad():
                hidden = text_encoder(input_ids=ids).last_hidden_state
                unet(torch.randn(1, 4, size, size), 10, encoder_hidden_states=hidden)
            prof.step()
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("module_traces")
    cases = {
        "text_encoder": {"encoder": "eager", "legacy_unet": False},
        "denoiser": {"encoder": "sdpa", "legacy_unet": True},
        "clean": {"encoder": "sdpa", "legacy_unet": False},
    }
    return {
        name: analyze_trace(capture(folder / f"{name}.json", **kwargs))  # type: ignore[arg-type]
        for name, kwargs in cases.items()
    }


def _manual(a: TraceAnalysis) -> Finding | None:
    return next((f for f in a.findings if f.id == ac.MANUAL_ID), None)


def test_component_names_generalise() -> None:
    """Class names of the real components (and trainers' record_function labels) classify."""
    assert classify("nn.Module: T5EncoderModel_0") == "text_encoder"
    assert classify("CLIPTextModelWithProjection_1") == "text_encoder"
    assert classify("Qwen3Model_0") == "text_encoder"
    assert classify("AutoencoderKL_0") == "vae"
    assert classify("UNet2DConditionModel_0") == "denoiser"
    assert classify("FluxTransformer2DModel_0") == "denoiser"
    # A denoiser whose class begins like a text encoder's is still the denoiser.
    assert classify("QwenImageTransformer2DModel_0") == "denoiser"
    assert classify("## text_encoder ##") == "text_encoder"
    assert classify("Linear_3") is None and classify("ResNet_0") is None


def test_text_encoder_attention_names_the_text_encoder_and_its_own_fix(
    traces: dict[str, TraceAnalysis],
) -> None:
    finding = _manual(traces["text_encoder"])
    assert finding is not None
    assert "text encoder (T5EncoderModel)" in finding.title
    components = finding.evidence["components"]
    assert [c["component"] for c in components] == ["text_encoder"]
    assert components[0]["path"].startswith("T5EncoderModel_0/")
    assert components[0]["path"].endswith("T5Attention_0")
    # The denoiser's switches are not what fixes it.
    assert finding.fix == ac.TEXT_ENCODER_MANUAL_FIX
    assert "AttnProcessor2_0()" not in finding.fix and "pass --sdpa" not in finding.fix


def test_denoiser_attention_names_the_denoiser_and_the_processor_fix(
    traces: dict[str, TraceAnalysis],
) -> None:
    finding = _manual(traces["denoiser"])
    assert finding is not None
    assert "denoiser (UNet2DConditionModel)" in finding.title
    assert {c["component"] for c in finding.evidence["components"]} == {"denoiser"}
    assert finding.fix == ac.MANUAL_FIX


def test_clean_twin_is_quiet(traces: dict[str, TraceAnalysis]) -> None:
    clean = traces["clean"]
    assert _manual(clean) is None
    assert any(c.id == ac.MANUAL_ID and c.outcome == "ok" for c in clean.checks)


def test_severity_follows_the_share_of_the_step(
    traces: dict[str, TraceAnalysis], tmp_path: Path
) -> None:
    """The text encoder's attention is a small part of a step the denoiser dominates: graded by
    the one rule on its share of the step (info below the warning share), whatever its kind."""
    record = analysis_to_record(traces["text_encoder"], tmp_path / "trace.json")
    settle(record, specs())
    finding = next(f for f in record.findings if f.id == ac.MANUAL_ID)
    step = step_seconds(record)
    assert step and finding.est_seconds_saved_per_it is not None
    share = finding.est_seconds_saved_per_it / step
    assert finding.severity == grade(share, finding.saving_basis)
    if share < WARN_SHARE:
        assert finding.severity == "info"


def capture_buckets(path: Path, sizes: tuple[int, ...], *, empty_ops: bool = False) -> Path:
    """A plain training loop (conv net, AdamW) stepped at the image sizes given, profiled with
    record_shapes and no module ranges: the shapes alone tell the buckets apart. ``empty_ops``:
    every other step also handles an empty tensor, as a DataLoader sets up shared storage."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(16, 3, 3, padding=1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=len(sizes), repeat=1),
    ) as prof:
        for n, size in enumerate((sizes[0], *sizes)):
            if empty_ops and n % 2:
                torch.empty(0).to(torch.float64).detach_()
            images = torch.randn(2, 3, size, size)
            loss = (model(images) - images).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def bucket_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("bucket_traces")
    return {
        "two": analyze_trace(capture_buckets(folder / "two.json", (32, 256) * 3)),
        "one": analyze_trace(capture_buckets(folder / "one.json", (32,) * 4)),
        "one, empty ops": analyze_trace(
            capture_buckets(folder / "empty.json", (32,) * 4, empty_ops=True)
        ),
    }


def test_two_bucket_trace_reports_each_bucket(
    bucket_traces: dict[str, TraceAnalysis], tmp_path: Path
) -> None:
    from diagnose.reports.headline import NOISY_RELATIVE_SPREAD, build_headline

    two = bucket_traces["two"]
    buckets = [s.bucket for s in two.steps]
    assert buckets == ["2x3x32x32", "2x3x256x256"] * 3
    assert any("2 input shapes" in n for n in two.notes)
    record = analysis_to_record(two, tmp_path / "two.json")
    per_bucket = record.timing.buckets()
    assert set(per_bucket) == {"2x3x32x32", "2x3x256x256"}
    assert per_bucket["2x3x256x256"].median > per_bucket["2x3x32x32"].median
    mix = (per_bucket["2x3x32x32"].median + per_bucket["2x3x256x256"].median) / 2
    assert record.timing.per_iteration == pytest.approx(mix)
    headline = build_headline(record)
    assert "2x3x32x32" in headline.how and "2x3x256x256" in headline.how
    # All steps together spread beyond the noise threshold; the verdict reads each bucket.
    assert record.timing.profiled.relative_spread > NOISY_RELATIVE_SPREAD
    within = max(b.relative_spread for b in per_bucket.values())
    assert headline.noisy == (within > NOISY_RELATIVE_SPREAD)


@pytest.mark.parametrize("twin", ["one", "one, empty ops"])
def test_one_shape_twin_has_no_buckets(bucket_traces: dict[str, TraceAnalysis], twin: str) -> None:
    # Ops that saw only empty tensors in some steps (a DataLoader's storage) are no input size.
    one = bucket_traces[twin]
    assert {s.bucket for s in one.steps} == {""}
    assert not any("input shapes" in n for n in one.notes)
