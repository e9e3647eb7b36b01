"""The image dataset and DataLoader of the workload: real files, real decoding, real DataLoader.

LoRA datasets are small but their images are big (phone photos of 1224x1800 trained at 512 or
1024 px), so decoding, resizing and augmenting them on the CPU every step is a real cost, and the
one this module makes the workload pay. Each sample is decoded from its file with PIL every time
(no cache), its centre square is resized to the bucket side, it is flipped horizontally when the
sampler says so, and it becomes a float tensor in [-1, 1], as in diffusers' training examples and
kohya's sd-scripts.

Two sources:

- ``prepare_data(None, ...)`` generates photo-like images (smooth gradients, shapes, sensor-like
  noise, so they compress and decode like photos rather than like noise or flat colour) into a
  fresh temporary folder. :class:`PreparedData` owns that folder: ``close()`` removes it, the
  ``with`` statement calls ``close()`` also when the block raises, and a ``weakref.finalize``
  removes it at garbage collection or interpreter exit if nobody called ``close()``.
- ``prepare_data(DIR, ...)`` reads the user's folder, recursively, and never writes, modifies or
  deletes anything in it.

Buckets: image *i* (in sorted path order) goes to ``resolutions[i % len(resolutions)]``. Cycling
rather than choosing by image size is deliberate: the tool measures what each training resolution
costs, and photos are nearly all larger than every bucket, so a size rule would put every image in
the largest bucket and never exercise the others. :class:`BucketBatchSampler` then builds batches
from one bucket at a time and takes the buckets in turn, so successive steps cycle through the
resolutions (what ``RunConfig.resolution`` promises).
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader, Dataset, Sampler

from diagnose.errors import DiagnoseError, ExitCode

#: File suffixes read as images (compared lower-case).
IMAGE_SUFFIXES: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp"})
#: Caption sidecar suffix: ``photo.jpg`` takes its caption from ``photo.txt``.
CAPTION_SUFFIX = ".txt"
#: Generated images: enough for a few epochs of small batches, quick to write (about 0.08 s per
#: image on one slow core, 0.7 s for the whole set with its checks).
DEFAULT_GENERATED_COUNT = 8
#: (width, height) of generated images: a portrait phone photo.
DEFAULT_GENERATED_SIZE: tuple[int, int] = (1224, 1800)
#: How many skipped file names the record keeps (the count is always complete).
MAX_SKIPPED_EXAMPLES = 10

#: EXIF orientation tag, and the transpose that brings each orientation upright (EXIF 2.32).
_EXIF_ORIENTATION = 0x0112
_ORIENTATION_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


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


class SampleKey(NamedTuple):
    """What the batch sampler hands the dataset: which item, and whether to flip it.

    The flip is decided by the (seeded) sampler in the main process rather than by a random
    generator inside each worker, so the pixels are the same whatever the number of workers.
    """

    #: Position in the dataset (``index`` would shadow ``tuple.index``).
    item: int
    flip: bool


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
# Decoding
# --------------------------------------------------------------------------------------------


def load_image(path: str, size: int, flip: bool = False) -> torch.Tensor:
    """Decode ``path``, resize its centre square to ``size`` x ``size``, optionally flip it.

    Returns (3, size, size) float32 in [-1, 1]. Equivalent to "resize the shorter side to the
    bucket, then centre-crop", done as one ``resize(box=...)`` so PIL resamples only the pixels
    it keeps. The EXIF orientation is applied to the small result: a centre square commutes with
    every rotation and mirror, so rotating after the crop gives the same pixels at a fraction of
    the cost.
    """
    with Image.open(path) as image:
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        width, height = rgb.size
        side = min(width, height)
        left = (width - side) / 2
        top = (height - side) / 2
        square = rgb.resize(
            (size, size),
            Image.Resampling.BILINEAR,
            box=(left, top, left + side, top + side),
        )
    transpose = _ORIENTATION_TRANSPOSE.get(int(orientation))
    if transpose is not None:
        square = square.transpose(transpose)
    if flip:
        square = square.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # HWC uint8 -> CHW float, as torchvision's ToTensor + Normalize(0.5, 0.5) do. Make the CHW
    # layout contiguous while still uint8: converting the strided view to float directly is
    # 30-50x slower on CPU (8 ms instead of 0.2 ms at 512 px).
    array = np.array(square, dtype=np.uint8)
    pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous().to(torch.float32)
    return pixels.div_(127.5).sub_(1.0)


def _check_image(data: bytes) -> tuple[int, int, str]:
    """Open, verify and decode an image from its bytes; return (width, height, format) upright.

    Raises on a file PIL cannot use. ``verify()`` catches broken structure (PNG checksums) but not
    a truncated JPEG, so the image is also decoded: at reduced scale for JPEG (``draft``), which
    still reads every byte and so still fails on a truncated file.
    """
    with Image.open(io.BytesIO(data)) as probe:
        probe.verify()
    with Image.open(io.BytesIO(data)) as image:
        fmt = image.format or "unknown"
        width, height = image.size
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
        image.convert("RGB").load()
    if orientation in (5, 6, 7, 8):  # a quarter turn: the displayed image is transposed
        width, height = height, width
    return width, height, fmt


# --------------------------------------------------------------------------------------------
# Dataset, collate, sampler
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


class BucketBatchSampler(Sampler[list[SampleKey]]):
    """Batches of one bucket each; steps take the buckets in turn; every batch is full.

    Per epoch: the items of each bucket are shuffled and, when their number is not a multiple of
    the batch size, the shuffled list is repeated to fill the last batch (so a batch larger than
    the bucket repeats images; nothing is dropped and every batch has the same shape). Batches
    are then taken round-robin over the buckets. Each item gets a seeded coin flip for the
    horizontal flip. Epoch ``e`` depends only on ``(seed, e)``; the epoch counter advances when an
    iteration actually starts, so iterators that torch creates and drops unused (it makes two for
    the first epoch of a multi-worker loader) do not shift the sequence.
    """

    def __init__(self, buckets: Sequence[int], batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not buckets:
            raise ValueError("no items to sample")
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        order: list[int] = []
        members: dict[int, list[int]] = {}
        for index, side in enumerate(buckets):
            if side not in members:
                order.append(side)
                members[side] = []
            members[side].append(index)
        #: Bucket sides in first-seen order, and the item indices of each.
        self.bucket_order = order
        self.members = members

    def __len__(self) -> int:
        return sum(-(-len(items) // self.batch_size) for items in self.members.values())

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration produce epoch ``epoch``."""
        self.epoch = epoch

    def plan_epoch(self, epoch: int) -> list[list[SampleKey]]:
        """The batches of one epoch, in order (pure: same epoch, same seed, same batches)."""
        rng = np.random.default_rng([self.seed, epoch])
        per_bucket: list[list[list[SampleKey]]] = []
        for side in self.bucket_order:
            items = [self.members[side][i] for i in rng.permutation(len(self.members[side]))]
            batches_needed = -(-len(items) // self.batch_size)
            needed = batches_needed * self.batch_size
            filled = [items[i % len(items)] for i in range(needed)]
            flips = rng.random(needed) < 0.5
            keys = [SampleKey(index, bool(flip)) for index, flip in zip(filled, flips, strict=True)]
            per_bucket.append(
                [keys[i : i + self.batch_size] for i in range(0, needed, self.batch_size)]
            )
        batches: list[list[SampleKey]] = []
        for round_index in range(max(len(bucket) for bucket in per_bucket)):
            batches.extend(
                bucket[round_index] for bucket in per_bucket if round_index < len(bucket)
            )
        return batches

    def __iter__(self) -> Iterator[list[SampleKey]]:
        # A generator function: nothing below runs (and the epoch does not advance) until the
        # first batch is requested.
        epoch = self.epoch
        self.epoch += 1
        yield from self.plan_epoch(epoch)


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
# Generated images
# --------------------------------------------------------------------------------------------


def generate_image(seed: int, size: tuple[int, int] = DEFAULT_GENERATED_SIZE) -> Image.Image:
    """A photo-like RGB image: smooth gradient, blurred shapes, sensor-like noise.

    The picture is drawn at 1/8 scale and upscaled (cheap smooth content), then fine noise is
    added at full size so the file compresses like a photo (about 0.25 bytes per pixel as JPEG
    q90) and decodes at a photo's cost.
    """
    width, height = size
    rng = np.random.default_rng(seed)
    small_w, small_h = max(2, width // 8), max(2, height // 8)
    start, end = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    mix = float(rng.uniform(0.2, 0.8))
    ys = np.linspace(0.0, 1.0, small_h, dtype=np.float32)[:, None, None]
    xs = np.linspace(0.0, 1.0, small_w, dtype=np.float32)[None, :, None]
    ramp = mix * ys + (1.0 - mix) * xs
    base = Image.fromarray((start * (1.0 - ramp) + end * ramp).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(base)
    for _ in range(12):
        cx, cy = int(rng.integers(0, small_w)), int(rng.integers(0, small_h))
        radius = int(rng.integers(2, max(3, small_w // 2)))
        colour = (int(rng.integers(0, 256)), int(rng.integers(0, 256)), int(rng.integers(0, 256)))
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    smooth = base.filter(ImageFilter.GaussianBlur(2)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    noise = rng.integers(-6, 7, size=(height, width, 3), dtype=np.int16)
    noisy = np.clip(np.asarray(smooth, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(noisy, "RGB")


def generate_images(
    folder: Path,
    count: int = DEFAULT_GENERATED_COUNT,
    seed: int = 0,
    size: tuple[int, int] = DEFAULT_GENERATED_SIZE,
) -> list[Path]:
    """Write ``count`` photo-like images with caption sidecars into ``folder``; return their paths.

    JPEG (quality 90, like a phone) except the last one, a PNG, as users' folders mix formats.
    """
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for number in range(count):
        image = generate_image(seed * 1_000_003 + number, size)
        is_png = count > 1 and number == count - 1
        path = folder / f"photo_{number:03d}{'.png' if is_png else '.jpg'}"
        if is_png:
            # Level 1: a PNG as cameras and screenshots write it, without seconds of zlib here.
            image.save(path, "PNG", compress_level=1)
        else:
            image.save(path, "JPEG", quality=90)
        path.with_suffix(CAPTION_SUFFIX).write_text(
            f"a photo of shapes, number {number}\n", encoding="utf-8"
        )
        written.append(path)
    return written


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
            width, height, fmt = _check_image(data)
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
