"""Environment rules about ROCm settings: kernel search at startup (MIOpen find, TunableOp),
TunableOp tuning live, HSA_OVERRIDE_GFX_VERSION, and hipBLASLt requested or switched off."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import environment_catalog as cat
from diagnose.probes.environment.facts import (
    EnvironmentFacts,
    fine,
    found,
    judged,
    truthy,
    unknown,
    version_tuple,
)
from diagnose.record import ProbeResult, Timing
from diagnose.stats import at_line

# --- kernel search and tuning --------------------------------------------------------------------


def _first_step_vs_rest(timing: Timing) -> tuple[float, float, str] | None:
    """(first step seconds, typical step seconds, where the first step comes from)."""
    if timing.warmup_seconds and timing.headline.n:
        return timing.warmup_seconds[0], timing.headline.median, "first warm-up step"
    unprofiled = [s.seconds for s in timing.samples if not s.profiled]
    if len(unprofiled) >= 3:
        return unprofiled[0], statistics.median(unprofiled[1:]), "first timed step (no warm-up)"
    return None


def _tunableop_state(facts: EnvironmentFacts) -> tuple[bool, bool]:
    """(enabled, tuning) from the environment or torch.cuda.tunable."""
    env = facts.env
    flags = facts.section("torch", "flags")
    enabled = truthy(env.get("PYTORCH_TUNABLEOP_ENABLED")) or flags.get("tunableop_enabled") is True
    # Tuning defaults to on once TunableOp is enabled.
    tuning_env = env.get("PYTORCH_TUNABLEOP_TUNING")
    if tuning_env is not None:
        tuning = truthy(tuning_env)
    else:
        tuning = flags.get("tunableop_tuning") is not False
    return enabled, enabled and tuning


def rule_rocm_warmup(facts: EnvironmentFacts) -> ProbeResult:
    """First steps much slower than the rest on ROCm: MIOpen find / TunableOp at startup."""
    check = cat.ROCM_KERNEL_SEARCH_WARMUP.id
    if facts.device.kind != "rocm" or facts.timing is None:
        return judged()
    pair = _first_step_vs_rest(facts.timing)
    if pair is None:
        return unknown(check, "kernel-search warm-up: fewer than 3 timed steps and no warm-up step")
    first, typical, source = pair
    if typical <= 0:
        return unknown(check, "kernel-search warm-up: no typical step time")
    ratio = first / typical
    if at_line(ratio, cat.WARMUP_RATIO).below or at_line(first - typical, cat.WARMUP_EXTRA_S).below:
        return fine(
            check,
            f"{source} {first:.2f} s vs {typical:.2f} s/it: no kernel-search warm-up to speak of",
        )
    env = facts.env
    flags = facts.section("torch", "flags")
    enabled, tuning = _tunableop_state(facts)
    find_mode = env.get("MIOPEN_FIND_MODE")
    slow_later = [
        s.index
        for s in facts.timing.samples
        if not s.profiled and at_line(s.seconds / typical, cat.WARMUP_RATIO).above
    ]
    evidence: dict[str, Any] = {
        "first_step_seconds": round(first, 3),
        "first_step_source": source,
        "median_seconds_per_it": round(typical, 3),
        "ratio": round(ratio, 1),
        "extra_seconds": round(first - typical, 2),
        "later_slow_steps": slow_later,
        "MIOPEN_FIND_MODE": find_mode or "unset (default DYNAMIC_HYBRID)",
        "MIOPEN_USER_DB_PATH": env.get("MIOPEN_USER_DB_PATH") or "unset (~/.config/miopen)",
        "tunableop_enabled": enabled,
        "tunableop_tuning": tuning,
        "cudnn_benchmark": flags.get("cudnn_benchmark"),
        "resolution_buckets": len(facts.resolutions) or None,
    }
    return found(
        cat.rocm_warmup_finding(
            source=source,
            first=first,
            typical=typical,
            tuning=tuning,
            cudnn_benchmark=bool(flags.get("cudnn_benchmark")),
            find_mode_fast=(find_mode or "").strip().upper() in ("2", "FAST"),
            resolution_buckets=len(facts.resolutions),
            evidence=evidence,
        )
    )


def rule_tunableop_tuning(facts: EnvironmentFacts) -> ProbeResult:
    """TunableOp enabled with tuning on: GEMMs are benchmarked during training."""
    check = cat.TUNABLEOP_TUNING.id
    if not facts.on_gpu:
        return judged()
    enabled, tuning = _tunableop_state(facts)
    if not enabled:
        return fine(check, "TunableOp off")
    if not tuning:
        return fine(check, "TunableOp on with tuning off (uses saved results)")
    env = facts.env
    names = (
        "PYTORCH_TUNABLEOP_ENABLED",
        "PYTORCH_TUNABLEOP_TUNING",
        "PYTORCH_TUNABLEOP_FILENAME",
        "PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS",
    )
    evidence = {k: env.get(k) for k in names if env.get(k) is not None}
    return found(cat.tunableop_tuning_finding(evidence=evidence or {"tunableop_tuning": True}))


# --- HSA_OVERRIDE_GFX_VERSION --------------------------------------------------------------------


def hsa_override_target(value: str) -> str | None:
    """The target an HSA_OVERRIDE_GFX_VERSION value names: "11.0.0" -> "gfx1100", "9.4.2" ->
    "gfx942"; None when malformed."""
    parts = value.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    major, minor, stepping = (int(p) for p in parts)
    return f"gfx{major}{minor}{stepping:x}"


def _gfx_generation(gfx: str) -> str:
    """ "gfx1100" -> "11", "gfx942" -> "9", "gfx1030" -> "10"."""
    digits = gfx.removeprefix("gfx")
    return digits[:2] if len(digits) == 4 else digits[:1]


def rule_hsa_override(facts: EnvironmentFacts) -> ProbeResult:
    """HSA_OVERRIDE_GFX_VERSION makes the runtime load kernels built for another GPU."""
    if facts.device.kind != "rocm":
        return judged()
    value = facts.env.get("HSA_OVERRIDE_GFX_VERSION")
    if not value:
        return fine(cat.HSA_OVERRIDE.id, "HSA_OVERRIDE_GFX_VERSION not set")
    target = hsa_override_target(value)
    kfd = [n for n in facts.section("gpu").get("kfd_nodes") or [] if isinstance(n, Mapping)]
    real = str(kfd[0].get("gfx_target")) if len(kfd) == 1 else None
    bus_id = facts.device.extra.get("pci_bus_id")
    for node in kfd:
        if bus_id and str(node.get("pci_bus_id", "")).lower() == str(bus_id).lower():
            real = str(node.get("gfx_target"))
    arch_list = [a.split(":")[0] for a in facts.section("torch").get("arch_list") or []]
    evidence: dict[str, Any] = {
        "HSA_OVERRIDE_GFX_VERSION": value,
        "runs_kernels_for": target,
        "real_gpu_target": real or "unknown (no KFD topology)",
        "torch_arch_list": arch_list,
    }
    kind: cat.HsaOverrideKind
    if target is None:
        kind = "malformed"
    elif real and real == target:
        kind = "own_target"
    elif real and _gfx_generation(real) != _gfx_generation(target):
        kind = "other_generation"
    elif real and real in arch_list:
        kind = "not_needed"
    else:
        kind = "needed"
    return found(
        cat.hsa_override_finding(kind, value=value, target=target, real=real, evidence=evidence)
    )


# --- hipBLASLt -----------------------------------------------------------------------------------


def hipblaslt_supported(arch: str, hip_version: str | None) -> bool | None:
    """Whether torch lets hipBLASLt run on ``arch`` with this ROCm version (None: unknown).

    torch's CUDAHooks::getHipblasltSupportedArchs: gfx90a, gfx942 always; gfx1100, gfx1101,
    gfx1103, gfx1200, gfx1201, gfx908 from ROCm 6.3; gfx950, gfx1150, gfx1151 from ROCm 7.0;
    gfx1250 from 7.2. On any other target torch warns "Attempting to use hipBLASLt on an
    unsupported architecture! Overriding blas backend to hipblas".
    """
    version = version_tuple(hip_version)
    if not version or not arch:
        return None
    supported = {"gfx90a", "gfx942"}
    if version >= (6, 3):
        supported |= {"gfx1100", "gfx1101", "gfx1103", "gfx1200", "gfx1201", "gfx908"}
    if version >= (7, 0):
        supported |= {"gfx950", "gfx1150", "gfx1151"}
    if version >= (7, 2):
        supported |= {"gfx1250"}
    return arch.split(":")[0].lower() in supported


def rule_hipblaslt(facts: EnvironmentFacts) -> ProbeResult:
    """hipBLASLt requested where torch does not support it (it falls back to hipBLAS), or
    switched off where it is supported."""
    if facts.device.kind != "rocm":
        return judged()
    hip = facts.section("torch").get("hip")
    arch = facts.device.arch
    supported = hipblaslt_supported(arch, hip)
    prefer = facts.env.get("TORCH_BLAS_PREFER_HIPBLASLT")
    flags = facts.section("torch", "flags")
    preferred = flags.get("preferred_blas_library")
    # The inventory keeps the warning torch gives when it falls back (see collect_torch).
    warning = str(flags.get("preferred_blas_library_warning") or "")
    torch_fell_back = "unsupported architecture" in warning
    evidence = {
        "arch": arch,
        "hip": hip,
        "TORCH_BLAS_PREFER_HIPBLASLT": prefer,
        "preferred_blas_library": preferred,
        "hipblaslt_supported": supported,
        "torch_warning": warning or None,
    }
    if supported is None and not torch_fell_back:
        result = unknown(
            cat.HIPBLASLT_UNSUPPORTED.id, "hipBLASLt support: unknown HIP version or arch"
        )
        result.add_not_judged(
            cat.HIPBLASLT_OFF.id, "hipBLASLt support: unknown HIP version or arch"
        )
        return result
    if torch_fell_back or (supported is False and truthy(prefer)):
        asked = f"TORCH_BLAS_PREFER_HIPBLASLT={prefer}" if prefer else "hipBLASLt requested"
        return found(
            cat.hipblaslt_unsupported_finding(asked=asked, arch=arch, hip=hip, evidence=evidence)
        )
    library = f"BLAS library: {preferred or 'default'} (hipBLASLt supported: {supported})"
    result = fine(cat.HIPBLASLT_UNSUPPORTED.id, library)
    if supported and prefer is not None and not truthy(prefer):
        result.add_finding(cat.hipblaslt_off_finding(value=prefer, arch=arch, evidence=evidence))
    elif supported:
        result.add_ok(cat.HIPBLASLT_OFF.id, f"hipBLASLt not switched off on {arch}")
    return result
