"""Data loading: is the GPU waiting for the CPU, which Python frames are why, and what fixes it.

LoRA datasets are small but their images are big (phone photos of 1224x1800 trained at 512 or
1024 px). Decoding, resizing and augmenting them on the CPU every step, with few or no DataLoader
workers and without cached latents, starves the GPU (docs/probes.md quotes what users report).
This probe

1. **reads the wait** the run measured: the ``data_wait`` phase (the time spent in
   ``next(dataloader)``) as the report's phase bar shows it, over the headline step
   (:mod:`diagnose.probes.dataloader.facts`), with the first-batch latency, the DataLoader's
   configuration, the usable cores and the dataset;
2. **names the hot frames** with py-spy (:mod:`diagnose.probes.dataloader.frames`);
3. **runs the fixes** as an A/B of the real step (:mod:`diagnose.probes.dataloader.ab`);
4. **judges** (:mod:`diagnose.probes.dataloader.verdict`) and reports the data folder's skipped
   and corrupt files.

The trace rule (:mod:`diagnose.trace.rules.dataloader`) asks "does the loop wait for data?" too,
on the few profiled steps; this probe measured it on the timed steps the headline and the phase
bar come from, so its answer stands in the record (the catalog's ``probe_answer_stands``; the
rule's answer is kept as evidence or a note): one question, one answer, one share on the page.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from diagnose.catalogs.dataloader_catalog import (
    CORRUPT_IMAGES,
    HOT_FRAMES_CHECK,
    MIN_MEASURED_GAIN,
    SKIPPED_FILES_CHECK,
    ab_check,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.dataloader.ab import (
    INPUT_PHASES,
    LOADER_PHASES,
    VARIANT_KEYS,
    VARIANT_OVERRUN_FACTOR,
    WARMUP_STEPS,
    PredecodedDataset,
    Variant,
    VariantRow,
    cannot_hold_saving,
    plan_timed_steps,
    plan_variants,
    planned_items,
    run_ab,
    split_reachable,
)
from diagnose.probes.dataloader.facts import (
    LoaderConfig,
    WaitSummary,
    corrupt_images_finding,
    dataset_facts,
    describe_loader,
    device_idle_note,
    skipped_files_line,
    usable_cores,
    wait_summary,
)
from diagnose.probes.dataloader.frames import (
    SAMPLE_RATE,
    SAMPLE_SECONDS,
    HotFrames,
    sample_hot_frames,
)
from diagnose.probes.dataloader.verdict import Verdict, judge, measured_saving
from diagnose.record import ProbeResult, phase_bound
from diagnose.timing import device_synchronizer
from diagnose.workload.data import DatasetInfo

NAME = "dataloader"
#: Seconds of A/B steps aimed for, all variants together (at the run's s/it).
AB_BUDGET_SECONDS = 8.0


# The probe


class DataLoaderProbe:
    """Data wait, py-spy hot frames, and a measured A/B of the loader fixes."""

    name = NAME
    description = (
        "whether the step waits for the DataLoader, which Python frames make it slow (py-spy), "
        "and what more workers, decoded-once images and cached latents measure"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        ab_budget_seconds: float = AB_BUDGET_SECONDS,
        variants: Sequence[str] = VARIANT_KEYS,
        sample: bool = True,
        sample_seconds: float = SAMPLE_SECONDS,
        sample_rate: int = SAMPLE_RATE,
        timed_steps: int | None = None,
    ) -> None:
        self.ab_budget_seconds = ab_budget_seconds
        self.variants = tuple(variants)
        self.sample = sample
        self.sample_seconds = sample_seconds
        self.sample_rate = sample_rate
        self.timed_steps = timed_steps

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped("no training workload (trace mode)")
        say = ctx.progress
        result = ProbeResult()
        data = result.data
        has_device = ctx.device.type != "cpu"
        config = workload.config

        # 1. The wait (as the phase bar shows it), the loader, the cores, the dataset.
        wait = wait_summary(ctx.record)
        loader = describe_loader(workload.loader)
        cores = usable_cores()
        info: DatasetInfo = workload.data_info
        facts = dataset_facts(info, config.batch, wait.s_per_it if wait else None)
        data["wait"] = _wait_data(wait)
        data["device_idle_while_waiting"] = device_idle_note(
            has_device, wait.wait_seconds if wait else 0.0
        )
        data["dataloader"] = dataclasses.asdict(loader)
        data["usable_cores"] = cores
        data["dataset"] = facts
        self._check_folder(info, result)

        # 2. Hot frames: they explain a wait, so only a wait that could matter is sampled.
        negligible = cannot_hold_saving(
            phase_bound(ctx.record, LOADER_PHASES),
            wait.s_per_it if wait else None,
            MIN_MEASURED_GAIN,
        )
        frames = self._hot_frames(ctx, loader, result, negligible)

        # 3. The A/B.
        variants = plan_variants(
            workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            decodes_images=loader.decodes_images,
            cache_latents=bool(config.cache_latents),
            cores=cores,
            allowed=self.variants,
        )
        variants, unreachable = split_reachable(
            variants,
            lambda phases: phase_bound(ctx.record, phases),
            wait.s_per_it if wait else None,
            MIN_MEASURED_GAIN,
        )
        for left_out in unreachable:
            result.add_ok(ab_check(left_out.key), left_out.text())
        steps = self.timed_steps or plan_timed_steps(
            wait.s_per_it if wait else None, len(variants), self.ab_budget_seconds
        )
        started = time.perf_counter()
        rows = run_ab(
            workload,
            variants,
            steps=steps,
            sync=device_synchronizer(ctx.device),
            progress=say,
            max_seconds_per_variant=VARIANT_OVERRUN_FACTOR
            * max(
                self.ab_budget_seconds / max(len(variants), 1),
                (WARMUP_STEPS + steps) * (wait.s_per_it if wait else 0.0),
            ),
            deadline=ctx.deadline,
        )
        data.setdefault("seconds", {})["ab"] = round(time.perf_counter() - started, 2)
        data["ab"] = [r.to_dict() for r in rows]
        data["ab_timed_steps"] = steps
        data["ab_warmup_steps"] = WARMUP_STEPS
        for row in rows:
            if row.error:
                result.add_not_judged(ab_check(row.key), f"A/B {row.label}: {row.error}")

        # 4. The verdict. The catalog says this probe's wait answer stands over the trace rule's
        # (diagnose.verdicts sets the rule's aside when the record is settled).
        verdict = judge(
            wait,
            rows,
            has_device=has_device,
            loader=loader,
            cores=cores,
            facts=facts,
            frames=frames,
            run_input_seconds=phase_bound(ctx.record, INPUT_PHASES),
        )
        data["ab_savings"] = verdict.savings
        data["recommended"] = verdict.best
        for finding in verdict.findings:
            result.add_finding(finding)
        for check_id, outcome, text in verdict.checks:
            if outcome == "ok":
                result.add_ok(check_id, text)
            else:
                result.add_not_judged(check_id, text)
        return result

    @staticmethod
    def _check_folder(info: DatasetInfo, result: ProbeResult) -> None:
        """Corrupt images (a finding) and files that are not images (said once)."""
        corrupt = corrupt_images_finding(info)
        if corrupt is not None:
            result.add_finding(corrupt)
        else:
            result.add_ok(CORRUPT_IMAGES.id, f"data folder: all {info.images} images decode")
        skipped = skipped_files_line(info)
        if skipped is not None:
            result.add_ok(SKIPPED_FILES_CHECK, skipped)

    def _hot_frames(
        self, ctx: ProbeContext, loader: LoaderConfig, result: ProbeResult, negligible: bool
    ) -> HotFrames | None:
        """Sample a fresh loader alone under py-spy, when there is image work to sample and the
        step waits long enough for it to matter."""
        data = result.data
        if not self.sample:
            data["sampling"] = {"available": False, "reason": "turned off"}
            return None
        if negligible:
            data["sampling"] = {
                "available": False,
                "reason": f"the step waits for its batches and copies them less than "
                f"{MIN_MEASURED_GAIN:.0%} of the time: no wait for the frames to explain",
            }
            return None
        if not loader.decodes_images:
            data["sampling"] = {
                "available": False,
                "reason": "the loader decodes no image per step (cached latents): nothing to "
                "sample",
            }
            return None
        ctx.progress("dataloader: sampling the loader with py-spy")
        config = ctx.workload.config
        started = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix="dataloader-", dir=ctx.scratch_dir))
        try:
            frames = sample_hot_frames(
                ctx.workload.data,
                loader,
                batch=config.batch,
                seed=config.seed,
                folder=folder,
                seconds=self.sample_seconds,
                rate=self.sample_rate,
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        data.setdefault("seconds", {})["sampling"] = round(time.perf_counter() - started, 2)
        data["sampling"] = frames.to_dict()
        if not frames.available:
            result.add_not_judged(HOT_FRAMES_CHECK, f"hot frames of the loader: {frames.reason}")
        return frames


def _wait_data(wait: WaitSummary | None) -> dict[str, object] | None:
    if wait is None:
        return None
    return {
        "s_per_it": wait.s_per_it,
        "wait_seconds": wait.wait_seconds,
        "wait_share": wait.wait_share,
        "share_basis": "the data_wait phase of the phase bar over the median step",
        "steps": wait.steps,
        "first_batch_seconds": wait.first_batch_seconds,
        "phases": wait.phases,
        "per_step": wait.per_step,
    }


__all__ = [
    "AB_BUDGET_SECONDS",
    "NAME",
    "DataLoaderProbe",
    "HotFrames",
    "LoaderConfig",
    "PredecodedDataset",
    "Variant",
    "VariantRow",
    "Verdict",
    "WaitSummary",
    "corrupt_images_finding",
    "dataset_facts",
    "describe_loader",
    "judge",
    "measured_saving",
    "plan_timed_steps",
    "plan_variants",
    "planned_items",
    "run_ab",
    "sample_hot_frames",
    "skipped_files_line",
    "usable_cores",
    "wait_summary",
]
