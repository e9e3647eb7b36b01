"""What the project knows about Triton and torch.compile kernels: finding ids, wording, fixes.

These findings are about correctness and installation, not time: no saving can be said, so
their severity is the kind of fault's, declared here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over
from diagnose.record import Finding, Severity

MISCOMPILE = FindingSpec(
    "triton.miscompile",
    "triton",
    "a Triton or `torch.compile` kernel typical of LoRA training compiles and runs here but "
    "computes a wrong answer (checked against a float64 CPU reference)",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over(
        "the probe's own kernels typical of LoRA training, at their own shapes: a property of "
        "the compiler and device"
    ),
)
COMPILE_ERROR = FindingSpec(
    "triton.compile_error",
    "triton",
    "a Triton or `torch.compile` kernel typical of LoRA training fails to compile or launch here",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over(
        "the probe's own kernels typical of LoRA training: a property of the compiler and device"
    ),
)
VERSION_MISMATCH = FindingSpec(
    "triton.version_mismatch",
    "triton",
    "the installed Triton is not the one this torch was built with (another version, the other "
    "vendor's build, or two installs mixed)",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over("the installed packages"),
)
SPECS = (MISCOMPILE, COMPILE_ERROR, VERSION_MISMATCH)

#: A wrong answer found only by Triton's interpreter on the CPU: the kernel's logic (or the
#: interpreter) is wrong, but no training step runs that code, so it is not critical.
INTERPRETED_MISCOMPILE_SEVERITY: Severity = "warn"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _expected(package: str, version: str) -> str:
    return f" ({package}=={version})" if version else ""


def miscompile_finding(
    *,
    wrong: int,
    cases: Sequence[str],
    where: str,
    runs_in_training: bool,
    interpreted: bool,
    inductor: bool,
    seed: int,
    cache_dirs: Sequence[str],
    expected_package: str,
    expected_version: str,
    first_failure: str,
    evidence: Mapping[str, Any],
) -> Finding:
    """``wrong`` kernel checks computed wrong answers; ``first_failure`` says how (label: why).

    ``runs_in_training``: a GPU kernel or inductor's output failed, which a training step runs."""
    fix = (
        f"Clear the compiled-kernel caches ({', '.join(d for d in cache_dirs if d)}) and install "
        "the Triton torch was built with"
        + _expected(expected_package, expected_version)
        + f", then re-run `diagnose triton --seed {seed}`. If it still fails, do not train with "
        "this kernel on this stack: use the PyTorch op instead"
        + (" (for torch.compile: backend='aot_eager', or no compile)" if inductor else "")
        + ", and report the case, shape and dtype upstream."
    )
    detail = (
        f"{first_failure}. Inputs were fresh random values (seed {seed}); outputs were filled "
        "with NaN before the launch, so an element the kernel never wrote shows as NaN."
    )
    if interpreted and not runs_in_training:
        detail += (
            " These ran in Triton's interpreter: the kernel logic (or the interpreter) is wrong; "
            "it says nothing about a GPU compiler."
        )
    return MISCOMPILE.build(
        f"{_plural(wrong, 'kernel check')} computed wrong answers ({', '.join(cases)}; {where})",
        fix=fix,
        evidence=evidence,
        detail=detail,
        severity=None if runs_in_training else INTERPRETED_MISCOMPILE_SEVERITY,
    )


def compile_error_finding(
    *,
    failed: int,
    cases: Sequence[str],
    cache_dir: str,
    expected_package: str,
    expected_version: str,
    first_message: str,
    evidence: Mapping[str, Any],
) -> Finding:
    return COMPILE_ERROR.build(
        f"{_plural(failed, 'kernel check')} failed to compile or launch ({', '.join(cases)})",
        fix=(
            "Install the Triton torch was built with"
            + _expected(expected_package, expected_version)
            + f" and clear {cache_dir}; kernels that still fail use a feature this backend "
            "lacks: keep the PyTorch op for them."
        ),
        evidence=evidence,
        detail=first_message,
    )


def version_mismatch_finding(*, problem: str, fix: str, evidence: Mapping[str, Any]) -> Finding:
    """``problem``: what is installed against what torch expects; ``fix``: the pip command."""
    return VERSION_MISMATCH.build(
        "The installed Triton does not match torch",
        fix=fix,
        evidence={**evidence, "problem": problem},
        detail=problem,
    )


__all__ = [
    "COMPILE_ERROR",
    "INTERPRETED_MISCOMPILE_SEVERITY",
    "MISCOMPILE",
    "SPECS",
    "VERSION_MISMATCH",
    "compile_error_finding",
    "miscompile_finding",
    "version_mismatch_finding",
]
