"""The ``environment`` probe: machine-level causes of a slow step.

Many "why is my LoRA slow" threads end here rather than in the model: training silently on the
CPU or on an integrated GPU, VRAM spilling into shared system memory (70-200 s/it instead of
1-2), MIOpen searching convolution kernels for every new shape, TunableOp tuning live, hipBLASLt
requested on a GPU it does not support, HSA_OVERRIDE_GFX_VERSION games, bf16 on a device without
bf16 units, allocator settings that fight each other, CUDA_LAUNCH_BLOCKING=1 left set, throttled
clocks, a PCIe link at x4, an old driver.

Each rule is a pure function of :class:`EnvironmentFacts` (the device, the inventory dict, the
telemetry summary, the timing, the precision) returning a :class:`RuleResult`, so it is tested on
recorded inventories and telemetry (``fixtures/inventory/``, ``fixtures/telemetry/``). The probe
only gathers the facts from the run's context and runs :data:`RULES`. It re-runs nothing, so it
costs milliseconds.
"""

from __future__ import annotations

import os
import statistics
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose.device import bf16_native, is_integrated_gpu
from diagnose.probes.base import ProbeContext
from diagnose.record import Category, DeviceInfo, Finding, ProbeResult, Severity, Timing
from diagnose.telemetry import TelemetrySummary

GIB = 1024**3

# --- facts ---------------------------------------------------------------------------------------


@dataclass
class EnvironmentFacts:
    """Everything the rules judge. Built by :func:`gather_facts` in a run, or from fixtures."""

    device: DeviceInfo
    #: The inventory dict (diagnose.inventory.collect_inventory); missing keys mean "unknown".
    inventory: Mapping[str, Any] = field(default_factory=dict)
    #: Telemetry sampled during the timed steps; None when not sampled.
    telemetry: TelemetrySummary | None = None
    timing: Timing | None = None
    #: The precision the run trained in ("bf16-mixed", ...); None when unknown (trace mode).
    precision: str | None = None
    #: torch caching-allocator counters (num_alloc_retries, num_ooms...) and what they cover.
    allocator: dict[str, int] = field(default_factory=dict)
    allocator_scope: str = ""
    #: Resolution buckets the run cycled through.
    resolutions: list[int] = field(default_factory=list)

    @property
    def env(self) -> Mapping[str, str]:
        env = self.inventory.get("env")
        return env if isinstance(env, Mapping) else {}

    def section(self, *path: str) -> Mapping[str, Any]:
        """inventory[path...] as a mapping ({} when absent)."""
        node: Any = self.inventory
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node if isinstance(node, Mapping) else {}

    @property
    def on_gpu(self) -> bool:
        return self.device.kind in ("cuda", "rocm")

    @property
    def seconds_per_it(self) -> float | None:
        if self.timing is None:
            return None
        median = self.timing.headline.median
        return median if median == median and median > 0 else None  # NaN-safe

    @property
    def sampled(self) -> TelemetrySummary | None:
        """The telemetry summary when it holds samples."""
        t = self.telemetry
        return t if t is not None and t.available and t.stats.n > 0 else None


@dataclass
class RuleResult:
    findings: list[Finding] = field(default_factory=list)
    #: Checked and found fine (one line each, for the report's "checked, fine").
    ok: list[str] = field(default_factory=list)
    #: Could not be judged here, and why.
    not_checked: list[str] = field(default_factory=list)


Rule = Callable[[EnvironmentFacts], RuleResult]


def _fine(line: str) -> RuleResult:
    return RuleResult(ok=[line])


def _unknown(line: str) -> RuleResult:
    return RuleResult(not_checked=[line])


def _finding(
    id: str,
    severity: Severity,
    title: str,
    *,
    evidence: dict[str, Any],
    fix: str,
    detail: str = "",
    category: Category = "environment",
) -> RuleResult:
    return RuleResult(
        findings=[
            Finding(
                id=id,
                category=category,
                severity=severity,
                title=title,
                evidence=evidence,
                fix=fix,
                detail=detail,
                source="environment",
            )
        ]
    )


_FALSY = frozenset({"", "0", "false", "no", "off", "none"})


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in _FALSY


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _device_label(device: DeviceInfo) -> str:
    name = device.name or device.kind
    return f"{name} ({device.arch})" if device.arch else name


# --- rules: which device -------------------------------------------------------------------------


def _gpu_candidates(facts: EnvironmentFacts) -> list[Mapping[str, Any]]:
    """NVIDIA/AMD display devices on the PCI bus that are not known to be integrated."""
    kfd = facts.section("gpu").get("kfd_nodes") or []
    integrated_bus_ids = {
        str(n.get("pci_bus_id", "")).lower()
        for n in kfd
        if isinstance(n, Mapping) and n.get("integrated")
    }
    out = []
    for device in facts.section("gpu").get("pci") or []:
        if not isinstance(device, Mapping) or device.get("vendor") not in ("NVIDIA", "AMD"):
            continue
        if str(device.get("slot", "")).lower() in integrated_bus_ids:
            continue
        out.append(device)
    return out


def rule_cpu_with_gpu_present(facts: EnvironmentFacts) -> RuleResult:
    """Training on the CPU while the machine has a GPU (torch sees it, or the PCI bus does)."""
    if facts.device.kind != "cpu":
        return RuleResult()
    torch_info = facts.section("torch")
    count = int(torch_info.get("device_count") or 0)
    if torch_info.get("cuda_available") and count:
        names = [d.get("name", "") for d in facts.section("gpu").get("torch_devices") or []]
        return _finding(
            "environment.cpu_with_gpu_present",
            "critical",
            f"The step ran on the CPU although torch sees {count} GPU{'' if count == 1 else 's'}",
            evidence={"torch_gpus": count, "gpu_names": names, "device": "cpu"},
            fix="Run on the GPU: diagnose run --device cuda (the default 'auto' picks it). In your "
            "trainer: no --cpu / use_cpu in the accelerate config; model and batch .to('cuda').",
        )
    os_info = facts.section("os")
    if os_info.get("wsl") or os_info.get("system") in ("Windows", "Darwin"):
        return _unknown("GPU presence: the PCI bus is not visible here (WSL2/Windows/macOS)")
    candidates = _gpu_candidates(facts)
    if not candidates:
        return _fine("no NVIDIA or AMD GPU on the PCI bus: the CPU is the only device here")
    vendors = sorted({str(d.get("vendor")) for d in candidates})
    hip, cuda = torch_info.get("hip"), torch_info.get("cuda")
    build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU-only"
    drivers = facts.section("gpu").get("drivers") or {}
    evidence: dict[str, Any] = {
        "gpus_on_pci_bus": [
            f"{d.get('slot')} {d.get('vendor')} {d.get('device_id')} "
            f"driver={d.get('driver') or '-'}"
            for d in candidates
        ],
        "torch_version": torch_info.get("version"),
        "torch_build": build,
        "nvidia_driver": drivers.get("nvidia") or "not loaded",
        "amdgpu_loaded": drivers.get("amdgpu_loaded"),
    }
    visible = {k: v for k, v in facts.env.items() if k.endswith("VISIBLE_DEVICES")}
    if visible:
        evidence["visible_devices"] = visible
    if "NVIDIA" in vendors and not hip and not cuda:
        why, fix = (
            "this torch is a CPU-only build",
            "Install a CUDA build of torch: pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128 (match your driver; see pytorch.org).",
        )
    elif "AMD" in vendors and not hip and not cuda:
        why, fix = (
            "this torch is a CPU-only build",
            "Install a ROCm build of torch: pip install torch --index-url "
            "https://download.pytorch.org/whl/rocm6.4 (Linux; see pytorch.org).",
        )
    elif "NVIDIA" in vendors and cuda:
        why = "the CUDA build of torch cannot reach the GPU"
        fix = (
            "Unset CUDA_VISIBLE_DEVICES"
            if any(v.strip() in ("", "-1") for v in visible.values())
            else "Load the NVIDIA driver (nvidia-smi must list the GPU; reinstall the driver "
            "if it does not), then rerun"
        )
    elif "AMD" in vendors and hip:
        why = "the ROCm build of torch cannot reach the GPU"
        fix = (
            "Give the user access to /dev/kfd and /dev/dri (groups render and video), check "
            "HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES, and that the amdgpu driver is loaded; "
            "rocminfo must list the GPU."
        )
    else:
        why = f"this torch ({build}) is built for another GPU vendor"
        fix = (
            "Install the torch build for your GPU: "
            + ("CUDA (…/whl/cu128)" if "NVIDIA" in vendors else "ROCm (…/whl/rocm6.4)")
            + " from https://download.pytorch.org."
        )
    # A desktop Ryzen's iGPU is an AMD display device too: name the NVIDIA card when there is one.
    named = "NVIDIA" if "NVIDIA" in vendors else "AMD"
    return _finding(
        "environment.cpu_with_gpu_present",
        "critical",
        f"The step ran on the CPU although the machine has an {named} GPU: {why}",
        evidence=evidence,
        fix=fix,
    )


def rule_integrated_gpu(facts: EnvironmentFacts) -> RuleResult:
    """An integrated GPU (APU) selected, above all when a discrete one is there too."""
    if not facts.on_gpu:
        return RuleResult()
    integrated = is_integrated_gpu(facts.device)
    if integrated is None:
        return _unknown("integrated or discrete GPU: torch does not say")
    if not integrated:
        return _fine(f"{_device_label(facts.device)} is a discrete GPU")
    current = facts.device.torch_device
    others = [
        d
        for d in facts.section("gpu").get("torch_devices") or []
        if isinstance(d, Mapping)
        and d.get("integrated") is False
        and f"cuda:{d.get('index')}" != current
    ]
    evidence: dict[str, Any] = {"device": _device_label(facts.device), "torch_device": current}
    if others:
        best = max(others, key=lambda d: d.get("memory_bytes") or 0)
        index = best.get("index")
        evidence["discrete_gpus"] = [
            f"cuda:{d.get('index')} {d.get('name')} ({_gib(d.get('memory_bytes'))})" for d in others
        ]
        variable = "HIP_VISIBLE_DEVICES" if facts.device.kind == "rocm" else "CUDA_VISIBLE_DEVICES"
        return _finding(
            "environment.integrated_gpu",
            "critical",
            f"Training ran on the integrated {facts.device.name} while a discrete "
            f"{best.get('name')} is present",
            evidence=evidence,
            fix=f"Use the discrete GPU: diagnose run --device cuda:{index}; for your trainer "
            f"{variable}={index} (or disable the integrated GPU in the BIOS).",
        )
    return _finding(
        "environment.integrated_gpu",
        "info",
        f"{facts.device.name} is an integrated GPU: its memory is system RAM, shared with the CPU",
        evidence=evidence,
        fix="Expect lower memory bandwidth than a discrete GPU; keep other memory-heavy work off "
        "the machine while training.",
    )


# --- rules: memory -------------------------------------------------------------------------------

#: Peak VRAM use at or above this share of the total leaves no headroom.
NEAR_CAPACITY = 0.95
#: Median PCIe traffic (bytes/s, one direction) that says memory is streamed over the bus.
HEAVY_PCIE_BYTES_PER_S = 1.0e9


def _spill_fix(facts: EnvironmentFacts) -> str:
    reduce = (
        "Reduce memory so the step fits: --grad-checkpointing (kohya: --gradient_checkpointing), "
        "--cache-latents, --optimizer adamw8bit, a smaller batch or resolution"
    )
    os_info = facts.section("os")
    if facts.device.kind == "cuda" and (os_info.get("system") == "Windows" or os_info.get("wsl")):
        return (
            "Turn the driver's spill off so an overflow is an out-of-memory error instead of a "
            "10-100x slower step: NVIDIA Control Panel > Manage 3D settings > CUDA - Sysmem "
            "Fallback Policy > Prefer No Sysmem Fallback (driver 536.40+). " + reduce + "."
        )
    return reduce + "; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cuts fragmentation."


def rule_vram_spill(facts: EnvironmentFacts) -> RuleResult:
    """VRAM at capacity: a spill into shared system memory, or a near-OOM that slows the step."""
    if not facts.on_gpu:
        return RuleResult()
    sampled = facts.sampled
    total = facts.device.memory_bytes or (sampled.limits.memory_total_bytes if sampled else None)
    timing = facts.timing
    reserved = timing.peak_reserved_bytes if timing else None
    used_fraction = sampled.stats.memory_used_max_fraction if sampled else None
    if not total or (reserved is None and used_fraction is None):
        return _unknown("VRAM headroom: no peak memory or telemetry")
    reserved_fraction = reserved / total if reserved else None
    evidence: dict[str, Any] = {
        "vram_total": _gib(total),
        "torch_peak_reserved": _gib(reserved),
        "torch_peak_reserved_fraction": reserved_fraction,
        "driver_peak_used_fraction": used_fraction,
        "seconds_per_it": facts.seconds_per_it,
    }
    if sampled:
        evidence["gpu_utilization_median_pct"] = sampled.stats.utilization_median_pct
        evidence["pcie_rx_median_bytes_per_s"] = sampled.stats.pcie_rx_median_bytes_per_s
        evidence["pcie_tx_median_bytes_per_s"] = sampled.stats.pcie_tx_median_bytes_per_s
    integrated = is_integrated_gpu(facts.device)
    if reserved_fraction is not None and reserved_fraction > 1.0 and not integrated:
        # Only possible when the driver backs allocations with system memory (NVIDIA's sysmem
        # fallback on Windows/WSL2): every kernel touching those pages goes over PCIe.
        return _finding(
            "memory.vram_spill",
            "critical",
            f"torch holds {_gib(reserved)} on a {_gib(total)} GPU: the overflow lives in shared "
            "system memory and every step streams it over PCIe",
            evidence=evidence,
            fix=_spill_fix(facts),
            category="memory",
            detail="When VRAM runs out, the Windows NVIDIA driver (and WSL2, which uses it) backs "
            "further allocations with system RAM instead of failing. The step then runs at PCIe "
            "speed: 70-200 s/it where 1-2 s/it is expected.",
        )
    fractions = [f for f in (reserved_fraction, used_fraction) if f is not None]
    peak = max(fractions)
    if peak < NEAR_CAPACITY:
        return _fine(f"peak VRAM {_pct(peak)} of {_gib(total)}: headroom left, no spill")
    signals = []
    if sampled:
        rx = sampled.stats.pcie_rx_median_bytes_per_s or 0.0
        tx = sampled.stats.pcie_tx_median_bytes_per_s or 0.0
        if max(rx, tx) >= HEAVY_PCIE_BYTES_PER_S:
            signals.append(f"PCIe traffic {max(rx, tx) / 1e9:.1f} GB/s during the steps")
        util = sampled.stats.utilization_median_pct
        if util is not None and util < 60:
            signals.append(f"GPU busy only {util:.0f}% of the time")
    retries = facts.allocator.get("num_alloc_retries", 0)
    if retries:
        signals.append(f"{retries} allocator retries")
    evidence["signals"] = signals
    if signals:
        return _finding(
            "memory.vram_near_capacity",
            "warn",
            f"VRAM {_pct(peak)} full and the GPU waits ({'; '.join(signals)}): the step is "
            "spilling or thrashing the allocator",
            evidence=evidence,
            fix=_spill_fix(facts),
            category="memory",
        )
    return _finding(
        "memory.vram_near_capacity",
        "info",
        f"VRAM {_pct(peak)} full: no headroom; a larger batch or resolution will spill or run "
        "out of memory",
        evidence=evidence,
        fix=_spill_fix(facts),
        category="memory",
    )


def rule_allocator_retries(facts: EnvironmentFacts) -> RuleResult:
    """torch's caching allocator ran out of cached memory and had to free and retry."""
    if not facts.on_gpu:
        return RuleResult()
    if not facts.allocator:
        return _unknown("allocator retries: torch.cuda.memory_stats not read")
    retries = facts.allocator.get("num_alloc_retries", 0)
    ooms = facts.allocator.get("num_ooms", 0)
    steps = facts.timing.unprofiled.n if facts.timing else 0
    if not retries and not ooms:
        return _fine(f"no allocator retries ({facts.allocator_scope or 'this run'})")
    per_step = retries / steps if steps and facts.allocator_scope.startswith("timed") else None
    severity: Severity = "critical" if ooms or (per_step is not None and per_step >= 1) else "warn"
    return _finding(
        "memory.allocator_retries",
        severity,
        f"The CUDA caching allocator ran out of cached memory {retries} time"
        f"{'' if retries == 1 else 's'} ({facts.allocator_scope or 'this run'}): each retry "
        "frees every cached block and synchronises the device",
        evidence={
            "num_alloc_retries": retries,
            "num_ooms": ooms,
            "retries_per_step": per_step,
            "scope": facts.allocator_scope,
            "num_device_alloc": facts.allocator.get("num_device_alloc"),
            "num_device_free": facts.allocator.get("num_device_free"),
        },
        fix="Leave headroom: --grad-checkpointing, --cache-latents, adamw8bit, a smaller batch; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (ROCm: PYTORCH_HIP_ALLOC_CONF) lets "
        "the allocator grow segments instead of freeing and re-allocating.",
        category="memory",
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


def rule_allocator_settings(facts: EnvironmentFacts) -> RuleResult:
    """Allocator settings that cost time: caching off, or options that fight each other."""
    if not facts.on_gpu:
        return RuleResult()
    env = facts.env
    if _truthy(env.get("PYTORCH_NO_CUDA_MEMORY_CACHING")):
        return _finding(
            "memory.caching_allocator_off",
            "critical",
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: every tensor allocation is a cudaMalloc and "
            "every free a synchronising cudaFree",
            evidence={"PYTORCH_NO_CUDA_MEMORY_CACHING": env.get("PYTORCH_NO_CUDA_MEMORY_CACHING")},
            fix="unset PYTORCH_NO_CUDA_MEMORY_CACHING (it is a debugging switch)",
            category="memory",
        )
    confs = _allocator_confs(env)
    if not confs:
        return _fine("allocator: default settings")
    merged: dict[str, str] = {}
    for options in confs.values():
        merged.update(options)
    expandable = merged.get("expandable_segments", "").lower() == "true"
    if expandable and "max_split_size_mb" in merged:
        return _finding(
            "memory.allocator_conf_conflict",
            "warn",
            "max_split_size_mb is set together with expandable_segments:True: two fixes for "
            "fragmentation that work against each other",
            evidence={name: env[name] for name in confs},
            fix="Keep expandable_segments:True and drop max_split_size_mb, e.g. "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            category="memory",
            detail="With expandable segments torch no longer splits blocks by max_split_size_mb "
            "(CUDACachingAllocator should_split), but its oversize-block rules still apply: "
            "cached blocks above the limit are not reused for smaller requests and are released "
            "on every retry, so memory is unmapped and mapped again.",
        )
    return _fine(f"allocator settings: {', '.join(f'{k}={env[k]}' for k in confs)}")


# --- rules: precision ----------------------------------------------------------------------------


def rule_bf16_not_native(facts: EnvironmentFacts) -> RuleResult:
    """bf16 requested on a device that has no bf16 units (it is emulated through fp32)."""
    precision = facts.precision or ""
    if not precision.startswith("bf16"):
        return RuleResult()
    native = bf16_native(facts.device)
    if native is None:
        return _unknown(f"bf16 support of {_device_label(facts.device)}: unknown")
    if native:
        return _fine(f"{precision} on {_device_label(facts.device)}: bf16 is native")
    evidence: dict[str, Any] = {
        "precision": precision,
        "device": _device_label(facts.device),
        "bf16_native": False,
    }
    if facts.device.kind == "cpu":
        evidence["isa"] = facts.device.extra.get("isa")
        fix = "--precision fp32 (this CPU has no AVX512-BF16/AMX-BF16; bf16 only adds conversions)"
    else:
        said = facts.device.extra.get("torch_is_bf16_supported")
        evidence["torch_is_bf16_supported"] = said
        fix = (
            "--precision fp16 with loss scaling (kohya: --mixed_precision fp16; diffusers "
            "examples: --mixed_precision fp16); keep fp32 for the VAE if it overflows"
        )
    return _finding(
        "precision.bf16_not_native",
        "warn",
        f"{precision} on {_device_label(facts.device)}, which has no bf16 units: bf16 math is "
        "emulated through fp32",
        evidence=evidence,
        fix=fix,
        category="precision",
        detail="torch.cuda.is_bf16_supported() says True on every ROCm build and on pre-Ampere "
        "NVIDIA GPUs it emulates; the GEMMs then run as fp32 plus conversions.",
    )


# --- rules: kernel search and tuning (ROCm) ------------------------------------------------------

#: A first step this many times the median, and this many seconds longer, is a warm-up to explain.
WARMUP_RATIO = 3.0
WARMUP_EXTRA_S = 2.0


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
    enabled = (
        _truthy(env.get("PYTORCH_TUNABLEOP_ENABLED")) or flags.get("tunableop_enabled") is True
    )
    # Tuning defaults to on once TunableOp is enabled.
    tuning_env = env.get("PYTORCH_TUNABLEOP_TUNING")
    if tuning_env is not None:
        tuning = _truthy(tuning_env)
    else:
        tuning = flags.get("tunableop_tuning") is not False
    return enabled, enabled and tuning


def rule_rocm_warmup(facts: EnvironmentFacts) -> RuleResult:
    """First steps much slower than the rest on ROCm: MIOpen find / TunableOp at startup."""
    if facts.device.kind != "rocm" or facts.timing is None:
        return RuleResult()
    pair = _first_step_vs_rest(facts.timing)
    if pair is None:
        return _unknown("kernel-search warm-up: fewer than 3 timed steps and no warm-up step")
    first, typical, source = pair
    if typical <= 0:
        return RuleResult()
    ratio = first / typical
    if ratio < WARMUP_RATIO or first - typical < WARMUP_EXTRA_S:
        return _fine(
            f"{source} {first:.2f} s vs {typical:.2f} s/it: no kernel-search warm-up to speak of"
        )
    env = facts.env
    flags = facts.section("torch", "flags")
    enabled, tuning = _tunableop_state(facts)
    find_mode = env.get("MIOPEN_FIND_MODE")
    slow_later = [
        s.index
        for s in facts.timing.samples
        if not s.profiled and s.seconds >= WARMUP_RATIO * typical
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
    fixes = []
    if tuning:
        fixes.append(
            "TunableOp is tuning every new GEMM shape: tune once, then train with "
            "PYTORCH_TUNABLEOP_TUNING=0 (PYTORCH_TUNABLEOP_FILENAME keeps the results)"
        )
    if flags.get("cudnn_benchmark"):
        fixes.append(
            "torch.backends.cudnn.benchmark=False (on ROCm it makes MIOpen search exhaustively "
            "for every new convolution shape)"
        )
    if (find_mode or "").strip().upper() not in ("2", "FAST"):
        fixes.append("MIOPEN_FIND_MODE=FAST (no search for shapes MIOpen has not seen)")
    fixes.append(
        "keep MIOpen's databases on a persistent disk (MIOPEN_USER_DB_PATH, "
        "MIOPEN_CUSTOM_CACHE_DIR; a container loses ~/.config/miopen and ~/.cache/miopen) so "
        "the search is paid once"
    )
    if len(facts.resolutions) > 1:
        fixes.append(f"each of the {len(facts.resolutions)} resolution buckets is a new shape")
    return _finding(
        "environment.rocm_kernel_search_warmup",
        "warn",
        f"The {source} took {first:.1f} s against {typical:.2f} s/it after it ({ratio:.0f}x): "
        "kernels were searched or tuned at startup (MIOpen find / TunableOp)",
        evidence=evidence,
        fix="; ".join(fixes) + ".",
        detail="MIOpen benchmarks candidate convolution kernels the first time it sees a shape "
        "and TunableOp benchmarks GEMM implementations; both are paid again for every new shape "
        "and in every fresh container.",
    )


def rule_tunableop_tuning(facts: EnvironmentFacts) -> RuleResult:
    """TunableOp enabled with tuning on: GEMMs are benchmarked during training."""
    if not facts.on_gpu:
        return RuleResult()
    enabled, tuning = _tunableop_state(facts)
    if not enabled:
        return _fine("TunableOp off")
    if not tuning:
        return _fine("TunableOp on with tuning off (uses saved results)")
    env = facts.env
    return _finding(
        "environment.tunableop_tuning",
        "warn",
        "TunableOp is tuning live: every new GEMM shape is benchmarked during training",
        evidence={
            k: env.get(k)
            for k in (
                "PYTORCH_TUNABLEOP_ENABLED",
                "PYTORCH_TUNABLEOP_TUNING",
                "PYTORCH_TUNABLEOP_FILENAME",
                "PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS",
            )
            if env.get(k) is not None
        },
        fix="Tune once (a short run with PYTORCH_TUNABLEOP_TUNING=1), then train with "
        "PYTORCH_TUNABLEOP_TUNING=0 and the same PYTORCH_TUNABLEOP_FILENAME so the tuned "
        "results are used without tuning again",
    )


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


def rule_hsa_override(facts: EnvironmentFacts) -> RuleResult:
    """HSA_OVERRIDE_GFX_VERSION makes the runtime load kernels built for another GPU."""
    if facts.device.kind != "rocm":
        return RuleResult()
    value = facts.env.get("HSA_OVERRIDE_GFX_VERSION")
    if not value:
        return _fine("HSA_OVERRIDE_GFX_VERSION not set")
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
    if target is None:
        return _finding(
            "environment.hsa_override",
            "warn",
            f"HSA_OVERRIDE_GFX_VERSION={value} is not of the form MAJOR.MINOR.STEPPING",
            evidence=evidence,
            fix="unset HSA_OVERRIDE_GFX_VERSION, or set it to e.g. 11.0.0",
        )
    if real and real == target:
        return _finding(
            "environment.hsa_override",
            "info",
            f"HSA_OVERRIDE_GFX_VERSION={value} names the GPU's own target ({real}): it does "
            "nothing",
            evidence=evidence,
            fix="unset HSA_OVERRIDE_GFX_VERSION",
        )
    if real and _gfx_generation(real) != _gfx_generation(target):
        return _finding(
            "environment.hsa_override",
            "critical",
            f"HSA_OVERRIDE_GFX_VERSION={value} runs {target} kernels on a {real}: another "
            "instruction-set generation (crashes, hangs or wrong results)",
            evidence=evidence,
            fix=f"unset HSA_OVERRIDE_GFX_VERSION, or use the {real[:-1]}x family value "
            "(e.g. 10.3.0 for RDNA2, 11.0.0 for RDNA3)",
        )
    if real and real in arch_list:
        return _finding(
            "environment.hsa_override",
            "warn",
            f"HSA_OVERRIDE_GFX_VERSION={value} is not needed: this torch has {real} kernels, and "
            f"the override makes it run kernels tuned for {target} instead",
            evidence=evidence,
            fix="unset HSA_OVERRIDE_GFX_VERSION",
        )
    return _finding(
        "environment.hsa_override",
        "info",
        f"HSA_OVERRIDE_GFX_VERSION={value}: the GPU runs kernels built for {target}"
        + (f" (it is a {real}, which this torch has no kernels for)" if real else ""),
        evidence=evidence,
        fix="Expected for a GPU torch does not ship kernels for; kernels and libraries "
        "(MIOpen, rocBLAS, hipBLASLt) are tuned for the other chip, so some ops are slower or "
        "fall back. A torch build listing your gfx target (TheRock nightlies) avoids it.",
    )


def hipblaslt_supported(arch: str, hip_version: str | None) -> bool | None:
    """Whether torch lets hipBLASLt run on ``arch`` with this ROCm version (None: unknown).

    torch's CUDAHooks::getHipblasltSupportedArchs: gfx90a, gfx942 always; gfx1100, gfx1101,
    gfx1103, gfx1200, gfx1201, gfx908 from ROCm 6.3; gfx950, gfx1150, gfx1151 from ROCm 7.0;
    gfx1250 from 7.2. On any other target torch warns "Attempting to use hipBLASLt on an
    unsupported architecture! Overriding blas backend to hipblas".
    """
    version = _version_tuple(hip_version)
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


def rule_hipblaslt(facts: EnvironmentFacts) -> RuleResult:
    """hipBLASLt requested where torch does not support it (it falls back to hipBLAS)."""
    if facts.device.kind != "rocm":
        return RuleResult()
    hip = facts.section("torch").get("hip")
    supported = hipblaslt_supported(facts.device.arch, hip)
    prefer = facts.env.get("TORCH_BLAS_PREFER_HIPBLASLT")
    flags = facts.section("torch", "flags")
    preferred = flags.get("preferred_blas_library")
    # The inventory keeps the warning torch gives when it falls back (see collect_torch).
    warning = str(flags.get("preferred_blas_library_warning") or "")
    torch_fell_back = "unsupported architecture" in warning
    evidence = {
        "arch": facts.device.arch,
        "hip": hip,
        "TORCH_BLAS_PREFER_HIPBLASLT": prefer,
        "preferred_blas_library": preferred,
        "hipblaslt_supported": supported,
        "torch_warning": warning or None,
    }
    if supported is None and not torch_fell_back:
        return _unknown("hipBLASLt support: unknown HIP version or arch")
    if torch_fell_back or (supported is False and _truthy(prefer)):
        asked = f"TORCH_BLAS_PREFER_HIPBLASLT={prefer}" if prefer else "hipBLASLt requested"
        return _finding(
            "environment.hipblaslt_unsupported",
            "info",
            f"{asked} on {facts.device.arch}, which torch's hipBLASLt path does not support "
            f"(HIP {hip}): GEMMs fall back to hipBLAS/rocBLAS",
            evidence=evidence,
            fix="unset TORCH_BLAS_PREFER_HIPBLASLT (it only adds the 'Attempting to use "
            "hipBLASLt on an unsupported architecture' warning here)",
        )
    if supported and prefer is not None and not _truthy(prefer):
        return _finding(
            "environment.hipblaslt_off",
            "info",
            f"hipBLASLt is switched off (TORCH_BLAS_PREFER_HIPBLASLT={prefer}) on "
            f"{facts.device.arch}, which supports it",
            evidence=evidence,
            fix="unset TORCH_BLAS_PREFER_HIPBLASLT, or compare both: hipBLASLt's GEMMs are "
            "usually faster on the GPUs it supports",
        )
    return _fine(f"BLAS library: {preferred or 'default'} (hipBLASLt supported: {supported})")


# --- rules: debugging switches left on -----------------------------------------------------------


def rule_launch_blocking(facts: EnvironmentFacts) -> RuleResult:
    """Synchronous kernel launches (debugging switches) serialise the CPU and the GPU."""
    if not facts.on_gpu:
        return RuleResult()
    env = facts.env
    blocking = {
        name: env[name]
        for name in ("CUDA_LAUNCH_BLOCKING", "HIP_LAUNCH_BLOCKING")
        if _truthy(env.get(name))
    }
    serialize = {
        name: env[name]
        for name in ("AMD_SERIALIZE_KERNEL", "AMD_SERIALIZE_COPY")
        if _truthy(env.get(name))
    }
    result = RuleResult()
    if blocking or serialize:
        names = {**blocking, **serialize}
        result.findings += _finding(
            "environment.launch_blocking",
            "critical",
            f"{', '.join(f'{k}={v}' for k, v in names.items())}: every kernel launch waits for "
            "the GPU, so the CPU can never queue work ahead",
            evidence=names,
            fix="unset " + " ".join(names) + " (debugging switches)",
        ).findings
    log_level = env.get("AMD_LOG_LEVEL", "")
    if log_level.strip().isdigit() and int(log_level) >= 3:
        result.findings += _finding(
            "environment.amd_log_level",
            "warn",
            f"AMD_LOG_LEVEL={log_level}: the HIP runtime logs every API call",
            evidence={"AMD_LOG_LEVEL": log_level},
            fix="unset AMD_LOG_LEVEL",
        ).findings
    if not result.findings:
        result.ok.append("no launch-blocking or runtime-logging switch set")
    return result


# --- rules: clocks, power, PCIe (telemetry) ------------------------------------------------------

#: NVML reasons that mean the hardware is held back (not the normal power cap).
_SERIOUS_NVML = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)
#: Share of busy samples with a serious throttle reason that makes a finding.
THROTTLE_FRACTION = 0.1
#: Median busy clock below this share of the maximum is "far below max".
LOW_CLOCK_FRACTION = 0.6


def _is_serious(reason: str) -> bool:
    return reason in _SERIOUS_NVML or reason.startswith("thermal:")


def _is_power(reason: str) -> bool:
    return reason == "sw_power_cap" or reason.startswith(("power:", "current:"))


def rule_throttling(facts: EnvironmentFacts) -> RuleResult:
    """Throttle reasons active, power held at a lowered limit, clocks far below their maximum."""
    if not facts.on_gpu:
        return RuleResult()
    sampled = facts.sampled
    if sampled is None:
        reason = facts.telemetry.reason if facts.telemetry else "not sampled"
        return _unknown(f"clocks, power and throttling: telemetry unavailable ({reason})")
    stats, limits = sampled.stats, sampled.limits
    if stats.busy_n < 3:
        return _unknown(f"clocks and throttling: only {stats.busy_n} samples with the GPU busy")
    evidence: dict[str, Any] = {
        "busy_samples": stats.busy_n,
        "throttle_fractions": {k: round(v, 2) for k, v in stats.throttle_fractions.items()},
        "gfx_clock_median_mhz": stats.gfx_clock_median_mhz,
        "gfx_clock_max_mhz": limits.gfx_clock_max_mhz,
        "gfx_clock_fraction_of_max": stats.gfx_clock_fraction_of_max,
        "power_median_w": stats.power_median_w,
        "power_limit_w": limits.power_limit_w,
        "power_default_limit_w": limits.power_default_limit_w,
        "power_at_limit_fraction": stats.power_at_limit_fraction,
        "temperature_max_c": stats.temperature_max_c,
        "utilization_median_pct": stats.utilization_median_pct,
    }
    amd = facts.device.kind == "rocm"
    result = RuleResult()
    serious = {r: f for r, f in stats.throttle_fractions.items() if _is_serious(r)}
    worst = max(serious.values(), default=0.0)
    clock_fraction = stats.gfx_clock_fraction_of_max
    if worst >= THROTTLE_FRACTION:
        thermal = any("thermal" in r or r == "hw_slowdown" for r in serious)
        brake = "hw_power_brake_slowdown" in serious
        severity: Severity = (
            "critical"
            if worst >= 0.5 and clock_fraction is not None and clock_fraction < 0.8
            else "warn"
        )
        fix = (
            "Check the power delivery: the board's external power-brake signal fired (PSU, "
            "12VHPWR/8-pin cables and adapters)"
            if brake and not thermal
            else "Cool the GPU: fan curve, case airflow, dust, thermal paste/pads; "
            + (
                "`amd-smi metric -t -p` shows temperatures"
                if amd
                else "`nvidia-smi -q -d PERFORMANCE,TEMPERATURE` shows the active reason"
            )
        )
        result.findings += _finding(
            "environment.gpu_throttled",
            severity,
            f"The GPU throttled in {_pct(worst)} of the busy samples "
            f"({', '.join(sorted(serious))}); clocks at {_pct(clock_fraction)} of max",
            evidence=evidence,
            fix=fix,
        ).findings
    power_fraction = stats.power_at_limit_fraction
    if power_fraction is None:
        power_fraction = max(
            (f for r, f in stats.throttle_fractions.items() if _is_power(r)), default=None
        )
    lowered = (
        limits.power_limit_w is not None
        and limits.power_default_limit_w is not None
        and limits.power_limit_w < 0.9 * limits.power_default_limit_w
    )
    if lowered and power_fraction is not None and power_fraction >= 0.3:
        default = limits.power_default_limit_w
        result.findings += _finding(
            "environment.power_limited",
            "warn",
            f"The power limit is lowered to {limits.power_limit_w:.0f} W (default "
            f"{default:.0f} W) and the GPU sits at it in {_pct(power_fraction)} of the busy "
            "samples",
            evidence=evidence,
            fix=(
                f"sudo amd-smi set --power-cap {default:.0f} (or rocm-smi --resetpoweroverdrive)"
                if amd
                else f"sudo nvidia-smi -pl {default:.0f}"
            )
            + " — if the limit was lowered on purpose (heat, noise, PSU), this is its price",
        ).findings
    explained = worst >= THROTTLE_FRACTION or (lowered and (power_fraction or 0) >= 0.3)
    busy_enough = (stats.utilization_median_pct or 0) >= 70
    if (
        clock_fraction is not None
        and clock_fraction < LOW_CLOCK_FRACTION
        and busy_enough
        and not explained
    ):
        app_clocks = stats.throttle_fractions.get("applications_clocks_setting", 0) > 0.5
        result.findings += _finding(
            "environment.clocks_low",
            "warn",
            f"The GPU is busy ({stats.utilization_median_pct:.0f}%) but clocks at "
            f"{stats.gfx_clock_median_mhz:.0f} MHz, {_pct(clock_fraction)} of its "
            f"{limits.gfx_clock_max_mhz:.0f} MHz maximum",
            evidence=evidence,
            fix=(
                "sudo amd-smi set --perf-level AUTO (or rocm-smi --setperflevel auto); check "
                "the power profile (rocm-smi --showprofile)"
                if amd
                else "sudo nvidia-smi -rgc && sudo nvidia-smi -rac (reset locked and "
                "application clocks)"
                + ("; the driver reports application clocks in force" if app_clocks else "")
            ),
        ).findings
    if not result.findings:
        result.ok.append(
            f"clocks {_pct(clock_fraction)} of max, no throttling in {stats.busy_n} busy samples"
            + (
                f", power at the limit in {_pct(power_fraction)} of them (normal at full load)"
                if power_fraction
                else ""
            )
        )
    return result


def rule_pcie_link(facts: EnvironmentFacts) -> RuleResult:
    """The PCIe link narrower or older than what the GPU and the slot support."""
    if not facts.on_gpu:
        return RuleResult()
    sampled = facts.sampled
    if sampled is not None and sampled.limits.pcie_width_max:
        stats, limits = sampled.stats, sampled.limits
        width, width_max = stats.pcie_width_seen_max, limits.pcie_width_max
        gen, gen_max = stats.pcie_gen_seen_max, limits.pcie_gen_max
        source = "telemetry during the steps (highest seen)"
    else:
        # Without telemetry: the NVIDIA GPU's own PCI function in sysfs. Not for AMD, whose
        # GPU function sits behind the card's internal switch and reports that link instead.
        link = None
        for device in facts.section("gpu").get("pci") or []:
            if (
                isinstance(device, Mapping)
                and device.get("vendor") == "NVIDIA"
                and (device.get("slot") == facts.device.extra.get("pci_bus_id") or link is None)
            ):
                link = device.get("link") or {}
        if not link or facts.device.kind != "cuda":
            return _unknown("PCIe link: no telemetry")
        width, width_max = link.get("current_width"), link.get("max_width")
        gen, gen_max = None, None  # an idle link trains down: generation not judged here
        source = "sysfs at inventory time (GPU idle)"
        if not width or not width_max:
            return _unknown("PCIe link: width not reported")
    evidence: dict[str, Any] = {
        "width": width,
        "width_max": width_max,
        "gen": gen,
        "gen_max": gen_max,
        "source": source,
    }
    if sampled is not None:
        evidence["gen_max_gpu"] = sampled.limits.pcie_gen_max_gpu
        evidence["pcie_rx_median_bytes_per_s"] = sampled.stats.pcie_rx_median_bytes_per_s
    narrow = bool(width and width_max and width < width_max)
    slow = bool(gen and gen_max and gen < gen_max)
    if not narrow and not slow:
        line = f"PCIe link x{width}" + (f" Gen{gen}" if gen else "") + " (as wide/fast as allowed)"
        return _fine(line)
    parts = []
    if narrow:
        parts.append(f"x{width} of x{width_max}")
    if slow:
        parts.append(f"Gen{gen} of Gen{gen_max}")
    return _finding(
        "environment.pcie_link_degraded",
        "warn" if narrow else "info",
        f"The GPU's PCIe link runs at {' and '.join(parts)}: host-device copies (batches, "
        "offloaded weights, anything spilled) are slower",
        evidence=evidence,
        fix="Seat the card in the CPU-attached x16 slot (usually the top one), remove riser or "
        "extension cables, set the slot to Auto/its full generation in the BIOS; verify under "
        "load with `nvidia-smi -q -d PCI` or `sudo lspci -vv | grep LnkSta`.",
    )


# --- rules: driver, CPU -------------------------------------------------------------------------

#: Minimum Linux driver for each CUDA version (NVIDIA CUDA Toolkit release notes, table 3).
CUDA_MIN_LINUX_DRIVER: dict[tuple[int, int], str] = {
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 4): "550.54.14",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}


def rule_driver(facts: EnvironmentFacts) -> RuleResult:
    """An NVIDIA driver older than the CUDA version torch is built for."""
    if facts.device.kind != "cuda":
        return RuleResult()
    build = facts.section("torch").get("cuda")
    supported = (facts.sampled.limits.cuda_driver_version if facts.sampled else "") or str(
        facts.section("gpu").get("cuda_driver_api") or ""
    )
    if not build or not supported:
        return _unknown("driver age: CUDA version of the driver unknown")
    if _version_tuple(supported) >= _version_tuple(build)[:2]:
        return _fine(f"driver supports CUDA {supported} (torch built for {build})")
    major_minor = _version_tuple(build)[:2]
    needed = (
        CUDA_MIN_LINUX_DRIVER.get((major_minor[0], major_minor[1]))
        if len(major_minor) == 2
        else None
    )
    driver = facts.device.driver or (facts.sampled.limits.driver_version if facts.sampled else "")
    return _finding(
        "environment.driver_old",
        "warn",
        f"The NVIDIA driver ({driver or 'version unknown'}) supports CUDA {supported}, older "
        f"than the CUDA {build} this torch is built for",
        evidence={"driver": driver, "driver_cuda": supported, "torch_cuda": build},
        fix=f"Update the NVIDIA driver{f' to {needed} or newer' if needed else ''}, or install "
        f"the torch build for CUDA {supported}",
        detail="torch then runs on CUDA's minor-version compatibility: kernels shipped only as "
        "PTX cannot be JIT-compiled and features of newer drivers stay off.",
    )


def rule_cpu_threads(facts: EnvironmentFacts) -> RuleResult:
    """A CPU run on one thread, on few threads, or on a machine with few cores."""
    if facts.device.kind != "cpu":
        return RuleResult()
    torch_info = facts.section("torch")
    cpu = facts.section("cpu")
    threads = torch_info.get("num_threads")
    usable = cpu.get("usable_cores") or cpu.get("logical_cores")
    physical = cpu.get("physical_cores") or usable
    if not threads or not usable:
        return _unknown("CPU threads: not recorded")
    env = facts.env
    evidence = {
        "torch_threads": threads,
        "usable_cores": usable,
        "physical_cores": physical,
        **{k: env[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in env},
    }
    result = RuleResult()
    if threads == 1 and usable > 1:
        result.findings += _finding(
            "environment.cpu_one_thread",
            "warn",
            f"torch computes on 1 thread of the {usable} cores it may use",
            evidence=evidence,
            fix=f"unset OMP_NUM_THREADS (or set it to {physical}); in code torch.set_num_threads"
            f"({physical})",
        ).findings
    elif physical and threads < physical / 2:
        result.findings += _finding(
            "environment.cpu_threads_low",
            "info",
            f"torch computes on {threads} threads of {physical} physical cores",
            evidence=evidence,
            fix=f"OMP_NUM_THREADS={physical} (or torch.set_num_threads({physical}))",
        ).findings
    if usable <= 4:
        result.findings += _finding(
            "environment.cpu_few_cores",
            "info",
            f"A CPU run on {usable} cores: a real model's step takes minutes to hours here; "
            "these numbers are a smoke test",
            evidence=evidence,
            fix="Measure on the GPU you train on (diagnose run --device cuda)",
        ).findings
    if not result.findings:
        result.ok.append(f"torch uses {threads} threads on {usable} usable cores")
    return result


#: The rules in report order; each is a pure function of EnvironmentFacts.
RULES: tuple[Rule, ...] = (
    rule_cpu_with_gpu_present,
    rule_integrated_gpu,
    rule_vram_spill,
    rule_allocator_retries,
    rule_allocator_settings,
    rule_bf16_not_native,
    rule_rocm_warmup,
    rule_tunableop_tuning,
    rule_hsa_override,
    rule_hipblaslt,
    rule_launch_blocking,
    rule_throttling,
    rule_pcie_link,
    rule_driver,
    rule_cpu_threads,
)


def evaluate(facts: EnvironmentFacts, rules: Sequence[Rule] = RULES) -> RuleResult:
    """Run the rules; a rule that raises is reported under not_checked with its error, so one
    broken rule does not hide the others."""
    total = RuleResult()
    for rule in rules:
        try:
            result = rule(facts)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            total.not_checked.append(
                f"{rule.__name__} failed: {type(exc).__name__}: {exc} "
                f"({os.path.basename(last.filename)}:{last.lineno})"
            )
            continue
        total.findings.extend(result.findings)
        total.ok.extend(result.ok)
        total.not_checked.extend(result.not_checked)
    return total


# --- gathering from a run ------------------------------------------------------------------------


def telemetry_from_record(
    inventory: Mapping[str, Any], record: Any = None
) -> TelemetrySummary | None:
    """The telemetry sampled during the timed steps, where the run stored it:
    ``record.telemetry`` (a later field) or ``inventory["telemetry"]["during_steps"]``."""
    stored = getattr(record, "telemetry", None)
    if isinstance(stored, TelemetrySummary):
        return stored
    if isinstance(stored, Mapping) and stored:
        return TelemetrySummary.from_dict(stored)
    section = inventory.get("telemetry")
    during = section.get("during_steps") if isinstance(section, Mapping) else None
    return TelemetrySummary.from_dict(during) if isinstance(during, Mapping) else None


def _allocator_from_torch(ctx: ProbeContext) -> dict[str, int]:
    import torch

    try:
        stats = torch.cuda.memory_stats(ctx.device)
    except Exception:
        return {}
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
    return {k: int(stats[k]) for k in keys if k in stats}


def gather_facts(ctx: ProbeContext) -> EnvironmentFacts:
    record = ctx.record
    telemetry = telemetry_from_record(record.inventory, record)
    allocator: dict[str, int] = {}
    scope = ""
    if telemetry is not None and telemetry.allocator:
        allocator, scope = dict(telemetry.allocator), "timed steps"
    elif ctx.device.type == "cuda":
        # Counters since the process started: model build, warm-up, timed and profiled steps.
        allocator, scope = _allocator_from_torch(ctx), "whole run"
    resolutions = record.config.get("resolution") or ctx.config.resolution or []
    return EnvironmentFacts(
        device=ctx.device_info,
        inventory=record.inventory,
        telemetry=telemetry,
        timing=record.timing,
        precision=ctx.config.precision,
        allocator=allocator,
        allocator_scope=scope,
        resolutions=[int(r) for r in resolutions if isinstance(r, int)],
    )


class EnvironmentProbe:
    name = "environment"
    description = (
        "machine-level causes of slow steps: device choice, VRAM, allocator, kernel search, "
        "throttling, PCIe, driver and environment variables"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        facts = gather_facts(ctx)
        result = evaluate(facts)
        telemetry = facts.telemetry
        return ProbeResult(
            findings=result.findings,
            checked_ok=result.ok,
            data={
                "not_checked": result.not_checked,
                "allocator": facts.allocator,
                "allocator_scope": facts.allocator_scope,
                "telemetry": (
                    "not sampled"
                    if telemetry is None
                    else f"{telemetry.backend}: {telemetry.stats.n} samples"
                    if telemetry.available
                    else f"unavailable: {telemetry.reason}"
                ),
            },
        )


__all__ = [
    "RULES",
    "EnvironmentFacts",
    "EnvironmentProbe",
    "RuleResult",
    "evaluate",
    "gather_facts",
    "hipblaslt_supported",
    "hsa_override_target",
    "telemetry_from_record",
]
