"""Environment rules about device memory: VRAM spilling into system memory or at capacity, the
caching allocator's retries, and allocator settings that cost time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import memory_catalog as cat
from diagnose.device import is_integrated_gpu
from diagnose.probes.environment.facts import (
    EnvironmentFacts,
    FullSizeMemory,
    fine,
    found,
    gib,
    judged,
    truthy,
    unknown,
)
from diagnose.record import ProbeResult
from diagnose.stats import at_line
from diagnose.units import pct


def _sysmem_fallback(facts: EnvironmentFacts) -> bool:
    """NVIDIA on Windows or WSL2: the driver backs an overflow with system memory."""
    os_info = facts.section("os")
    return facts.device.kind == "cuda" and bool(
        os_info.get("system") == "Windows" or os_info.get("wsl")
    )


def rule_vram_spill(facts: EnvironmentFacts) -> ProbeResult:
    """VRAM at capacity: a spill into shared system memory, or a near-OOM that slows the step."""
    if not facts.on_gpu:
        return judged()
    sampled = facts.sampled
    total = facts.device.memory_bytes or (sampled.limits.memory_total_bytes if sampled else None)
    timing = facts.timing
    reserved = timing.peak_reserved_bytes if timing else None
    if facts.full_size is not None:
        return _vram_at_full_size(facts, facts.full_size, total, reserved)
    used_fraction = sampled.stats.memory_used_max_fraction if sampled else None
    if not total or (reserved is None and used_fraction is None):
        result = unknown(cat.VRAM_SPILL.id, "VRAM spill: no peak memory recorded")
        result.add_not_judged(
            cat.VRAM_NEAR_CAPACITY.id, "VRAM headroom: no peak memory or telemetry"
        )
        return result
    reserved_fraction = reserved / total if reserved else None
    evidence: dict[str, Any] = {
        "vram_total": gib(total),
        "torch_peak_reserved": gib(reserved),
        "torch_peak_reserved_fraction": reserved_fraction,
        "driver_peak_used_fraction": used_fraction,
        "seconds_per_it": facts.seconds_per_it,
    }
    if sampled:
        evidence["gpu_utilization_median_pct"] = sampled.stats.utilization_median_pct
        evidence["pcie_rx_median_bytes_per_s"] = sampled.stats.pcie_rx_median_bytes_per_s
        evidence["pcie_tx_median_bytes_per_s"] = sampled.stats.pcie_tx_median_bytes_per_s
    sysmem = _sysmem_fallback(facts)
    result = judged()
    if is_integrated_gpu(facts.device):
        pass  # its memory is system memory: there is nothing to spill into
    elif reserved_fraction is None:
        result.add_not_judged(
            cat.VRAM_SPILL.id, "VRAM spill: torch's peak reservation not recorded"
        )
    elif reserved_fraction > 1.0:
        # Only possible when the driver backs allocations with system memory (NVIDIA's sysmem
        # fallback on Windows/WSL2): every kernel touching those pages goes over PCIe.
        result.add_finding(
            cat.vram_spill_finding(
                reserved=gib(reserved), total=gib(total), sysmem_fallback=sysmem, evidence=evidence
            )
        )
        return result
    else:
        result.add_ok(
            cat.VRAM_SPILL.id,
            f"torch's peak reservation ({gib(reserved)}) fits in the GPU's {gib(total)}: nothing "
            "spilled",
        )
    peak = max(f for f in (reserved_fraction, used_fraction) if f is not None)
    if at_line(peak, cat.NEAR_CAPACITY).below:
        result.add_ok(
            cat.VRAM_NEAR_CAPACITY.id, f"peak VRAM {pct(peak)} of {gib(total)}: headroom left"
        )
        return result
    signals = []
    if sampled:
        rx = sampled.stats.pcie_rx_median_bytes_per_s or 0.0
        tx = sampled.stats.pcie_tx_median_bytes_per_s or 0.0
        if at_line(max(rx, tx), cat.HEAVY_PCIE_BYTES_PER_S).above:
            signals.append(f"PCIe traffic {max(rx, tx) / 1e9:.1f} GB/s during the steps")
        util = sampled.stats.utilization_median_pct
        if util is not None and at_line(util, cat.LOW_UTILIZATION_PCT).below:
            signals.append(f"GPU busy only {util:.0f}% of the time")
    retries = facts.allocator.get("num_alloc_retries", 0)
    if retries:
        signals.append(f"{retries} allocator retries")
    evidence["signals"] = signals
    result.add_finding(
        cat.vram_near_capacity_finding(
            peak=pct(peak), signals=signals, sysmem_fallback=sysmem, evidence=evidence
        )
    )
    return result


def _activations_said(full: FullSizeMemory, total: int | None) -> str:
    """What one full-size step's activations add, counted on the meta device, and whether the
    peak fits with and without gradient checkpointing."""
    plain = full.peak_bytes(checkpointing=False)
    checkpointed = full.peak_bytes(checkpointing=True)
    if plain is None or checkpointed is None:
        why = f" ({full.activations_at})" if full.activations_at else ""
        return f"its activations could not be counted{why}, so whether they fit is not said"
    said = (
        f"one step at {full.activations_at} peaks at about {gib(plain)} "
        f"({gib(checkpointed)} with gradient checkpointing)"
    )
    if total is None or plain <= total:
        return f"{said}: it fits"
    if checkpointed <= total:
        return f"{said}: it fits only with gradient checkpointing (--grad-checkpointing)"
    return f"{said}: it does not fit even with gradient checkpointing"


def _vram_at_full_size(
    facts: EnvironmentFacts, full: FullSizeMemory, total: int | None, reserved: int | None
) -> ProbeResult:
    """A shrunk model's peak memory is no advice for the real one: the VRAM questions are
    withheld, with the real model's memory before activations (meta device) against the GPU's,
    and what that already says."""
    result = judged()
    tiny = f"the tiny model's peak reservation ({gib(reserved)})"
    static = full.static_bytes
    share = f" ({pct(static / total)})" if total else ""
    base = (
        f"{tiny} says nothing about {full.preset}'s: at full size its weights, LoRA, gradients "
        f"and optimizer state take {gib(static)} of the GPU's {gib(total)}{share} before any "
        "activation"
    )
    if total and static >= total:
        spill = (
            f"VRAM spill: {base}, more than it has: a full-size run spills or runs out of memory"
        )
    else:
        spill = f"VRAM spill: {base}; {_activations_said(full, total)}"
    result.add_not_judged(cat.VRAM_SPILL.id, spill)
    result.add_not_judged(
        cat.VRAM_NEAR_CAPACITY.id,
        f"VRAM headroom: judged only at full size ({tiny} is the tiny model's)",
    )
    return result


def rule_allocator_retries(facts: EnvironmentFacts) -> ProbeResult:
    """torch's caching allocator ran out of cached memory and had to free and retry."""
    check = cat.ALLOCATOR_RETRIES.id
    if not facts.on_gpu:
        return judged()
    if not facts.allocator:
        return unknown(check, "allocator retries: torch.cuda.memory_stats not read")
    retries = facts.allocator.get("num_alloc_retries", 0)
    ooms = facts.allocator.get("num_ooms", 0)
    scope = facts.allocator_scope or "this run"
    steps = facts.timing.unprofiled.n if facts.timing else 0
    if not retries and not ooms:
        return fine(check, f"no allocator retries ({scope})")
    per_step = retries / steps if steps and facts.allocator_scope.startswith("timed") else None
    return found(
        cat.allocator_retries_finding(
            retries=retries,
            every_step=bool(ooms)
            or (per_step is not None and at_line(per_step, cat.RETRIES_PER_STEP_CRITICAL).above),
            scope=scope,
            evidence={
                "num_alloc_retries": retries,
                "num_ooms": ooms,
                "retries_per_step": per_step,
                "scope": facts.allocator_scope,
                "num_device_alloc": facts.allocator.get("num_device_alloc"),
                "num_device_free": facts.allocator.get("num_device_free"),
            },
        )
    )


def _allocator_confs(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Each set allocator variable parsed into {option: value}."""
    confs: dict[str, dict[str, str]] = {}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        text = env.get(name)
        if not text:
            continue
        options: dict[str, str] = {}
        for part in text.split(","):
            key, _, value = part.partition(":")
            if key.strip():
                options[key.strip()] = value.strip()
        confs[name] = options
    return confs


def rule_allocator_settings(facts: EnvironmentFacts) -> ProbeResult:
    """Allocator settings that cost time: caching off, or options that fight each other."""
    if not facts.on_gpu:
        return judged()
    env = facts.env
    no_caching = env.get("PYTORCH_NO_CUDA_MEMORY_CACHING")
    if truthy(no_caching):
        # Without a cache the options below have nothing to act on.
        return found(cat.caching_allocator_off_finding(str(no_caching)))
    result = fine(cat.CACHING_ALLOCATOR_OFF.id, "the caching allocator is on")
    confs = _allocator_confs(env)
    if not confs:
        result.add_ok(cat.ALLOCATOR_CONF_CONFLICT.id, "allocator: default settings")
        return result
    merged: dict[str, str] = {}
    for options in confs.values():
        merged.update(options)
    expandable = merged.get("expandable_segments", "").lower() == "true"
    if expandable and "max_split_size_mb" in merged:
        result.add_finding(cat.allocator_conf_conflict_finding({name: env[name] for name in confs}))
    else:
        result.add_ok(
            cat.ALLOCATOR_CONF_CONFLICT.id,
            f"allocator settings: {', '.join(f'{k}={env[k]}' for k in confs)}",
        )
    return result
