"""The data-loading probe end to end: the wait, the hot frames (py-spy), the A/B of the fixes and
the data folder, on real workloads.

Planted fault: 1836x2700 PNGs (slow to decode) decoded and resized on the training thread
(num_workers=0, no cached latents) for a tiny model at 64 px, batch 4: the wait is most of the
step. Clean twin: cached latents and small images. Timings are never asserted beyond large
planted effects: several processes share this machine's cores. The probe's pure parts are
``test_dataloader_verdict.py``; py-spy's recorded output is ``test_dataloader_sampling.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from diagnose import sampling
from diagnose.capture import measure
from diagnose.catalogs.dataloader_catalog import (
    CORRUPT_IMAGES,
    GPU_STARVED,
    SLOW_LOADER,
    BarWait,
    starved_title,
)
from diagnose.cli import main
from diagnose.config import RunConfig
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.dataloader.ab import CAPPED_TIMED_STEPS
from diagnose.probes.dataloader.probe import (
    DataLoaderProbe,
    corrupt_images_finding,
    skipped_files_line,
    usable_cores,
)
from diagnose.record import DeviceInfo, ProbeResult, RunRecord, new_record
from diagnose.run import execute_run
from diagnose.timing import PhaseTimer
from diagnose.verdicts import finding_grade, shown_severity
from diagnose.workload import Workload, build_workload
from diagnose.workload.data import prepare_data
from diagnose.workload.synthetic_images import generate_image, generate_images
from tests.conftest import FIXTURES, ok_lines, one_torch_thread, unjudged_lines

FINDING_ID = GPU_STARVED.id
SLOW_LOADER_ID = SLOW_LOADER.id
CORRUPT_IMAGES_ID = CORRUPT_IMAGES.id

CPU = torch.device("cpu")
HERE = FIXTURES / "dataloader"
HAVE_PY_SPY = sampling.find_py_spy() is not None


# --------------------------------------------------------------------------------------------
# Fixtures: a starved workload and a fed one, each measured and probed once


@dataclass
class Probed:
    workload: Workload
    record: RunRecord
    result: ProbeResult
    before: dict[str, Any]
    children_before: set[int]


def _state(workload: Workload) -> dict[str, Any]:
    params = workload.lora_parameters()
    optimizer = workload.optimizer
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "state": [
            {
                k: (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state[p].items()
            }
            for p in params
        ],
        "loader": workload.loader,
        "config": workload.config,
        "rng": workload.noise_generator.get_state(),
    }


def _assert_restored(before: dict[str, Any], workload: Workload) -> None:
    after = _state(workload)
    assert after["loader"] is before["loader"] and after["config"] is before["config"]
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert [g is None for g in before["grads"]] == [g is None for g in after["grads"]]
    for saved, now in zip(before["state"], after["state"], strict=True):
        assert saved.keys() == now.keys()
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, now[key]), key
            else:
                assert value == now[key]
    assert torch.equal(before["rng"], after["rng"])


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _probe(
    workload: Workload,
    probe: DataLoaderProbe,
    scratch: Path,
    budgets: dict[str, float] | None = None,
) -> Probed:
    measured = measure(workload, steps=3, warmup=1, profiled_steps=0, trace_path=None)
    record = new_record("run")
    record.timing = measured.timing
    record.breakdown = measured.breakdown
    before = _state(workload)
    children = _children()
    scratch.mkdir(parents=True, exist_ok=True)  # as diagnose run's own scratch folder exists
    ctx = ProbeContext(
        config=workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=record,
        workload=workload,
        scratch_dir=scratch,
    )
    # Without a time budget unless one is planted (see tests.test_attention_probe._run).
    result = run_probe(probe, ctx, budgets={} if budgets is None else budgets)
    return Probed(workload, record, result, before, children)


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread for the module's tests (put back after the last one).

    On a 2-core machine shared with other processes, OpenMP threads that wait for a descheduled
    peer make a multi-threaded CPU step swing 10x from one step to the next; the planted effect
    (decode time against compute time) is what these tests are about, not that noise.
    """
    with one_torch_thread():
        yield


def _null_timer() -> PhaseTimer:
    return PhaseTimer(lambda: None)


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 1836x2700 photo-like PNGs: about 9 MB each, tens of ms each to decode (large
    enough that the wait stays over the critical share on a CPU with fast PNG decoding)."""
    folder = tmp_path_factory.mktemp("pngs")
    for number in range(4):
        image = generate_image(number, size=(1836, 2700))
        image.save(folder / f"photo_{number}.png", "PNG", compress_level=1)
    return folder


@pytest.fixture(scope="module")
def starved(png_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probed]:
    # fp32: on a CPU without bf16 units, emulated bf16 compute would dwarf the planted decode.
    config = RunConfig(
        preset="sd15",
        size="tiny",
        precision="fp32",
        resolution=[64],
        batch=4,
        workers=0,
        data_dir=str(png_folder),
    )
    with _one_thread():
        workload = build_workload(config, CPU)
        try:
            yield _probe(workload, DataLoaderProbe(), tmp_path_factory.mktemp("scratch"))
        finally:
            workload.close()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probed]:
    folder = tmp_path_factory.mktemp("small")
    generate_images(folder, count=3, seed=1, size=(96, 80))
    config = RunConfig(
        preset="sd15",
        size="tiny",
        precision="fp32",
        resolution=[64],
        cache_latents=True,
        data_dir=str(folder),
    )
    with _one_thread():
        workload = build_workload(config, CPU)
        try:
            yield _probe(workload, DataLoaderProbe(), tmp_path_factory.mktemp("scratch"))
        finally:
            workload.close()


# --------------------------------------------------------------------------------------------
# Planted fault and clean twin, end to end on real workloads


def test_decoding_big_pngs_on_the_training_thread_is_found(starved: Probed) -> None:
    result = starved.result
    assert result.status == "ok", result.traceback
    finding = next(f for f in result.findings if f.id == FINDING_ID)
    evidence = finding.evidence
    # The planted wait: four 5 MP PNG decodes per step against a tiny model at 64 px.
    assert evidence["data_wait_share_of_step"] >= 0.3
    # The share quoted is the one the phase bar shows: data_wait over the headline step (or over
    # the phases' sum, when the per-phase medians add up to more than the median step).
    record = starved.record
    phases = record.breakdown.seconds
    assert evidence["data_wait_share_of_step"] == pytest.approx(
        phases["data_wait"] / max(record.timing.headline.median, sum(phases.values()))
    )
    grade = finding_grade(finding, record.timing.headline.median)
    assert shown_severity(grade, finding.borderline) in ("warn", "critical")
    assert evidence["dataloader"]["num_workers"] == 0
    assert evidence["dataset"]["formats"] == {"PNG": 4}
    assert evidence["dataset"]["pixels_decoded_per_pixel_trained"] > 500  # 1836x2700 / 64^2
    assert "num_workers=0" in finding.detail and "decodes 1836x2700" in finding.detail
    # Shared wording with the trace rule.
    bar = BarWait(evidence["data_wait_seconds_per_step"], evidence["s_per_it"])
    assert finding.title.startswith(starved_title(bar, has_device=False))
    assert "--cache_latents" in finding.fix or "--max_data_loader_n_workers" in finding.fix


def test_the_ab_shows_a_cache_is_faster_and_the_saving_is_measured(starved: Probed) -> None:
    result = starved.result
    rows = {row["key"]: row for row in result.data["ab"]}
    assert set(rows) == {"configured", "workers", "predecoded", "cached_latents"}
    assert rows["workers"]["num_workers"] == min(usable_cores(), 8)
    assert all(not row["error"] for row in rows.values())
    configured = rows["configured"]["s_per_it_median"]
    # Caching removes the decode (and the VAE encode): a large planted effect.
    fastest_cache = min(
        rows["predecoded"]["s_per_it_median"], rows["cached_latents"]["s_per_it_median"]
    )
    assert fastest_cache < 0.8 * configured
    assert rows["cached_latents"]["data_wait_median"] < 0.2 * rows["configured"]["data_wait_median"]
    finding = next(f for f in result.findings if f.id == FINDING_ID)
    assert finding.saving_basis == "measured"
    assert finding.est_seconds_saved_per_it and finding.est_seconds_saved_per_it > 0
    # Never more than the input phases (wait, copy, encode) of the configured loader took.
    assert finding.est_seconds_saved_per_it <= rows["configured"]["input_phases_median"]
    assert result.data["recommended"] in ("workers", "predecoded", "cached_latents")
    assert "measured" in finding.title


def test_the_hot_frames_are_the_decode_and_the_resize(starved: Probed) -> None:
    if not HAVE_PY_SPY:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    sampled = starved.result.data["sampling"]
    assert sampled["available"] is True, sampled
    functions = [frame["function"] for frame in sampled["top_frames"]]
    assert "ImageFile.load" in functions
    assert any("resize" in name for name in functions)
    assert sampled["categories"].get("image decode", 0) > 0.2
    assert sampled["samples_by_process"].get("main", 0) > 0  # num_workers=0: the main process
    finding = next(f for f in starved.result.findings if f.id == FINDING_ID)
    assert "ImageFile.load" in finding.detail
    assert "Run alone, without the training step, the loader needs" in finding.detail
    assert sampled["loader_alone_batches"] > 0
    assert sampled["py_spy"].startswith("Samples:")
    assert finding.evidence["hot_frames"]


def test_the_workload_is_put_back_and_no_worker_is_left(starved: Probed) -> None:
    _assert_restored(starved.before, starved.workload)
    left = _children() - starved.children_before
    alive = [pid for pid in left if psutil.pid_exists(pid)]
    assert not alive, f"processes left running: {alive}"
    # The workload still trains on its own loader afterwards.
    loss = starved.workload.step(next(iter(starved.workload.loader)), _null_timer())
    assert loss == loss  # finite or not, it ran


def test_cached_latents_with_small_images_is_quiet(fed: Probed) -> None:
    result = fed.result
    assert result.status == "ok", result.traceback
    assert not result.findings
    starved_check = next(c for c in result.checks if c.id == FINDING_ID)
    assert starved_check.outcome == "ok" and starved_check.text.startswith("data loading:")
    assert "compute is not waiting" in starved_check.text
    # Nothing is decoded per step, so nothing is sampled; no fix is left to try, so not even
    # the configured loader is timed again (the run's own steps already were).
    assert result.data["sampling"]["available"] is False
    assert result.data["ab"] == []
    assert result.data["dataloader"]["decodes_images"] is False
    _assert_restored(fed.before, fed.workload)


def _small_images(folder: Path) -> RunConfig:
    """Four small images a tiny fp32 step hardly waits for (decoded on the training thread)."""
    generate_images(folder, count=4, seed=2, size=(64, 64))
    return RunConfig(
        preset="sd15",
        size="tiny",
        precision="fp32",
        resolution=[64],
        workers=0,
        data_dir=str(folder),
    )


def test_a_negligible_wait_spends_no_step_on_loader_fixes(tmp_path: Path) -> None:
    """Clean twin of ``starved``: small images decode in well under a millisecond, so the step
    hardly waits for its batch. More workers and decoded-once images could save at most that
    wait: they are left out with the numbers, py-spy is not started, and only cached latents
    (which also removes the VAE encode) is timed against the configured loader."""
    config = _small_images(tmp_path / "small")
    with _one_thread():
        workload = build_workload(config, CPU)
        try:
            probed = _probe(workload, DataLoaderProbe(), tmp_path / "scratch")
        finally:
            workload.close()
    result = probed.result
    assert result.status == "ok", result.traceback
    phases = probed.record.breakdown.seconds
    share = (phases["data_wait"] + phases.get("h2d", 0.0)) / probed.record.timing.headline.median
    assert share < 0.05, f"the planted small images still waited {share:.1%} of the step"
    assert [row["key"] for row in result.data["ab"]] == ["configured", "cached_latents"]
    left_out = {
        c.id: c
        for c in result.checks
        if c.id in ("dataloader.ab_workers", "dataloader.ab_predecoded")
    }
    assert set(left_out) == {"dataloader.ab_workers", "dataloader.ab_predecoded"}
    assert all(c.outcome == "ok" and "not measured" in c.text for c in left_out.values())
    assert result.data["sampling"]["available"] is False
    assert "no wait for the frames to explain" in result.data["sampling"]["reason"]


def test_past_its_time_budget_each_variant_takes_its_fewest_steps_and_says_why(
    tmp_path: Path,
) -> None:
    """Two timed steps a variant are too few for the A/B to be sure of a loader change, so "no
    loader change measured clearly faster" would be an answer the budget made: with the budget
    planted spent each variant stops there and the answer stays open, saying why; within the
    budget the same probe times every planned step and answers."""
    config = _small_images(tmp_path / "small")
    probe = DataLoaderProbe(timed_steps=5, sample=False)
    with _one_thread():
        workload = build_workload(config, CPU)
        try:
            spent = _probe(workload, probe, tmp_path, {"dataloader": 0.0}).result
            within = _probe(workload, probe, tmp_path, {"dataloader": 3600.0}).result
        finally:
            workload.close()
    assert spent.status == within.status == "ok", spent.traceback or within.traceback
    rows = spent.data["ab"]
    assert rows and all(r["steps"] == CAPPED_TIMED_STEPS and r["stopped_by_budget"] for r in rows)
    # The answer the A/B would have decided says why it did not: not judged when the loop does
    # not wait, else the wait's finding, estimated (the busy machine decides which).
    answers = {c.id: c for c in spent.checks}
    if SLOW_LOADER_ID in answers:
        assert answers[SLOW_LOADER_ID].outcome == "not_judged"
        assert BUDGET_STOPPED in answers[SLOW_LOADER_ID].text
    else:
        (finding,) = [f for f in spent.findings if f.id == FINDING_ID]
        assert finding.saving_basis == "estimated" and BUDGET_STOPPED in finding.detail
    assert all(r["steps"] == 5 and not r["stopped_by_budget"] for r in within.data["ab"])
    assert not any(BUDGET_STOPPED in c.text for c in within.checks)


def test_without_py_spy_the_probe_completes_and_says_why(
    starved: Probed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert sampling.find_py_spy() is None
    ctx = ProbeContext(
        config=starved.workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=starved.record,
        workload=starved.workload,
        scratch_dir=tmp_path,
    )
    result = run_probe(DataLoaderProbe(variants=("configured",), timed_steps=2), ctx)
    assert result.status == "ok", result.traceback
    assert result.data["sampling"] == {
        "available": False,
        "reason": f"py-spy is not installed or not on PATH ({sampling.INSTALL_HINT})",
    }
    assert any(
        line.startswith("hot frames of the loader: py-spy") for line in unjudged_lines(result)
    )
    finding = next(f for f in result.findings if f.id == FINDING_ID)
    assert finding.evidence["hot_frames"] == []
    assert "py-spy is not installed" in finding.evidence["hot_frames_missing"]
    # Only the configured loader was timed: nothing to compare, so the saving is the wait.
    assert finding.saving_basis == "estimated"


# --------------------------------------------------------------------------------------------
# The data folder: corrupt and skipped files, empty folder


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_corrupt_image_and_text_file_are_reported(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(HERE / "mixed_folder", folder)
    with prepare_data(str(folder), [64]) as data:
        info = data.info
    finding = corrupt_images_finding(info)
    assert finding is not None and finding.id == CORRUPT_IMAGES_ID
    assert finding.severity == "warn"  # the catalog's: no time is lost, yet a trainer stops
    assert finding.evidence["corrupt"] == ["broken.jpg"]
    assert finding.evidence["reasons"]["broken.jpg"]
    assert "broken.jpg" in finding.title
    line = skipped_files_line(info)
    assert line is not None and "notes.txt" in line and "1 images used" in line


def test_corrupt_listing_is_capped(tmp_path: Path) -> None:
    generate_images(tmp_path, count=1, size=(64, 48))
    for number in range(14):
        (tmp_path / f"bad_{number:02d}.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with prepare_data(str(tmp_path), [64]) as data:
        finding = corrupt_images_finding(data.info)
    assert finding is not None
    assert len(finding.evidence["corrupt"]) == 10 and finding.evidence["corrupt_count"] == 14
    assert "and 4 more" in finding.title


def test_a_run_on_a_mixed_folder_reports_and_never_touches_it(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(HERE / "mixed_folder", folder)
    before = _digest(folder)
    config = RunConfig(
        preset="sd15",
        size="tiny",
        device="cpu",
        resolution=[64],
        data_dir=str(folder),
        steps=2,
        warmup=0,
        profiled_steps=0,
    )
    out = tmp_path / "out"
    out.mkdir()
    probe = DataLoaderProbe(variants=("configured",), timed_steps=2, sample=False)
    outputs = execute_run(config, out, probes=[probe])
    record = outputs.record
    assert _digest(folder) == before
    ids = {f.id for f in record.findings}
    assert CORRUPT_IMAGES_ID in ids
    result = next(p for p in record.probes if p.name == "dataloader")
    assert result.status == "ok", result.traceback
    assert any("notes.txt" in line for line in ok_lines(result))
    saved = json.loads(outputs.record_path.read_text())
    assert any(f["id"] == CORRUPT_IMAGES_ID for f in saved["findings"])


def test_an_empty_folder_is_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["run", "--data", str(empty), "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 3
