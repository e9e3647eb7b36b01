"""The workload's image dataset and DataLoader: real files, real PIL decoding, real DataLoader."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.workload.bucket_sampler import BucketBatchSampler, SampleKey
from diagnose.workload.data import (
    ImageBatch,
    PreparedData,
    collate_images,
    make_loader,
    prepare_data,
    seed_worker,
)
from diagnose.workload.image_files import load_image
from diagnose.workload.synthetic_images import (
    DEFAULT_GENERATED_COUNT,
    DEFAULT_GENERATED_SIZE,
    generate_image,
    generate_images,
)

SMALL = (96, 144)  # (width, height): portrait like the default, but quick to write and decode


def _batches(loader: torch.utils.data.DataLoader[object]) -> list[ImageBatch]:
    return list(loader)


def _folder_digest(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under root (hidden ones too): content hash, size and modification time."""
    digest: dict[str, tuple[str, int, int]] = {}
    for directory, _subdirs, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            stat = path.stat()
            content = hashlib.sha256(path.read_bytes()).hexdigest()
            digest[path.relative_to(root).as_posix()] = (content, stat.st_size, stat.st_mtime_ns)
    return digest


def _save(path: Path, fmt: str, seed: int, size: tuple[int, int] = SMALL) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    generate_image(seed, size).save(path, fmt)
    return path


@pytest.fixture(scope="module")
def default_data() -> Iterator[PreparedData]:
    with prepare_data(None, [64, 96]) as data:
        yield data


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    """A user's folder: formats mixed across subfolders, one corrupt and one truncated image,
    caption sidecars, a stray non-image file and a hidden folder."""
    root = tmp_path / "dataset"
    _save(root / "a_top.jpg", "JPEG", 1)
    (root / "a_top.txt").write_text("  a caption from the sidecar \n", encoding="utf-8")
    _save(root / "sub" / "b_upper.JPG", "JPEG", 2)
    rgba = generate_image(3, SMALL).convert("RGBA")
    (root / "sub").mkdir(exist_ok=True)
    rgba.save(root / "sub" / "c_alpha.png", "PNG")
    _save(root / "sub" / "deeper" / "d_web.webp", "WEBP", 4)
    (root / "sub" / "deeper" / "broken.png").write_bytes(np.random.default_rng(0).bytes(2000))
    whole = _save(root / "e_whole.jpg", "JPEG", 5).read_bytes()
    (root / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (root / "notes.csv").write_text("file,score\n", encoding="utf-8")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n", encoding="utf-8")
    return root


# --------------------------------------------------------------------------------------------
# Generated dataset
# --------------------------------------------------------------------------------------------


def test_generated_dataset_describes_photo_like_images(default_data: PreparedData) -> None:
    info = default_data.info
    assert info.generated
    assert info.images == DEFAULT_GENERATED_COUNT
    assert info.formats == {"JPEG": DEFAULT_GENERATED_COUNT - 1, "PNG": 1}
    width, height = DEFAULT_GENERATED_SIZE
    assert (info.pixel_sizes.width_max, info.pixel_sizes.height_max) == (width, height)
    assert info.pixel_sizes.side_over_bucket_max == pytest.approx(width / 64, rel=1e-3)
    # Photo-like: a JPEG of a phone-sized picture weighs hundreds of kB, not a few (flat colour).
    jpeg_bytes = [entry.bytes for entry in default_data.entries if entry.format == "JPEG"]
    assert min(jpeg_bytes) > 150_000
    assert info.resolutions == [64, 96]
    assert info.read_mb_per_s is None
    assert (info.skipped_non_images, info.corrupt) == (0, [])
    assert all(entry.caption.startswith("a photo of") for entry in default_data.entries)
    json.dumps(dataclasses.asdict(info))  # goes into the run record as is


def test_generated_batches_have_bucket_shapes_and_range(default_data: PreparedData) -> None:
    loader = make_loader(default_data, batch_size=2, workers=0, pin_memory=False)
    batches = _batches(loader)
    assert len(batches) == len(loader) == 4  # 8 images, 4 per bucket, 2 per batch
    assert [batch.resolution for batch in batches] == [64, 96, 64, 96]  # steps cycle buckets
    for batch in batches:
        side = batch.resolution
        assert batch.pixels.shape == (2, 3, side, side)
        assert batch.pixels.dtype == torch.float32
        assert -1.0 <= float(batch.pixels.min()) < -0.5
        assert 0.5 < float(batch.pixels.max()) <= 1.0
        assert len(batch.captions) == len(batch.paths) == 2
    seen = {path for batch in batches for path in batch.paths}
    assert seen == {entry.path for entry in default_data.entries}


def test_temp_folder_removed_by_close(tmp_path: Path) -> None:
    data = prepare_data(None, [32], count=2)
    folder = Path(data.info.root)
    assert sorted(p.suffix for p in folder.iterdir()) == [".jpg", ".png", ".txt", ".txt"]
    assert not data.closed
    data.close()
    assert data.closed
    assert not folder.exists()
    data.close()  # idempotent


def test_temp_folder_removed_on_exception_in_with() -> None:
    folder: Path | None = None
    with (
        pytest.raises(RuntimeError, match="step failed"),
        prepare_data(None, [32], count=2) as data,
    ):
        folder = Path(data.info.root)
        assert folder.is_dir()
        raise RuntimeError("step failed")
    assert folder is not None and not folder.exists()


def test_temp_folder_removed_when_never_closed() -> None:
    data = prepare_data(None, [32], count=1)
    folder = Path(data.info.root)
    del data
    gc.collect()
    assert not folder.exists()


# --------------------------------------------------------------------------------------------
# A user's folder
# --------------------------------------------------------------------------------------------


def test_user_folder_loads_reports_and_stays_unchanged(user_folder: Path) -> None:
    before = _folder_digest(user_folder)
    with prepare_data(str(user_folder), [48], count=None) as data:
        info = data.info
        assert not info.generated
        assert info.root == str(user_folder.resolve())
        assert info.images == 5
        assert info.formats == {"JPEG": 3, "PNG": 1, "WEBP": 1}
        assert info.corrupt == ["sub/deeper/broken.png", "truncated.jpg"]
        assert "truncated" in info.corrupt_reasons["truncated.jpg"]
        # The sidecar is a caption, not a skipped file; the hidden folder is not scanned.
        assert (info.skipped_non_images, info.skipped_examples) == (1, ["notes.csv"])
        assert info.read_mb_per_s is not None and info.read_mb_per_s > 0
        captions = {entry.name: entry.caption for entry in data.entries}
        assert captions["a_top.jpg"] == "a caption from the sidecar"
        assert captions["sub/b_upper.JPG"] == "b_upper"
        batches = _batches(make_loader(data, batch_size=5, workers=0, pin_memory=False))
        assert [tuple(batch.pixels.shape) for batch in batches] == [(5, 3, 48, 48)]
        assert batches[0].captions.count("a caption from the sidecar") == 1
        json.dumps(dataclasses.asdict(info))
    assert user_folder.is_dir()  # close() never removes a user's folder
    assert _folder_digest(user_folder) == before


def test_user_folder_count_caps_the_images(user_folder: Path) -> None:
    with prepare_data(str(user_folder), [32], count=2) as data:
        assert data.info.images == 2
        assert data.info.capped == 5  # the other image files, corrupt ones included, unread
        assert [entry.name for entry in data.entries] == ["a_top.jpg", "e_whole.jpg"]


@pytest.mark.parametrize("case", ["empty", "only_bad", "missing", "file"])
def test_unusable_data_path_is_bad_input(tmp_path: Path, case: str) -> None:
    target = tmp_path / "data"
    if case == "empty":
        target.mkdir()
    elif case == "only_bad":
        target.mkdir()
        (target / "x.jpg").write_bytes(b"not a jpeg")
        (target / "readme.md").write_text("hello", encoding="utf-8")
    elif case == "file":
        _save(target, "JPEG", 0)
    with pytest.raises(DiagnoseError) as raised:
        prepare_data(str(target), [32])
    assert raised.value.code == ExitCode.BAD_INPUT
    assert "\n" not in raised.value.message
    if case == "only_bad":
        assert "1 corrupt, 1 other files" in raised.value.message


def test_bad_settings_are_usage_errors(tmp_path: Path) -> None:
    for resolutions, count in (([], None), ([0], None), ([32], 0)):
        with pytest.raises(DiagnoseError) as raised:
            prepare_data(str(tmp_path), resolutions, count=count)
        assert raised.value.code == ExitCode.USAGE


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def test_load_image_centre_crops_and_flips(tmp_path: Path) -> None:
    # Portrait 60x120: red top quarter, green middle half, blue bottom quarter. The centre square
    # is the green half exactly.
    stripes = np.zeros((120, 60, 3), dtype=np.uint8)
    stripes[:30, :, 0] = 255
    stripes[30:90, :, 1] = 255
    stripes[90:, :, 2] = 255
    path = tmp_path / "stripes.png"
    Image.fromarray(stripes).save(path)
    pixels = load_image(str(path), 32)
    assert pixels.shape == (3, 32, 32)
    # Rows inside the square; the edge rows blend in their neighbours, as resize-then-crop does.
    assert torch.equal(pixels[1, 1:-1], torch.ones(30, 32))
    assert torch.equal(pixels[0, 1:-1], -torch.ones(30, 32))
    assert float(pixels[0, 0].mean()) > -1.0  # the red stripe just above bleeds into row 0

    # Left half black, right half white: the flip mirrors it exactly.
    halves = np.zeros((40, 40, 3), dtype=np.uint8)
    halves[:, 20:] = 255
    path = tmp_path / "halves.png"
    Image.fromarray(halves).save(path)
    plain, flipped = load_image(str(path), 40), load_image(str(path), 40, flip=True)
    assert float(plain[:, :, 0].mean()) == -1.0 and float(plain[:, :, -1].mean()) == 1.0
    assert torch.equal(flipped, torch.flip(plain, dims=[2]))


def test_load_image_honours_exif_orientation(tmp_path: Path) -> None:
    halves = np.zeros((40, 40, 3), dtype=np.uint8)
    halves[:, 20:] = 255  # stored: white on the right
    exif = Image.Exif()
    exif[0x0112] = 3  # shown rotated by 180 degrees: white on the left
    path = tmp_path / "rotated.jpg"
    Image.fromarray(halves).save(path, "JPEG", quality=95, exif=exif)
    pixels = load_image(str(path), 40)
    assert float(pixels[:, :, :5].mean()) > 0.9
    assert float(pixels[:, :, -5:].mean()) < -0.9


# --------------------------------------------------------------------------------------------
# Sampler and loader
# --------------------------------------------------------------------------------------------


def test_sampler_is_seeded_full_and_cycles_buckets() -> None:
    buckets = [32, 64] * 5  # 5 items per bucket
    sampler = BucketBatchSampler(buckets, batch_size=2, seed=7)
    first, again = sampler.plan_epoch(0), BucketBatchSampler(buckets, 2, seed=7).plan_epoch(0)
    assert first == again
    assert first != sampler.plan_epoch(1)
    assert first != BucketBatchSampler(buckets, 2, seed=8).plan_epoch(0)
    assert len(first) == len(sampler) == 6  # ceil(5 / 2) per bucket, the last one filled
    assert [buckets[batch[0].item] for batch in first] == [32, 64] * 3
    for batch in first:
        assert len(batch) == 2
        assert len({buckets[key.item] for key in batch}) == 1
    for side in (32, 64):
        in_bucket = {key.item for batch in first for key in batch if buckets[key.item] == side}
        assert in_bucket == {i for i, b in enumerate(buckets) if b == side}
    flips = [key.flip for batch in first for key in batch]
    assert any(flips) and not all(flips)
    # Iterators created and dropped unused (as torch does) do not advance the epoch.
    iter(sampler)
    iter(sampler)
    assert list(sampler) == first
    assert list(sampler) == sampler.plan_epoch(1)


def test_batch_larger_than_the_dataset_still_fills_batches(tmp_path: Path) -> None:
    for number in range(3):
        _save(tmp_path / f"img{number}.jpg", "JPEG", number)
    with prepare_data(str(tmp_path), [32, 48]) as data:
        loader = make_loader(data, batch_size=5, workers=0, pin_memory=False)
        for _epoch in range(2):
            batches = _batches(loader)
            assert [tuple(batch.pixels.shape) for batch in batches] == [
                (5, 3, 32, 32),
                (5, 3, 48, 48),
            ]


def test_fewer_images_than_buckets_fills_every_bucket(tmp_path: Path) -> None:
    _save(tmp_path / "only.jpg", "JPEG", 0)
    with prepare_data(str(tmp_path), [32, 48, 64]) as data:
        assert data.info.images == 1
        batches = _batches(make_loader(data, batch_size=1, workers=0, pin_memory=False))
        assert [batch.resolution for batch in batches] == [32, 48, 64]


def test_two_workers_yield_what_no_workers_yield(tmp_path: Path) -> None:
    for number in range(6):
        _save(tmp_path / f"img{number}.jpg", "JPEG", number)
    with prepare_data(str(tmp_path), [32, 48]) as data:
        serial = make_loader(data, batch_size=2, workers=0, pin_memory=False, seed=3)
        parallel = make_loader(data, batch_size=2, workers=2, pin_memory=False, seed=3)
        assert parallel.persistent_workers and not serial.persistent_workers
        for _epoch in range(2):  # the second epoch reuses the persistent workers
            expected, got = _batches(serial), _batches(parallel)
            assert {p for b in got for p in b.paths} == {p for b in expected for p in b.paths}
            assert [b.paths for b in got] == [b.paths for b in expected]
            for mine, theirs in zip(got, expected, strict=True):
                assert torch.equal(mine.pixels, theirs.pixels)  # flips included
        del parallel  # stop the workers before the folder goes


def test_pin_memory_with_the_custom_batch(tmp_path: Path) -> None:
    _save(tmp_path / "img.jpg", "JPEG", 0)
    with prepare_data(str(tmp_path), [32]) as data:
        loader = make_loader(data, batch_size=1, workers=0, pin_memory=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no accelerator": pinning is skipped
            (batch,) = _batches(loader)
        assert isinstance(batch, ImageBatch)
        if torch.cuda.is_available():
            assert batch.pixels.is_pinned()
            assert batch.pin_memory().pixels.is_pinned()


def test_dataset_and_collate_are_picklable(default_data: PreparedData) -> None:
    dataset = pickle.loads(pickle.dumps(default_data.dataset))
    sample = dataset[SampleKey(0, True)]
    assert sample.pixels.shape == (3, 64, 64)
    assert pickle.loads(pickle.dumps(collate_images)) is collate_images
    assert pickle.loads(pickle.dumps(seed_worker)) is seed_worker
    batch = collate_images([dataset[0], dataset[2]])
    assert batch.pixels.shape == (2, 3, 64, 64)
    with pytest.raises(ValueError, match="mixes bucket shapes"):
        collate_images([dataset[0], dataset[1]])


def test_generate_images_writes_captions(tmp_path: Path) -> None:
    paths = generate_images(tmp_path / "gen", count=3, seed=1, size=SMALL)
    assert [p.suffix for p in paths] == [".jpg", ".jpg", ".png"]
    for path in paths:
        with Image.open(path) as image:
            assert image.size == SMALL
        assert path.with_suffix(".txt").read_text(encoding="utf-8").startswith("a photo")
