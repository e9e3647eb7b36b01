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
    "computes a wrong answer: far outside the error bound of a float64 reference at the kernel's "
    "own precision, or wrong in a pattern (rows, blocks, the tail, NaN, writes outside the output)",
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
DRIFT = FindingSpec(
    "triton.numeric_drift",
    "triton",
    "a kernel check's answer went a little beyond its error bound, without a pattern: numerical "
    "drift a correct kernel may show on a rare input, reported so a rerun with another seed can "
    "tell",
    ("probe",),
    severity_without_saving="info",
    at_full_size=carries_over(
        "the probe's own kernels at their own shapes: a property of the compiler and device"
    ),
)
SPECS = (MISCOMPILE, DRIFT, COMPILE_ERROR, VERSION_MISMATCH)

#: How a wrong answer is wrong (the judge's pattern), in words for a finding's title.
WRONGNESS = {
    "nonfinite": "NaN or Inf where the reference is finite",
    "outside": "writes outside the output",
    "everywhere": "wrong nearly everywhere",
    "scaled": "off by a constant factor",
    "tail": "the tail wrong",
    "rows": "whole rows wrong",
    "columns": "whole columns wrong",
    "block": "a block wrong",
    "scattered": "elements far beyond the error bound",
    "shape": "the wrong output shape",
}

#: The inputs' seed when none is asked for: the same stack gives the same verdicts on every run.
DEFAULT_SEED = 1
#: A check whose elements go beyond their error bound by at most this factor, everywhere and
#: without a pattern, drifted: an info line, not a wrong answer (the bounds are worst cases, so a
#: correct kernel stays inside them; a little beyond is a numerical effect they do not model).
DRIFT_FACTOR = 4.0
#: As many as this many isolated elements beyond their bounds (no two adjacent) also drifted ...
HANDFUL = 4
#: ... as long as each stays within this factor of its bound.
ISOLATED_FACTOR = 64.0

#: A wrong answer found only by Triton's interpreter on the CPU: the kernel's logic (or the
#: interpreter) is wrong, but no training step runs that code, so it is not critical.
INTERPRETED_MISCOMPILE_SEVERITY: Severity = "warn"


def seeds_label(seeds: Sequence[int]) -> str:
    """ "seed 1" or "seeds 1–20"."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {seeds[0]}–{seeds[-1]}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _expected(package: str, version: str) -> str:
    return f" ({package}=={version})" if version else ""


def miscompile_finding(
    *,
    wrong: int,
    cases: Sequence[str],
    patterns: Sequence[str],
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
    """``wrong`` kernel checks computed wrong answers, in the judge's ``patterns``;
    ``first_failure`` says how (label: why).

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
        f"{first_failure}. Inputs were random values of seed {seed}; the reference is computed "
        "in float64 at the kernel's own precision, and each element has a bound on what a "
        "correct kernel can differ by; outputs were filled with NaN inside a poisoned margin "
        "before the launch, so an element never written shows as NaN and a write outside the "
        "output is seen."
    )
    if interpreted and not runs_in_training:
        detail += (
            " These ran in Triton's interpreter: the kernel logic (or the interpreter) is wrong; "
            "it says nothing about a GPU compiler."
        )
    kinds = "; ".join(dict.fromkeys(WRONGNESS.get(p, p) for p in patterns if p))
    return MISCOMPILE.build(
        f"{_plural(wrong, 'kernel check')} computed wrong answers"
        + (f": {kinds}" if kinds else "")
        + f" ({', '.join(cases)}; {where})",
        fix=fix,
        evidence=evidence,
        detail=detail,
        severity=None if runs_in_training else INTERPRETED_MISCOMPILE_SEVERITY,
    )


def drift_finding(
    *,
    drifted: int,
    cases: Sequence[str],
    worst_ratio: float,
    seeds: str,
    rerun_seed: int,
    evidence: Mapping[str, Any],
) -> Finding:
    """``drifted`` checks went beyond their bound by at most ``worst_ratio`` times it."""
    return DRIFT.build(
        f"{_plural(drifted, 'kernel check')} went a little beyond the error bound, by at most "
        f"{worst_ratio:.2g}× it, without a pattern ({', '.join(cases)})",
        fix=(
            f"Rerun `diagnose triton --seed {rerun_seed}` (other inputs). Drift that does not "
            "repeat is a rare input, not a fault; drift that repeats on every seed, at the same "
            "places, is worth reporting upstream with the case, shape and dtype."
        ),
        evidence=evidence,
        detail=(
            f"Judged with {seeds}. The bound is a worst case for a correct kernel, so going a "
            "little beyond it, at isolated elements, is a numerical effect it does not model "
            "rather than a wrong answer; it is not counted as a failure."
        ),
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
    "DEFAULT_SEED",
    "DRIFT",
    "DRIFT_FACTOR",
    "HANDFUL",
    "INTERPRETED_MISCOMPILE_SEVERITY",
    "ISOLATED_FACTOR",
    "MISCOMPILE",
    "SPECS",
    "VERSION_MISMATCH",
    "WRONGNESS",
    "compile_error_finding",
    "drift_finding",
    "miscompile_finding",
    "seeds_label",
    "version_mismatch_finding",
]
