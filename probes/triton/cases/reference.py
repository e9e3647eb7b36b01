"""A case's reference outputs and the bound on each element a correct kernel keeps within.

A reference that declares where its kernel rounds (``reference(inputs, num)``) gets bounds computed
from what it declares (:mod:`~.numerics`); a plain one (``reference(inputs)``) gets the generic
bound of its dtype. Kept apart from the harness in :mod:`~.check` so the reference cache
(:mod:`~.reference_cache`) can compute what it keeps without importing the harness.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from diagnose.probes.triton.cases.api import CheckEnv, Tensors, TritonCase
from diagnose.probes.triton.cases.bounds import Error
from diagnose.probes.triton.cases.formats import format_of
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

# --- generic bounds -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """The generic bound of a reference that declares nothing about its kernel's rounding.

    A reference written as ``reference(inputs)`` returns plain float64 tensors, so nothing says
    where its kernel rounds: each element may then be off by atol·rms(ref) + rtol·|ref| (the
    absolute part relative to the RMS, because a reduction's error scales with the size of its
    terms, not of its result). References that take ``(inputs, num)`` get bounds computed from
    what they declare instead (:mod:`~.numerics`).
    """

    name: str
    rtol: float
    atol: float


#: A few times what correct kernels show in each format, far below what a miscompile gives.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance("fp32", rtol=1e-4, atol=1e-5),
    # tf32 keeps 10 mantissa bits; a tl.dot's operands may be truncated, not rounded.
    "tf32": Tolerance("tf32", rtol=2e-2, atol=5e-3),
    "fp16": Tolerance("fp16", rtol=5e-3, atol=2e-3),
    "bf16": Tolerance("bf16", rtol=3e-2, atol=2e-2),
    "fp64": Tolerance("fp64", rtol=1e-9, atol=1e-10),
}

_DEFAULT_TOLERANCE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


def tolerance_name(case: TritonCase, dtype: torch.dtype, env: CheckEnv) -> str:
    """The generic bound an undeclared reference is judged by: the case's override, else the
    dtype's default (tf32 for inductor's fp32 matmuls where the user allowed TF32)."""
    if dtype in case.tolerance_overrides:
        return str(case.tolerance_overrides[dtype])
    if (
        case.kind == "inductor"
        and dtype == torch.float32
        and env.mode == "device"
        and (
            torch.backends.cuda.matmul.allow_tf32
            or torch.get_float32_matmul_precision() != "highest"
        )
    ):
        return "tf32"
    return _DEFAULT_TOLERANCE.get(dtype, "fp32")


def generic_bound(reference: torch.Tensor, tolerance: Tolerance, num: Numerics) -> Bounded:
    """A plain reference tensor with the generic bound of ``tolerance`` around it."""
    value = reference.detach().to("cpu", torch.float64)
    if not reference.is_floating_point():
        return Bounded(reference.detach().cpu(), Error.none(), None, num)
    rms = float(value.norm()) / math.sqrt(value.numel()) if value.numel() else 0.0
    err = tolerance.atol * rms + tolerance.rtol * value.abs()
    return Bounded(value, Error.none().plus_worst(err), format_of(reference.dtype), num)


def declares_precision(case: TritonCase) -> bool:
    """Whether the case's reference takes ``(inputs, num)``: it declares where its kernel rounds."""
    try:
        parameters = inspect.signature(case.reference).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional)


def reference_of(
    case: TritonCase,
    inputs: Tensors,
    dtype: torch.dtype,
    env: CheckEnv,
    num: Numerics | None = None,
) -> tuple[dict[str, Bounded], str]:
    """The case's reference outputs with their bounds, and how they were made.

    ``num`` (default: the reference side for ``env``) is what the reference runs on; the
    emulated device of :mod:`~.emulate` passes itself to compute a device's answer instead.
    """
    num = num or Numerics(env, case.kind)
    if declares_precision(case):
        bounded = {k: num.input(v) for k, v in inputs.items()}
        returned = case.reference(bounded, num)  # type: ignore[call-arg]
        outputs = {
            k: v if isinstance(v, Bounded) else generic_bound(v, TOLERANCES["fp64"], num)
            for k, v in returned.items()
        }
        return outputs, "; ".join(num.steps) or "kernel precision (no rounding declared)"
    name = tolerance_name(case, dtype, env)
    copies = {
        k: v.detach().to("cpu", torch.float64, copy=True) if v.is_floating_point() else v.clone()
        for k, v in inputs.items()
    }
    plain = case.reference(copies)
    tolerance = TOLERANCES.get(name, TOLERANCES["fp32"])
    return {k: generic_bound(v, tolerance, num) for k, v in plain.items()}, f"generic {name} bound"


__all__ = [
    "TOLERANCES",
    "Tolerance",
    "declares_precision",
    "generic_bound",
    "reference_of",
    "tolerance_name",
]
