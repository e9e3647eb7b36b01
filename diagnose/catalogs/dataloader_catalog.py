"""What the project knows about data loading: finding ids, thresholds, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

GPU_STARVED = FindingSpec(
    "dataloader.gpu_starved",
    "dataloader",
    "the loop waits for the next batch while the GPU idles",
    ("probe", "trace"),
    phases=("data_wait",),
)
SLOW_LOADER = FindingSpec(
    "dataloader.slow_loader",
    "dataloader",
    "the loop hardly waits, yet a loader change (cached latents, pre-decoded images, more "
    "workers) was measured clearly faster: the image work is paid inside the step",
    ("probe",),
)
CORRUPT_IMAGES = FindingSpec(
    "dataloader.corrupt_images",
    "dataloader",
    "files of the data folder that could not be decoded",
    ("probe",),
)
SPECS = (GPU_STARVED, SLOW_LOADER, CORRUPT_IMAGES)
