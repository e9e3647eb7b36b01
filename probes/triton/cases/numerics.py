"""References at the kernel's own precision: the value a correct kernel computes, and how far from
it a correct kernel may land.

A case's reference is written with the operations of :class:`Numerics` (``num.dot``,
``num.round``, ``num.sum``, ``num.exp2``...), and that is how it declares where its kernel rounds:
a ``dot`` rounds its fp32 operands to the precision the kernel's ``tl.dot`` uses on this backend
(:mod:`~.formats`: TF32 truncated on NVIDIA tensor cores, xf32 on MI300, fp32 in the interpreter),
fp16 / bf16 / fp8 operands are taken as stored, and ``round`` rounds an intermediate the kernel
casts (the softmax weights before the second dot of attention) the same way. Each value carries,
beside its float64 value, how far a correct kernel's may be from it (:mod:`~.bounds`). What is
left between a correct kernel and the reference is the order of its roundings.

:mod:`diagnose.probes.triton.cases.emulate` runs the same references as a device would (fp32
arithmetic in random orders and block sizes): that is how the bounds are calibrated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch

from diagnose.probes.triton.cases.api import CheckEnv
from diagnose.probes.triton.cases.bounds import (
    APPROXIMATE_UNITS,
    MIN_KEY_BLOCK,
    ROUNDING_ALLOWANCE,
    Error,
    accumulation_error,
    gamma,
    in_blocks,
    summed_along,
    through_dot,
)
from diagnose.probes.triton.cases.formats import (
    FP32,
    FP64,
    DotPrecision,
    Format,
    format_of,
    torch_fp32_precision,
    triton_fp32_precision,
)

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

    # Arithmetic in the kernel's compute format.
    def __add__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value + b.value
        return self.num.pointwise(value, self.error + b.error)

    __radd__ = __add__

    def __sub__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value - b.value
        return self.num.pointwise(value, self.error + b.error)

    def __rsub__(self, other: Operand) -> Bounded:
        return self.num.lift(other) - self

    def __mul__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value * b.value
        error = self.error.scaled(b.value) + b.error.scaled(self.value)
        if not (self.exact or b.exact):
            error = error.plus_worst(self.error.worst * b.error.worst)  # second order
        return self.num.pointwise(value, error)

    __rmul__ = __mul__

    def __truediv__(self, other: Operand) -> Bounded:
        b = self.num.lift(other)
        value = self.value / b.value
        error = (self.error + b.error.scaled(value)).scaled(1.0 / b.value)
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
        error = x.error.added_up(summed_along(x.value, dim))
        if block is None or block >= n:
            magnitude = x.value.abs().sum(dim, keepdim=True)
            l2 = x.value.square().sum(dim, keepdim=True).sqrt()
            own = accumulation_error(n, ROUNDING_ALLOWANCE, magnitude, value, l2)
        else:
            # Each block's sum, then the sum of the block sums.
            blocks = in_blocks(x.value.movedim(dim, -1), block)
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
        value = cross_products(a_parts, b_parts)
        a_abs, b_abs = _total_abs(a_parts), _total_abs(b_parts)
        magnitude = a_abs @ b_abs
        l2 = (a_abs.square() @ b_abs.square()).sqrt()
        k = a.shape[-1] * len(a_parts)
        own = accumulation_error(k, ROUNDING_ALLOWANCE, magnitude, value, l2)
        if precision.residual:
            own = own + precision.residual * magnitude
        error = Error.none().plus_noise(own + self.compute.min_spacing)
        if not a_error.exact:
            error = error + through_dot(a_error, a.value, b_abs, b_abs.square(), left=True)
        if not b_error.exact:
            error = error + through_dot(b_error, b.value, a_abs, a_abs.square(), left=False)
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
        sa, sb = a.error, other.error
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
            return torch_fp32_precision(self.env)
        return triton_fp32_precision(self.env, requested)

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


def _total_abs(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].abs()
    for part in parts[1:]:
        total = total + part.abs()
    return total


def cross_products(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ a_i·b_j over i + j < pieces: one product as stored, three for the x3 splits."""
    pieces = len(a)
    total: torch.Tensor | None = None
    for i in range(pieces):
        for j in range(pieces - i):
            term = a[i] @ b[j]
            total = term if total is None else total + term
    assert total is not None
    return total


__all__ = ["Bounded", "Numerics", "Operand", "cross_products"]
