"""The precision, launch and data-loading rules name the component that pays their finding.

Precision and data loading on real CPU traces captured here with ``with_stack=True`` (which
records an ``nn.Module:`` range per module forward): a tiny diffusers ``AutoencoderKL`` encoding
the batch the way trainers call it (``vae.encode``, so the trace's outermost VAE range is its
``Encoder``), a tiny ``UNet2DConditionModel`` under bf16 autocast, a tiny transformers
``T5EncoderModel``. The launch rule needs a GPU trace, so its traces are built event by event in
the Kineto layout, with the ``python_function`` module ranges torch writes. Each planted fault
has twins: the cost in another component, and the same trace without module ranges, which must
read exactly as it did before components were named.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.catalogs.compute_catalog import LAUNCH_BOUND
from diagnose.catalogs.dataloader_catalog import (
    CACHE_LATENTS_ADVICE,
    DEFAULT_WORKERS,
    GPU_STARVED,
    usual_fix,
)
from diagnose.catalogs.precision_catalog import UPCAST_FIX, UPCAST_ID
from diagnose.record import Finding
from diagnose.trace.analysis import TraceAnalysis, analyze_trace
from diagnose.trace.components import CACHE_TEXT_ENCODER_ADVICE
from diagnose.trace.modules import module_scopes
from diagnose.trace.reader import read_trace
from diagnose.trace.structure import build_structure
from tests.test_trace_modules import _denoiser, _text_encoder
from tests.test_trace_synthetic import AUTOGRAD, MAIN, PID, TraceBuilder

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def _finding(analysis: TraceAnalysis, finding_id: str) -> Finding:
    found = [f for f in analysis.findings if f.id == finding_id]
    assert found, [f.id for f in analysis.findings]
    return found[0]


def _roles(finding: Finding) -> list[str]:
    return [c["component"] for c in finding.evidence.get("components", [])]


# --------------------------------------------------------------------------------------------
# Which ranges are the VAE's


def _module(b: TraceBuilder, name: str, ts: float, dur: float) -> None:
    b.events.append(
        {
            "ph": "X",
            "cat": "python_function",
            "name": f"nn.Module: {name}",
            "pid": PID,
            "tid": MAIN,
            "ts": ts,
            "dur": dur,
            "args": {},
        }
    )


def _scopes(tmp_path: Path, ranges: list[tuple[str, float, float]]) -> Any:
    b = TraceBuilder()
    b.op_with_kernel("aten::mm", 0, "gemm", 5)
    for name, ts, dur in ranges:
        _module(b, name, ts, dur)
    trace = read_trace(b.save(tmp_path / "modules.json"))
    return module_scopes(trace, build_structure(trace))


def test_an_autoencoder_half_called_on_its_own_is_the_vae(tmp_path: Path) -> None:
    """``vae.encode(x)`` never enters ``AutoencoderKL.forward``: its ``Encoder`` is the outermost
    range, and the convolutions under it make it the VAE's. A text model's encoder holds none."""
    encode = _scopes(tmp_path, [("Encoder_0", 0, 100), ("Conv2d_0", 10, 20)])
    assert encode.role[0] == "vae" and encode.vae_encodes_only()

    clip = _scopes(tmp_path, [("CLIPEncoder_0", 0, 100), ("Linear_0", 10, 20)])
    assert not clip.found

    full = _scopes(
        tmp_path,
        [
            ("AutoencoderKL_0", 0, 300),
            ("Encoder_0", 10, 100),
            ("Conv2d_0", 20, 10),
            ("Decoder_0", 150, 100),
            ("Conv2d_1", 160, 10),
        ],
    )
    assert set(full.role) == {"vae"} and not full.vae_encodes_only()


# --------------------------------------------------------------------------------------------
# Precision: fp32 ops in a bf16 run


class KeptInFp32(torch.nn.Module):
    """A layer the training code runs outside autocast on fp32 inputs: an upcast in the
    denoiser."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.inner(x.float())  # type: ignore[no-any-return]


def _vae() -> Any:
    """A tiny AutoencoderKL (random weights); typed Any for its ``encode``."""
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()


def capture_precision(path: Path, *, fp32_in: str, module_ranges: bool) -> Path:
    """Steps of a bf16 run: the VAE encodes the images, the denoiser runs under autocast.
    ``fp32_in`` is the component left in fp32: "vae" (encoded outside autocast, as a trainer
    keeping the VAE in fp32 does) or "denoiser" (two of its layers upcast)."""
    torch.manual_seed(0)
    vae = _vae()
    unet: Any = _denoiser(legacy_attention=False)
    if fp32_in == "denoiser":
        unet.conv_in = KeptInFp32(unet.conv_in)
        unet.time_embedding.linear_1 = KeptInFp32(unet.time_embedding.linear_1)
    hidden = torch.randn(1, 8, 16)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        with_stack=module_ranges,
        schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
    ) as prof:
        for _ in range(3):
            with torch.no_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32_in != "vae"):
                    latents = vae.encode(torch.randn(1, 3, 16, 16)).latent_dist.sample()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    unet(latents, 10, encoder_hidden_states=hidden)
            prof.step()
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def precision_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("precision_components")
    cases: dict[str, dict[str, Any]] = {
        "vae": {"fp32_in": "vae", "module_ranges": True},
        "denoiser": {"fp32_in": "denoiser", "module_ranges": True},
        "no_modules": {"fp32_in": "vae", "module_ranges": False},
    }
    return {
        name: analyze_trace(capture_precision(folder / f"{name}.json", **kwargs))
        for name, kwargs in cases.items()
    }


def test_fp32_vae_names_the_vae_and_its_own_fix(
    precision_traces: dict[str, TraceAnalysis],
) -> None:
    finding = _finding(precision_traces["vae"], UPCAST_ID)
    assert "in the VAE (Encoder)" in finding.title
    assert _roles(finding)[0] == "vae"
    assert "denoiser" not in _roles(finding)
    assert finding.evidence["components"][0]["share"] > 0.9
    assert finding.detail.startswith("fp32 forward time by component: the VAE (Encoder)")
    # The VAE only encodes here: frozen, so caching the latents comes first; the autocast
    # upcast advice is for training code and is not given.
    assert "only encodes" in finding.fix and "frozen" in finding.fix
    assert CACHE_LATENTS_ADVICE in finding.fix
    assert "bf16" in finding.fix and "--no_half_vae" in finding.fix
    assert UPCAST_FIX not in finding.fix


def test_fp32_in_the_denoiser_names_the_denoiser_not_the_vae(
    precision_traces: dict[str, TraceAnalysis],
) -> None:
    finding = _finding(precision_traces["denoiser"], UPCAST_ID)
    assert "the denoiser (UNet2DConditionModel)" in finding.title
    assert "VAE" not in finding.title
    assert _roles(finding) == ["denoiser"]
    assert finding.fix == UPCAST_FIX


def test_without_module_ranges_the_finding_reads_as_before(
    precision_traces: dict[str, TraceAnalysis],
) -> None:
    finding = _finding(precision_traces["no_modules"], UPCAST_ID)
    assert " in the " not in finding.title and "VAE" not in finding.title
    assert "components" not in finding.evidence
    assert finding.detail.startswith("These are the lowest-level compute ops")
    assert finding.fix == UPCAST_FIX


# --------------------------------------------------------------------------------------------
# Launch: the device waits while the host is inside a component's forward


def launch_trace(path: Path, *, slow: str, module_ranges: bool = True) -> TraceAnalysis:
    """Three steps of a text encoder then a denoiser forward, a short backward and an optimizer
    step. The ``slow`` component launches tiny kernels with host time between them (the device
    waits for each launch); the other queues long kernels back to back."""
    b = TraceBuilder()
    t = 0.0
    for step in range(3):
        step_start = t
        for role, name in (
            ("text_encoder", "T5EncoderModel_0"),
            ("denoiser", "UNet2DConditionModel_0"),
        ):
            start = t
            for _ in range(30 if role == slow else 10):
                if role == slow:
                    t = b.op_with_kernel("aten::mm", t, "gemm_small", 5) + 100
                else:
                    t = b.op_with_kernel("aten::mm", t, "gemm_large", 300)
            if module_ranges:
                _module(b, name, start - 1, t - start + 2)
            # The component's output is read back (a loss, a dtype check): its queued kernels
            # drain before the next component launches, so one's gaps are not hidden by the
            # other's queue.
            t = b.sync(t) + 5
        for _ in range(5):
            b.annotation("autograd::engine::evaluate_function: MmBackward0", t, 25, AUTOGRAD)
            t = b.op_with_kernel("aten::mm", t + 2, "gemm_large", 50, AUTOGRAD) + 5
        opt_start = t
        for _ in range(5):
            t = b.op_with_kernel("aten::_foreach_add_", t, "multi_tensor_apply_kernel", 30)
        b.annotation("Optimizer.step#AdamW.step", opt_start - 1, t - opt_start + 2)
        t = b.sync(t + 5) + 20
        b.annotation(f"ProfilerStep#{step}", step_start, t - step_start)
    return analyze_trace(b.save(path))


def test_launch_gaps_in_the_text_encoder_name_it(tmp_path: Path) -> None:
    finding = _finding(launch_trace(tmp_path / "te.json", slow="text_encoder"), LAUNCH_BOUND.id)
    assert "inside the text encoder (T5EncoderModel)" in finding.title
    components = finding.evidence["components"]
    assert components[0]["component"] == "text_encoder"
    assert components[0]["share"] > 0.5
    assert "while the device waited: the text encoder (T5EncoderModel)" in finding.detail
    # A frozen text encoder next to a denoiser: caching its outputs removes the wait.
    assert finding.fix.startswith("Most of the wait is in the text encoder (T5EncoderModel)")
    assert CACHE_TEXT_ENCODER_ADVICE in finding.fix


def test_launch_gaps_in_the_denoiser_name_the_denoiser(tmp_path: Path) -> None:
    finding = _finding(launch_trace(tmp_path / "unet.json", slow="denoiser"), LAUNCH_BOUND.id)
    assert "inside the denoiser (UNet2DConditionModel)" in finding.title
    assert "text encoder" not in finding.title
    assert finding.evidence["components"][0]["component"] == "denoiser"
    assert "cache" not in finding.fix.split(".")[0]


def test_launch_gaps_without_module_ranges_read_as_before(tmp_path: Path) -> None:
    bare = launch_trace(tmp_path / "bare.json", slow="text_encoder", module_ranges=False)
    named = launch_trace(tmp_path / "named.json", slow="text_encoder")
    finding, with_names = _finding(bare, LAUNCH_BOUND.id), _finding(named, LAUNCH_BOUND.id)
    assert "components" not in finding.evidence
    assert "inside" not in finding.title and "while the device waited" not in finding.detail
    assert with_names.title.startswith(finding.title)
    assert with_names.fix.endswith(finding.fix) and with_names.fix != finding.fix


# --------------------------------------------------------------------------------------------
# Data loading: a Dataset that runs the text encoder is encoding on the fly


class TinyDenoiser(torch.nn.Module):
    """The model the loop trains; its class names it the denoiser, so the trace has components
    whether or not the wait runs one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class Captions(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample's caption, encoded in ``__getitem__`` by the text encoder when one is given;
    otherwise the same wait spent reading (a sleep stands in for I/O)."""

    def __init__(self, encoder: torch.nn.Module | None) -> None:
        self.encoder = encoder

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.encoder is None:
            time.sleep(0.01)
            return torch.randn(8, 16)
        with torch.no_grad():
            for _ in range(4):
                hidden = self.encoder(input_ids=torch.randint(0, 64, (1, 8))).last_hidden_state
        return hidden[0]  # type: ignore[no-any-return]


def capture_loading(path: Path, *, encode: bool) -> Path:
    torch.manual_seed(0)
    model = TinyDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        Captions(_text_encoder("sdpa") if encode else None), batch_size=2, num_workers=0
    )
    with profile(
        activities=[ProfilerActivity.CPU],
        with_stack=True,
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
    ) as prof:
        for step, batch in enumerate(loader):
            model(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
            if step == 3:
                break
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def loading_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceAnalysis]:
    folder = tmp_path_factory.mktemp("loading_components")
    return {
        name: analyze_trace(capture_loading(folder / f"{name}.json", encode=name == "encode"))
        for name in ("encode", "load")
    }


def test_a_text_encoder_in_the_dataset_is_encoding_on_the_fly(
    loading_traces: dict[str, TraceAnalysis],
) -> None:
    finding = _finding(loading_traces["encode"], GPU_STARVED.id)
    assert "the text encoder (T5EncoderModel) encoding on the fly" in finding.title
    assert finding.detail.startswith(
        "Inside next(dataloader) the host spent the wait in the text encoder (T5EncoderModel)"
    )
    assert _roles(finding)[0] == "text_encoder"
    # Caching the encoder's outputs, not more loader workers.
    assert finding.fix.startswith("Cache the text encoder's outputs")
    assert "num_workers" not in finding.fix


def test_a_slow_loader_is_still_data_loading(loading_traces: dict[str, TraceAnalysis]) -> None:
    """Module ranges in the trace (the trained model's), none in the wait: the finding reads as
    it always has."""
    finding = _finding(loading_traces["load"], GPU_STARVED.id)
    assert "on the fly" not in finding.title and "components" not in finding.evidence
    assert finding.fix == usual_fix(DEFAULT_WORKERS, pin_memory=False)
