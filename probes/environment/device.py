"""Environment rules about the device itself: which device ran the step, debugging switches that
serialise it, its clocks, power and PCIe link (from telemetry), and the NVIDIA driver's age."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import environment_catalog as cat
from diagnose.device import is_integrated_gpu
from diagnose.probes.environment.facts import (
    EnvironmentFacts,
    device_label,
    fine,
    found,
    gib,
    judged,
    truthy,
    unknown,
    version_tuple,
)
from diagnose.record import ProbeResult
from diagnose.stats import at_line
from diagnose.units import pct

# --- which device --------------------------------------------------------------------------------


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


def rule_cpu_with_gpu_present(facts: EnvironmentFacts) -> ProbeResult:
    """Training on the CPU while the machine has a GPU (torch sees it, or the PCI bus does)."""
    check = cat.CPU_WITH_GPU_PRESENT.id
    if facts.device.kind != "cpu":
        return judged()
    torch_info = facts.section("torch")
    count = int(torch_info.get("device_count") or 0)
    if torch_info.get("cuda_available") and count:
        names = [d.get("name", "") for d in facts.section("gpu").get("torch_devices") or []]
        return found(
            cat.cpu_with_gpu_present_finding(
                title=cat.torch_sees_gpu_title(count),
                fix=cat.RUN_ON_THE_GPU_FIX,
                evidence={"torch_gpus": count, "gpu_names": names, "device": "cpu"},
            )
        )
    os_info = facts.section("os")
    if os_info.get("wsl") or os_info.get("system") in ("Windows", "Darwin"):
        return unknown(check, "GPU presence: the PCI bus is not visible here (WSL2/Windows/macOS)")
    candidates = _gpu_candidates(facts)
    if not candidates:
        return fine(check, "no NVIDIA or AMD GPU on the PCI bus: the CPU is the only device here")
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
    # A desktop Ryzen's iGPU is an AMD display device too: name the NVIDIA card when there is one.
    named = "NVIDIA" if "NVIDIA" in vendors else "AMD"
    if not hip and not cuda:
        why, fix = cat.cpu_only_torch(named)
    elif named == "NVIDIA" and cuda:
        why, fix = cat.cuda_cannot_reach(any(v.strip() in ("", "-1") for v in visible.values()))
    elif named == "AMD" and hip:
        why, fix = cat.ROCM_CANNOT_REACH
    else:
        why, fix = cat.other_vendor_build(build, named)
    return found(
        cat.cpu_with_gpu_present_finding(
            title=cat.gpu_on_bus_title(named, why), fix=fix, evidence=evidence
        )
    )


def rule_integrated_gpu(facts: EnvironmentFacts) -> ProbeResult:
    """An integrated GPU (APU) selected, above all when a discrete one is there too."""
    check = cat.INTEGRATED_GPU.id
    if not facts.on_gpu:
        return judged()
    integrated = is_integrated_gpu(facts.device)
    if integrated is None:
        return unknown(check, "integrated or discrete GPU: torch does not say")
    if not integrated:
        return fine(check, f"{device_label(facts.device)} is a discrete GPU")
    current = facts.device.torch_device
    others = [
        d
        for d in facts.section("gpu").get("torch_devices") or []
        if isinstance(d, Mapping)
        and d.get("integrated") is False
        and f"cuda:{d.get('index')}" != current
    ]
    evidence: dict[str, Any] = {"device": device_label(facts.device), "torch_device": current}
    if not others:
        return found(
            cat.integrated_gpu_finding(name=facts.device.name, discrete=None, evidence=evidence)
        )
    best = max(others, key=lambda d: d.get("memory_bytes") or 0)
    evidence["discrete_gpus"] = [
        f"cuda:{d.get('index')} {d.get('name')} ({gib(d.get('memory_bytes'))})" for d in others
    ]
    return found(
        cat.integrated_gpu_finding(
            name=facts.device.name,
            discrete=str(best.get("name")),
            discrete_index=best.get("index"),
            visible_variable=(
                "HIP_VISIBLE_DEVICES" if facts.device.kind == "rocm" else "CUDA_VISIBLE_DEVICES"
            ),
            evidence=evidence,
        )
    )


# --- debugging switches left on ------------------------------------------------------------------


def rule_launch_blocking(facts: EnvironmentFacts) -> ProbeResult:
    """Synchronous kernel launches (debugging switches) serialise the CPU and the GPU."""
    if not facts.on_gpu:
        return judged()
    env = facts.env
    result = judged()
    switches = {
        name: env[name]
        for name in (
            "CUDA_LAUNCH_BLOCKING",
            "HIP_LAUNCH_BLOCKING",
            "AMD_SERIALIZE_KERNEL",
            "AMD_SERIALIZE_COPY",
        )
        if truthy(env.get(name))
    }
    if switches:
        result.add_finding(cat.launch_blocking_finding(switches))
    else:
        result.add_ok(cat.LAUNCH_BLOCKING.id, "no launch-blocking or kernel-serialising switch set")
    log_level = env.get("AMD_LOG_LEVEL", "").strip()
    if log_level.isdigit() and at_line(int(log_level), cat.AMD_LOG_LEVEL_SLOW).above:
        result.add_finding(cat.amd_log_level_finding(log_level))
    elif facts.device.kind == "rocm":
        result.add_ok(
            cat.AMD_LOG_LEVEL.id,
            f"AMD_LOG_LEVEL {log_level or 'unset'}: the HIP runtime does not log every call",
        )
    return result


# --- clocks, power, PCIe (telemetry) -------------------------------------------------------------

#: NVML reasons that mean the hardware is held back (not the normal power cap).
_SERIOUS_NVML = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def _is_serious(reason: str) -> bool:
    return reason in _SERIOUS_NVML or reason.startswith("thermal:")


def _is_power(reason: str) -> bool:
    return reason == "sw_power_cap" or reason.startswith(("power:", "current:"))


def rule_throttling(facts: EnvironmentFacts) -> ProbeResult:
    """Throttle reasons active, power held at a lowered limit, clocks far below their maximum."""
    if not facts.on_gpu:
        return judged()
    questions = (cat.GPU_THROTTLED.id, cat.POWER_LIMITED.id, cat.CLOCKS_LOW.id)
    result = judged()
    sampled = facts.sampled
    if sampled is None or sampled.stats.busy_n < 3:
        if sampled is None:
            reason = facts.telemetry.reason if facts.telemetry else "not sampled"
            why = f"telemetry unavailable ({reason})"
        else:
            why = f"only {sampled.stats.busy_n} samples with the GPU busy"
        for check, what in zip(questions, ("throttling", "power limit", "clocks"), strict=True):
            result.add_not_judged(check, f"{what}: {why}")
        return result
    stats, limits = sampled.stats, sampled.limits
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
    serious = {r: f for r, f in stats.throttle_fractions.items() if _is_serious(r)}
    worst = max(serious.values(), default=0.0)
    clock_fraction = stats.gfx_clock_fraction_of_max
    throttled = at_line(worst, cat.THROTTLE_FRACTION).above
    if throttled:
        result.add_finding(
            cat.gpu_throttled_finding(
                worst=worst,
                reasons=list(serious),
                clock_fraction=clock_fraction,
                thermal=any("thermal" in r or r == "hw_slowdown" for r in serious),
                power_brake="hw_power_brake_slowdown" in serious,
                amd=amd,
                evidence=evidence,
            )
        )
    else:
        result.add_ok(
            cat.GPU_THROTTLED.id,
            f"no throttling (thermal, hardware, power brake) in {stats.busy_n} busy samples"
            + (f" (at most {pct(worst)})" if worst else ""),
        )

    power_fraction = stats.power_at_limit_fraction
    if power_fraction is None:
        power_fraction = max(
            (f for r, f in stats.throttle_fractions.items() if _is_power(r)), default=None
        )
    limit, default = limits.power_limit_w, limits.power_default_limit_w
    lowered = (
        limit is not None
        and default is not None
        and default > 0
        and at_line(limit / default, cat.POWER_LOWERED_FRACTION).below
    )
    power_limited = lowered and at_line(power_fraction or 0.0, cat.POWER_AT_LIMIT_FRACTION).above
    if power_limited and limit is not None and default is not None:
        result.add_finding(
            cat.power_limited_finding(
                limit_w=limit,
                default_w=default,
                at_limit=power_fraction or 0.0,
                amd=amd,
                evidence=evidence,
            )
        )
    else:
        result.add_ok(
            cat.POWER_LIMITED.id,
            ("power limit lowered, but rarely reached" if lowered else "power limit at its default")
            + (
                f"; at the limit in {pct(power_fraction)} of the busy samples (normal at full load)"
                if power_fraction
                else ""
            ),
        )

    utilization = stats.utilization_median_pct
    if throttled or power_limited:
        # Low clocks are then the throttling's or the power limit's effect, found above.
        pass
    elif clock_fraction is None:
        result.add_not_judged(cat.CLOCKS_LOW.id, "clocks: the maximum clock is not reported")
    elif utilization is None or at_line(utilization, cat.BUSY_UTILIZATION_PCT).below:
        result.add_not_judged(
            cat.CLOCKS_LOW.id,
            f"clocks: the GPU is busy {utilization or 0:.0f}% of the time, too little to judge "
            "them (an idle GPU clocks down)",
        )
    elif at_line(clock_fraction, cat.LOW_CLOCK_FRACTION).below:
        result.add_finding(
            cat.clocks_low_finding(
                utilization_pct=utilization,
                clock_mhz=stats.gfx_clock_median_mhz or 0.0,
                clock_fraction=clock_fraction,
                max_mhz=limits.gfx_clock_max_mhz or 0.0,
                amd=amd,
                application_clocks=stats.throttle_fractions.get("applications_clocks_setting", 0)
                > 0.5,
                evidence=evidence,
            )
        )
    else:
        result.add_ok(cat.CLOCKS_LOW.id, f"clocks {pct(clock_fraction)} of max while busy")
    return result


def rule_pcie_link(facts: EnvironmentFacts) -> ProbeResult:
    """The PCIe link narrower or older than what the GPU and the slot support."""
    check = cat.PCIE_LINK_DEGRADED.id
    if not facts.on_gpu:
        return judged()
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
            return unknown(check, "PCIe link: no telemetry")
        width, width_max = link.get("current_width"), link.get("max_width")
        gen, gen_max = None, None  # an idle link trains down: generation not judged here
        source = "sysfs at inventory time (GPU idle)"
        if not width or not width_max:
            return unknown(check, "PCIe link: width not reported")
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
        return fine(check, line)
    parts = []
    if narrow:
        parts.append(f"x{width} of x{width_max}")
    if slow:
        parts.append(f"Gen{gen} of Gen{gen_max}")
    return found(cat.pcie_link_finding(narrow=narrow, parts=parts, evidence=evidence))


# --- driver --------------------------------------------------------------------------------------


def rule_driver(facts: EnvironmentFacts) -> ProbeResult:
    """An NVIDIA driver older than the CUDA version torch is built for."""
    check = cat.DRIVER_OLD.id
    if facts.device.kind != "cuda":
        return judged()
    build = facts.section("torch").get("cuda")
    supported = (facts.sampled.limits.cuda_driver_version if facts.sampled else "") or str(
        facts.section("gpu").get("cuda_driver_api") or ""
    )
    if not build or not supported:
        return unknown(check, "driver age: CUDA version of the driver unknown")
    if version_tuple(supported) >= version_tuple(build)[:2]:
        return fine(check, f"driver supports CUDA {supported} (torch built for {build})")
    major_minor = version_tuple(build)[:2]
    needed = (
        cat.CUDA_MIN_LINUX_DRIVER.get((major_minor[0], major_minor[1]))
        if len(major_minor) == 2
        else None
    )
    driver = facts.device.driver or (facts.sampled.limits.driver_version if facts.sampled else "")
    return found(
        cat.driver_old_finding(
            driver=driver, driver_cuda=supported, torch_cuda=str(build), needed=needed
        )
    )
