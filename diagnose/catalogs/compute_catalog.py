"""What the project knows about how the device is kept busy: finding ids, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

LAUNCH_BOUND = FindingSpec(
    "compute.launch_bound",
    "compute",
    "the GPU waits for the host between kernels (launch overhead, Python between ops)",
    ("trace",),
)
SPECS = (LAUNCH_BOUND,)
