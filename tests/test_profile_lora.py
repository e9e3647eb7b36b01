"""`diagnose profile` on a diffusers + peft LoRA loop launched with `accelerate launch`.

The script is written as the diffusers examples are: an `Accelerator` whose mixed precision comes
from `accelerate launch --mixed_precision bf16`, a prepared UNet with a LoRA adapter, a DataLoader.
The faulty run plants two faults users meet: a block that turns autocast off and computes in fp32
(an upcast), and attention forced onto SDPA's unfused math path; its twin plants neither.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main

pytest.importorskip("accelerate")

TRAIN_LORA = textwrap.dedent(
    """
    import argparse, contextlib, torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.data import DataLoader, Dataset

    parser = argparse.ArgumentParser()
    parser.add_argument("--max_train_steps", type=int, default=8)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--upcast_mid_block", action="store_true")
    parser.add_argument("--fp32_module", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator()

    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=8,
    )
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    )
    if args.upcast_mid_block:
        inner = unet.mid_block.forward
        def fp32_mid_block(*a, **k):
            up = lambda v: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            with torch.autocast(accelerator.device.type, enabled=False):
                return inner(*[up(v) for v in a], **{n: up(v) for n, v in k.items()})
        unet.mid_block.forward = fp32_mid_block
    if args.fp32_module:
        # One module left in fp32 inside the bf16 run, as a hand-made upcast leaves it.
        planted = unet.get_submodule(args.fp32_module)
        plain = planted.forward
        def fp32_module(x, *a, **k):
            with torch.autocast(accelerator.device.type, enabled=False):
                return plain(x.float(), *a, **k)
        planted.forward = fp32_module
    scheduler = DDPMScheduler(num_train_timesteps=1000)

    class Latents(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.latents = torch.randn(64, 4, 16, 16, generator=g)
            self.text = torch.randn(64, 8, 64, generator=g)
        def __len__(self):
            return len(self.latents)
        def __getitem__(self, i):
            return self.latents[i], self.text[i]

    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    loader = DataLoader(Latents(), batch_size=4, shuffle=True)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    forced = args.attention == "math"
    attention = sdpa_kernel(SDPBackend.MATH) if forced else contextlib.nullcontext()
    step = 0
    with attention:
        while step < args.max_train_steps:
            for latents, text in loader:
                noise = torch.randn_like(latents)
                t = torch.randint(0, 1000, (latents.shape[0],), device=latents.device)
                noisy = scheduler.add_noise(latents, noise, t)
                pred = unet(noisy, t, encoder_hidden_states=text).sample
                loss = F.mse_loss(pred.float(), noise.float())
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step == args.max_train_steps:
                    break
    print("trained", step, "loss", repr(loss.item()))
    """
)
LAUNCH = [
    "-m",
    "accelerate.commands.launch",
    "--cpu",
    "--num_processes",
    "1",
    "--num_machines",
    "1",
    "--mixed_precision",
    "bf16",
    "--dynamo_backend",
    "no",
    "--num_cpu_threads_per_process",
    "1",
]
OPTIONS = ["--skip-steps", "1", "--steps", "2", "--profile-steps", "2"]


def _profiled(folder: Path, *faults: str) -> dict[str, Any]:
    script = folder / "train_lora.py"
    script.write_text(TRAIN_LORA)
    out = folder / "out"
    # One step past the capture's 1 + 2 + 1 (probe) + 2: the run trains on after it.
    command = [sys.executable, *LAUNCH, str(script), "--max_train_steps", "7", *faults]
    code = main(["profile", "--out", str(out), *OPTIONS, "--", *command])
    assert code == 0
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("lora-faulty")
    return _profiled(folder, "--attention", "math", "--upcast_mid_block")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _profiled(tmp_path_factory.mktemp("lora-clean"))


def _outcomes(record: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["outcome"] for p in record["probes"] for c in p.get("checks", [])}


def _finding(record: dict[str, Any], finding_id: str) -> dict[str, Any] | None:
    return next((f for f in record["findings"] if f["id"] == finding_id), None)


def test_the_planted_math_attention_is_found(faulty: dict[str, Any]) -> None:
    finding = _finding(faulty, "attention.math_fallback")
    assert finding is not None
    assert "math" in finding["title"]


def test_the_math_path_saving_is_measured_here_and_agrees_with_its_verdict(
    faulty: dict[str, Any],
) -> None:
    """Which backend wins on this CPU is the machine's to say; what the finding claims must
    follow from what was measured, whichever way it went."""
    finding = _finding(faulty, "attention.math_fallback")
    assert finding is not None
    measured = finding["evidence"]["measured_here"]
    # The trace's own shape of the planted calls: the UNet's attention at its latent size.
    assert measured["signature"].endswith("bfloat16 fwd+bwd")
    if "not_measured" in measured:
        # A machine too slow for the budget (bf16 emulated in software) says so and keeps the
        # trace's estimate, with the reason on the page.
        assert "over the" in measured["not_measured"], measured["not_measured"]
        assert "Not measured on this machine" in finding["detail"]
        assert finding["saving_basis"] != "measured"
        return
    (trial,) = [t for t in measured["ab"]["trials"] if t["backend"] == "math"]
    assert trial["runs"] and trial["samples"] >= 3
    outcomes = {v["outcome"] for v in measured["verdicts"].values()}
    saving = finding["est_seconds_saved_per_it"]
    if "faster" in outcomes:
        assert saving > 0 and finding["saving_basis"] == "measured"
        assert "measured" in finding["title"] and "faster with" in finding["title"]
    elif outcomes == {"not_faster"}:
        assert saving == 0 and finding["saving_basis"] == "measured"
        assert "No fused backend was faster here" in finding["detail"]
    else:
        assert saving is None and "could not decide" in finding["detail"]
    # Measured per step, not read off the profiled steps: no scaling is claimed for it.
    assert "saving_scaled_by" not in finding["evidence"]


def test_the_planted_upcast_is_found_and_placed(faulty: dict[str, Any]) -> None:
    finding = _finding(faulty, "precision.fp32_compute_in_low_precision_run")
    assert finding is not None
    # The capture names where autocast was off: the planted block, and no other.
    off = finding["evidence"]["autocast_off_in_trained_modules"]
    assert off["examples"] == ["UNet2DConditionModel.mid_block"]
    assert 0 < off["modules"] < off["of"]
    assert "mid_block" in finding["detail"]


def test_the_accelerate_flag_is_seen_to_reach_the_step(
    faulty: dict[str, Any], clean: dict[str, Any]
) -> None:
    # accelerate enters its autocast inside the prepared model's forward: the capture must see
    # it there, not at the UNet's own pre-hook (where it is still off).
    for record in (faulty, clean):
        assert _outcomes(record)["profile.precision_claim"] == "ok"
        assert record["config"]["precision"] == "bf16-mixed"
        assert _finding(record, "precision.fp32_training") is None


def test_the_clean_twin_stays_quiet(clean: dict[str, Any]) -> None:
    outcomes = _outcomes(clean)
    assert outcomes["attention.math_fallback"] == "ok"
    assert outcomes["precision.fp32_compute_in_low_precision_run"] == "ok"
    assert not [f for f in clean["findings"] if f["category"] in ("attention", "precision")]


def test_no_saving_is_larger_than_the_step(faulty: dict[str, Any], clean: dict[str, Any]) -> None:
    for record in (faulty, clean):
        step = record["timing"]["unprofiled"]["median"]
        phases = sum(record["breakdown"]["seconds"].values())
        # The trace's phases are the profiled steps' shares of the unprofiled step.
        assert phases <= step * 1.5
        for finding in record["findings"]:
            saving = finding["est_seconds_saved_per_it"]
            assert saving is None or saving <= step
