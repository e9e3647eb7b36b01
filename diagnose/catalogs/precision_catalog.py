"""What the project knows about numeric precision: finding ids, thresholds, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

#: The phases in which the step computes with the model's weights.
COMPUTE_PHASES = ("encode", "forward", "backward")

UPCAST = FindingSpec(
    "precision.fp32_compute_in_low_precision_run",
    "precision",
    "matmuls/convolutions ran with fp32 inputs in an otherwise bf16/fp16 run (from a trace: "
    "needs `record_shapes`)",
    ("probe", "trace"),
    phases=COMPUTE_PHASES,
)
FP32_TRAINING = FindingSpec(
    "precision.fp32_training",
    "precision",
    "the whole run computes in fp32",
    ("probe", "trace"),
    phases=COMPUTE_PHASES,
)
FP32_WEIGHTS = FindingSpec(
    "precision.fp32_weights_in_full_bf16",
    "precision",
    "`bf16-full` was asked for but some weights are fp32",
    ("probe",),
    phases=COMPUTE_PHASES,
)
DTYPE_MISMATCH = FindingSpec(
    "precision.dtype_mismatch_warning",
    "precision",
    "a fused kernel warned about mismatched dtypes and fell back",
    ("probe",),
    phases=COMPUTE_PHASES,
)
BF16_NOT_NATIVE = FindingSpec(
    "precision.bf16_not_native",
    "precision",
    "bf16 on a device without native bf16 units (emulated, slow)",
    ("probe",),
    phases=COMPUTE_PHASES,
)
BF16_SLOWER = FindingSpec(
    "precision.bf16_slower_than_fp32",
    "precision",
    "bf16 measured slower than fp32 on this device",
    ("probe",),
    phases=COMPUTE_PHASES,
)
SPECS = (UPCAST, FP32_TRAINING, FP32_WEIGHTS, DTYPE_MISMATCH, BF16_NOT_NATIVE, BF16_SLOWER)
