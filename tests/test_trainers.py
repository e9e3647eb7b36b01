"""Fixes in the words of the trainer that ran, and how a run shows which trainer it is."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------------------------
# Each trainer's own layout, run under `diagnose profile`: small fakes of the trainers' source
# trees (the modules their scripts import from their own folder, or the script's name alone),
# each training a loop whose data comes slower than its step, so that a fix in every trainer's
# words is found.

LOOP = """
import sys, time, torch
{imports}
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):  # a decode slower than the step: the loop waits for its data
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.randn(16)

model = torch.nn.Linear(16, 16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, x in enumerate(DataLoader(Slow(), batch_size=2)):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 5:
        break
"""

#: trainer (None: a plain loop of the user's) -> (its files, the script, the script's imports).
LAYOUTS: dict[str | None, tuple[tuple[str, ...], str, str]] = {
    "kohya": (
        ("library/__init__.py", "library/train_util.py"),
        "train_network.py",
        "import library.train_util",
    ),
    "onetrainer": (
        ("modules/__init__.py", "modules/trainer/__init__.py", "modules/trainer/GenericTrainer.py"),
        "train.py",
        "from modules.trainer.GenericTrainer import *",
    ),
    "ai-toolkit": (("toolkit/__init__.py", "toolkit/job.py"), "run.py", "import toolkit.job"),
    "simpletuner": (
        (
            "helpers/__init__.py",
            "helpers/training/__init__.py",
            "helpers/training/state_tracker.py",
        ),
        "train.py",
        "from helpers.training import state_tracker",
    ),
    "diffusers": ((), "train_text_to_image_lora_sdxl.py", ""),
    None: ((), "train.py", ""),
}


def _profile_layout(folder: Path, trainer: str | None) -> dict[str, object]:
    files, script, imports = LAYOUTS[trainer]
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("")
    (folder / script).write_text(LOOP.format(imports=imports))
    out = folder / "out"
    options = ["--skip-steps", "1", "--steps", "2", "--profile-steps", "1", "--no-stacks"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "diagnose",
            "profile",
            "--out",
            str(out),
            *options,
            "--",
            sys.executable,
            script,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),  # several at once on a shared machine
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, dict[str, object]]:
    base = tmp_path_factory.mktemp("layouts")
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {t: pool.submit(_profile_layout, base / str(t), t) for t in LAYOUTS}
        return {trainer: run.result() for trainer, run in runs.items()}


def _starved_fix(record: dict[str, Any]) -> str:
    (finding,) = [f for f in record["findings"] if f["id"] == "dataloader.gpu_starved"]
    return str(finding["fix"])


@pytest.mark.parametrize("trainer", [t for t in LAYOUTS if t is not None])
def test_each_trainers_layout_is_recognised_and_spoken_to(
    layouts: dict[str | None, dict[str, Any]], trainer: str
) -> None:
    record = layouts[trainer]
    assert record["config"].get("trainer") == trainer
    (note,) = [n for n in record["notes"] if n.startswith("Trainer: ")]
    assert note.startswith(f"Trainer: {TRAINERS[trainer]} (")
    fix = _starved_fix(record)
    others = [name for key, name in TRAINERS.items() if key != trainer and f"{name}: " in fix]
    if f"{TRAINERS[trainer]}: " in fix:
        # Its own words wherever the fix has them; another's only in a list without them.
        assert "where this project knows them" in note or not others, (note, fix)
    else:  # no words of its own in this fix (SimpleTuner): the lists stay whole, and say so
        assert others and "where this project knows them" in note, (note, fix)


def test_kohyas_layout_gets_kohyas_words_only_and_a_plain_loop_the_generic_form(
    layouts: dict[str | None, dict[str, Any]],
) -> None:
    kohya = _starved_fix(layouts["kohya"])
    assert "kohya/sd-scripts: --max_data_loader_n_workers" in kohya
    assert [name for name in TRAINERS.values() if f"{name}: " in kohya] == ["kohya/sd-scripts"]
    plain = layouts[None]
    assert "trainer" not in plain["config"]
    assert not [n for n in plain["notes"] if n.startswith("Trainer: ")]
    generic = _starved_fix(plain)
    spoken = [name for name in TRAINERS.values() if f"{name}: " in generic]
    assert {"kohya/sd-scripts", "diffusers scripts", "OneTrainer", "Lightning"} <= set(spoken)


def test_trainers_are_told_apart_by_module_and_script() -> None:
    from diagnose.profile import capture_describe
    from diagnose.trainers import trainer_in_script, watched_modules

    # Every module that names a trainer is one a profiled process reports (the capture cannot
    # import this package, so it keeps its own list).
    assert set(watched_modules()) <= set(capture_describe.FRAMEWORK_PACKAGES)
    assert trainer_in_packages(["torch", "library", "library.train_util"]) == "kohya"
    assert trainer_in_packages(["library", "modules", "toolkit", "helpers"]) is None  # anyone's
    assert trainer_in_packages(["simpletuner", "diffusers", "accelerate"]) == "simpletuner"
    assert trainer_in_script("/home/u/diffusers/examples/train_dreambooth_lora_flux.py") == (
        "diffusers"
    )
    assert trainer_in_script("textual_inversion_sdxl.py") == "diffusers"
    for generic in ("train.py", "run.py", "train_network.py", "my_train_text.py"):
        assert trainer_in_script(generic) is None, generic
