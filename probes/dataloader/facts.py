"""What the dataloader probe reads without stepping anything: the run's data wait (as the phase bar
shows it), the DataLoader's configuration, the usable cores, and the data folder (images, formats,
bytes, pixels decoded per pixel trained, read throughput, skipped and corrupt files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diagnose.catalogs.dataloader_catalog import (
    MAX_LISTED_FILES,
    BarWait,
    bar_wait,
    corrupt_images,
)
from diagnose.record import Finding, RunRecord, StepSample
from diagnose.workload.data import DatasetInfo

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


# --------------------------------------------------------------------------------------------
# The wait, from the run's own steps (pure)


@dataclass
class WaitSummary:
    """The run's data wait: the share the phase bar shows, and the timed steps it comes from."""

    #: The data_wait phase over the headline step (:func:`bar_wait`): the share judged.
    bar: BarWait
    #: Timed steps the phases are medians of.
    steps: int
    first_batch_seconds: float | None
    #: Seconds of each phase, as the phase bar shows them.
    phases: dict[str, float]
    #: Each timed step's wait and its own share, to show how much they vary (two resolution
    #: buckets alternate short and long steps: the per-step shares differ, the bar does not).
    per_step: list[dict[str, float]]

    @property
    def s_per_it(self) -> float:
        return self.bar.step

    @property
    def wait_seconds(self) -> float:
        return self.bar.seconds

    @property
    def wait_share(self) -> float:
        return self.bar.share


def wait_summary(record: RunRecord) -> WaitSummary | None:
    """The run's wait as the report shows it: ``record.breakdown``'s data_wait over the headline
    step. None when the run recorded no timed step or no phase."""
    bar = bar_wait(record)
    if bar is None:
        return None
    timing = record.timing
    samples: list[StepSample] = [s for s in timing.samples if not s.profiled] or list(
        timing.samples
    )
    samples = [s for s in samples if s.seconds > 0]
    return WaitSummary(
        bar=bar,
        steps=len(samples),
        first_batch_seconds=timing.first_batch_seconds,
        phases=dict(record.breakdown.seconds),
        per_step=[
            {
                "index": s.index,
                "seconds": round(s.seconds, 4),
                "data_wait": round(s.phases.get("data_wait", 0.0), 4),
                "share": round(s.phases.get("data_wait", 0.0) / s.seconds, 4),
            }
            for s in samples
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
    return corrupt_images(
        info.root,
        info.corrupt,
        info.corrupt_reasons,
        usable_images=info.images,
        skipped_non_images=info.skipped_non_images,
        skipped_examples=info.skipped_examples,
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


__all__ = [
    "LoaderConfig",
    "WaitSummary",
    "corrupt_images_finding",
    "dataset_facts",
    "describe_loader",
    "device_idle_note",
    "skipped_files_line",
    "usable_cores",
    "wait_summary",
]
