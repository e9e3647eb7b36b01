"""The image dataset and DataLoader of the workload: real files, real decoding, real DataLoader.

LoRA datasets are small but their images are big (phone photos of 1224x1800 trained at 512 or
1024 px), so decoding, resizing and augmenting them on the CPU every step is a real cost, and the
one this module's dataset makes the workload pay (how one image is decoded:
:mod:`diagnose.workload.image_files`).

Two sources:

- ``prepare_data(None, ...)`` generates photo-like images
  (:mod:`diagnose.workload.synthetic_images`) into a fresh temporary folder.
  :class:`PreparedData` owns that folder: ``close()`` removes it, the ``with`` statement calls
  ``close()`` also when the block raises, and a ``weakref.finalize`` removes it at garbage
  collection or interpreter exit if nobody called ``close()``.
- ``prepare_data(DIR, ...)`` reads the user's folder, recursively, and never writes, modifies or
  deletes anything in it.

Buckets: image *i* (in sorted path order) goes to ``resolutions[i % len(resolutions)]``. Cycling
rather than choosing by image size is deliberate: the tool measures what each training resolution
costs, and photos are nearly all larger than every bucket, so a size rule would put every image in
the largest bucket and never exercise the others. The loader's
:class:`~diagnose.workload.bucket_sampler.BucketBatchSampler` then builds batches from one bucket
at a time and takes the buckets in turn, so successive steps cycle through the resolutions.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.workload.bucket_sampler import BucketBatchSampler, SampleKey
from diagnose.workload.image_files import CAPTION_SUFFIX, IMAGE_SUFFIXES, check_image, load_image
from diagnose.workload.synthetic_images import DEFAULT_GENERATED_COUNT, generate_images

#: How many skipped file names the record keeps (the count is always complete).
MAX_SKIPPED_EXAMPLES = 10


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class PixelSizes:
    """How big the source images are, and how much larger than the bucket they are decoded.

    ``side_over_bucket`` is the shorter side of an image divided by the side of its bucket (above
    1: the loader shrinks it); ``pixels_over_bucket`` is decoded pixels over output pixels, the
    factor by which decoding costs more than the tensor the model sees.
    """

    width_min: int
    width_median: float
    width_max: int
    height_min: int
    height_median: float
    height_max: int
    megapixels_median: float
    side_over_bucket_min: float
    side_over_bucket_median: float
    side_over_bucket_max: float
    pixels_over_bucket_median: float
    pixels_over_bucket_max: float


@dataclass
class DatasetInfo:
    """What the run record says about the data (JSON-serialisable with ``dataclasses.asdict``)."""

    #: The folder read; for a generated set, the temporary folder (removed after the run).
    root: str
    generated: bool
    #: Usable images (each counted once, even when it is repeated to fill buckets or batches).
    images: int
    #: Usable images per decoded format, e.g. {"JPEG": 7, "PNG": 1}.
    formats: dict[str, int]
    #: Bytes of the usable image files.
    total_bytes: int
    pixel_sizes: PixelSizes
    #: Bucket sides in pixels (square), in the order steps cycle through them.
    resolutions: list[int]
    #: Files that are neither images nor caption sidecars, and the first few of their names.
    skipped_non_images: int
    skipped_examples: list[str]
    #: Image files that could not be opened or decoded (names relative to root), skipped.
    corrupt: list[str]
    #: Why each corrupt file failed, by name: the first line of the error.
    corrupt_reasons: dict[str, str] = field(default_factory=dict)
    #: Read throughput of the image files (one pass, at preparation). None for a generated set:
    #: its files were just written and sit in the page cache, so the number would mean nothing.
    #: For a user's folder it may also come from the page cache when the files were read recently.
    read_mb_per_s: float | None = None
    #: Image files left unread (not even checked) because ``count`` usable images were found.
    capped: int = 0


@dataclass(frozen=True)
class ImageEntry:
    """One usable image of the dataset, as found at preparation."""

    path: str
    #: Name relative to the root, with forward slashes.
    name: str
    caption: str
    width: int
    height: int
    format: str
    bytes: int


@dataclass
class Sample:
    """One decoded image: (3, S, S) float32 in [-1, 1]."""

    pixels: torch.Tensor
    caption: str
    path: str


@dataclass
class ImageBatch:
    """What the DataLoader yields: images of one bucket stacked, with their captions and paths."""

    #: (B, 3, H, W) float32 in [-1, 1]; H == W == the bucket side.
    pixels: torch.Tensor
    captions: list[str]
    paths: list[str]

    def pin_memory(self) -> ImageBatch:
        """Page-locked copy; torch's DataLoader calls this when ``pin_memory=True``."""
        return ImageBatch(self.pixels.pin_memory(), list(self.captions), list(self.paths))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ImageBatch:
        """Copy of the batch with its pixels on ``device``."""
        return ImageBatch(
            self.pixels.to(device, non_blocking=non_blocking), self.captions, self.paths
        )

    def __len__(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def resolution(self) -> int:
        """The bucket side of this batch."""
        return int(self.pixels.shape[-1])


# --------------------------------------------------------------------------------------------
# Dataset, collate, worker seeds
# --------------------------------------------------------------------------------------------


class ImageFolderDataset(Dataset[Sample]):
    """Items = (image file, bucket side). Decodes the file on every access, never caches.

    Picklable (plain lists of str/int), so it crosses into DataLoader workers under fork or spawn.
    """

    def __init__(
        self,
        paths: Sequence[str],
        captions: Sequence[str],
        buckets: Sequence[int],
        decode: bool = True,
    ):
        if not len(paths) == len(captions) == len(buckets):
            raise ValueError("paths, captions and buckets must have the same length")
        self.paths = list(paths)
        self.captions = list(captions)
        self.buckets = list(buckets)
        self.decode = decode

    def without_decoding(self) -> ImageFolderDataset:
        """The same items with no image work: for trainers' cached-latents mode, where the
        cached latents stand in for the pixels and no file is read per step."""
        return ImageFolderDataset(self.paths, self.captions, self.buckets, decode=False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: int | SampleKey) -> Sample:
        index, flip = (key.item, key.flip) if isinstance(key, SampleKey) else (int(key), False)
        path, side = self.paths[index], self.buckets[index]
        if not self.decode:
            # No channels, but ImageBatch.resolution still reads the bucket side off the shape.
            return Sample(torch.empty((0, side, side)), self.captions[index], path)
        return Sample(load_image(path, side, flip), self.captions[index], path)


def collate_images(samples: list[Sample]) -> ImageBatch:
    """Stack samples of one bucket into an :class:`ImageBatch` (the DataLoader's collate_fn)."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    sides = {tuple(sample.pixels.shape) for sample in samples}
    if len(sides) != 1:
        raise ValueError(f"a batch mixes bucket shapes {sorted(sides)}")
    return ImageBatch(
        pixels=torch.stack([sample.pixels for sample in samples]),
        captions=[sample.caption for sample in samples],
        paths=[sample.path for sample in samples],
    )


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed numpy and ``random`` from the worker's torch seed.

    torch seeds each worker with ``base_seed + worker_id`` (base_seed from the loader's seeded
    generator) but leaves numpy and ``random`` alone; this makes any augmentation added later
    reproducible too. The flips themselves come from the sampler (see :class:`SampleKey`).
    """
    import random

    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


# --------------------------------------------------------------------------------------------
# Scanning a folder
# --------------------------------------------------------------------------------------------


@dataclass
class _Scan:
    entries: list[ImageEntry]
    skipped: list[str]
    corrupt: dict[str, str]
    read_seconds: float
    capped: int


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _caption_for(image: Path) -> str:
    sidecar = image.with_suffix(CAPTION_SUFFIX)
    if sidecar.is_file():
        try:
            return sidecar.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            pass
    return image.stem


def _list_files(root: Path) -> list[Path]:
    """All files under root, sorted, without following directory links or entering hidden folders.

    Hidden folders (.git, .cache, ...) are not part of a dataset; counting their contents as
    "skipped" would only bury the files the user needs to hear about.
    """
    found: list[Path] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(name for name in subdirs if not name.startswith("."))
        found.extend(Path(directory) / name for name in files)
    return sorted(found)


def _scan(root: Path, count: int | None) -> _Scan:
    files = _list_files(root)
    image_files = [path for path in files if path.suffix.lower() in IMAGE_SUFFIXES]
    image_stems = {path.with_suffix("") for path in image_files}
    skipped = [
        _relative(path, root)
        for path in files
        if path.suffix.lower() not in IMAGE_SUFFIXES
        and not (path.suffix.lower() == CAPTION_SUFFIX and path.with_suffix("") in image_stems)
    ]
    entries: list[ImageEntry] = []
    corrupt: dict[str, str] = {}
    read_seconds = 0.0
    capped = 0
    for path in image_files:
        if count is not None and len(entries) >= count:
            capped += 1
            continue
        name = _relative(path, root)
        try:
            started = time.perf_counter()
            data = path.read_bytes()
            read_seconds += time.perf_counter() - started
            width, height, fmt = check_image(data)
        except Exception as error:  # any failure to read or decode makes the file unusable
            text = str(error).strip().splitlines()
            corrupt[name] = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
            continue
        entries.append(
            ImageEntry(str(path), name, _caption_for(path), width, height, fmt, len(data))
        )
    return _Scan(entries, skipped, corrupt, read_seconds, capped)


def _pixel_sizes(entries: Sequence[ImageEntry], buckets: Sequence[int]) -> PixelSizes:
    widths = [entry.width for entry in entries]
    heights = [entry.height for entry in entries]
    side_ratios = [
        min(entry.width, entry.height) / bucket
        for entry, bucket in zip(entries, buckets, strict=True)
    ]
    pixel_ratios = [
        entry.width * entry.height / bucket**2
        for entry, bucket in zip(entries, buckets, strict=True)
    ]
    return PixelSizes(
        width_min=min(widths),
        width_median=float(statistics.median(widths)),
        width_max=max(widths),
        height_min=min(heights),
        height_median=float(statistics.median(heights)),
        height_max=max(heights),
        megapixels_median=round(
            statistics.median(w * h for w, h in zip(widths, heights, strict=True)) / 1e6, 3
        ),
        side_over_bucket_min=round(min(side_ratios), 3),
        side_over_bucket_median=round(statistics.median(side_ratios), 3),
        side_over_bucket_max=round(max(side_ratios), 3),
        pixels_over_bucket_median=round(statistics.median(pixel_ratios), 3),
        pixels_over_bucket_max=round(max(pixel_ratios), 3),
    )


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _remove_tree(path: str, owner_pid: int) -> None:
    # A forked DataLoader worker carries a copy of this finalizer; only the process that made the
    # folder may remove it.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class PreparedData:
    """The image folder of a run, its :class:`DatasetInfo` and its torch Dataset.

    Owns the folder only when it generated it: ``close()`` (or leaving a ``with`` block, also by
    an exception) removes a generated folder; a ``weakref.finalize`` does the same at garbage
    collection or interpreter exit if ``close()`` was never called. A user's folder is never
    touched. Close DataLoaders (drop their iterators) before closing: persistent workers may still
    be reading ahead.
    """

    def __init__(
        self,
        info: DatasetInfo,
        dataset: ImageFolderDataset,
        entries: Sequence[ImageEntry],
        temp_dir: Path | None = None,
    ) -> None:
        self.info = info
        self.dataset = dataset
        self.entries = list(entries)
        self.temp_dir = temp_dir
        self._finalizer = (
            weakref.finalize(self, _remove_tree, str(temp_dir), os.getpid())
            if temp_dir is not None
            else None
        )

    @property
    def root(self) -> Path:
        return Path(self.info.root)

    @property
    def closed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def close(self) -> None:
        """Remove the generated folder, if any (idempotent); never touches a user's folder."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> PreparedData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _check_resolutions(resolutions: Sequence[int]) -> list[int]:
    unique = list(dict.fromkeys(int(side) for side in resolutions))
    if not unique:
        raise DiagnoseError("no resolution given for the image buckets", ExitCode.USAGE)
    if any(side < 8 for side in unique):
        raise DiagnoseError(f"resolutions must be at least 8 px, got {unique}", ExitCode.USAGE)
    return unique


def _build(
    root: Path, scan: _Scan, resolutions: list[int], generated: bool, temp_dir: Path | None
) -> PreparedData:
    entries = scan.entries
    # Every bucket needs at least one item: with fewer images than buckets, images repeat.
    items = max(len(entries), len(resolutions))
    item_entries = [entries[i % len(entries)] for i in range(items)]
    item_buckets = [resolutions[i % len(resolutions)] for i in range(items)]
    formats: dict[str, int] = {}
    for entry in entries:
        formats[entry.format] = formats.get(entry.format, 0) + 1
    total_bytes = sum(entry.bytes for entry in entries)
    read_rate = None
    if not generated and scan.read_seconds > 0:
        read_rate = round(total_bytes / 1e6 / scan.read_seconds, 1)
    info = DatasetInfo(
        root=str(root),
        generated=generated,
        images=len(entries),
        formats=dict(sorted(formats.items())),
        total_bytes=total_bytes,
        pixel_sizes=_pixel_sizes(item_entries, item_buckets),
        resolutions=resolutions,
        skipped_non_images=len(scan.skipped),
        skipped_examples=scan.skipped[:MAX_SKIPPED_EXAMPLES],
        corrupt=sorted(scan.corrupt),
        corrupt_reasons=dict(sorted(scan.corrupt.items())),
        read_mb_per_s=read_rate,
        capped=scan.capped,
    )
    dataset = ImageFolderDataset(
        [entry.path for entry in item_entries],
        [entry.caption for entry in item_entries],
        item_buckets,
    )
    return PreparedData(info, dataset, entries, temp_dir)


def prepare_data(
    data_dir: str | None,
    resolutions: list[int],
    seed: int = 0,
    *,
    count: int | None = None,
) -> PreparedData:
    """Find (or generate) the images of a run and describe them.

    ``data_dir=None`` generates ``count`` images (default :data:`DEFAULT_GENERATED_COUNT`) into a
    new temporary folder that the returned object owns. Otherwise ``data_dir`` is read
    recursively (.jpg .jpeg .png .webp, any case; captions from same-name .txt files, else the
    file stem); ``count`` then caps how many images are used (the first in sorted order). Every
    image is read once and decoded (at reduced scale where the format allows) so that corrupt
    files are listed and skipped here instead of failing a step. Raises
    ``DiagnoseError(BAD_INPUT)`` for a missing path, a file, or a folder without a usable image.
    """
    buckets = _check_resolutions(resolutions)
    if count is not None and count < 1:
        raise DiagnoseError(f"image count must be at least 1, got {count}", ExitCode.USAGE)
    if data_dir is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="diagnose-data-"))
        try:
            generate_images(temp_dir, count or DEFAULT_GENERATED_COUNT, seed)
            scan = _scan(temp_dir, None)
            if not scan.entries:
                raise RuntimeError(f"generated images are unreadable: {scan.corrupt}")
            return _build(temp_dir, scan, buckets, generated=True, temp_dir=temp_dir)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise

    root = Path(data_dir).expanduser()
    if not root.exists():
        raise DiagnoseError(f"data folder not found: {data_dir}", ExitCode.BAD_INPUT)
    if not root.is_dir():
        raise DiagnoseError(f"data path is a file, not a folder: {data_dir}", ExitCode.BAD_INPUT)
    root = root.resolve()
    scan = _scan(root, count)
    if not scan.entries:
        raise DiagnoseError(
            f"no usable image in {data_dir} (looked for {' '.join(sorted(IMAGE_SUFFIXES))}, "
            f"recursively): {len(scan.corrupt)} corrupt, {len(scan.skipped)} other files",
            ExitCode.BAD_INPUT,
        )
    return _build(root, scan, buckets, generated=False, temp_dir=None)


def make_loader(
    data: PreparedData,
    batch_size: int,
    workers: int,
    pin_memory: bool,
    seed: int = 0,
    *,
    decode: bool = True,
) -> DataLoader[Sample]:
    """A real DataLoader over ``data``: bucketed full batches of :class:`ImageBatch`.

    ``persistent_workers`` when ``workers > 0`` (trainers keep workers alive between epochs, so
    a worker start-up is not charged to every epoch). Batches, their order and the flips depend
    only on ``seed`` and the epoch, never on ``workers``. Without an accelerator torch ignores
    ``pin_memory=True`` with a warning. ``decode=False`` yields the same batches without reading
    any image (pixels with no channels): the loader of a cached-latents run.
    """
    if workers < 0:
        raise DiagnoseError(f"workers must be 0 or more, got {workers}", ExitCode.USAGE)
    if batch_size < 1:
        raise DiagnoseError(f"batch must be at least 1, got {batch_size}", ExitCode.USAGE)
    sampler = BucketBatchSampler(data.dataset.buckets, batch_size, seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        data.dataset if decode else data.dataset.without_decoding(),
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=collate_images,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        worker_init_fn=seed_worker if workers > 0 else None,
        generator=generator,
    )
