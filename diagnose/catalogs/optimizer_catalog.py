"""What the project knows about the optimizer step: finding ids, thresholds, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

SYNC_IN_STEP = FindingSpec(
    "optimizer.sync_in_step",
    "optimizer",
    "host-device synchronisations inside `Optimizer.step`",
    ("probe", "trace"),
    phases=("optimizer",),
)
SLOWER_THAN_ALTERNATIVE = FindingSpec(
    "optimizer.slower_than_alternative",
    "optimizer",
    "another optimizer that trains the same LoRA was measured faster here",
    ("probe",),
    phases=("optimizer",),
)
STATE_MOSTLY_FP32 = FindingSpec(
    "optimizer.8bit_state_mostly_fp32",
    "optimizer",
    "an 8-bit optimizer keeps most of its state in fp32 (tensors below its size threshold)",
    ("probe",),
    phases=("optimizer",),
)
NUMERICS_8BIT = FindingSpec(
    "optimizer.8bit_numerics",
    "optimizer",
    "an 8-bit update differs from fp32 AdamW beyond the quantisation bound",
    ("probe",),
    severity_without_saving="warn",
)
SPECS = (SYNC_IN_STEP, SLOWER_THAN_ALTERNATIVE, STATE_MOSTLY_FP32, NUMERICS_8BIT)
