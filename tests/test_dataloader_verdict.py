"""The data-loading probe's pure parts: the wait the phase bar shows, the plan of variants and
timed steps, the measured saving and the verdict, on records and timed rows built by hand
(the probe end to end is ``test_dataloader_probe.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.catalogs.dataloader_catalog import GPU_STARVED, SLOW_LOADER, BarWait, workers_advice
from diagnose.probes.dataloader.ab import MIN_TIMED_STEPS, split_reachable, time_steps
from diagnose.probes.dataloader.probe import (
    HotFrames,
    LoaderConfig,
    PredecodedDataset,
    VariantRow,
    WaitSummary,
    dataset_facts,
    judge,
    measured_saving,
    plan_timed_steps,
    plan_variants,
    planned_items,
    wait_summary,
)
from diagnose.record import Breakdown, Finding, RunRecord, StepSample, Timing, new_record
from diagnose.timing import PhaseTimer
from diagnose.verdicts import finding_grade, shown_severity
from diagnose.workload.data import SampleKey, generate_images, load_image, make_loader, prepare_data

FINDING_ID = GPU_STARVED.id
SLOW_LOADER_ID = SLOW_LOADER.id


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
    # The two numbers agree on the line: the gain is more than the wait, and the title says the
    # saving is the wait's part of it.
    assert "cached latents: measured 595 ms/it faster, 550 ms of it the wait" in finding.title
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
