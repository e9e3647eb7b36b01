"""Fixes in the words of the trainer that ran, and how a run shows which trainer it is."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from diagnose.catalogs import CONCERN_MODULES
from diagnose.trace.reader import read_trace
from diagnose.trainers import (
    TRAINERS,
    accumulation_setting,
    in_trainers,
    speak_to,
    trainer_in_packages,
    trainer_in_trace,
)

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "gpu-traces"


def test_a_fix_keeps_its_general_words_and_the_trainers_own() -> None:
    fix = in_trainers(
        "Use bf16 autocast.",
        kohya="--mixed_precision bf16",
        diffusers="--mixed_precision bf16",
        lightning='Trainer(precision="bf16-mixed")',
    )
    assert (
        speak_to(fix, "lightning")
        == 'Use bf16 autocast. Lightning: Trainer(precision="bf16-mixed")'
    )
    assert speak_to(fix, "kohya") == "Use bf16 autocast. kohya/sd-scripts: --mixed_precision bf16"


def test_a_list_inside_parentheses_with_parentheses_of_its_own() -> None:
    words = in_trainers(
        kohya="--cache_latents (kept between runs), no --random_crop",
        lightning="DataLoader(num_workers=4) in train_dataloader()",
    )
    fix = f"cache the latents ({words}), then time again"
    assert speak_to(fix, "lightning") == (
        "cache the latents (Lightning: DataLoader(num_workers=4) in train_dataloader()), "
        "then time again"
    )
    assert speak_to(fix, "kohya") == (
        "cache the latents (kohya/sd-scripts: --cache_latents (kept between runs), no "
        "--random_crop), then time again"
    )


def test_a_list_without_the_trainers_words_stays_whole() -> None:
    fix = in_trainers("Cache the latents.", kohya="--cache_latents", onetrainer="latent caching")
    assert speak_to(fix, "lightning") == fix
    assert speak_to(fix, "no-such-trainer") == fix
    assert speak_to("", "lightning") == ""


def _catalog_texts() -> list[str]:
    texts = []
    for name in CONCERN_MODULES:
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, str) and any(f"{t}: " in value for t in TRAINERS.values()):
                texts.append(value)
    return texts


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_every_catalog_fix_speaks_to_one_trainer(trainer: str) -> None:
    texts = _catalog_texts()
    assert len(texts) >= 5
    own = f"{TRAINERS[trainer]}: "
    for text in texts:
        spoken = speak_to(text, trainer)
        general = text[: min(text.index(f"{t}: ") for t in TRAINERS.values() if f"{t}: " in text)]
        assert spoken.startswith(general)
        if own in text:
            others = [t for key, t in TRAINERS.items() if key != trainer and f"{t}: " in spoken]
            assert not others, (trainer, spoken)
            assert own in spoken
        else:
            assert spoken == text


def test_lightning_is_seen_in_its_profiler_ranges_and_its_packages() -> None:
    assert trainer_in_trace(["aten::mm", "[pl][profile][Strategy]SingleDeviceStrategy.backward"])
    assert trainer_in_trace(["[LightningModule]Model.training_step"]) == "lightning"
    assert trainer_in_trace(["ProfilerStep#3", "Optimizer.step#AdamW.step", "aten::addmm"]) is None
    assert trainer_in_packages({"torch": 1, "lightning": 1}) == "lightning"
    assert trainer_in_packages(["pytorch_lightning"]) == "lightning"
    assert trainer_in_packages(["torch", "accelerate", "diffusers"]) is None


def test_accumulation_in_the_trainers_words() -> None:
    assert accumulation_setting("lightning", 4) == "Trainer(accumulate_grad_batches=4)"
    assert accumulation_setting("kohya", 2) == "--gradient_accumulation_steps 2"
    assert accumulation_setting(None, 2) == ""


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="needs ../shared/gpu-traces")
def test_no_shared_trace_is_taken_for_a_lightning_run() -> None:
    traces = sorted(SHARED_TRACES.glob("*/*.json*"))
    assert traces
    for path in traces:
        assert trainer_in_trace(read_trace(path).names) is None, path.name
