"""What the project knows about the machine and its settings: finding ids, thresholds, wording,
fixes.

The environment probe's rules (``probes/environment/``) decide whether a finding is raised;
its words and fixes are here. None of these findings has a measured saving: a setting or a
machine fault is not A/B-tested in the run, so the severity is the kind of fault's, declared here
(where one id covers faults of different weight, each variant's severity is declared here too).

Why one file: each concern keeps its ids, thresholds, wording and fixes in one catalog module
(``CONCERN_MODULES`` lists one per concern); the environment probe's rule files all read this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Finding, Severity
from diagnose.stats import at_line
from diagnose.units import pct

CPU_WITH_GPU_PRESENT = FindingSpec(
    "environment.cpu_with_gpu_present",
    "environment",
    "training runs on the CPU while the machine has a GPU (torch sees it, or the PCI bus does)",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over("the device the run was given"),
)
INTEGRATED_GPU = FindingSpec(
    "environment.integrated_gpu",
    "environment",
    "the run uses an integrated GPU (its memory is system RAM), above all while a discrete one "
    "is present",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over("the device the run was given"),
)
ROCM_KERNEL_SEARCH_WARMUP = FindingSpec(
    "environment.rocm_kernel_search_warmup",
    "environment",
    "on ROCm the first step is many times slower than the rest: MIOpen find or TunableOp "
    "searched kernels at startup",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "the first step's excess is measured against the tiny model's few shapes and short "
        "steps; the real model searches more shapes for a longer step"
    ),
)
TUNABLEOP_TUNING = FindingSpec(
    "environment.tunableop_tuning",
    "environment",
    "PyTorch TunableOp is enabled with tuning on: every new GEMM shape is benchmarked during "
    "training",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("an environment setting"),
)
HSA_OVERRIDE = FindingSpec(
    "environment.hsa_override",
    "environment",
    "`HSA_OVERRIDE_GFX_VERSION` makes the GPU run kernels built for another target (needed, "
    "useless, or dangerous across generations)",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("an environment setting and the GPU"),
)
HIPBLASLT_UNSUPPORTED = FindingSpec(
    "environment.hipblaslt_unsupported",
    "environment",
    "hipBLASLt is requested on a GPU torch's hipBLASLt path does not support; GEMMs fall back to "
    "hipBLAS",
    ("probe",),
    at_full_size=carries_over("an environment setting and the GPU"),
)
HIPBLASLT_OFF = FindingSpec(
    "environment.hipblaslt_off",
    "environment",
    "hipBLASLt is switched off by `TORCH_BLAS_PREFER_HIPBLASLT` on a GPU that supports it",
    ("probe",),
    at_full_size=carries_over("an environment setting and the GPU"),
)
LAUNCH_BLOCKING = FindingSpec(
    "environment.launch_blocking",
    "environment",
    "`CUDA_LAUNCH_BLOCKING`, `HIP_LAUNCH_BLOCKING` or `AMD_SERIALIZE_*` is set: every kernel "
    "launch waits for the GPU",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over("an environment setting"),
)
AMD_LOG_LEVEL = FindingSpec(
    "environment.amd_log_level",
    "environment",
    "`AMD_LOG_LEVEL` of 3 or more: the HIP runtime logs every API call",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("an environment setting"),
)
GPU_THROTTLED = FindingSpec(
    "environment.gpu_throttled",
    "environment",
    "the GPU throttled (thermal, hardware slowdown or power brake) in a part of the busy samples",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "a tiny model hardly loads the GPU; the real model's sustained load is what heats and "
        "throttles it"
    ),
)
POWER_LIMITED = FindingSpec(
    "environment.power_limited",
    "environment",
    "the GPU's power limit is lowered below its default and the GPU sits at it",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "a tiny model does not draw the power that reaches the limit; the real model may"
    ),
)
CLOCKS_LOW = FindingSpec(
    "environment.clocks_low",
    "environment",
    "the GPU is busy but its clocks stay far below their maximum, with no throttling to explain "
    "it (locked or application clocks, a power profile)",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "a tiny model's light load lets the clocks drop; the real model's load raises them"
    ),
)
PCIE_LINK_DEGRADED = FindingSpec(
    "environment.pcie_link_degraded",
    "environment",
    "the GPU's PCIe link runs narrower or at an older generation than the GPU and slot allow",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("a property of the machine"),
)
DRIVER_OLD = FindingSpec(
    "environment.driver_old",
    "environment",
    "the NVIDIA driver supports an older CUDA than the one this torch is built for",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("the installed driver and torch"),
)
CPU_ONE_THREAD = FindingSpec(
    "environment.cpu_one_thread",
    "environment",
    "a CPU run where torch computes on one thread of several cores",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("torch's thread settings"),
)
CPU_THREADS_LOW = FindingSpec(
    "environment.cpu_threads_low",
    "environment",
    "a CPU run where torch uses fewer than half the physical cores",
    ("probe",),
    at_full_size=carries_over("torch's thread settings"),
)
CPU_FEW_CORES = FindingSpec(
    "environment.cpu_few_cores",
    "environment",
    "a CPU run on a machine with few cores: the numbers are a smoke test, not a training speed",
    ("probe",),
    at_full_size=carries_over("a property of the machine"),
)
SPECS = (
    CPU_WITH_GPU_PRESENT,
    INTEGRATED_GPU,
    ROCM_KERNEL_SEARCH_WARMUP,
    TUNABLEOP_TUNING,
    HSA_OVERRIDE,
    HIPBLASLT_UNSUPPORTED,
    HIPBLASLT_OFF,
    LAUNCH_BLOCKING,
    AMD_LOG_LEVEL,
    GPU_THROTTLED,
    POWER_LIMITED,
    CLOCKS_LOW,
    PCIE_LINK_DEGRADED,
    DRIVER_OLD,
    CPU_ONE_THREAD,
    CPU_THREADS_LOW,
    CPU_FEW_CORES,
)


# --- thresholds --------------------------------------------------------------------------------

#: A first step this many times the median, and this many seconds longer, is a warm-up to explain.
WARMUP_RATIO = 3.0
WARMUP_EXTRA_S = 2.0
#: Share of busy samples with a serious throttle reason that makes a finding.
THROTTLE_FRACTION = 0.1
#: Throttling in this share of the busy samples with clocks below :data:`THROTTLED_CLOCK_FRACTION`
#: of their maximum costs a large part of the step: the critical variant.
THROTTLE_MOST_FRACTION = 0.5
THROTTLED_CLOCK_FRACTION = 0.8
#: A power limit below this share of the default counts as lowered.
POWER_LOWERED_FRACTION = 0.9
#: The GPU at its (lowered) power limit in this share of the busy samples makes a finding.
POWER_AT_LIMIT_FRACTION = 0.3
#: Median busy clock below this share of the maximum is "far below max".
LOW_CLOCK_FRACTION = 0.6
#: Clocks are only judged when the GPU is at least this busy (an idle GPU clocks down).
BUSY_UTILIZATION_PCT = 70.0
#: AMD_LOG_LEVEL from this level logs every HIP API call.
AMD_LOG_LEVEL_SLOW = 3
#: A CPU run uses too few threads below this share of the physical cores.
CPU_THREADS_LOW_SHARE = 0.5
#: A CPU run on fewer usable cores than this is a smoke test.
CPU_ENOUGH_CORES = 5

# --- severities of the variants of one id ------------------------------------------------------

#: An integrated GPU when it is the only one: expected, worth knowing.
INTEGRATED_ONLY_SEVERITY: Severity = "info"
HsaOverrideKind = Literal["malformed", "own_target", "other_generation", "not_needed", "needed"]
#: Across instruction-set generations the override crashes or computes wrong results; where torch
#: has no kernels for the GPU it is the usual way to run at all.
HSA_OVERRIDE_SEVERITY: dict[HsaOverrideKind, Severity] = {
    "malformed": "warn",
    "own_target": "info",
    "other_generation": "critical",
    "not_needed": "warn",
    "needed": "info",
}
#: Throttling most of the time with clocks well down costs a large part of the step.
THROTTLED_MOST_SEVERITY: Severity = "critical"
#: Only an older PCIe generation (full width): copies are slower, rarely the bottleneck.
PCIE_GEN_ONLY_SEVERITY: Severity = "info"


# --- builders ----------------------------------------------------------------------------------


def cpu_with_gpu_present_finding(*, title: str, fix: str, evidence: Mapping[str, Any]) -> Finding:
    """``title`` says which GPU and why torch did not use it; ``fix`` is from :func:`gpu_fix`."""
    return CPU_WITH_GPU_PRESENT.build(title, fix=fix, evidence=evidence)


def torch_sees_gpu_title(count: int) -> str:
    return f"The step ran on the CPU although torch sees {count} GPU{'' if count == 1 else 's'}"


def gpu_on_bus_title(vendor: str, why: str) -> str:
    return f"The step ran on the CPU although the machine has an {vendor} GPU: {why}"


RUN_ON_THE_GPU_FIX = in_trainers(
    "Run on the GPU: diagnose run --device cuda (the default 'auto' picks it); move the model "
    "and batch with .to('cuda')",
    kohya="no --cpu",
    diffusers="no --cpu / use_cpu: false in the accelerate config",
    lightning='Trainer(accelerator="gpu")',
)


def cpu_only_torch(vendor: str) -> tuple[str, str]:
    """(why, fix) for a CPU-only torch on a machine with a ``vendor`` GPU."""
    if vendor == "NVIDIA":
        return (
            "this torch is a CPU-only build",
            "Install a CUDA build of torch: pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128 (match your driver; see pytorch.org).",
        )
    return (
        "this torch is a CPU-only build",
        "Install a ROCm build of torch: pip install torch --index-url "
        "https://download.pytorch.org/whl/rocm6.4 (Linux; see pytorch.org).",
    )


def cuda_cannot_reach(visible_devices_hidden: bool) -> tuple[str, str]:
    return (
        "the CUDA build of torch cannot reach the GPU",
        "Unset CUDA_VISIBLE_DEVICES"
        if visible_devices_hidden
        else "Load the NVIDIA driver (nvidia-smi must list the GPU; reinstall the driver if it "
        "does not), then rerun",
    )


ROCM_CANNOT_REACH = (
    "the ROCm build of torch cannot reach the GPU",
    "Give the user access to /dev/kfd and /dev/dri (groups render and video), check "
    "HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES, and that the amdgpu driver is loaded; rocminfo "
    "must list the GPU.",
)


def other_vendor_build(build: str, vendor: str) -> tuple[str, str]:
    return (
        f"this torch ({build}) is built for another GPU vendor",
        "Install the torch build for your GPU: "
        + ("CUDA (…/whl/cu128)" if vendor == "NVIDIA" else "ROCm (…/whl/rocm6.4)")
        + " from https://download.pytorch.org.",
    )


def integrated_gpu_finding(
    *,
    name: str,
    discrete: str | None,
    discrete_index: Any = None,
    visible_variable: str = "CUDA_VISIBLE_DEVICES",
    evidence: Mapping[str, Any],
) -> Finding:
    """The integrated GPU ``name`` ran the step; ``discrete``: the discrete GPU beside it."""
    if discrete is not None:
        return INTEGRATED_GPU.build(
            f"Training ran on the integrated {name} while a discrete {discrete} is present",
            fix=f"Use the discrete GPU: diagnose run --device cuda:{discrete_index}; for your "
            f"trainer {visible_variable}={discrete_index} (or disable the integrated GPU in the "
            "BIOS).",
            evidence=evidence,
        )
    return INTEGRATED_GPU.build(
        f"{name} is an integrated GPU: its memory is system RAM, shared with the CPU",
        fix="Expect lower memory bandwidth than a discrete GPU; keep other memory-heavy work off "
        "the machine while training.",
        evidence=evidence,
        severity=INTEGRATED_ONLY_SEVERITY,
    )


def rocm_warmup_finding(
    *,
    source: str,
    first: float,
    typical: float,
    tuning: bool,
    cudnn_benchmark: bool,
    find_mode_fast: bool,
    resolution_buckets: int,
    evidence: Mapping[str, Any],
) -> Finding:
    fixes = []
    if tuning:
        fixes.append(
            "TunableOp is tuning every new GEMM shape: tune once, then train with "
            "PYTORCH_TUNABLEOP_TUNING=0 (PYTORCH_TUNABLEOP_FILENAME keeps the results)"
        )
    if cudnn_benchmark:
        fixes.append(
            "torch.backends.cudnn.benchmark=False (on ROCm it makes MIOpen search exhaustively "
            "for every new convolution shape)"
        )
    if not find_mode_fast:
        fixes.append("MIOPEN_FIND_MODE=FAST (no search for shapes MIOpen has not seen)")
    fixes.append(
        "keep MIOpen's databases on a persistent disk (MIOPEN_USER_DB_PATH, "
        "MIOPEN_CUSTOM_CACHE_DIR; a container loses ~/.config/miopen and ~/.cache/miopen) so "
        "the search is paid once"
    )
    if resolution_buckets > 1:
        fixes.append(f"each of the {resolution_buckets} resolution buckets is a new shape")
    return ROCM_KERNEL_SEARCH_WARMUP.build(
        f"The {source} took {first:.1f} s against {typical:.2f} s/it after it "
        f"({first / typical:.0f}x): kernels were searched or tuned at startup (MIOpen find / "
        "TunableOp)",
        fix="; ".join(fixes) + ".",
        evidence=evidence,
        detail="MIOpen benchmarks candidate convolution kernels the first time it sees a shape "
        "and TunableOp benchmarks GEMM implementations; both are paid again for every new shape "
        "and in every fresh container. The cost is paid at startup, not per step, so no per-step "
        "saving is given.",
    )


def tunableop_tuning_finding(*, evidence: Mapping[str, Any]) -> Finding:
    return TUNABLEOP_TUNING.build(
        "TunableOp is tuning live: every new GEMM shape is benchmarked during training",
        fix="Tune once (a short run with PYTORCH_TUNABLEOP_TUNING=1), then train with "
        "PYTORCH_TUNABLEOP_TUNING=0 and the same PYTORCH_TUNABLEOP_FILENAME so the tuned "
        "results are used without tuning again",
        evidence=evidence,
    )


def hsa_override_finding(
    kind: HsaOverrideKind,
    *,
    value: str,
    target: str | None,
    real: str | None,
    evidence: Mapping[str, Any],
) -> Finding:
    """``HSA_OVERRIDE_GFX_VERSION=value`` runs ``target`` kernels on the ``real`` GPU."""
    unset = "unset HSA_OVERRIDE_GFX_VERSION"
    if kind == "malformed":
        title = f"HSA_OVERRIDE_GFX_VERSION={value} is not of the form MAJOR.MINOR.STEPPING"
        fix = unset + ", or set it to e.g. 11.0.0"
    elif kind == "own_target":
        title = (
            f"HSA_OVERRIDE_GFX_VERSION={value} names the GPU's own target ({real}): it does nothing"
        )
        fix = unset
    elif kind == "other_generation":
        title = (
            f"HSA_OVERRIDE_GFX_VERSION={value} runs {target} kernels on a {real}: another "
            "instruction-set generation (crashes, hangs or wrong results)"
        )
        fix = (
            f"{unset}, or use the {(real or 'gfx')[:-1]}x family value (e.g. 10.3.0 for RDNA2, "
            "11.0.0 for RDNA3)"
        )
    elif kind == "not_needed":
        title = (
            f"HSA_OVERRIDE_GFX_VERSION={value} is not needed: this torch has {real} kernels, and "
            f"the override makes it run kernels tuned for {target} instead"
        )
        fix = unset
    else:
        title = f"HSA_OVERRIDE_GFX_VERSION={value}: the GPU runs kernels built for {target}" + (
            f" (it is a {real}, which this torch has no kernels for)" if real else ""
        )
        fix = (
            "Expected for a GPU torch does not ship kernels for; kernels and libraries (MIOpen, "
            "rocBLAS, hipBLASLt) are tuned for the other chip, so some ops are slower or fall "
            "back. A torch build listing your gfx target (TheRock nightlies) avoids it."
        )
    return HSA_OVERRIDE.build(
        title, fix=fix, evidence=evidence, severity=HSA_OVERRIDE_SEVERITY[kind]
    )


def hipblaslt_unsupported_finding(
    *, asked: str, arch: str, hip: str | None, evidence: Mapping[str, Any]
) -> Finding:
    return HIPBLASLT_UNSUPPORTED.build(
        f"{asked} on {arch}, which torch's hipBLASLt path does not support (HIP {hip}): GEMMs "
        "fall back to hipBLAS/rocBLAS",
        fix="unset TORCH_BLAS_PREFER_HIPBLASLT (it only adds the 'Attempting to use hipBLASLt on "
        "an unsupported architecture' warning here)",
        evidence=evidence,
    )


def hipblaslt_off_finding(*, value: str, arch: str, evidence: Mapping[str, Any]) -> Finding:
    return HIPBLASLT_OFF.build(
        f"hipBLASLt is switched off (TORCH_BLAS_PREFER_HIPBLASLT={value}) on {arch}, which "
        "supports it",
        fix="unset TORCH_BLAS_PREFER_HIPBLASLT, or compare both: hipBLASLt's GEMMs are usually "
        "faster on the GPUs it supports",
        evidence=evidence,
    )


def launch_blocking_finding(switches: Mapping[str, str]) -> Finding:
    return LAUNCH_BLOCKING.build(
        f"{', '.join(f'{k}={v}' for k, v in switches.items())}: every kernel launch waits for "
        "the GPU, so the CPU can never queue work ahead",
        fix="unset " + " ".join(switches) + " (debugging switches)",
        evidence=dict(switches),
    )


def amd_log_level_finding(level: str) -> Finding:
    return AMD_LOG_LEVEL.build(
        f"AMD_LOG_LEVEL={level}: the HIP runtime logs every API call",
        fix="unset AMD_LOG_LEVEL",
        evidence={"AMD_LOG_LEVEL": level},
    )


def gpu_throttled_finding(
    *,
    worst: float,
    reasons: Sequence[str],
    clock_fraction: float | None,
    thermal: bool,
    power_brake: bool,
    amd: bool,
    evidence: Mapping[str, Any],
) -> Finding:
    """Serious throttle ``reasons`` active in ``worst`` of the busy samples."""
    most = (
        at_line(worst, THROTTLE_MOST_FRACTION).above
        and clock_fraction is not None
        and at_line(clock_fraction, THROTTLED_CLOCK_FRACTION).below
    )
    if power_brake and not thermal:
        fix = (
            "Check the power delivery: the board's external power-brake signal fired (PSU, "
            "12VHPWR/8-pin cables and adapters)"
        )
    else:
        fix = "Cool the GPU: fan curve, case airflow, dust, thermal paste/pads; " + (
            "`amd-smi metric -t -p` shows temperatures"
            if amd
            else "`nvidia-smi -q -d PERFORMANCE,TEMPERATURE` shows the active reason"
        )
    return GPU_THROTTLED.build(
        f"The GPU throttled in {pct(worst)} of the busy samples ({', '.join(sorted(reasons))}); "
        f"clocks at {pct(clock_fraction)} of max",
        fix=fix,
        evidence=evidence,
        severity=THROTTLED_MOST_SEVERITY if most else None,
    )


def power_limited_finding(
    *, limit_w: float, default_w: float, at_limit: float, amd: bool, evidence: Mapping[str, Any]
) -> Finding:
    return POWER_LIMITED.build(
        f"The power limit is lowered to {limit_w:.0f} W (default {default_w:.0f} W) and the GPU "
        f"sits at it in {pct(at_limit)} of the busy samples",
        fix=(
            f"sudo amd-smi set --power-cap {default_w:.0f} (or rocm-smi --resetpoweroverdrive)"
            if amd
            else f"sudo nvidia-smi -pl {default_w:.0f}"
        )
        + " — if the limit was lowered on purpose (heat, noise, PSU), this is its price",
        evidence=evidence,
    )


def clocks_low_finding(
    *,
    utilization_pct: float,
    clock_mhz: float,
    clock_fraction: float,
    max_mhz: float,
    amd: bool,
    application_clocks: bool,
    evidence: Mapping[str, Any],
) -> Finding:
    return CLOCKS_LOW.build(
        f"The GPU is busy ({utilization_pct:.0f}%) but clocks at {clock_mhz:.0f} MHz, "
        f"{pct(clock_fraction)} of its {max_mhz:.0f} MHz maximum",
        fix=(
            "sudo amd-smi set --perf-level AUTO (or rocm-smi --setperflevel auto); check the "
            "power profile (rocm-smi --showprofile)"
            if amd
            else "sudo nvidia-smi -rgc && sudo nvidia-smi -rac (reset locked and application "
            "clocks)"
            + ("; the driver reports application clocks in force" if application_clocks else "")
        ),
        evidence=evidence,
    )


def pcie_link_finding(
    *, narrow: bool, parts: Sequence[str], evidence: Mapping[str, Any]
) -> Finding:
    """``parts``: "x4 of x16", "Gen3 of Gen4"; ``narrow``: fewer lanes than allowed."""
    return PCIE_LINK_DEGRADED.build(
        f"The GPU's PCIe link runs at {' and '.join(parts)}: host-device copies (batches, "
        "offloaded weights, anything spilled) are slower",
        fix="Seat the card in the CPU-attached x16 slot (usually the top one), remove riser or "
        "extension cables, set the slot to Auto/its full generation in the BIOS; verify under "
        "load with `nvidia-smi -q -d PCI` or `sudo lspci -vv | grep LnkSta`.",
        evidence=evidence,
        severity=None if narrow else PCIE_GEN_ONLY_SEVERITY,
    )


#: Minimum Linux driver for each CUDA version (NVIDIA CUDA Toolkit release notes).
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


def driver_old_finding(
    *, driver: str, driver_cuda: str, torch_cuda: str, needed: str | None
) -> Finding:
    return DRIVER_OLD.build(
        f"The NVIDIA driver ({driver or 'version unknown'}) supports CUDA {driver_cuda}, older "
        f"than the CUDA {torch_cuda} this torch is built for",
        fix=f"Update the NVIDIA driver{f' to {needed} or newer' if needed else ''}, or install "
        f"the torch build for CUDA {driver_cuda}",
        evidence={"driver": driver, "driver_cuda": driver_cuda, "torch_cuda": torch_cuda},
        detail="torch then runs on CUDA's minor-version compatibility: kernels shipped only as "
        "PTX cannot be JIT-compiled and features of newer drivers stay off.",
    )


def cpu_one_thread_finding(*, usable: int, physical: int, evidence: Mapping[str, Any]) -> Finding:
    return CPU_ONE_THREAD.build(
        f"torch computes on 1 thread of the {usable} cores it may use",
        fix=f"unset OMP_NUM_THREADS (or set it to {physical}); in code "
        f"torch.set_num_threads({physical})",
        evidence=evidence,
    )


def cpu_threads_low_finding(*, threads: int, physical: int, evidence: Mapping[str, Any]) -> Finding:
    return CPU_THREADS_LOW.build(
        f"torch computes on {threads} threads of {physical} physical cores",
        fix=f"OMP_NUM_THREADS={physical} (or torch.set_num_threads({physical}))",
        evidence=evidence,
    )


def cpu_few_cores_finding(*, usable: int, evidence: Mapping[str, Any]) -> Finding:
    return CPU_FEW_CORES.build(
        f"A CPU run on {usable} cores: a diffusion model's LoRA step takes minutes to hours "
        "here; these numbers are a smoke test",
        fix="Measure on the GPU you train on: diagnose run --device cuda there, or diagnose "
        "profile -- <your training command> on that machine",
        evidence=evidence,
    )
