"""The data-loading probe: the wait, the hot frames (py-spy), the A/B of the fixes, the folder.

Planted fault: 1836x2700 PNGs (slow to decode) decoded and resized on the training thread
(num_workers=0, no cached latents) for a tiny model at 64 px, batch 4: the wait is most of the
step. Clean twin: cached latents and small images. Timings are never asserted beyond large
planted effects: several processes share this machine's cores.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
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
    workers_advice,
)
from diagnose.cli import main
from diagnose.config import RunConfig
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.dataloader.ab import (
    CAPPED_TIMED_STEPS,
    MIN_TIMED_STEPS,
    split_reachable,
    time_steps,
)
from diagnose.probes.dataloader.probe import (
    DataLoaderProbe,
    HotFrames,
    LoaderConfig,
    PredecodedDataset,
    VariantRow,
    WaitSummary,
    corrupt_images_finding,
    dataset_facts,
    judge,
    measured_saving,
    plan_timed_steps,
    plan_variants,
    planned_items,
    skipped_files_line,
    usable_cores,
    wait_summary,
)
from diagnose.record import (
    Breakdown,
    DeviceInfo,
    Finding,
    ProbeResult,
    RunRecord,
    StepSample,
    Timing,
    new_record,
)
from diagnose.run import execute_run
from diagnose.timing import PhaseTimer
from diagnose.verdicts import finding_grade, shown_severity
from diagnose.workload import Workload, build_workload
from diagnose.workload.data import (
    SampleKey,
    generate_image,
    generate_images,
    load_image,
    make_loader,
    prepare_data,
)
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


@pytest.mark.slow
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
    assert _graded(finding, record) in ("warn", "critical")
    assert evidence["dataloader"]["num_workers"] == 0
    assert evidence["dataset"]["formats"] == {"PNG": 4}
    assert evidence["dataset"]["pixels_decoded_per_pixel_trained"] > 500  # 1836x2700 / 64^2
    assert "num_workers=0" in finding.detail and "decodes 1836x2700" in finding.detail
    # Shared wording with the trace rule.
    bar = BarWait(evidence["data_wait_seconds_per_step"], evidence["s_per_it"])
    assert finding.title.startswith(starved_title(bar, has_device=False))
    assert "--cache_latents" in finding.fix or "--max_data_loader_n_workers" in finding.fix


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_workload_is_put_back_and_no_worker_is_left(starved: Probed) -> None:
    _assert_restored(starved.before, starved.workload)
    left = _children() - starved.children_before
    alive = [pid for pid in left if psutil.pid_exists(pid)]
    assert not alive, f"processes left running: {alive}"
    # The workload still trains on its own loader afterwards.
    loss = starved.workload.step(next(iter(starved.workload.loader)), _null_timer())
    assert loss == loss  # finite or not, it ran


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_empty_folder_is_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["run", "--data", str(empty), "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 3


# --------------------------------------------------------------------------------------------
# py-spy output: parsing the recorded real samples


def _profile(name: str) -> sampling.StackProfile:
    stacks = sampling.parse_raw((HERE / name).read_text(encoding="utf-8"))
    return sampling.summarize(stacks, keep=sampling.is_loader_work, top=8)


def test_recorded_single_process_loader_decodes_on_the_main_process() -> None:
    profile = _profile("pyspy_loader_workers0.txt")
    assert profile.samples_by_role == {"main": profile.samples}
    assert profile.dropped > 0  # interpreter start-up and imports are left out
    functions = {f.function: f for f in profile.top_frames}
    assert "ImageFile.load" in functions and "Image.resize" in functions
    assert functions["ImageFile.load"].category == "image decode"
    assert functions["ImageFile.load"].called_from.startswith(
        "load_image (diagnose/workload/data.py"
    )
    assert profile.categories["image decode"] > 0.2


def test_recorded_worker_loader_decodes_in_two_workers() -> None:
    profile = _profile("pyspy_loader_workers2.txt")
    assert profile.processes_by_role["worker"] == 2
    assert profile.samples_by_role["worker"] > 5 * profile.samples_by_role.get("main", 0)
    top = profile.top_frames[0]
    assert top.function == "ImageFile.load" and set(top.by_role) == {"worker"}
    assert profile.busy_categories["image decode"] > profile.busy_categories.get("other", 0)
    assert all(f.category != "waiting" for f in profile.top_frames)


def test_parse_raw_reads_processes_frames_and_counts() -> None:
    text = (
        'process 7:"python x.py";process 9:"python x.py";main (x.py:3);'
        "ImageFile.load (PIL/ImageFile.py:296) 12\n"
        "garbage line without count\n"
        "\n"
        "<module> (x.py) 3\n"
    )
    stacks = sampling.parse_raw(text)
    assert [s.count for s in stacks] == [12, 3]
    assert stacks[0].process == "9" and stacks[0].command == "python x.py"
    assert stacks[0].frames[-1] == sampling.Frame("ImageFile.load", "PIL/ImageFile.py", 296)
    assert stacks[1].frames[0] == sampling.Frame("<module>", "x.py", None)
    assert sampling.Frame("load_image", "mine/data.py", 3).is_library is False
    assert sampling.Frame("Image.resize", "PIL/Image.py", 1).is_library is True
    assert sampling.Frame("wait", "threading.py", 1).is_library is True


@pytest.mark.parametrize(
    ("function", "file", "category"),
    [
        ("ImageFile.load", "PIL/ImageFile.py", "image decode"),
        ("JpegImageFile.draft", "PIL/JpegImagePlugin.py", "image decode"),
        ("Image.resize", "PIL/Image.py", "image resize / crop / flip"),
        ("Image.convert", "PIL/Image.py", "colour convert"),
        ("Condition.wait", "threading.py", "waiting"),
        ("Connection._recv", "multiprocessing/connection.py", "waiting"),
        ("Encoder.forward", "diffusers/models/autoencoders/vae.py", "VAE / model on the CPU"),
        ("default_collate", "torch/utils/data/_utils/collate.py", "batch collate / transfer"),
        ("load_image", "diagnose/workload/data.py", "other"),
    ],
)
def test_categories(function: str, file: str, category: str) -> None:
    assert sampling.categorize(sampling.Frame(function, file, 1)) == category


def test_py_spy_missing_or_failing_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    assert sampling.find_py_spy(path=str(tmp_path)) is None
    missing = sampling.record(["true"], tmp_path / "out.txt", py_spy=str(tmp_path / "no-py-spy"))
    assert not missing.ok and "could not be started" in missing.reason
    if HAVE_PY_SPY:
        failing = sampling.record(["/nonexistent/python"], tmp_path / "out.txt")
        assert not failing.ok and failing.reason.startswith("py-spy recorded nothing")


# --------------------------------------------------------------------------------------------
# Pure parts: the wait, the plan, the verdict


def _graded(finding: Finding, record: RunRecord) -> str:
    """The severity the one rule gives ``finding`` in ``record`` (probes no longer grade)."""
    return shown_severity(finding_grade(finding, record.timing.headline.median), finding.borderline)


def _record(pairs: list[tuple[float, float]]) -> RunRecord:
    """A run whose timed steps took ``(seconds, data_wait)`` each, with its phase bar."""
    from diagnose.capture import phase_breakdown

    timing = Timing(
        samples=[
            StepSample(index=i, seconds=s, phases={"data_wait": w, "forward": s - w})
            for i, (s, w) in enumerate(pairs)
        ],
        first_batch_seconds=pairs[0][1] if pairs else None,
    )
    timing.summarize()
    record = new_record("run")
    record.timing = timing
    record.breakdown = phase_breakdown(timing)
    return record


def test_the_wait_is_the_share_the_phase_bar_shows() -> None:
    """Two resolution buckets: short and long steps alternate with the same wait. The median of
    the per-step shares (what the probe used to judge) is not what the bar shows; the probe now
    judges the bar: data_wait's median over the median step."""
    record = _record([(0.5, 0.1), (2.0, 0.1), (0.5, 0.1), (2.0, 0.1)])
    summary = wait_summary(record)
    assert summary is not None
    assert summary.steps == 4 and summary.s_per_it == pytest.approx(1.25)
    assert summary.wait_share == pytest.approx(0.1 / 1.25)
    assert summary.wait_share == pytest.approx(
        record.breakdown.seconds["data_wait"] / record.timing.headline.median
    )
    assert [r["share"] for r in summary.per_step] == [0.2, 0.05, 0.2, 0.05]
    assert wait_summary(new_record("run")) is None


_LABELS = {
    "configured": "as configured (num_workers=0)",
    "workers": "2 workers (persistent)",
    "predecoded": "images decoded once (tensors kept)",
    "cached_latents": "cached latents",
}


def _row(key: str, seconds: list[float], inputs: float = 0.0) -> VariantRow:
    """A measured row whose input phases (wait + copy + encode) took ``inputs`` s per step."""
    return VariantRow(
        key=key,
        label=_LABELS[key],
        workers=2 if key == "workers" else 0,
        pin_memory=False,
        persistent_workers=key == "workers",
        source="decode",
        seconds=seconds,
        data_wait=[inputs for _ in seconds],
        input_seconds=[inputs for _ in seconds],
    )


def test_measured_saving_needs_a_sure_clear_margin() -> None:
    configured = _row("configured", [1.0, 1.1, 0.95, 1.05], inputs=0.6)
    fast = _row("cached_latents", [0.5, 0.55, 0.52, 0.51])
    saving = measured_saving(configured, fast)
    assert saving is not None
    assert saving.seconds == pytest.approx(1.025 - 0.515)
    assert 0 < saving.sure <= saving.seconds
    # Within the noise, overlapping, or too few steps to be sure of anything: not clearly faster.
    assert measured_saving(configured, _row("workers", [0.99, 1.0, 1.01, 0.98])) is None
    assert measured_saving(configured, _row("workers", [0.5, 1.2, 1.3, 0.5])) is None
    assert measured_saving(configured, _row("workers", [0.5, 0.5])) is None
    # The saving never exceeds what the input phases lost; too little of it is no fix.
    assert measured_saving(configured, fast, bound=0.1) == pytest.approx(
        type(saving)(0.1, min(0.1, saving.sure), 0.1)
    )
    assert measured_saving(configured, fast, bound=0.01) is None
    assert MIN_TIMED_STEPS >= 4  # fewer steps a side and the test can never be sure


LOADER = LoaderConfig(0, False, False, None, 4, True, "ImageFolderDataset")


def _wait(share: float, s_per_it: float = 1.0) -> WaitSummary:
    return WaitSummary(
        bar=BarWait(share * s_per_it, s_per_it),
        steps=5,
        first_batch_seconds=0.5,
        phases={"encode": 0.2},
        per_step=[],
    )


def _as_record(finding: Finding, s_per_it: float) -> RunRecord:
    record = _record([(s_per_it, 0.0)] * 3)
    record.breakdown = Breakdown(seconds={"data_wait": s_per_it})
    record.findings = [finding]
    return record


def test_judge_planted_wait_fires_with_the_measured_best_fix() -> None:
    rows = [
        _row("configured", [1.0, 1.05, 0.98, 1.02], inputs=0.6),
        _row("workers", [0.99, 1.01, 1.0, 1.03], inputs=0.55),
        _row("cached_latents", [0.40, 0.42, 0.41, 0.43]),
    ]
    frames = HotFrames(available=False, reason="py-spy is not installed")
    verdict = judge(
        _wait(0.55), rows, has_device=True, loader=LOADER, cores=8, facts={}, frames=frames
    )
    [finding] = verdict.findings
    assert finding.id == FINDING_ID
    assert finding.saving_basis == "measured" and verdict.best == "cached_latents"
    # The whole measured gain is in the title; the saving is what of it the wait was.
    assert verdict.savings["cached_latents"] == pytest.approx(1.01 - 0.415)
    assert finding.est_seconds_saved_per_it == pytest.approx(0.55)
    assert _graded(finding, _as_record(finding, 1.0)) == "critical"
    assert finding.title.startswith("The training loop waits for data 55% of each step")
    assert "while the GPU idles" in finding.title and "cached latents" in finding.title
    assert finding.fix.startswith("Cache the latents") and "--cache_latents_to_disk" in finding.fix
    assert "--max_data_loader_n_workers" not in finding.fix  # not measured faster here
    assert "2 workers (persistent): no clear gain." in finding.detail
    assert verdict.checks == []  # the finding is the answer: no "not waiting" beside it


def test_judge_never_saves_more_than_the_run_lost_to_its_input_phases() -> None:
    """A busy machine slows the probe's own A/B steps; the saving stays bounded by what the
    data wait and encode cost in the run's timed steps."""
    rows = [
        _row("configured", [4.0, 4.2, 3.9, 4.1], inputs=3.0),
        _row("cached_latents", [0.40, 0.42, 0.41, 0.43]),
    ]
    verdict = judge(
        _wait(0.30, 0.1),
        rows,
        has_device=False,
        loader=LOADER,
        cores=2,
        facts={},
        frames=None,
        run_input_seconds=0.05,
    )
    assert verdict.savings["cached_latents"] is None or verdict.savings["cached_latents"] <= 0.05
    for finding in verdict.findings:
        assert (finding.est_seconds_saved_per_it or 0.0) <= 0.1  # never above the run's s/it


def test_judge_gpu_workers_fix_names_the_trainer_flags() -> None:
    rows = [
        _row("configured", [2.0, 2.1, 1.9, 2.05], inputs=1.0),
        _row("workers", [1.0, 1.02, 0.98, 1.01]),
    ]
    verdict = judge(
        _wait(0.45, 2.0), rows, has_device=True, loader=LOADER, cores=16, facts={}, frames=None
    )
    [finding] = verdict.findings
    assert workers_advice(2, False)[1:] in finding.fix
    assert "--persistent_data_loader_workers" in finding.fix
    assert "--dataloader_num_workers 2" in finding.fix


def test_judge_without_a_measured_fix_estimates_the_wait_and_stays_below_critical() -> None:
    verdict = judge(
        _wait(0.6),
        [_row("configured", [1.0, 1.0, 1.0])],
        has_device=True,
        loader=LOADER,
        cores=8,
        facts={},
        frames=None,
    )
    [finding] = verdict.findings
    assert finding.saving_basis == "estimated" and finding.est_seconds_saved_per_it == 0.6
    assert _graded(finding, _as_record(finding, 1.0)) == "warn"


def test_judge_small_wait_and_no_fix_is_checked_fine() -> None:
    rows = [_row("configured", [1.0, 1.02, 0.99, 1.01]), _row("workers", [1.01, 0.98, 1.0, 1.0])]
    verdict = judge(
        _wait(0.02), rows, has_device=True, loader=LOADER, cores=8, facts={}, frames=None
    )
    assert not verdict.findings
    assert verdict.checks[0] == (
        FINDING_ID,
        "ok",
        "data loading: 2% of the step; the GPU is not waiting",
    )
    assert verdict.checks[1][0] == SLOW_LOADER_ID
    assert verdict.checks[1][2].startswith("data loading: no loader change measured clearly")


def test_judge_small_wait_but_cached_latents_much_faster_is_slow_loader() -> None:
    rows = [
        _row("configured", [1.0, 1.02, 0.99, 1.01], inputs=0.45),
        _row("cached_latents", [0.6, 0.61, 0.62, 0.6], inputs=0.05),
    ]
    verdict = judge(
        _wait(0.03), rows, has_device=True, loader=LOADER, cores=8, facts={}, frames=None
    )
    [finding] = verdict.findings
    assert finding.id == SLOW_LOADER_ID and finding.saving_basis == "measured"
    assert finding.title.startswith("Cached latents: measured 400 ms/it faster")
    assert "VAE-encodes" in finding.title
    assert [c[0] for c in verdict.checks] == [FINDING_ID]  # and the loop is not waiting


def test_a_variant_past_its_time_share_stops_after_two_timed_steps() -> None:
    class Instant:
        def step(self, batch: object, timer: PhaseTimer) -> float:
            return 0.0

    row = _row("configured", [])
    items: Any = list(range(10))
    loader: Any = torch.utils.data.DataLoader(items, batch_size=1)
    time_steps(Instant(), loader, row, steps=5, warmup=1, sync=lambda: None, max_seconds=0.0)
    assert len(row.seconds) == 2 and len(row.warmup_seconds) == 1 and row.stopped_early
    row = _row("configured", [])
    time_steps(Instant(), loader, row, steps=5, warmup=1, sync=lambda: None, max_seconds=60.0)
    assert len(row.seconds) == 5 and not row.stopped_early and not row.stopped_by_budget
    # The probe's deadline passed: the same two steps, and the row says the budget stopped it.
    row = _row("configured", [])
    spent = time.perf_counter()
    time_steps(Instant(), loader, row, steps=5, warmup=1, sync=lambda: None, deadline=spent)
    assert len(row.seconds) == 2 and row.stopped_early and row.stopped_by_budget


def test_plan_variants_and_steps() -> None:
    keys = [
        v.key
        for v in plan_variants(
            workers=0, pin_memory=False, decodes_images=True, cache_latents=False, cores=2
        )
    ]
    assert keys == ["configured", "workers", "predecoded", "cached_latents"]
    many = plan_variants(
        workers=0, pin_memory=True, decodes_images=True, cache_latents=False, cores=64
    )
    assert many[1].workers == 8 and many[1].pin_memory and "pin_memory" in many[1].label
    assert [
        v.key
        for v in plan_variants(
            workers=2, pin_memory=False, decodes_images=True, cache_latents=False, cores=2
        )
    ] == ["configured", "predecoded", "cached_latents"]
    assert [
        v.key
        for v in plan_variants(
            workers=0, pin_memory=False, decodes_images=False, cache_latents=True, cores=2
        )
    ] == ["configured"]
    assert plan_timed_steps(0.35, 4, 8.0) == 4
    assert plan_timed_steps(0.01, 4, 8.0) == 5
    assert plan_timed_steps(2.0, 4, 8.0) == MIN_TIMED_STEPS
    assert plan_timed_steps(None, 4, 8.0) == MIN_TIMED_STEPS


def test_planned_items_are_the_items_a_fresh_loader_yields(tmp_path: Path) -> None:
    generate_images(tmp_path, count=5, size=(64, 48))
    with prepare_data(str(tmp_path), [64, 96]) as data:
        loader = make_loader(data, 2, 0, False, seed=4, decode=False)
        seen: set[tuple[str, int]] = set()
        batches = 0
        while batches < 7:
            for batch in loader:
                seen.update(zip(batch.paths, [batch.resolution] * len(batch), strict=True))
                batches += 1
                if batches == 7:
                    break
        items = planned_items(data.dataset.buckets, 2, 4, 7)
        planned = {(data.dataset.paths[i], data.dataset.buckets[i]) for i in items}
    assert planned == seen


def test_predecoded_items_equal_the_decoded_ones(tmp_path: Path) -> None:
    generate_images(tmp_path, count=2, size=(120, 90))
    with prepare_data(str(tmp_path), [64]) as data:
        dataset = data.dataset
        cached = PredecodedDataset(dataset, {0: load_image(dataset.paths[0], 64)})
        for flip in (False, True):
            assert torch.equal(
                cached[SampleKey(0, flip)].pixels, dataset[SampleKey(0, flip)].pixels
            )
        assert torch.equal(cached[1].pixels, dataset[1].pixels)  # not cached: decoded


def test_dataset_facts_spell_out_the_pixel_ratio(tmp_path: Path) -> None:
    generate_images(tmp_path, count=2, size=(1224, 1800))
    with prepare_data(str(tmp_path), [512]) as data:
        facts = dataset_facts(data.info, batch=1, s_per_it=2.0)
    assert facts["images"] == 2 and facts["median_size"] == "1224x1800"
    assert facts["pixels_decoded_per_pixel_trained"] == pytest.approx(1224 * 1800 / 512**2, 1e-3)
    assert "to train at 512 px: 8.4x the pixels" in facts["pixel_ratio_note"]
    assert facts["read_mb_per_s_needed"] > 0 and "read_note" in facts


def _null_timer() -> PhaseTimer:
    return PhaseTimer(lambda: None)


def test_fixes_whose_phases_cannot_hold_a_saving_are_not_timed() -> None:
    """Planted: the step waits 2 ms of 100 ms for its batch and encodes for 60 ms. More workers
    or decoded-once images can shorten only the wait and the copy (2%, below the least saving
    that counts), so they are left out with the numbers that say why; cached latents can
    shorten the encode too and is timed. Clean twin: a 30 ms wait keeps every fix."""
    from diagnose.catalogs.dataloader_catalog import MIN_MEASURED_GAIN
    from diagnose.record import phase_bound

    def record(wait: float) -> RunRecord:
        timing = Timing(
            samples=[
                StepSample(
                    index=i,
                    seconds=0.1,
                    phases={"data_wait": wait, "encode": 0.06, "forward": 0.04 - wait},
                )
                for i in range(6)
            ]
        )
        timing.summarize()
        run = new_record("run")
        run.timing = timing
        from diagnose.capture import phase_breakdown

        run.breakdown = phase_breakdown(timing)
        return run

    variants = plan_variants(
        workers=0, pin_memory=False, decodes_images=True, cache_latents=False, cores=4
    )
    fed = record(0.002)
    keep, left_out = split_reachable(
        variants, lambda phases: phase_bound(fed, phases), 0.1, MIN_MEASURED_GAIN
    )
    assert [v.key for v in keep] == ["configured", "cached_latents"]
    assert [u.key for u in left_out] == ["workers", "predecoded"]
    assert "data_wait + h2d" in left_out[0].text() and "2.0%" in left_out[0].text()

    starved = record(0.03)
    keep, left_out = split_reachable(
        variants, lambda phases: phase_bound(starved, phases), 0.1, MIN_MEASURED_GAIN
    )
    assert [v.key for v in keep] == [v.key for v in variants] and not left_out
    # Nothing worth timing: not even the configured loader.
    no_encode = [v for v in variants if v.key != "cached_latents"]
    keep, left_out = split_reachable(
        no_encode, lambda phases: phase_bound(fed, phases), 0.1, MIN_MEASURED_GAIN
    )
    assert keep == [] and len(left_out) == 2
