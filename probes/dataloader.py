"""Data loading: is the GPU waiting for the CPU, which Python frames are why, and what fixes it.

LoRA datasets are small but their images are big (phone photos of 1224x1800 trained at 512 or
1024 px). Decoding, resizing and augmenting them on the CPU every step, with few or no DataLoader
workers and without cached latents, starves the GPU: users report 13 s/it with 0 workers against
2 s/it with workers. This probe

1. **measures the wait** from the run's own step samples (the ``data_wait`` phase: the time spent
   in ``next(dataloader)``), its share of the s/it, the first-batch latency, the DataLoader's
   configuration, the usable cores and the dataset (images, formats, bytes, pixels decoded per
   pixel trained, read throughput);
2. **names the hot frames**: it runs a fresh loader of the same configuration alone in a child
   process under ``py-spy record --subprocesses`` (main process and workers) and ranks the Python
   frames the samples land in (``ImageFile.load``, ``Image.resize`` ...). py-spy is optional:
   without it (or without permission to sample) the rest still runs and the result says why;
3. **runs the fixes** (an A/B of the real step): the configured loader again, more workers
   (persistent, pinned on a GPU), images decoded once (pre-decoded tensors), and cached latents
   (what trainers' ``--cache_latents`` does), each built with ``make_loader`` and stepped with
   ``workload.step``; the model, optimizer, grad scaler and noise generator are put back
   afterwards and every loader it makes is closed;
4. **reports the data folder's skipped and corrupt files** (``dataloader.corrupt_images``).

Findings: ``dataloader.gpu_starved`` (same id, threshold and wording as the trace rule in
``diagnose.trace.rules.dataloader``) when the loop waits for batches at least ``WARN_SHARE`` of
the step; ``dataloader.slow_loader`` when it hardly waits but a loader change (typically cached
latents, which also removes the per-step VAE encode) was measured clearly faster by at least
``WARN_SHARE`` of the s/it. Neither: a checked-fine line ("data loading: 2% of the step; the GPU is
not waiting").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

import diagnose
from diagnose import sampling
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.record import Finding, ProbeResult, Stats, StepSample, Timing
from diagnose.timing import PhaseTimer, device_synchronizer
from diagnose.trace.rules import ms, pct, per_it
from diagnose.trace.rules.dataloader import (
    CACHE_LATENTS_ADVICE,
    CORRUPT_IMAGES_ID,
    FINDING_ID,
    MIN_MEASURED_GAIN,
    SLOW_LOADER_ID,
    WARN_SHARE,
    device_word,
    loader_fix,
    not_waiting_line,
    predecode_advice,
    severity_for_share,
    starved_title,
    workers_advice,
)
from diagnose.workload.data import (
    BucketBatchSampler,
    DatasetInfo,
    ImageFolderDataset,
    PreparedData,
    Sample,
    SampleKey,
    load_image,
    make_loader,
)

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

NAME = "dataloader"
#: Warm-up steps per A/B variant (the first batch of a fresh loader pays for starting workers).
WARMUP_STEPS = 1
#: Timed steps per A/B variant: as many as the budget allows within these bounds.
MIN_TIMED_STEPS = 3
MAX_TIMED_STEPS = 5
#: A variant whose steps run past this many times its share of the budget (a machine busy with
#: something else, a step far slower than the run's) stops after :data:`CAPPED_TIMED_STEPS`.
VARIANT_OVERRUN_FACTOR = 2.0
CAPPED_TIMED_STEPS = 2
#: Seconds of A/B steps aimed for, all variants together (at the run's s/it). With the tiny CPU
#: default (about 0.35 s/it on an idle laptop core pair) this is 4 variants x 5 steps.
AB_BUDGET_SECONDS = 8.0
#: How long the child iterates the loader under py-spy, and py-spy's sampling rate.
SAMPLE_SECONDS = 2.0
SAMPLE_RATE = 100
#: Most workers the A/B tries (more rarely helps a LoRA-sized folder, and each one is a process).
MAX_WORKERS = 8
#: How many file names a finding lists (the counts are always complete).
MAX_LISTED_FILES = 10
#: How many hot frames the result keeps.
TOP_FRAMES = 8

#: The phases a loader change can shorten: the wait for the batch, its copy to the device, and
#: the VAE/text encode (cached latents). Forward, backward and optimizer are the same in every
#: variant, so a saving larger than what these phases lost is noise, not the fix.
INPUT_PHASES: tuple[str, ...] = ("data_wait", "h2d", "encode")

VariantKey = Literal["configured", "workers", "predecoded", "cached_latents"]
VARIANT_KEYS: tuple[VariantKey, ...] = ("configured", "workers", "predecoded", "cached_latents")
#: What a variant's loader hands the step: images decoded per step, decoded-once tensors, or no
#: pixels at all (latents come from the cache).
Source = Literal["decode", "predecoded", "latents"]


# --------------------------------------------------------------------------------------------
# 1. The wait, from the run's own samples (pure)


@dataclass
class WaitSummary:
    """The run's data wait, per step, from its timed samples."""

    steps: int
    #: Median seconds per step, median data wait, and the median of the per-step wait shares.
    s_per_it: float
    wait_seconds: float
    wait_share: float
    first_batch_seconds: float | None
    #: Median seconds of each phase.
    phases: dict[str, float]
    per_step: list[dict[str, float]]


def wait_summary(timing: Timing) -> WaitSummary | None:
    """Summarise ``data_wait`` over the unprofiled steps (the profiled ones if there are none)."""
    samples: list[StepSample] = [s for s in timing.samples if not s.profiled] or list(
        timing.samples
    )
    samples = [s for s in samples if s.seconds > 0]
    if not samples:
        return None
    waits = [s.phases.get("data_wait", 0.0) for s in samples]
    phase_names = sorted({name for s in samples for name in s.phases})
    return WaitSummary(
        steps=len(samples),
        s_per_it=statistics.median(s.seconds for s in samples),
        wait_seconds=statistics.median(waits),
        # The median share, not the share of the medians: one slow step (a cold cache, the
        # machine busy elsewhere) moves neither.
        wait_share=statistics.median(w / s.seconds for w, s in zip(waits, samples, strict=True)),
        first_batch_seconds=timing.first_batch_seconds,
        phases={
            name: statistics.median(s.phases.get(name, 0.0) for s in samples)
            for name in phase_names
        },
        per_step=[
            {
                "index": s.index,
                "seconds": round(s.seconds, 4),
                "data_wait": round(w, 4),
                "share": round(w / s.seconds, 4),
            }
            for w, s in zip(waits, samples, strict=True)
        ],
    )


def device_idle_note(has_device: bool, wait_seconds: float) -> dict[str, Any]:
    """What the wait costs the device, and how this run knows."""
    if has_device:
        meaning = (
            "diagnose run synchronises the GPU before each phase, so the GPU has no queued work "
            "while the loop waits in next(dataloader): every second of data wait is a second "
            "of GPU idle here. In a trainer without those syncs, queued kernels can hide part "
            "of it; `diagnose trace` on your own trainer's profile measures that overlap."
        )
    else:
        meaning = (
            "This run's device is the CPU: the training thread that computes the step also "
            "loads the batch (num_workers=0) or waits for it, so no training compute runs "
            "during the wait and all of it is lost. Workers run on the same cores as the "
            "compute here, so on a CPU they help only where cores are left over; on a GPU "
            "machine they overlap with GPU compute."
        )
    return {
        "seconds_per_step": wait_seconds,
        "device": "GPU" if has_device else "CPU",
        "meaning": meaning,
    }


# --------------------------------------------------------------------------------------------
# The loader's configuration, the cores, the dataset


@dataclass
class LoaderConfig:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    batch_size: int | None
    #: Whether the dataset decodes an image per item (False: cached latents stand in).
    decodes_images: bool
    dataset: str


def describe_loader(loader: DataLoader[Any]) -> LoaderConfig:
    workers = int(loader.num_workers)
    sampler = loader.batch_sampler
    batch = getattr(sampler, "batch_size", None)
    if batch is None:
        batch = loader.batch_size
    return LoaderConfig(
        num_workers=workers,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
        # torch keeps prefetch_factor only when there are workers (None otherwise).
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        batch_size=int(batch) if batch is not None else None,
        decodes_images=bool(getattr(loader.dataset, "decode", True)),
        dataset=type(loader.dataset).__name__,
    )


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def dataset_facts(info: DatasetInfo, batch: int, s_per_it: float | None) -> dict[str, Any]:
    """The dataset as the loader sees it, with the decode-vs-train pixel ratio spelled out."""
    sizes = info.pixel_sizes
    buckets = list(info.resolutions)
    mb = info.total_bytes / 1e6
    per_image_mb = mb / info.images if info.images else 0.0
    facts: dict[str, Any] = {
        "folder": info.root,
        "generated": info.generated,
        "images": info.images,
        "formats": dict(info.formats),
        "total_mb": round(mb, 2),
        "mb_per_image": round(per_image_mb, 3),
        "median_size": f"{sizes.width_median:.0f}x{sizes.height_median:.0f}",
        "megapixels_median": sizes.megapixels_median,
        "buckets_px": buckets,
        "pixels_decoded_per_pixel_trained": sizes.pixels_over_bucket_median,
        "pixels_decoded_per_pixel_trained_max": sizes.pixels_over_bucket_max,
        "shorter_side_over_bucket": sizes.side_over_bucket_median,
        "read_mb_per_s": info.read_mb_per_s,
        "skipped_non_images": info.skipped_non_images,
        "corrupt": len(info.corrupt),
        "capped": info.capped,
    }
    bucket_text = "/".join(str(b) for b in buckets)
    ratio = sizes.pixels_over_bucket_median
    if ratio > 1.0:
        facts["pixel_ratio_note"] = (
            f"each step decodes {sizes.width_median:.0f}x{sizes.height_median:.0f} images "
            f"({sizes.megapixels_median:.1f} MP) to train at {bucket_text} px: {ratio:.1f}x "
            "the pixels the model sees, decoded and then thrown away"
        )
    if s_per_it and s_per_it > 0 and info.images:
        needed = per_image_mb * batch / s_per_it
        facts["read_mb_per_s_needed"] = round(needed, 2)
        if info.read_mb_per_s:
            facts["read_note"] = (
                f"at {s_per_it:.2f} s/it the loader reads {needed:.1f} MB/s; the folder was "
                f"read at {info.read_mb_per_s:.0f} MB/s"
                + (
                    " (the disk is not what the loop waits for: decoding is)"
                    if info.read_mb_per_s > 5 * needed
                    else " (reading the files may itself be the limit)"
                )
            )
    return facts


def corrupt_images_finding(info: DatasetInfo) -> Finding | None:
    """Image files the loader had to skip because they could not be decoded."""
    if not info.corrupt:
        return None
    names = info.corrupt[:MAX_LISTED_FILES]
    more = len(info.corrupt) - len(names)
    listed = ", ".join(names) + (f" and {more} more" if more else "")
    count = len(info.corrupt)
    return Finding(
        id=CORRUPT_IMAGES_ID,
        category="dataloader",
        severity="warn",
        title=(
            f"{count} image file{'s' if count != 1 else ''} in the data folder could not be "
            f"decoded and {'were' if count != 1 else 'was'} skipped: {listed}"
        ),
        evidence={
            "folder": info.root,
            "corrupt": names,
            "corrupt_count": count,
            "reasons": {name: info.corrupt_reasons.get(name, "") for name in names},
            "usable_images": info.images,
            "skipped_non_images": info.skipped_non_images,
            "skipped_examples": list(info.skipped_examples),
        },
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=(
            "Re-export or remove the listed files (most trainers stop with an error, or loop "
            "on it, when they reach an image PIL cannot decode); diagnose never changes the "
            "folder."
        ),
        detail=(
            "Each file was opened, verified and decoded once when the folder was scanned; the "
            "reasons are the first line of PIL's error. The measurement used the "
            f"{info.images} usable images."
        ),
    )


def skipped_files_line(info: DatasetInfo) -> str | None:
    if not info.skipped_non_images:
        return None
    examples = ", ".join(info.skipped_examples[:MAX_LISTED_FILES])
    more = info.skipped_non_images - min(len(info.skipped_examples), MAX_LISTED_FILES)
    return (
        f"data folder: {info.images} images used; {info.skipped_non_images} other file"
        f"{'s' if info.skipped_non_images != 1 else ''} skipped (not images or captions: "
        f"{examples}{f' and {more} more' if more > 0 else ''})"
    )


# --------------------------------------------------------------------------------------------
# 2. Hot frames: the loader alone, in a child, under py-spy


@dataclass
class HotFrames:
    """What sampling the loader found, or why it did not run."""

    available: bool
    reason: str = ""
    profile: sampling.StackProfile | None = None
    #: Batches the loader delivered alone in the child, and over how many seconds.
    batches: int | None = None
    loader_seconds: float | None = None
    wall_seconds: float = 0.0
    summary: str = ""
    rate: int = SAMPLE_RATE

    @property
    def seconds_per_batch(self) -> float | None:
        if not self.batches or not self.loader_seconds:
            return None
        return self.loader_seconds / self.batches

    def headline(self, top: int = 3) -> str:
        """``ImageFile.load 48%, Image.resize 31%``: the frames a reader should look at."""
        if self.profile is None:
            return ""
        return ", ".join(f"{f.function} {pct(f.share)}" for f in self.profile.top_frames[:top])

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"available": self.available}
        if not self.available:
            data["reason"] = self.reason
            return data
        assert self.profile is not None
        profile = self.profile
        data.update(
            {
                "tool": "py-spy record --subprocesses --nonblocking --function --format raw",
                "rate_hz": self.rate,
                "samples": profile.samples,
                "samples_dropped_startup": profile.dropped,
                "samples_by_process": profile.samples_by_role,
                "processes": profile.processes_by_role,
                "top_frames": [dataclasses.asdict(f) for f in profile.top_frames],
                "categories": profile.categories,
                "busy_categories": profile.busy_categories,
                "loader_alone_batches": self.batches,
                "loader_alone_seconds": self.loader_seconds,
                "loader_alone_seconds_per_batch": self.seconds_per_batch,
                "wall_seconds": round(self.wall_seconds, 2),
                "py_spy": self.summary,
            }
        )
        return data


def _child_env() -> dict[str, str]:
    """The environment for the sampled child: this one, with this diagnose importable first."""
    env = dict(os.environ)
    root = str(Path(diagnose.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def sample_hot_frames(
    data: PreparedData,
    loader: LoaderConfig,
    *,
    batch: int,
    seed: int,
    folder: Path,
    seconds: float = SAMPLE_SECONDS,
    rate: int = SAMPLE_RATE,
    timeout: float = 120.0,
) -> HotFrames:
    """Iterate a fresh loader of this configuration alone in a child that py-spy samples."""
    exe = sampling.find_py_spy()
    if exe is None:
        return HotFrames(
            available=False,
            reason=f"py-spy is not installed or not on PATH ({sampling.INSTALL_HINT})",
        )
    dataset = data.dataset
    spec = sampling.LoaderSpec(
        paths=list(dataset.paths),
        captions=list(dataset.captions),
        buckets=list(dataset.buckets),
        batch=batch,
        workers=loader.num_workers,
        seed=seed,
        decode=loader.decodes_images,
        seconds=seconds,
        max_batches=100_000,
        result_path=str(folder / "loader_result.json"),
        info=dataclasses.asdict(data.info),
    )
    spec_path = folder / "loader_spec.json"
    spec.save(spec_path)
    recording = sampling.record(
        sampling.loader_command(spec_path),
        folder / "pyspy_raw.txt",
        rate=rate,
        timeout=timeout,
        py_spy=exe,
        env=_child_env(),
    )
    if not recording.ok:
        return HotFrames(
            available=False, reason=recording.reason, wall_seconds=recording.wall_seconds
        )
    profile = sampling.summarize(recording.stacks, keep=sampling.is_loader_work, top=TOP_FRAMES)
    if profile.samples == 0:
        return HotFrames(
            available=False,
            reason="py-spy sampled the child, but no sample fell inside the loader iteration",
            wall_seconds=recording.wall_seconds,
        )
    batches = loader_seconds = None
    result_path = Path(spec.result_path)
    if result_path.is_file():
        counts = json.loads(result_path.read_text(encoding="utf-8"))
        batches, loader_seconds = int(counts["batches"]), float(counts["seconds"])
    return HotFrames(
        available=True,
        profile=profile,
        batches=batches,
        loader_seconds=loader_seconds,
        wall_seconds=recording.wall_seconds,
        summary=recording.summary,
        rate=rate,
    )


# --------------------------------------------------------------------------------------------
# 3. The A/B of the real step


@dataclass(frozen=True)
class Variant:
    key: VariantKey
    label: str
    workers: int
    pin_memory: bool
    source: Source


@dataclass
class VariantRow:
    """One variant's measured steps."""

    key: str
    label: str
    workers: int
    pin_memory: bool
    persistent_workers: bool
    source: str
    seconds: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    #: Seconds of the :data:`INPUT_PHASES` together, per timed step.
    input_seconds: list[float] = field(default_factory=list)
    warmup_seconds: list[float] = field(default_factory=list)
    #: data_wait of the first step of a fresh loader (starting workers, filling the queue).
    first_batch_seconds: float | None = None
    #: One-off work before the steps (decoding the images once, encoding latents), not in s/it.
    setup_seconds: float = 0.0
    #: Whether the variant stopped before its planned steps because it ran past its time share.
    stopped_early: bool = False
    error: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.seconds)

    @property
    def wait_stats(self) -> Stats:
        return Stats.of(self.data_wait)

    @property
    def input_stats(self) -> Stats:
        return Stats.of(self.input_seconds)

    def to_dict(self) -> dict[str, Any]:
        stats, wait = self.stats, self.wait_stats
        return {
            "key": self.key,
            "label": self.label,
            "num_workers": self.workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "source": self.source,
            "s_per_it_median": stats.median if stats.n else None,
            "s_per_it_q1": stats.q1 if stats.n else None,
            "s_per_it_q3": stats.q3 if stats.n else None,
            "data_wait_median": wait.median if wait.n else None,
            "input_phases_median": self.input_stats.median if self.input_stats.n else None,
            "steps": stats.n,
            "samples": [round(s, 4) for s in self.seconds],
            "data_wait_samples": [round(s, 4) for s in self.data_wait],
            "first_batch_seconds": self.first_batch_seconds,
            "setup_seconds": round(self.setup_seconds, 3),
            "stopped_early": self.stopped_early,
            "error": self.error,
        }


def variant_label(key: VariantKey, workers: int, pin_memory: bool, cached: bool) -> str:
    if key == "configured":
        extras = [f"num_workers={workers}"]
        if pin_memory:
            extras.append("pin_memory")
        if cached:
            extras.append("cached latents")
        return f"as configured ({', '.join(extras)})"
    if key == "workers":
        return f"{workers} workers (persistent{', pin_memory' if pin_memory else ''})"
    if key == "predecoded":
        return "images decoded once (tensors kept)"
    return "cached latents"


def plan_variants(
    *,
    workers: int,
    pin_memory: bool,
    decodes_images: bool,
    cache_latents: bool,
    cores: int,
    allowed: Sequence[str] = VARIANT_KEYS,
) -> list[Variant]:
    """The A/B: the configured loader, and each fix that changes something here.

    Only one thing changes per variant: more workers keep the per-step decode; the two caches
    keep the configured workers.
    """
    source: Source = "latents" if cache_latents else ("decode" if decodes_images else "latents")
    variants = [
        Variant(
            "configured",
            variant_label("configured", workers, pin_memory, cache_latents),
            workers,
            pin_memory,
            source,
        )
    ]
    more = min(cores, MAX_WORKERS)
    if source == "decode" and more > workers:
        variants.append(
            Variant(
                "workers",
                variant_label("workers", more, pin_memory, False),
                more,
                pin_memory,
                "decode",
            )
        )
    if source == "decode":
        variants.append(
            Variant(
                "predecoded",
                variant_label("predecoded", workers, pin_memory, False),
                workers,
                pin_memory,
                "predecoded",
            )
        )
    if not cache_latents:
        variants.append(
            Variant(
                "cached_latents",
                variant_label("cached_latents", workers, pin_memory, True),
                workers,
                pin_memory,
                "latents",
            )
        )
    return [v for v in variants if v.key == "configured" or v.key in allowed]


def plan_timed_steps(s_per_it: float | None, variants: int, budget: float) -> int:
    """Timed steps per variant so the A/B stays near ``budget`` seconds at the run's s/it."""
    if not s_per_it or s_per_it <= 0 or variants <= 0:
        return MIN_TIMED_STEPS
    per_variant = budget / variants / s_per_it - WARMUP_STEPS
    return int(max(MIN_TIMED_STEPS, min(MAX_TIMED_STEPS, per_variant)))


def planned_items(buckets: Sequence[int], batch: int, seed: int, n_batches: int) -> list[int]:
    """Dataset items of the first ``n_batches`` batches a fresh loader yields (any workers)."""
    sampler = BucketBatchSampler(buckets, batch, seed)
    items: set[int] = set()
    produced = epoch = 0
    while produced < n_batches:
        for keys in sampler.plan_epoch(epoch):
            items.update(key.item for key in keys)
            produced += 1
            if produced >= n_batches:
                break
        epoch += 1
    return sorted(items)


class PredecodedDataset(ImageFolderDataset):
    """The run's items with their pixels decoded once: what an in-memory image cache does.

    Items that were not decoded ahead (none, when the A/B stays within the planned batches) fall
    back to decoding. The flip is applied to the tensor, as a cheap per-step augmentation.
    """

    def __init__(self, base: ImageFolderDataset, pixels: dict[int, torch.Tensor]) -> None:
        super().__init__(base.paths, base.captions, base.buckets)
        self.pixels = pixels

    def __getitem__(self, key: int | SampleKey) -> Sample:
        index, flip = (key.item, key.flip) if isinstance(key, SampleKey) else (int(key), False)
        cached = self.pixels.get(index)
        if cached is None:
            return super().__getitem__(key)
        pixels = cached.flip(-1) if flip else cached.clone()
        return Sample(pixels, self.captions[index], self.paths[index])


def _subset(data: PreparedData, items: Sequence[int]) -> PreparedData:
    dataset = data.dataset
    subset = ImageFolderDataset(
        [dataset.paths[i] for i in items],
        [dataset.captions[i] for i in items],
        [dataset.buckets[i] for i in items],
    )
    return PreparedData(data.info, subset, data.entries)  # no temp_dir: removes nothing


class _Batches:
    """Endless batches from one loader; ``close()`` stops its workers."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.iterator: Iterator[Any] | None = None

    def next(self) -> Any:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:
            self.iterator = iter(self.loader)  # a new epoch (persistent workers are reused)
            return next(self.iterator)

    def close(self) -> None:
        # The same private hook Workload.close() uses: persistent workers otherwise live on
        # until the loader is garbage-collected.
        shutdown = getattr(self.iterator, "_shutdown_workers", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self.iterator = None


def _time_steps(
    workload: Any,
    loader: DataLoader[Any],
    row: VariantRow,
    *,
    steps: int,
    warmup: int,
    sync: Callable[[], None],
    max_seconds: float | None = None,
) -> None:
    """Step ``workload`` on batches of ``loader``; fill ``row`` with the timed samples.

    Past ``max_seconds`` (warm-up included) the variant stops once it has
    :data:`CAPPED_TIMED_STEPS` timed steps, and says so.
    """
    batches = _Batches(loader)
    timer = PhaseTimer(sync)
    began = time.perf_counter()
    try:
        for index in range(warmup + steps):
            if (
                max_seconds is not None
                and len(row.seconds) >= CAPPED_TIMED_STEPS
                and time.perf_counter() - began > max_seconds
            ):
                row.stopped_early = True
                break
            timer.reset()
            sync()
            start = time.perf_counter()
            with timer.phase("data_wait"):
                batch = batches.next()
            workload.step(batch, timer)
            sync()
            seconds = time.perf_counter() - start
            if index == 0:
                row.first_batch_seconds = timer.seconds["data_wait"]
            if index < warmup:
                row.warmup_seconds.append(seconds)
            else:
                row.seconds.append(seconds)
                row.data_wait.append(timer.seconds["data_wait"])
                row.input_seconds.append(sum(timer.seconds.get(p, 0.0) for p in INPUT_PHASES))
    finally:
        batches.close()


def _run_variant(
    workload: Any,
    variant: Variant,
    *,
    steps: int,
    warmup: int,
    sync: Callable[[], None],
    max_seconds: float | None = None,
) -> VariantRow:
    config = workload.config
    data: PreparedData = workload.data
    row = VariantRow(
        key=variant.key,
        label=variant.label,
        workers=variant.workers,
        pin_memory=variant.pin_memory,
        persistent_workers=variant.workers > 0,
        source=variant.source,
    )
    items = planned_items(data.dataset.buckets, config.batch, config.seed, warmup + steps)
    if variant.source == "latents" and not config.cache_latents:
        # Encode the latents of exactly the items these steps will see, through the workload's
        # own cache (as --cache_latents does), then step a loader that reads no image.
        started = time.perf_counter()
        workload.config = dataclasses.replace(config, cache_latents=True)
        workload.loader = make_loader(_subset(data, items), config.batch, 0, False, config.seed)
        workload.prepare_caches()
        row.setup_seconds = time.perf_counter() - started
        loader = make_loader(
            data, config.batch, variant.workers, variant.pin_memory, config.seed, decode=False
        )
    elif variant.source == "latents":
        loader = make_loader(
            data, config.batch, variant.workers, variant.pin_memory, config.seed, decode=False
        )
    elif variant.source == "predecoded":
        started = time.perf_counter()
        dataset = data.dataset
        pixels = {i: load_image(dataset.paths[i], dataset.buckets[i]) for i in items}
        cached = PreparedData(data.info, PredecodedDataset(dataset, pixels), data.entries)
        row.setup_seconds = time.perf_counter() - started
        loader = make_loader(cached, config.batch, variant.workers, variant.pin_memory, config.seed)
    else:
        loader = make_loader(data, config.batch, variant.workers, variant.pin_memory, config.seed)
    _time_steps(
        workload, loader, row, steps=steps, warmup=warmup, sync=sync, max_seconds=max_seconds
    )
    return row


def run_ab(
    workload: Any,
    variants: Sequence[Variant],
    *,
    steps: int,
    warmup: int = WARMUP_STEPS,
    sync: Callable[[], None],
    progress: Callable[[str], None] = lambda message: None,
    max_seconds_per_variant: float | None = None,
) -> list[VariantRow]:
    """Measure each variant; the workload is put back as it was whatever happens."""
    state = workload.snapshot()
    rows: list[VariantRow] = []
    try:
        for number, variant in enumerate(variants, start=1):
            progress(f"dataloader: A/B {number}/{len(variants)}: {variant.label}")
            try:
                rows.append(
                    _run_variant(
                        workload,
                        variant,
                        steps=steps,
                        warmup=warmup,
                        sync=sync,
                        max_seconds=max_seconds_per_variant,
                    )
                )
            except Exception as exc:  # one variant failing (e.g. workers refused) is a row
                first = (str(exc).strip().splitlines() or [""])[0]
                rows.append(
                    VariantRow(
                        key=variant.key,
                        label=variant.label,
                        workers=variant.workers,
                        pin_memory=variant.pin_memory,
                        persistent_workers=variant.workers > 0,
                        source=variant.source,
                        error=f"{type(exc).__name__}: {first}".rstrip(": "),
                    )
                )
            finally:
                state.restore()  # each variant starts from the same weights
    finally:
        state.restore()
    return rows


# --------------------------------------------------------------------------------------------
# 4. The verdict (pure)


def clearly_faster(
    configured: Stats, candidate: Stats, removable: float | None = None
) -> float | None:
    """Seconds per iteration the candidate saves, when the A/B says so clearly; else None.

    Clearly: the candidate's median lies below the configured loader's first quartile (most of
    its steps beat most of the configured ones), and the saving is at least
    :data:`MIN_MEASURED_GAIN` of the configured s/it. ``removable`` bounds the saving: the
    seconds the changed phases (:data:`INPUT_PHASES`) actually lost, so that a step of the
    configured loader slowed by something else (a busy machine) does not inflate the saving.
    """
    if configured.n < 2 or candidate.n < 2 or configured.median <= 0:
        return None
    if candidate.median >= configured.q1:
        return None
    saving = configured.median - candidate.median
    if removable is not None:
        saving = min(saving, max(0.0, removable))
    if saving < MIN_MEASURED_GAIN * configured.median:
        return None
    return saving


def removable_seconds(configured: VariantRow, candidate: VariantRow) -> float | None:
    """Median input-phase seconds the candidate saved against the configured loader."""
    if not (configured.input_stats.n and candidate.input_stats.n):
        return None
    return configured.input_stats.median - candidate.input_stats.median


@dataclass
class Verdict:
    findings: list[Finding]
    checked_ok: list[str]
    #: key -> clear saving in s/it (None: not clearly faster).
    savings: dict[str, float | None]
    best: str | None


def _advice(row: VariantRow, facts: dict[str, Any]) -> str:
    if row.key == "workers":
        return workers_advice(row.workers, row.pin_memory)
    if row.key == "cached_latents":
        return CACHE_LATENTS_ADVICE
    if row.key == "predecoded":
        buckets = facts.get("buckets_px") or [None]
        return predecode_advice(facts.get("pixels_decoded_per_pixel_trained"), max(buckets))
    return ""


def _ab_sentence(rows: Sequence[VariantRow], steps: int) -> str:
    measured = [r for r in rows if r.stats.n]
    if not measured:
        return ""
    parts = [f"{r.label} {r.stats.median:.3f} s/it" for r in measured]
    return (
        f"Measured A/B ({steps} timed steps each after {WARMUP_STEPS} warm-up): "
        + "; ".join(parts)
        + "."
    )


def judge(
    wait: WaitSummary | None,
    rows: Sequence[VariantRow],
    *,
    has_device: bool,
    loader: LoaderConfig,
    cores: int,
    facts: dict[str, Any],
    frames: HotFrames | None,
    run_input_seconds: float | None = None,
) -> Verdict:
    """Findings from the measured wait and the A/B (pure: numbers in, findings out).

    ``run_input_seconds`` is what the input phases cost in the run's own timed steps: a fix can
    save no more than that, however slow the probe's A/B steps were (a busy machine inflates
    them, and the saving is quoted against the run's s/it).
    """
    configured = next((r for r in rows if r.key == "configured" and r.stats.n), None)
    savings: dict[str, float | None] = {}
    if configured is not None:
        for row in rows:
            if row.key != "configured" and row.stats.n:
                removable = removable_seconds(configured, row)
                if run_input_seconds is not None:
                    removable = (
                        run_input_seconds
                        if removable is None
                        else min(removable, run_input_seconds)
                    )
                savings[row.key] = clearly_faster(configured.stats, row.stats, removable)
    ranked = sorted(
        (r for r in rows if savings.get(r.key) is not None),
        key=lambda r: -(savings[r.key] or 0.0),
    )
    best = ranked[0] if ranked else None

    if wait is not None:
        share, wait_seconds, s_per_it = wait.wait_share, wait.wait_seconds, wait.s_per_it
        basis_note = f"median of {wait.steps} timed steps of the run"
    elif configured is not None:
        s_per_it = configured.stats.median
        wait_seconds = configured.wait_stats.median
        share = statistics.median(
            w / s for w, s in zip(configured.data_wait, configured.seconds, strict=True)
        )
        basis_note = "the probe's own steps of the configured loader"
    else:
        return Verdict([], [], savings, None)

    steps = configured.stats.n if configured is not None else 0
    ab = _ab_sentence(rows, steps)
    hot = frames.headline() if frames is not None and frames.available else ""
    evidence: dict[str, Any] = {
        "data_wait_seconds_per_step": wait_seconds,
        "data_wait_share_of_step": share,
        "s_per_it": s_per_it,
        "basis": basis_note,
        "first_batch_seconds": wait.first_batch_seconds if wait is not None else None,
        "dataloader": dataclasses.asdict(loader),
        "usable_cores": cores,
        "dataset": facts,
        "ab": [r.to_dict() for r in rows],
        "hot_frames": (
            [dataclasses.asdict(f) for f in frames.profile.top_frames[:5]]
            if frames is not None and frames.profile is not None
            else []
        ),
        "hot_frames_missing": (
            frames.reason if frames is not None and not frames.available else ""
        ),
    }
    advice = [_advice(r, facts) for r in ranked]
    word = device_word(has_device)

    if share >= WARN_SHARE:
        if best is not None:
            saving: float = savings[best.key] or 0.0
            title = (
                starved_title(share, wait_seconds, has_device)
                + f"; {best.label}: measured {per_it(saving)} faster"
            )
            basis: Literal["measured", "estimated"] = "measured"
        else:
            saving = wait_seconds
            title = starved_title(share, wait_seconds, has_device)
            basis = "estimated"
            advice = [
                workers_advice(max(2, min(cores, MAX_WORKERS)), has_device),
                CACHE_LATENTS_ADVICE,
            ]
        alone = frames.seconds_per_batch if frames is not None else None
        detail = _starved_detail(
            loader, wait_seconds, hot, facts, has_device, cores, ab, best is None, alone
        )
        workers_row = next((r for r in rows if r.key == "workers" and r.stats.n), None)
        if workers_row is not None and savings.get("workers") is None:
            detail += f" {workers_row.label[0].upper() + workers_row.label[1:]}: no clear gain" + (
                f" (on a CPU the workers take the {cores} cores the step computes on)."
                if not has_device
                else "."
            )
        finding = Finding(
            id=FINDING_ID,
            category="dataloader",
            severity=severity_for_share(share),
            title=title,
            evidence=evidence,
            est_seconds_saved_per_it=saving,
            saving_basis=basis,
            fix=loader_fix(advice),
            detail=detail,
        )
        return Verdict([finding], [], savings, best.key if best else None)

    base = configured.stats.median if configured is not None else s_per_it
    if best is not None and base > 0 and (savings[best.key] or 0.0) >= WARN_SHARE * base:
        saving = savings[best.key] or 0.0
        gain_share = saving / base
        encode = wait.phases.get("encode") if wait is not None else None
        why = (
            "the step decodes and VAE-encodes its images every time"
            + (f" (encode phase {ms(encode)}/step)" if encode else "")
            if best.key == "cached_latents"
            else "the per-step image work costs more than the wait shows"
        )
        finding = Finding(
            id=SLOW_LOADER_ID,
            category="dataloader",
            severity="warn" if gain_share >= 0.3 else "info",
            title=(
                f"{best.label[0].upper() + best.label[1:]}: measured {per_it(saving)} faster "
                f"({pct(gain_share)}); {why}"
            ),
            evidence=evidence,
            est_seconds_saved_per_it=saving,
            saving_basis="measured",
            fix=loader_fix(advice),
            detail=(
                f"The loop waits only {pct(share)} of the step for batches ({word} not "
                "starved), but the input pipeline still costs time inside the step: "
                + (
                    "decoding, resizing and VAE-encoding the same images again every epoch. "
                    if best.key == "cached_latents"
                    else ""
                )
                + ab
            ),
        )
        return Verdict([finding], [not_waiting_line(share, has_device)], savings, best.key)

    lines = [not_waiting_line(share, has_device)]
    tried = [r for r in rows if r.key != "configured" and r.stats.n]
    if tried and configured is not None:
        lines.append(
            "data loading: no loader change measured clearly faster ("
            + "; ".join(f"{r.label} {r.stats.median:.3f}" for r in [configured, *tried])
            + " s/it)"
        )
    return Verdict([], lines, savings, best.key if best else None)


def _starved_detail(
    loader: LoaderConfig,
    wait_seconds: float,
    hot: str,
    facts: dict[str, Any],
    has_device: bool,
    cores: int,
    ab: str,
    estimated: bool,
    alone: float | None,
) -> str:
    parts: list[str] = []
    if loader.num_workers == 0:
        parts.append(
            "The DataLoader runs with num_workers=0: every batch is read, decoded and resized "
            "on the training thread, between two steps."
        )
    else:
        parts.append(
            f"The DataLoader's {loader.num_workers} workers do not keep up with the step "
            f"({cores} usable cores)."
        )
    if hot:
        parts.append(f"Sampled with py-spy, the loader spends its time in {hot}.")
    if alone is not None:
        parts.append(
            f"Run alone, without the training step, the loader needs {ms(alone)} per batch."
        )
    if "pixel_ratio_note" in facts:
        parts.append(f"The images are large: {facts['pixel_ratio_note']}.")
    if not has_device:
        parts.append(
            "On this CPU run the device is the CPU itself: no training compute runs while the "
            "batch is loaded, so the whole wait is lost."
        )
    if ab:
        parts.append(ab)
    if estimated:
        parts.append(
            f"No change was clearly faster in the A/B, so the saving is estimated as the wait "
            f"itself ({ms(wait_seconds)}/step)."
        )
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
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
        not_judged = result.not_judged
        has_device = ctx.device.type != "cpu"
        config = workload.config

        # 1. The wait, the loader, the cores, the dataset.
        wait = wait_summary(ctx.record.timing)
        loader = describe_loader(workload.loader)
        cores = usable_cores()
        info: DatasetInfo = workload.data_info
        facts = dataset_facts(info, config.batch, wait.s_per_it if wait else None)
        data["wait"] = dataclasses.asdict(wait) if wait is not None else None
        data["device_idle_while_waiting"] = device_idle_note(
            has_device, wait.wait_seconds if wait else 0.0
        )
        data["dataloader"] = dataclasses.asdict(loader)
        data["usable_cores"] = cores
        data["dataset"] = facts
        if wait is None:
            not_judged.append("data wait: the run recorded no timed step")

        corrupt = corrupt_images_finding(info)
        if corrupt is not None:
            result.findings.append(corrupt)
        skipped = skipped_files_line(info)
        if skipped is not None:
            result.checked_ok.append(skipped)

        # 2. Hot frames.
        frames: HotFrames | None = None
        timings: dict[str, float] = {}
        if not self.sample:
            data["sampling"] = {"available": False, "reason": "turned off"}
        elif not loader.decodes_images:
            data["sampling"] = {
                "available": False,
                "reason": "the loader decodes no image per step (cached latents): nothing to "
                "sample",
            }
        else:
            say("dataloader: sampling the loader with py-spy")
            started = time.perf_counter()
            folder = Path(tempfile.mkdtemp(prefix="dataloader-", dir=ctx.scratch_dir))
            try:
                frames = sample_hot_frames(
                    workload.data,
                    loader,
                    batch=config.batch,
                    seed=config.seed,
                    folder=folder,
                    seconds=self.sample_seconds,
                    rate=self.sample_rate,
                )
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            timings["sampling"] = time.perf_counter() - started
            data["sampling"] = frames.to_dict()
            if not frames.available:
                not_judged.append(f"hot frames of the loader: {frames.reason}")

        # 3. The A/B.
        variants = plan_variants(
            workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            decodes_images=loader.decodes_images,
            cache_latents=bool(config.cache_latents),
            cores=cores,
            allowed=self.variants,
        )
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
                self.ab_budget_seconds / len(variants),
                (WARMUP_STEPS + steps) * (wait.s_per_it if wait else 0.0),
            ),
        )
        timings["ab"] = time.perf_counter() - started
        data["ab"] = [r.to_dict() for r in rows]
        data["ab_timed_steps"] = steps
        data["ab_warmup_steps"] = WARMUP_STEPS
        for row in rows:
            if row.error:
                not_judged.append(f"A/B {row.label}: {row.error}")

        # 4. The verdict.
        phases = ctx.record.breakdown.seconds
        run_input = sum(phases.get(p, 0.0) for p in INPUT_PHASES) if phases else None
        verdict = judge(
            wait,
            rows,
            has_device=has_device,
            loader=loader,
            cores=cores,
            facts=facts,
            frames=frames,
            run_input_seconds=run_input,
        )
        data["ab_savings"] = verdict.savings
        data["recommended"] = verdict.best
        data["seconds"] = {k: round(v, 2) for k, v in timings.items()}
        result.findings.extend(verdict.findings)
        result.checked_ok.extend(verdict.checked_ok)
        return result


__all__ = [
    "DataLoaderProbe",
    "HotFrames",
    "LoaderConfig",
    "PredecodedDataset",
    "Variant",
    "VariantRow",
    "Verdict",
    "WaitSummary",
    "clearly_faster",
    "corrupt_images_finding",
    "dataset_facts",
    "describe_loader",
    "judge",
    "plan_timed_steps",
    "plan_variants",
    "planned_items",
    "removable_seconds",
    "run_ab",
    "sample_hot_frames",
    "skipped_files_line",
    "usable_cores",
    "wait_summary",
]
