"""The error model of a reference: how far from it a correct kernel's value may be, per element.

Every rounding a kernel does costs at most one ulp of its result (:data:`ROUNDING_ALLOWANCE`), an
approximate function a few units (:data:`APPROXIMATE_UNITS`), a sum of n terms at most what each
addition can lose of the running sum (:func:`accumulation_error`: a bound that grows with n,
against the terms' magnitudes, |A|·|B| for a dot, not against the result). :class:`Error` carries
these bounds through a computation to first order, and bounds the independent per-element noise
(roundings a kernel may do differently) statistically where many of them are added up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diagnose.probes.triton.cases.formats import FP32

#: Every rounding a kernel does is allowed one ulp of its result, twice what rounding to nearest
#: can cost: that covers additions that truncate (tensor cores' accumulators, some atomics), fused
#: multiply-adds that round once where the reference's model rounds twice, and leaves room below
#: the bound for a correct kernel.
ROUNDING_ALLOWANCE = FP32.ulp
#: How many units of fp32 the GPU's approximate exp2 / log2 / rsqrt / division and libdevice's erf
#: may be off by: their documented worst cases are about 2 ulps (4 units); twice that.
APPROXIMATE_UNITS = 8.0
#: The fewest keys a flash-attention block holds (tl.dot's smallest size): bounds how many times
#: the online softmax rescales its running sums.
MIN_KEY_BLOCK = 16


#: How far a running sum may wander from its drift, in multiples of its random walk's mean path.
WALK_ALLOWANCE = 4.0


def gamma(n: int, unit: float) -> float:
    """γ(n) = n·u/(1 − n·u): the relative bound of a sum of n terms in any order."""
    nu = n * unit
    return nu / (1.0 - nu) if nu < 1.0 else math.inf


def accumulation_error(
    n: int, unit: float, absolute: torch.Tensor, total: torch.Tensor, l2: torch.Tensor
) -> torch.Tensor:
    """A bound on the rounding error of adding n terms x_k in a kernel's order and blocking.

    Each addition loses at most ``unit`` of the running sum s_k, so the error is at most
    unit·Σ|s_k|. In the worst case that is γ(n)·Σ|x| (``absolute``); a kernel adds its terms in
    index order, where the running sum follows its drift k/n·Σx (``total``) plus a random walk
    whose mean size after k terms is √(k/n)·‖x‖₂ (``l2``): Σ|s_k| ≤ n/2·|Σx| + (2/3)·n·‖x‖₂
    on average, allowed :data:`WALK_ALLOWANCE` times. The smaller of the two bounds.
    """
    worst = gamma(n, unit) * absolute
    walk = unit * (0.5 * n * total.abs() + WALK_ALLOWANCE * (2.0 / 3.0) * n * l2)
    return torch.minimum(worst, walk)


#: How many standard deviations the independent rounding noise of an element may reach: a normal
#: tail beyond 8σ has a probability of about 1e-15, so a million-element output stays inside.
NOISE_SIGMAS = 8.0


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


def _nonzero(t: torch.Tensor) -> bool:
    return bool((t != 0).any())


def _none(t: torch.Tensor) -> bool:
    """A part that is known to be zero without looking at every element (kept 0-dim)."""
    return t.dim() == 0 and float(t) == 0.0


def _plus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b if _none(a) else a if _none(b) else a + b


def _times(t: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    return t if _none(t) else t * factor


@dataclass(frozen=True)
class Error:
    """How far a correct kernel's value may be from the reference, per element.

    ``worst`` bounds everything, in the worst case. Part of it is noise that each element gets on
    its own: the roundings of its own operations and sums, and the roundings to a narrow format
    the kernel may do differently (a cast a compiler may fuse away, a value near a rounding
    boundary that the kernel's slightly different value crosses). Such errors are independent from
    element to element, so where a later dot or sum adds many of them they partly cancel:

    - ``fresh``: the element's own noise, not yet added up with others' (its worst case);
    - ``mixed``: noise that reached it through dots and sums (its worst case), and ``var``, the
      variance of that sum (each noise taken as uniform over its range), whose
      :data:`NOISE_SIGMAS` standard deviations bound it more tightly when many terms were added.

    Noise shared by several elements (a row's mean broadcast over the row) is still taken as
    independent where a later sum adds those elements up: that sum's other factor (a weight
    matrix, the values attention weighs) has signs of its own, so the shared error cancels like
    independent ones would; the calibration benchmark checks that this holds for the corpus's
    computations. Errors with a sign of their own (a rounding mode that is not documented) stay
    in the worst case alone.
    """

    worst: torch.Tensor
    fresh: torch.Tensor
    mixed: torch.Tensor
    var: torch.Tensor

    @staticmethod
    def none() -> Error:
        return Error(_zero(), _zero(), _zero(), _zero())

    @property
    def exact(self) -> bool:
        # Exact values keep a 0-dim zero: no operation turns it into a tensor of zeros.
        return _none(self.worst)

    def _parts(self) -> tuple[torch.Tensor, ...]:
        return (self.worst, self.fresh, self.mixed, self.var)

    def __add__(self, other: Error) -> Error:
        return Error(*(_plus(a, b) for a, b in zip(self._parts(), other._parts(), strict=True)))

    def scaled(self, factor: torch.Tensor | float) -> Error:
        """The error of ``factor·x`` (to first order)."""
        if self.exact:
            return self
        size = abs(factor) if isinstance(factor, float) else factor.abs()
        square = size**2 if not _none(self.var) else size
        return Error(
            _times(self.worst, size),
            _times(self.fresh, size),
            _times(self.mixed, size),
            _times(self.var, square),
        )

    def plus_worst(self, extra: torch.Tensor | float) -> Error:
        return Error(_plus(self.worst, torch.as_tensor(extra)), self.fresh, self.mixed, self.var)

    def plus_noise(self, extra: torch.Tensor) -> Error:
        """The element's own independent error of up to ``extra``."""
        return Error(_plus(self.worst, extra), _plus(self.fresh, extra), self.mixed, self.var)

    def added_up(self, total: Callable[[torch.Tensor, bool], torch.Tensor]) -> Error:
        """The error of a sum of such elements: ``total(part, squared)`` adds a part up over the
        terms (weighted by |w|, or by w² for variances). The noise becomes mixed."""
        if self.exact:
            return self
        worst = total(self.worst, False)
        noise = _plus(self.fresh, self.mixed)
        if _none(noise):
            return Error(worst, _zero(), _zero(), _zero())
        mixed = total(noise, False)
        var = total(_plus(self.fresh.square() / 3, self.var), True)
        return Error(worst, _zero(), mixed, var)

    def moved(self, op: str, like: torch.Tensor, *args: object) -> Error:
        """A shape operation (``op`` of torch.Tensor) applied to every part."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t if t.dim() == 0 else getattr(t.expand(like.shape), op)(*args)

        return Error(*(move(t) for t in self._parts()))

    def largest(self, like: torch.Tensor, dim: int) -> Error:
        """Of elements along ``dim`` (kept), the largest of each part: the error of their max."""

        def most(t: torch.Tensor) -> torch.Tensor:
            return t if t.dim() == 0 else t.expand(like.shape).amax(dim, keepdim=True)

        return Error(*(most(t) for t in self._parts()))

    def bound(self) -> torch.Tensor:
        """The bound: the worst case, with the mixed noise capped at its statistical bound."""
        if _none(self.mixed):
            return self.worst
        capped = torch.minimum(self.mixed, NOISE_SIGMAS * self.var.sqrt())
        return self.worst - self.mixed + capped


def summed_along(like: torch.Tensor, dim: int) -> Callable[[torch.Tensor, bool], torch.Tensor]:
    """Adds a part up along ``dim`` (kept), for :meth:`Error.added_up`."""

    def total(t: torch.Tensor, squared: bool) -> torch.Tensor:
        del squared  # unit weights
        if t.dim() == 0:
            return t * like.shape[dim]
        return t.expand(like.shape).sum(dim, keepdim=True)

    return total


def through_dot(
    error: Error, like: torch.Tensor, other_abs: torch.Tensor, other_sq: torch.Tensor, *, left: bool
) -> Error:
    """The error a dot inherits from one operand's: ``x @ B`` (``left``) or ``A @ x``, where
    ``other_abs`` and ``other_sq`` are |B| and B² (or |A| and A²)."""

    def total(t: torch.Tensor, squared: bool) -> torch.Tensor:
        full = t.expand(like.shape)
        other = other_sq if squared else other_abs
        return full @ other if left else other @ full

    return error.added_up(total)


def in_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """The last dim cut into blocks of ``block`` (zero-padded): shape (..., blocks, block)."""
    n = values.shape[-1]
    count = math.ceil(n / block)
    padded = torch.nn.functional.pad(values, (0, count * block - n))
    return padded.reshape(*values.shape[:-1], count, block)
