"""The verdict on one output: pass, drift or mismatch, and what kind of wrongness it is.

Every element is measured against its own bound (:mod:`~.numerics`: the reference at the kernel's
precision, and how far a correct kernel may be from it), plus the rounding of the stored output.
Within every bound: ``pass``. A correct kernel never leaves its bounds (they are worst cases), so
an element beyond one is either a numerical effect the bound does not model, which stays small and
rare, or a bug, which does not:

- ``drift``: beyond the bound but within :data:`DRIFT_FACTOR` of it everywhere, or a handful
  (:data:`HANDFUL`) of isolated elements within :data:`ISOLATED_FACTOR` of it, with no pattern.
  Reported at info level, with how far, and an offer to rerun with another seed.
- ``mismatch``: NaN or Inf where the reference is finite (an element never written stays NaN), a
  write outside the output, a pattern (whole rows, columns, a block, the tail, nearly every
  element, a constant factor), or elements far beyond the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from diagnose.catalogs.triton_catalog import DRIFT_FACTOR, HANDFUL, ISOLATED_FACTOR, WRONGNESS
from diagnose.probes.triton.cases.formats import format_of
from diagnose.probes.triton.cases.numerics import Bounded

JudgedAs = Literal["pass", "drift", "mismatch"]

#: What storing the kernel's fp32 result in the output's format may cost, in ulps of that format:
#: a store that truncates (``fp_downcast_rounding="rtz"``, and Triton's interpreter for bfloat16)
#: loses up to one, rounding to nearest half of one; twice the worse, so a store alone never comes
#: near the bound.
STORE_ULPS = 2.0
#: A row, a column or the tail counts as wrong when at least this share of it is beyond the bound
#: (and at least two elements).
_PATTERN_SHARE = 0.5
#: Contiguous elements beyond the bound that make "a block".
_BLOCK_RUN = 8


@dataclass
class OutputJudgement:
    """One output against its reference."""

    name: str
    verdict: JudgedAs
    numel: int
    #: Elements beyond their bound (NaN/Inf where the reference is finite included).
    beyond: int = 0
    #: The largest |out − ref| / bound (inf for NaN/Inf): how far the worst element went.
    worst_ratio: float = 0.0
    #: The first element beyond its bound, row-major, and its numbers.
    first_index: list[int] | None = None
    expected: float | None = None
    actual: float | None = None
    bound: float | None = None
    rel_l2: float = 0.0
    max_abs: float = 0.0
    #: What kind of wrongness: "", "isolated", "spread", "nonfinite", "outside", "everywhere",
    #: "scaled", "tail", "rows", "columns", "block", "scattered", "shape".
    pattern: str = ""
    #: One line in words.
    detail: str = ""


def element_bounds(out_dtype: torch.dtype, want: Bounded | torch.Tensor) -> torch.Tensor:
    """Each element's bound for an output stored as ``out_dtype``: the reference's own, plus
    :data:`STORE_ULPS` ulps of the output's format for the store; zero for integers."""
    value = want.value if isinstance(want, Bounded) else want.detach().cpu()
    out_format = format_of(out_dtype)
    if out_format is None or not value.is_floating_point():
        return torch.zeros(value.shape, dtype=torch.float64)
    want64 = value.to(torch.float64)
    err = want.err if isinstance(want, Bounded) else torch.zeros((), dtype=torch.float64)
    err = err.expand(want64.shape) if err.dim() else err
    store = out_format.ulp * (want64.abs() + err) + out_format.min_spacing
    bound = err + STORE_ULPS * store
    return torch.as_tensor(bound, dtype=torch.float64).expand(want64.shape)


def judge_output(
    name: str, got: torch.Tensor, want: Bounded | torch.Tensor, outside_writes: int = 0
) -> OutputJudgement:
    """Judge ``got`` (any device or dtype) against the reference ``want``."""
    value = want.value if isinstance(want, Bounded) else want.detach().cpu()
    if tuple(got.shape) != tuple(value.shape):
        return OutputJudgement(
            name,
            "mismatch",
            value.numel(),
            value.numel(),
            math.inf,
            pattern="shape",
            detail=f"output shape {tuple(got.shape)} != expected {tuple(value.shape)}",
        )
    bound = element_bounds(got.dtype, want)
    got64 = got.detach().to("cpu", torch.float64)
    want64 = value.to(torch.float64)
    diff = (got64 - want64).abs()
    if format_of(got.dtype) is None or not value.is_floating_point():
        # Integers and booleans: exact.
        ratio = torch.where(diff > 0, math.inf, 0.0)
        nonfinite = torch.zeros(value.shape, dtype=torch.bool)
    else:
        nonfinite = ~torch.isfinite(got64) & torch.isfinite(want64)
        ratio = torch.where(nonfinite, math.inf, diff / bound)
        ratio = torch.nan_to_num(ratio, nan=math.inf, posinf=math.inf)
    judged = OutputJudgement(name, "pass", value.numel())
    if value.numel() == 0:
        return judged
    over = ratio > 1.0
    judged.beyond = int(over.sum())
    judged.worst_ratio = float(ratio.max())
    finite = torch.isfinite(got64)
    if bool(finite.all()):
        ref_norm = float(want64.norm())
        diff_norm = float(diff.norm())
        judged.rel_l2 = (
            diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
        )
        judged.max_abs = float(diff.max())
    else:
        judged.rel_l2 = judged.max_abs = math.inf
    if not judged.beyond and not outside_writes:
        return judged
    if judged.beyond:
        first = int(over.reshape(-1).nonzero()[0, 0])
        index = _unravel(first, tuple(value.shape))
        judged.first_index = index
        judged.expected = float(want64.reshape(-1)[first])
        judged.actual = float(got64.reshape(-1)[first])
        judged.bound = float(bound.reshape(-1)[first])
    judged.verdict, judged.pattern, detail = _classify(
        over, ratio, nonfinite, got64, want64, bound, outside_writes
    )
    kind = WRONGNESS.get(judged.pattern)
    judged.detail = f"{kind}: {detail}" if kind and judged.verdict == "mismatch" else detail
    return judged


def _classify(
    over: torch.Tensor,
    ratio: torch.Tensor,
    nonfinite: torch.Tensor,
    got: torch.Tensor,
    want: torch.Tensor,
    bound: torch.Tensor,
    outside_writes: int,
) -> tuple[JudgedAs, str, str]:
    count, numel = int(over.sum()), over.numel()
    if outside_writes:
        return (
            "mismatch",
            "outside",
            f"{outside_writes} element(s) written past the end of the output or before its "
            "start (a masked-off region)",
        )
    if bool(nonfinite.any()):
        nans = int((nonfinite & torch.isnan(got)).sum())
        infs = int(nonfinite.sum()) - nans
        parts = []
        if nans:
            parts.append(
                f"NaN at {nans} of {numel} elements (the buffer held NaN before the launch: "
                "never written, or computed as NaN)"
            )
        if infs:
            parts.append(f"Inf at {infs} of {numel} elements")
        return "mismatch", "nonfinite", "; ".join(parts)
    pattern = _pattern(over, got, want, bound)
    if pattern is not None:
        return "mismatch", pattern[0], pattern[1]
    worst = float(ratio.max())
    if worst <= DRIFT_FACTOR:
        return (
            "drift",
            "spread",
            f"{count} of {numel} elements beyond the bound, by at most {worst:.2g}× it",
        )
    if count <= HANDFUL and _isolated(over) and worst <= ISOLATED_FACTOR:
        return (
            "drift",
            "isolated",
            f"{count} isolated element(s) of {numel} beyond the bound, by at most {worst:.2g}× it",
        )
    return (
        "mismatch",
        "scattered",
        f"{count} of {numel} elements beyond the bound, up to {worst:.3g}× it",
    )


def _pattern(
    over: torch.Tensor, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor
) -> tuple[str, str] | None:
    """A structure in the elements beyond their bounds, as (pattern, words), or None."""
    count, numel = int(over.sum()), over.numel()
    if count < 2:
        return None
    flat = over.reshape(-1)
    if count >= _PATTERN_SHARE * numel:
        scale = _common_factor(got, want, bound)
        if scale is not None:
            return "scaled", (
                f"{count} of {numel} elements beyond the bound, all ×{scale:.4g} the reference "
                "(a wrong scale factor?)"
            )
        return "everywhere", f"{count} of {numel} elements beyond the bound"
    first = int(flat.nonzero()[0, 0])
    tail = flat[first:]
    if numel - first >= 2 and float(tail.float().mean()) >= _PATTERN_SHARE:
        where = tuple(_unravel(first, tuple(over.shape)))
        return "tail", (
            f"{count} of the last {numel - first} elements (from index {where} on) beyond the bound"
        )
    if over.dim() >= 2 and over.shape[-1] >= 2:
        grid = over.reshape(-1, over.shape[-1])
        for axis, word in ((1, "rows"), (0, "columns")):
            hits = grid.sum(axis)
            wrong = (hits >= 2) & (hits.float() >= _PATTERN_SHARE * grid.shape[axis])
            if bool(wrong.any()):
                which = int(wrong.nonzero()[0, 0])
                total = grid.shape[1 - axis]
                return word, (
                    f"{int(wrong.sum())} of {total} {word} (of the last dimension) mostly beyond "
                    f"the bound, the first {word[:-1]} {which}"
                )
    run = _longest_run(flat)
    if run >= _BLOCK_RUN:
        return "block", f"a contiguous run of {run} elements beyond the bound"
    return None


def _common_factor(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float | None:
    """c when got ≈ c·want everywhere (c ≠ 1): the signature of a wrong scale factor."""
    denominator = float((want * want).sum())
    if denominator == 0 or not bool(torch.isfinite(got).all()):
        return None
    scale = float((got * want).sum()) / denominator
    residual = (got - scale * want).abs()
    fits = residual <= DRIFT_FACTOR * bound * max(1.0, abs(scale)) + 1e-3 * want.abs()
    if abs(scale - 1.0) > 1e-3 and float(fits.float().mean()) >= 0.9:
        return scale
    return None


def _isolated(over: torch.Tensor) -> bool:
    flat = over.reshape(-1)
    return not bool((flat[1:] & flat[:-1]).any())


def _longest_run(flat: torch.Tensor) -> int:
    """The longest run of True in ``flat``."""
    edges = torch.diff(flat.to(torch.int8), prepend=flat.new_zeros(1, dtype=torch.int8),
                       append=flat.new_zeros(1, dtype=torch.int8))  # fmt: skip
    starts = (edges == 1).nonzero().reshape(-1)
    ends = (edges == -1).nonzero().reshape(-1)
    return int((ends - starts).max()) if len(starts) else 0


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return list(reversed(index))
