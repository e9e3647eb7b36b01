"""Generated photo-like images, for a run without ``--data``: smooth gradients, shapes and
sensor-like noise, so that they compress and decode like photos rather than like noise or flat
colour. :func:`~diagnose.workload.data.prepare_data` writes them into a folder it owns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from diagnose.workload.image_files import CAPTION_SUFFIX

#: Generated images: enough for a few epochs of small batches, quick to write (about 0.08 s per
#: image on one slow core, 0.7 s for the whole set with its checks).
DEFAULT_GENERATED_COUNT = 8
#: (width, height) of generated images: a portrait phone photo.
DEFAULT_GENERATED_SIZE: tuple[int, int] = (1224, 1800)


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


__all__ = ["DEFAULT_GENERATED_COUNT", "DEFAULT_GENERATED_SIZE", "generate_image", "generate_images"]
