"""What the project knows about device memory and the caching allocator: finding ids,
thresholds, wording, fixes.

The environment probe's memory rules (``probes/environment/memory.py``) decide whether a finding
is raised. No saving is measured for these (the step is not re-run with more headroom), so the
severity is the kind of fault's, declared here, variants included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.catalogs import (
    FindingSpec,
    carries_over,
    in_trainers,
    judged_at_full_size,
    tiny_model_only,
)
from diagnose.record import Finding, Severity

VRAM_SPILL = FindingSpec(
    "memory.vram_spill",
    "memory",
    "torch holds more memory than the GPU has: the driver backs the overflow with system RAM "
    "and every step streams it over PCIe",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=judged_at_full_size(
        "a tiny model's peak memory says nothing about the real model's: judged on the preset's "
        "full-size weights, LoRA, gradients and optimizer state (meta device), or withheld"
    ),
)
VRAM_NEAR_CAPACITY = FindingSpec(
    "memory.vram_near_capacity",
    "memory",
    "peak VRAM is near the GPU's capacity (a warning when the GPU also waits: PCIe traffic, low "
    "utilisation, allocator retries)",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=judged_at_full_size(
        "a tiny model's peak memory says nothing about the real model's: judged on the preset's "
        "full-size weights, LoRA, gradients and optimizer state (meta device), or withheld"
    ),
)
ALLOCATOR_RETRIES = FindingSpec(
    "memory.allocator_retries",
    "memory",
    "the caching allocator ran out of cached memory and freed every cached block to retry "
    "(a device synchronisation each time)",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "retries come with memory pressure, which a tiny model does not create"
    ),
)
CACHING_ALLOCATOR_OFF = FindingSpec(
    "memory.caching_allocator_off",
    "memory",
    "`PYTORCH_NO_CUDA_MEMORY_CACHING` turns the caching allocator off: every allocation is a "
    "device malloc and every free synchronises",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over("an environment variable"),
)
ALLOCATOR_CONF_CONFLICT = FindingSpec(
    "memory.allocator_conf_conflict",
    "memory",
    "`max_split_size_mb` set together with `expandable_segments:True` in the allocator settings",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("allocator settings in the environment"),
)
SPECS = (
    VRAM_SPILL,
    VRAM_NEAR_CAPACITY,
    ALLOCATOR_RETRIES,
    CACHING_ALLOCATOR_OFF,
    ALLOCATOR_CONF_CONFLICT,
)


#: Peak VRAM use at or above this share of the total leaves no headroom.
NEAR_CAPACITY = 0.95
#: Median PCIe traffic (bytes/s, one direction) that says memory is streamed over the bus.
HEAVY_PCIE_BYTES_PER_S = 1.0e9
#: A GPU at capacity and busy less than this (median %) is waiting on memory.
LOW_UTILIZATION_PCT = 60.0
#: Retries in every timed step (or an out-of-memory) make the allocator's retries critical.
RETRIES_PER_STEP_CRITICAL = 1.0

#: At capacity without a sign the GPU waits: no headroom, not yet a slowdown.
NEAR_CAPACITY_QUIET_SEVERITY: Severity = "info"
#: Retrying in every step, or running out of memory, frees the whole cache again and again.
RETRIES_EVERY_STEP_SEVERITY: Severity = "critical"

_REDUCE_MEMORY = in_trainers(
    "Reduce memory so the step fits: gradient checkpointing, cached latents, an 8-bit "
    "optimizer, a smaller batch or resolution",
    kohya="--gradient_checkpointing --cache_latents --optimizer_type AdamW8bit",
    diffusers="--gradient_checkpointing --use_8bit_adam",
    onetrainer="gradient checkpointing on, latent caching on",
)
_EXPANDABLE = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (ROCm: PYTORCH_HIP_ALLOC_CONF) cuts "
    "fragmentation"
)


def spill_fix(sysmem_fallback: bool) -> str:
    """How to leave headroom; ``sysmem_fallback``: NVIDIA on Windows or WSL2, whose driver spills
    into system memory instead of failing."""
    if sysmem_fallback:
        return (
            "Turn the driver's spill off so an overflow is an out-of-memory error instead of a "
            "much slower step: NVIDIA Control Panel > Manage 3D settings > CUDA - Sysmem "
            "Fallback Policy > Prefer No Sysmem Fallback (driver 536.40+). " + _REDUCE_MEMORY
        )
    return f"{_REDUCE_MEMORY.rstrip('.')}. {_EXPANDABLE}."


def vram_spill_finding(
    *, reserved: str, total: str, sysmem_fallback: bool, evidence: Mapping[str, Any]
) -> Finding:
    return VRAM_SPILL.build(
        f"torch holds {reserved} on a {total} GPU: the overflow lives in shared system memory "
        "and every step streams it over PCIe",
        fix=spill_fix(sysmem_fallback),
        evidence=evidence,
        detail="When VRAM runs out, the Windows NVIDIA driver (and WSL2, which uses it) backs "
        "further allocations with system RAM instead of failing. The step then runs at PCIe "
        "speed, tens of times slower than in VRAM.",
    )


def vram_near_capacity_finding(
    *, peak: str, signals: Sequence[str], sysmem_fallback: bool, evidence: Mapping[str, Any]
) -> Finding:
    """Peak VRAM ``peak`` full; ``signals``: the signs that the GPU waits on memory."""
    if signals:
        return VRAM_NEAR_CAPACITY.build(
            f"VRAM {peak} full and the GPU waits ({'; '.join(signals)}): the step is spilling "
            "or thrashing the allocator",
            fix=spill_fix(sysmem_fallback),
            evidence=evidence,
        )
    return VRAM_NEAR_CAPACITY.build(
        f"VRAM {peak} full: no headroom; a larger batch or resolution will spill or run out of "
        "memory",
        fix=spill_fix(sysmem_fallback),
        evidence=evidence,
        severity=NEAR_CAPACITY_QUIET_SEVERITY,
    )


def allocator_retries_finding(
    *, retries: int, every_step: bool, scope: str, evidence: Mapping[str, Any]
) -> Finding:
    """``every_step``: retries in every timed step, or an out-of-memory."""
    return ALLOCATOR_RETRIES.build(
        f"The CUDA caching allocator ran out of cached memory {retries} time"
        f"{'' if retries == 1 else 's'} ({scope}): each retry frees every cached block and "
        "synchronises the device",
        fix=f"Leave headroom: {_REDUCE_MEMORY.rstrip('.')}. {_EXPANDABLE}: it lets the "
        "allocator grow segments instead of freeing and re-allocating.",
        evidence=evidence,
        severity=RETRIES_EVERY_STEP_SEVERITY if every_step else None,
    )


def caching_allocator_off_finding(value: str) -> Finding:
    return CACHING_ALLOCATOR_OFF.build(
        "PYTORCH_NO_CUDA_MEMORY_CACHING is set: every tensor allocation is a cudaMalloc and "
        "every free a synchronising cudaFree",
        fix="unset PYTORCH_NO_CUDA_MEMORY_CACHING (it is a debugging switch)",
        evidence={"PYTORCH_NO_CUDA_MEMORY_CACHING": value},
    )


def allocator_conf_conflict_finding(settings: Mapping[str, str]) -> Finding:
    """``settings``: the allocator variables as set."""
    return ALLOCATOR_CONF_CONFLICT.build(
        "max_split_size_mb is set together with expandable_segments:True: two fixes for "
        "fragmentation that work against each other",
        fix="Keep expandable_segments:True and drop max_split_size_mb, e.g. "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        evidence=dict(settings),
        detail="With expandable segments torch no longer splits blocks by max_split_size_mb "
        "(CUDACachingAllocator should_split), but its oversize-block rules still apply: cached "
        "blocks above the limit are not reused for smaller requests and are released on every "
        "retry, so memory is unmapped and mapped again.",
    )
