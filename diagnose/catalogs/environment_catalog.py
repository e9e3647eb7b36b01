"""What the project knows about the machine and its settings: finding ids, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

CPU_WITH_GPU_PRESENT = FindingSpec(
    "environment.cpu_with_gpu_present",
    "environment",
    "training runs on the CPU while a GPU is present",
    ("probe",),
)
INTEGRATED_GPU = FindingSpec(
    "environment.integrated_gpu",
    "environment",
    "the run uses an integrated GPU (it shares memory with the host)",
    ("probe",),
)
ROCM_KERNEL_SEARCH_WARMUP = FindingSpec(
    "environment.rocm_kernel_search_warmup",
    "environment",
    "MIOpen/hipBLASLt kernel search makes the first steps slow",
    ("probe",),
)
TUNABLEOP_TUNING = FindingSpec(
    "environment.tunableop_tuning",
    "environment",
    "PyTorch TunableOp is tuning GEMMs during the run",
    ("probe",),
)
HSA_OVERRIDE = FindingSpec(
    "environment.hsa_override",
    "environment",
    "`HSA_OVERRIDE_GFX_VERSION` makes the GPU pose as another architecture",
    ("probe",),
)
HIPBLASLT_UNSUPPORTED = FindingSpec(
    "environment.hipblaslt_unsupported",
    "environment",
    "hipBLASLt is not supported on this GPU; GEMMs fall back",
    ("probe",),
)
HIPBLASLT_OFF = FindingSpec(
    "environment.hipblaslt_off",
    "environment",
    "hipBLASLt is turned off by an environment variable",
    ("probe",),
)
LAUNCH_BLOCKING = FindingSpec(
    "environment.launch_blocking",
    "environment",
    "`CUDA_LAUNCH_BLOCKING=1` serialises every kernel launch",
    ("probe",),
)
AMD_LOG_LEVEL = FindingSpec(
    "environment.amd_log_level",
    "environment",
    "`AMD_LOG_LEVEL` logging slows every HIP call",
    ("probe",),
)
GPU_THROTTLED = FindingSpec(
    "environment.gpu_throttled",
    "environment",
    "the GPU's clocks are throttled (thermal or power)",
    ("probe",),
)
POWER_LIMITED = FindingSpec(
    "environment.power_limited",
    "environment",
    "the GPU runs at its power limit",
    ("probe",),
)
CLOCKS_LOW = FindingSpec(
    "environment.clocks_low",
    "environment",
    "the GPU's clocks stay low during the steps",
    ("probe",),
)
PCIE_LINK_DEGRADED = FindingSpec(
    "environment.pcie_link_degraded",
    "environment",
    "the GPU's PCIe link runs narrower or slower than it can",
    ("probe",),
)
DRIVER_OLD = FindingSpec(
    "environment.driver_old",
    "environment",
    "the GPU driver is older than this torch expects",
    ("probe",),
)
CPU_ONE_THREAD = FindingSpec(
    "environment.cpu_one_thread",
    "environment",
    "torch computes on one CPU thread",
    ("probe",),
)
CPU_THREADS_LOW = FindingSpec(
    "environment.cpu_threads_low",
    "environment",
    "torch uses fewer CPU threads than the machine has cores",
    ("probe",),
)
CPU_FEW_CORES = FindingSpec(
    "environment.cpu_few_cores",
    "environment",
    "the machine has too few CPU cores for the loader and the training loop",
    ("probe",),
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
