"""References at the kernel's own precision: the value a correct kernel computes, and how far from
it a correct kernel may land.

A case's reference is written with the operations of :class:`Numerics` (``num.dot``,
``num.round``, ``num.sum``, ``num.exp2``...), and that is how it declares where its kernel rounds:
a ``dot`` rounds its fp32 operands to the precision the kernel's ``tl.dot`` uses on this backend
(TF32 truncated on NVIDIA tensor cores, xf32 on MI300, fp32 in the interpreter), fp16 / bf16 / fp8
operands are taken as stored, and ``round`` rounds an intermediate the kernel casts (the softmax
weights before the second dot of attention) the same way. Each value carries, beside its float64
value, a componentwise bound on the error a correct kernel can add to it (first-order, worst
case): fp32 rounding of every operation, reductions bounded by γ(n) = n·u/(1 − n·u) against the sum
of the absolute terms (|A|·|B| for a dot, not the result), approximate exp2/log2/rsqrt within
:data:`APPROXIMATE_UNITS` units, and one unit in the last place wherever the kernel may round at
another point than the reference (an intermediate whose own value is uncertain, a cast a compiler
may fuse away). What is left between a correct kernel and the reference is accumulation order.

:mod:`diagnose.probes.triton_cases.emulate` runs the same references as a device would (fp32
arithmetic in random orders and block sizes): that is how the bounds are calibrated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Union

import torch

from diagnose.probes.triton_cases.api import CheckEnv

Rounding = Literal["nearest-even", "nearest-away", "truncate"]


@dataclass(frozen=True)
class Format:
    """A floating-point format a kernel holds or multiplies values in."""

    name: str
    #: Explicit mantissa bits: fp32 23, tf32 10, fp16 10, bf16 7.
    mantissa_bits: int
    rounding: Rounding = "nearest-even"
    #: The absolute error floor of a rounding into it: fp16's subnormal spacing, the smallest
    #: normal fp32 (GPUs flush fp32 subnormals to zero).
    min_spacing: float = 0.0
    #: The torch dtype that holds it; None for tf32 / xf32 (fp32 bits with the low ones dropped).
    storage: torch.dtype | None = None
    #: False where the hardware's rounding mode is not documented: the reference rounds to
    #: nearest and the bound allows one unit in the last place for the difference.
    rounding_known: bool = True

    @property
    def ulp(self) -> float:
        """The spacing of values in [1, 2)."""
        return 2.0**-self.mantissa_bits

    @property
    def unit(self) -> float:
        """The largest relative error of one rounding into this format."""
        return self.ulp if self.rounding == "truncate" else self.ulp / 2

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float64) rounded into this format, returned as float64."""
        if self.storage is torch.float64:
            return x
        # Device values reach a narrower format from fp32, so round through fp32 first.
        single = x.to(torch.float32)
        if self.storage is not None:
            return single.to(self.storage).to(torch.float64)
        dropped = 23 - self.mantissa_bits
        bits = single.view(torch.int32)
        half = 1 << (dropped - 1)
        # IEEE floats are sign and magnitude: adding to the bit pattern rounds the magnitude.
        if self.rounding == "nearest-away":
            bits = bits + half
        elif self.rounding == "nearest-even":
            bits = bits + (half - 1) + ((bits >> dropped) & 1)
        bits = bits & ~((1 << dropped) - 1)
        return bits.view(torch.float32).to(torch.float64)


FP64 = Format("fp64", 52, storage=torch.float64)
FP32 = Format("fp32", 23, min_spacing=2.0**-126, storage=torch.float32)
#: NVIDIA tensor cores read fp32 operands as TF32 by ignoring the 13 low mantissa bits (Triton's
#: tl.dot documents that its "tf32" inputs "may be truncated ... without rounding"; the H200's
#: recorded errors match truncation, not rounding).
TF32 = Format("tf32", 10, "truncate", 2.0**-126)
#: ``cvt.rna.tf32.f32``: Triton's tf32x3 splits its operands with it.
TF32_RNA = Format("tf32 (rounded)", 10, "nearest-away", 2.0**-126)
#: MI300's xf32 (and cuBLAS's TF32): 10 bits, rounding mode not documented.
XF32 = Format("xf32", 10, "nearest-even", 2.0**-126, rounding_known=False)
FP16 = Format("fp16", 10, min_spacing=2.0**-24, storage=torch.float16)
BF16 = Format("bf16", 7, min_spacing=2.0**-133, storage=torch.bfloat16)
FP8E4M3 = Format("fp8e4m3", 3, min_spacing=2.0**-9, storage=torch.float8_e4m3fn)
FP8E5M2 = Format("fp8e5m2", 2, min_spacing=2.0**-16, storage=torch.float8_e5m2)

_BY_DTYPE = {
    torch.float64: FP64,
    torch.float32: FP32,
    torch.float16: FP16,
    torch.bfloat16: BF16,
    torch.float8_e4m3fn: FP8E4M3,
    torch.float8_e5m2: FP8E5M2,
}


def format_of(dtype: torch.dtype) -> Format | None:
    """The format of a floating dtype (None for integers and booleans)."""
    return _BY_DTYPE.get(dtype)


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


# --- what a dot multiplies ------------------------------------------------------------------------


@dataclass(frozen=True)
class DotPrecision:
    """What a dot does to its operands on one backend."""

    #: The format fp32 operands are rounded to (None: taken as stored).
    operand: Format | None
    #: Precision recovered by splitting each operand into pieces (Triton's tf32x3, bf16x3, bf16x6).
    pieces: int = 1
    #: The format the pieces after the first are rounded to.
    piece_format: Format | None = None
    #: Relative error the splitting leaves (the dropped cross products, the pieces' rounding).
    residual: float = 0.0
    label: str = "as stored"


def _triton_fp32_precision(env: CheckEnv, requested: str | None) -> DotPrecision:
    if env.mode == "interpreter":
        # The interpreter multiplies in numpy's float32 whatever input_precision asks for.
        return DotPrecision(FP32, label="fp32 (Triton's interpreter)")
    precision = (requested or os.environ.get("TRITON_F32_DEFAULT") or "").lower()
    sm = env.arch.removeprefix("sm_")
    tensor_cores = env.backend == "cuda" and not (sm.isdigit() and int(sm) < 80)
    if env.backend == "hip":
        tensor_cores = env.arch == "gfx942"
    if not precision:
        precision = "tf32" if tensor_cores else "ieee"
    if precision == "ieee" or not tensor_cores:
        return DotPrecision(FP32, label="fp32 (ieee)")
    if precision == "tf32":
        if env.backend == "hip":
            return DotPrecision(XF32, label="xf32 (MI300; rounding mode not documented)")
        return DotPrecision(TF32, label="tf32, truncated (NVIDIA tensor cores)")
    if precision == "tf32x3":
        return DotPrecision(
            TF32_RNA, 2, TF32, residual=2.0 * TF32.ulp**2, label="tf32x3 (3 tf32 products)"
        )
    if precision in ("bf16x3", "bf16x6"):
        pieces = 2 if precision == "bf16x3" else 3
        left = 2.0 * BF16.ulp**pieces
        return DotPrecision(BF16, pieces, BF16, residual=left, label=precision)
    raise ValueError(f"unknown tl.dot input_precision {precision!r}")


def _torch_fp32_precision(env: CheckEnv) -> DotPrecision:
    """fp32 matmuls of torch (and inductor's kernels for them) follow torch's TF32 switches."""
    if env.mode == "device" and (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    ):
        return DotPrecision(XF32, label="tf32 (torch allows TF32 matmuls; rounding not documented)")
    return DotPrecision(FP32, label="fp32")


# --- errors -------------------------------------------------------------------------------------

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

    Noise shared by several elements (a row's mean broadcast over the row) is no longer
    independent and stays in the worst case alone, as do errors with a sign of their own (a
    rounding mode that is not documented).
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

    def shared(self) -> Error:
        """The same error, no longer independent between the elements it will be spread over."""
        return Error(self.worst, _zero(), _zero(), _zero())

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


def _summed(like: torch.Tensor, dim: int) -> Callable[[torch.Tensor, bool], torch.Tensor]:
    """Adds a part up along ``dim`` (kept), for :meth:`Error.added_up`."""

    def total(t: torch.Tensor, squared: bool) -> torch.Tensor:
        del squared  # unit weights
        if t.dim() == 0:
            return t * like.shape[dim]
        return t.expand(like.shape).sum(dim, keepdim=True)

    return total


def _through(
    error: Error, like: torch.Tensor, other_abs: torch.Tensor, other_sq: torch.Tensor, *, left: bool
) -> Error:
    """The error a dot inherits from one operand's: ``x @ B`` (``left``) or ``A @ x``, where
    ``other_abs`` and ``other_sq`` are |B| and B² (or |A| and A²)."""

    def total(t: torch.Tensor, squared: bool) -> torch.Tensor:
        full = t.expand(like.shape)
        other = other_sq if squared else other_abs
        return full @ other if left else other @ full

    return error.added_up(total)


# --- values with a bound ------------------------------------------------------------------------

Operand = Union["Bounded", float, int]


class Bounded:
    """A reference value (float64) and how far a correct kernel's value may be from it.

    ``fmt`` is the format the kernel holds the value in: an input's dtype, fp32 for what it
    computes, or what ``Numerics.round`` rounded it to. Arithmetic propagates the error to first
    order and adds the rounding of the operation.
    """

    __slots__ = ("error", "fmt", "num", "value")

    def __init__(
        self, value: torch.Tensor, error: Error, fmt: Format | None, num: Numerics
    ) -> None:
        self.value = value
        self.error = error
        self.fmt = fmt
        self.num = num

    @property
    def shape(self) -> torch.Size:
        return self.value.shape

    @property
    def exact(self) -> bool:
        return self.error.exact

    @property
    def err(self) -> torch.Tensor:
        """The bound on each element's error (broadcastable to the value)."""
        return self.error.bound()

    def __repr__(self) -> str:
        return f"Bounded(shape={tuple(self.shape)}, fmt={self.fmt.name if self.fmt else None})"

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    # Shape operations move values, and their errors, without arithmetic.
    def _moved(self, op: str, *args: object) -> Bounded:
        value = getattr(self.value, op)(*args)
        return Bounded(value, self.error.moved(op, self.value, *args), self.fmt, self.num)

    def __getitem__(self, index: object) -> Bounded:
        return self._moved("__getitem__", index)

    def reshape(self, *shape: int) -> Bounded:
        return self._moved("reshape", *shape)

    def transpose(self, a: int, b: int) -> Bounded:
        return self._moved("transpose", a, b)

    def unsqueeze(self, dim: int) -> Bounded:
        return self._moved("unsqueeze", dim)

    @property
    def mT(self) -> Bounded:
        return self.transpose(-2, -1)

    def chunk(self, chunks: int, dim: int = -1) -> list[Bounded]:
        size = self.shape[dim] // chunks
        return [self._moved("narrow", dim, i * size, size) for i in range(chunks)]

    def spread(self, shape: torch.Size) -> Error:
        """This value's error, as seen by elements of ``shape`` it is broadcast over."""
        return self.error

    # Arithmetic in the kernel's compute format.
    def __add__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value + b.value
        return self.num.pointwise(value, self.spread(value.shape) + b.spread(value.shape))

    __radd__ = __add__

    def __sub__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value - b.value
        return self.num.pointwise(value, self.spread(value.shape) + b.spread(value.shape))

    def __rsub__(self, other: Operand) -> Bounded:
        return self.num.lift(other) - self

    def __mul__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value * b.value
        error = self.spread(value.shape).scaled(b.value) + b.spread(value.shape).scaled(self.value)
        if not (self.exact or b.exact):
            error = error.plus_worst(self.error.worst * b.error.worst)  # second order
        return self.num.pointwise(value, error)

    __rmul__ = __mul__

    def __truediv__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value / b.value
        error = (self.spread(value.shape) + b.spread(value.shape).scaled(value)).scaled(
            1.0 / b.value
        )
        # Triton's fp32 division is div.full.f32, within 2 ulps, not correctly rounded.
        return self.num.pointwise(value, error, approximate=APPROXIMATE_UNITS)

    def __rtruediv__(self, other: Operand) -> Bounded:
        return self.num.lift(other) / self

    def __neg__(self) -> Bounded:
        return Bounded(-self.value, self.error, self.fmt, self.num)

    def square(self) -> Bounded:
        return self * self


# --- the operations a reference is written with -------------------------------------------------


class Numerics:
    """The reference side: float64 values and first-order error bounds.

    ``kind`` is the case's kind: a Triton kernel's fp32 dots follow tl.dot's default for the
    backend, a torch.compile'd function's follow torch's TF32 switches. ``steps`` lists, in order,
    what the reference declared about rounding (the verdict quotes it).
    """

    def __init__(self, env: CheckEnv, kind: str = "triton") -> None:
        self.env = env
        self.kind = kind
        self.compute = FP32
        self.steps: list[str] = []

    # -- values
    def input(self, tensor: torch.Tensor) -> Bounded:
        """An input as the kernel reads it: exact, in its own dtype's format."""
        fmt = format_of(tensor.dtype)
        value = tensor.detach().to("cpu", torch.float64) if fmt is not None else tensor.cpu()
        return Bounded(value, Error.none(), fmt, self)

    def constant(self, value: float) -> Bounded:
        """A scalar the kernel receives or writes as fp32 (the reference uses that same fp32)."""
        rounded = torch.tensor(value, dtype=torch.float32).to(torch.float64)
        return Bounded(rounded, Error.none(), FP32, self)

    def lift(self, other: Operand) -> Bounded:
        if isinstance(other, Bounded):
            return other
        return self.constant(float(other))

    def declare(self, step: str) -> None:
        if step not in self.steps:
            self.steps.append(step)

    # -- hooks the emulated device overrides
    def pointwise(self, value: torch.Tensor, error: Error, *, approximate: float = 0.0) -> Bounded:
        """One fp32 operation's result: its rounding (and an approximate function's error,
        ``approximate`` units of it) added to the propagated error."""
        unit = self.compute.unit
        own = (ROUNDING_ALLOWANCE + approximate * unit) * value.abs() + self.compute.min_spacing
        return Bounded(value, error.plus_noise(own), self.compute, self)

    def reduce_sum(self, x: Bounded, dim: int, block: int | None = None) -> Bounded:
        n = x.shape[dim]
        value = x.value.sum(dim, keepdim=True)
        error = x.error.added_up(_summed(x.value, dim))
        if block is None or block >= n:
            magnitude = x.value.abs().sum(dim, keepdim=True)
            l2 = x.value.square().sum(dim, keepdim=True).sqrt()
            own = accumulation_error(n, ROUNDING_ALLOWANCE, magnitude, value, l2)
        else:
            # Each block's sum, then the sum of the block sums.
            blocks = _blocked(x.value.movedim(dim, -1), block)
            sums = blocks.sum(-1)
            within = accumulation_error(
                block,
                ROUNDING_ALLOWANCE,
                blocks.abs().sum(-1),
                sums,
                blocks.square().sum(-1).sqrt(),
            ).sum(-1, keepdim=True)
            across = accumulation_error(
                sums.shape[-1],
                ROUNDING_ALLOWANCE,
                sums.abs().sum(-1, keepdim=True),
                sums.sum(-1, keepdim=True),
                sums.square().sum(-1, keepdim=True).sqrt(),
            )
            own = (within + across).movedim(-1, dim)
        return Bounded(value, error.plus_noise(own + self.compute.min_spacing), self.compute, self)

    def multiply(self, a: Bounded, b: Bounded, precision: DotPrecision) -> Bounded:
        (a_parts, a_error), (b_parts, b_error) = (
            self._operand(a, precision),
            self._operand(b, precision),
        )
        value = _cross_products(a_parts, b_parts)
        a_abs, b_abs = _total_abs(a_parts), _total_abs(b_parts)
        magnitude = a_abs @ b_abs
        l2 = (a_abs.square() @ b_abs.square()).sqrt()
        k = a.shape[-1] * len(a_parts)
        own = accumulation_error(k, ROUNDING_ALLOWANCE, magnitude, value, l2)
        if precision.residual:
            own = own + precision.residual * magnitude
        error = Error.none().plus_noise(own + self.compute.min_spacing)
        if not a_error.exact:
            error = error + _through(a_error, a.value, b_abs, b_abs.square(), left=True)
        if not b_error.exact:
            error = error + _through(b_error, b.value, a_abs, a_abs.square(), left=False)
        return Bounded(value, error, self.compute, self)

    def rounded(self, x: Bounded, fmt: Format, optional: bool) -> Bounded:
        value = x.value if optional else fmt.round(x.value)
        if x.exact and not optional:
            # A value the kernel holds exactly, rounded by the same rule: the same number.
            return Bounded(value, x.error, fmt, self)
        # The kernel's value before the rounding is uncertain (or it may not round here at all):
        # the two roundings can land one unit in the last place apart.
        error = x.error.plus_noise(fmt.ulp * value.abs() + fmt.min_spacing)
        return Bounded(value, error, fmt, self)

    def softmax_dot(self, scores: Bounded, v: Bounded, p_format: Format) -> tuple[Bounded, Bounded]:
        """Rows of softmax(scores)·v as flash attention computes them; see :meth:`attend`."""
        m = self.shift(scores, -1)
        p = self.exp2(scores - m)
        l_sum = self.sum(p, -1)
        weights = self.round(p, p_format)
        out = self.multiply(weights, v, self._precision(weights))
        out = out / l_sum
        # A kernel that walks the keys in blocks rescales its sums by exp2(m_old − m_new) once
        # per block; the running max also sets the scale at which each weight is rounded, which
        # the rounding's one-unit allowance above already covers.
        blocks = math.ceil(scores.shape[-1] / MIN_KEY_BLOCK)
        rescale = gamma(blocks, (APPROXIMATE_UNITS + 2) * self.compute.unit)
        # Σ p·|v| / Σ p is at most the largest |v| of the column.
        spread = v.value.abs().amax(-2, keepdim=True)
        out = Bounded(out.value, out.error.plus_worst(rescale * spread), out.fmt, self)
        l_sum = Bounded(l_sum.value, l_sum.error.plus_worst(rescale * l_sum.value), l_sum.fmt, self)
        log_sum = m + self.log2(l_sum)
        return out, log_sum

    # -- operations (reference and emulation share these)
    def exp(self, x: Bounded) -> Bounded:
        """tl.exp: exp2 of x·log2(e), so the product's rounding scales with |x|."""
        value = torch.exp(x.value)
        argument = self.compute.unit * x.value.abs() * value
        error = x.error.scaled(value).plus_worst(argument)
        return self.pointwise(value, error, approximate=APPROXIMATE_UNITS)

    def exp2(self, x: Bounded) -> Bounded:
        value = torch.exp2(x.value)
        return self.pointwise(
            value, x.error.scaled(value * math.log(2)), approximate=APPROXIMATE_UNITS
        )

    def log2(self, x: Bounded) -> Bounded:
        value = torch.log2(x.value)
        error = x.error.scaled(1.0 / (x.value.abs() * math.log(2)))
        absolute = APPROXIMATE_UNITS * self.compute.unit  # lg2.approx: absolute near 1
        return self.pointwise(value, error.plus_worst(absolute), approximate=APPROXIMATE_UNITS)

    def erf(self, x: Bounded) -> Bounded:
        value = torch.erf(x.value)
        slope = 2.0 / math.sqrt(math.pi) * torch.exp(-x.value.square())
        absolute = APPROXIMATE_UNITS * self.compute.unit
        return self.pointwise(
            value, x.error.scaled(slope).plus_worst(absolute), approximate=APPROXIMATE_UNITS
        )

    def sqrt(self, x: Bounded) -> Bounded:
        value = torch.sqrt(x.value)
        return self.pointwise(value, x.error.scaled(0.5 / value), approximate=APPROXIMATE_UNITS)

    def rsqrt(self, x: Bounded) -> Bounded:
        value = torch.rsqrt(x.value)
        return self.pointwise(
            value, x.error.scaled(0.5 * value / x.value.abs()), approximate=APPROXIMATE_UNITS
        )

    def sigmoid_mul(self, x: Bounded) -> Bounded:
        """x / (1 + exp(−x)): SiLU as kernels write it."""
        return x / (1.0 + self.exp(-x))

    def maximum(self, a: Bounded, b: Operand) -> Bounded:
        other = self.lift(b)
        value = torch.maximum(a.value, other.value)
        sa, sb = a.spread(value.shape), other.spread(value.shape)
        error = Error(*(torch.maximum(x, y) for x, y in zip(sa._parts(), sb._parts(), strict=True)))
        return Bounded(value, error, self.compute, self)

    def amax(self, x: Bounded, dim: int) -> Bounded:
        """The max along ``dim`` (kept): exact, so it is off by at most the largest error."""
        value = x.value.amax(dim, keepdim=True)
        return Bounded(value, x.error.largest(x.value, dim), x.fmt, self)

    def shift(self, x: Bounded, dim: int) -> Bounded:
        """The max along ``dim`` (kept), subtracted before an exp to keep it in range. A softmax
        does not depend on the shift (numerator and denominator scale alike), so whatever max the
        kernel finds, the error it carries is not the result's: it is taken as exact."""
        return Bounded(x.value.amax(dim, keepdim=True), Error.none(), x.fmt, self)

    def sum(self, x: Bounded, dim: int, *, block: int | None = None) -> Bounded:
        """The sum along ``dim`` (kept), in any order and blocking. ``block``: the kernel sums
        blocks of that many elements first (a tile) and then adds the blocks' sums in any order
        (``tl.atomic_add`` across programs): far fewer additions at the total's own size."""
        return self.reduce_sum(x, dim, block)

    def mean(self, x: Bounded, dim: int) -> Bounded:
        return self.sum(x, dim) / float(x.shape[dim])

    def dot(
        self,
        a: Bounded,
        b: Bounded,
        *,
        input_precision: str | None = None,
        name: str = "dot",
    ) -> Bounded:
        """``a @ b`` as tl.dot (or a torch matmul) computes it: operands rounded to the precision
        the backend multiplies them in, fp32 accumulation in any order."""
        precision = self._precision(a, input_precision)
        self.declare(f"{name}: operands {precision.label}, fp32 accumulate (K={a.shape[-1]})")
        return self.multiply(a, b, precision)

    def round(
        self, x: Bounded, fmt: Format | torch.dtype, *, name: str = "", optional: bool = False
    ) -> Bounded:
        """The kernel casts ``x`` to ``fmt`` (a dtype or Format). ``optional``: a compiler may
        fuse the cast away (torch.compile between ops), so it may or may not happen."""
        target = fmt if isinstance(fmt, Format) else format_of(fmt)
        if target is None:
            raise ValueError(f"cannot round to {fmt}")
        if name:
            how = "may round" if optional else "rounded"
            self.declare(f"{name}: {how} to {target.name}")
        return self.rounded(x, target, optional)

    def attend(
        self, q: Bounded, k: Bounded, v: Bounded, scale: float, *, name: str = "attention"
    ) -> tuple[Bounded, Bounded]:
        """softmax(q·kᵀ·scale)·v and the natural log-sum-exp of each row, as flash attention
        computes them: scores in log2 units (exp2), the weights cast to v's format before the
        second dot, the division by their sum at the end."""
        scores = self.dot(q, k.mT, name=f"{name} q·kᵀ") * (scale / math.log(2))
        p_format = v.fmt or self.compute
        self.declare(f"{name} softmax weights: rounded to {p_format.name} before p·v")
        self.declare(f"{name} p·v: operands {self._precision(v).label}, fp32 accumulate")
        out, log2_sum = self.softmax_dot(scores, v, p_format)
        return out, log2_sum[..., 0] * math.log(2)

    def layer_norm(
        self, x: Bounded, weight: Bounded | None, bias: Bounded | None, eps: float
    ) -> tuple[Bounded, Bounded, Bounded]:
        """(y, mean, rstd) of a two-pass LayerNorm over the last dim, in fp32."""
        mean = self.mean(x, -1)
        centered = x - mean
        # 1/sqrt bounds rsqrt too (each within a few ulps): kernels use either.
        rstd = 1.0 / self.sqrt(self.mean(centered.square(), -1) + eps)
        y = centered * rstd
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y, mean, rstd

    # -- helpers
    def _precision(self, a: Bounded, requested: str | None = None) -> DotPrecision:
        if a.fmt is not None and a.fmt.mantissa_bits < FP32.mantissa_bits:
            return DotPrecision(None, label=f"{a.fmt.name} as stored")
        if a.fmt is FP64:
            return DotPrecision(None, label="fp64")
        if self.kind == "inductor":
            return _torch_fp32_precision(self.env)
        return _triton_fp32_precision(self.env, requested)

    def _operand(self, x: Bounded, precision: DotPrecision) -> tuple[list[torch.Tensor], Error]:
        """The pieces the dot multiplies and their bound."""
        fmt = precision.operand
        if fmt is None:
            return [x.value], x.error
        first = fmt.round(x.value)
        parts = [first]
        left = x.value - first
        for _ in range(precision.pieces - 1):
            piece_format = precision.piece_format or fmt
            piece = piece_format.round(left)
            parts.append(piece)
            left = left - piece
        error = x.error
        if not x.exact:
            # The value before rounding is uncertain: it may round to the next value.
            error = error.plus_noise(fmt.ulp * first.abs())
        if not fmt.rounding_known:
            # Truncated or rounded: up to one ulp apart, the same way for every element.
            error = error.plus_worst(fmt.ulp * first.abs())
        return parts, error


def _blocked(values: torch.Tensor, block: int) -> torch.Tensor:
    """The last dim cut into blocks of ``block`` (zero-padded): shape (..., blocks, block)."""
    n = values.shape[-1]
    count = math.ceil(n / block)
    padded = torch.nn.functional.pad(values, (0, count * block - n))
    return padded.reshape(*values.shape[:-1], count, block)


def _total_abs(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].abs()
    for part in parts[1:]:
        total = total + part.abs()
    return total


def _cross_products(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ a_i·b_j over i + j < pieces: one product as stored, three for the x3 splits."""
    pieces = len(a)
    total: torch.Tensor | None = None
    for i in range(pieces):
        for j in range(pieces - i):
            term = a[i] @ b[j]
            total = term if total is None else total + term
    assert total is not None
    return total


__all__ = [
    "APPROXIMATE_UNITS",
    "BF16",
    "FP16",
    "FP32",
    "FP64",
    "TF32",
    "XF32",
    "Bounded",
    "DotPrecision",
    "Format",
    "Numerics",
    "format_of",
    "gamma",
]
