"""What the project knows about Triton and torch.compile kernels: finding ids, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

MISCOMPILE = FindingSpec(
    "triton.miscompile",
    "triton",
    "a Triton or `torch.compile` kernel compiles and runs but computes a wrong answer",
    ("probe",),
    severity_without_saving="critical",
)
COMPILE_ERROR = FindingSpec(
    "triton.compile_error",
    "triton",
    "a Triton kernel typical of LoRA training fails to compile here",
    ("probe",),
    severity_without_saving="warn",
)
VERSION_MISMATCH = FindingSpec(
    "triton.version_mismatch",
    "triton",
    "the installed Triton is not the one this torch was built with",
    ("probe",),
    severity_without_saving="warn",
)
SPECS = (MISCOMPILE, COMPILE_ERROR, VERSION_MISMATCH)
