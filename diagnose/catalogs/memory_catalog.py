"""What the project knows about device and host memory: finding ids, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

VRAM_SPILL = FindingSpec(
    "memory.vram_spill",
    "memory",
    "VRAM is over-committed and memory spills to the host",
    ("probe",),
)
VRAM_NEAR_CAPACITY = FindingSpec(
    "memory.vram_near_capacity",
    "memory",
    "the step's peak memory is near the GPU's capacity",
    ("probe",),
)
ALLOCATOR_RETRIES = FindingSpec(
    "memory.allocator_retries",
    "memory",
    "the caching allocator had to free and retry allocations (cudaMalloc retries)",
    ("probe",),
)
CACHING_ALLOCATOR_OFF = FindingSpec(
    "memory.caching_allocator_off",
    "memory",
    "the caching allocator is turned off",
    ("probe",),
)
ALLOCATOR_CONF_CONFLICT = FindingSpec(
    "memory.allocator_conf_conflict",
    "memory",
    "allocator settings in the environment conflict",
    ("probe",),
)
SPECS = (
    VRAM_SPILL,
    VRAM_NEAR_CAPACITY,
    ALLOCATOR_RETRIES,
    CACHING_ALLOCATOR_OFF,
    ALLOCATOR_CONF_CONFLICT,
)
