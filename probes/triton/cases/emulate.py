"""A correct device emulated on the CPU: a case's reference run the way a GPU kernel would run it.

:class:`EmulatedDevice` runs the same reference code as :class:`~.numerics.Numerics`, but each
operation's result is rounded to fp32 as the kernel's would be, approximate functions are off by up
to two ulps, reductions and dots accumulate in fp32 in a random order with a random block size
(per-lane sequential sums then a tree, as ``acc += x`` loops and ``tl.sum`` do; dots block by block
as tensor cores do, their accumulators rounding or truncating), flash attention walks its keys in
random-sized blocks with a running max, casts a compiler may fuse away are kept or dropped at
random, and outputs are stored rounded to nearest or truncated. These are the ways correct kernels
differ from one another; the judge's bounds must hold for all of them (the calibration benchmark
and the tests check that they do on every corpus case, and that planted bugs fall far outside).
"""

from __future__ import annotations

import math

import torch

from diagnose.probes.triton.cases.api import CheckEnv, Shape, Tensors, TritonCase
from diagnose.probes.triton.cases.bounds import Error, in_blocks
from diagnose.probes.triton.cases.formats import FP32, DotPrecision, Format
from diagnose.probes.triton.cases.judge import OutputJudgement, judge_output
from diagnose.probes.triton.cases.numerics import Bounded, Numerics, cross_products

#: The emulated approximate functions' error, in fp32 units (within the judge's allowance).
EMULATED_APPROXIMATE_UNITS = 4.0
BLOCK_SIZES = (16, 32, 64, 128)
LANES = (1, 4, 16, 32, 128, 256, 1024)
#: The most values one lane adds up in sequence (a kernel's loop over its row in blocks).
MAX_SEQUENTIAL = 256


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def _fp32_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp32 toward zero, as tensor cores' accumulators add."""
    single = x.to(torch.float32)
    over = single.to(torch.float64).abs() > x.abs()
    single = torch.where(over, torch.nextafter(single, torch.zeros_like(single)), single)
    return single.to(torch.float64)


class EmulatedDevice(Numerics):
    """Numerics whose values are what one correct kernel, drawn at random, would compute."""

    def __init__(self, env: CheckEnv, kind: str, generator: torch.Generator) -> None:
        super().__init__(env, kind)
        self.generator = generator
        #: Where the hardware's rounding mode is not documented, this device picks one.
        self.undocumented_rounding = "truncate" if self.coin() else "nearest-even"
        #: Dots accumulate rounding to nearest, or toward zero as tensor cores do.
        self.dot_add = _fp32_toward_zero if self.coin() else _fp32

    def coin(self) -> bool:
        return bool(torch.randint(0, 2, (), generator=self.generator))

    def _choice(self, options: tuple[int, ...], limit: int, least: int = 1) -> int:
        allowed = [o for o in options if least <= o <= max(limit, options[0])] or [options[-1]]
        return allowed[int(torch.randint(0, len(allowed), (), generator=self.generator))]

    def _value(self, value: torch.Tensor, fmt: Format | None = FP32) -> Bounded:
        return Bounded(value, Error.none(), fmt, self)

    def _round_as_device(self, fmt: Format, x: torch.Tensor) -> torch.Tensor:
        if not fmt.rounding_known:
            fmt = Format(fmt.name, fmt.mantissa_bits, self.undocumented_rounding)  # type: ignore[arg-type]
        return fmt.round(x)

    # -- the hooks
    def pointwise(self, value: torch.Tensor, error: Error, *, approximate: float = 0.0) -> Bounded:
        if approximate:
            unit = EMULATED_APPROXIMATE_UNITS * FP32.unit
            noise = torch.rand(value.shape, generator=self.generator, dtype=torch.float64)
            value = value * (1.0 + (2.0 * noise - 1.0) * unit)
        return self._value(_fp32(value))

    def reduce_sum(self, x: Bounded, dim: int, block: int | None = None) -> Bounded:
        values = x.value.movedim(dim, -1)
        n = values.shape[-1]
        order = torch.randperm(n, generator=self.generator)
        values = values[..., order]
        if block is not None and block < n:
            # Each block summed on its own (a tile), then the sums added one by one in a random
            # order, as atomics land.
            sums = self._lanes_then_tree(in_blocks(values, block))
            total = torch.zeros(sums.shape[:-1], dtype=torch.float64)
            for index in torch.randperm(sums.shape[-1], generator=self.generator).tolist():
                total = _fp32(total + sums[..., index])
            return self._value(total.unsqueeze(-1).movedim(-1, dim))
        return self._value(self._lanes_then_tree(values).unsqueeze(-1).movedim(-1, dim))

    def _lanes_then_tree(self, values: torch.Tensor) -> torch.Tensor:
        """Sums of the last dim: lanes that each add their share in sequence, then a tree over
        the lanes (as ``acc += x`` loops and ``tl.sum`` do)."""
        n = values.shape[-1]
        lanes = self._choice(LANES, n, least=math.ceil(n / MAX_SEQUENTIAL))
        padded = math.ceil(n / lanes) * lanes
        values = torch.nn.functional.pad(values, (0, padded - n))
        values = values.reshape(*values.shape[:-1], padded // lanes, lanes)
        acc = torch.zeros((*values.shape[:-2], lanes), dtype=torch.float64)
        for step in range(values.shape[-2]):
            acc = _fp32(acc + values[..., step, :])
        while acc.shape[-1] > 1:
            half = acc.shape[-1] // 2
            acc = _fp32(acc[..., :half] + acc[..., half:])
        return acc[..., 0]

    def multiply(self, a: Bounded, b: Bounded, precision: DotPrecision) -> Bounded:
        a_parts, b_parts = self._parts(a, precision), self._parts(b, precision)
        k = a.shape[-1]
        order = torch.randperm(k, generator=self.generator)
        block = self._choice(BLOCK_SIZES, k)
        acc: torch.Tensor | None = None
        for start in range(0, k, block):
            index = order[start : start + block]
            partial = self.dot_add(
                cross_products(
                    [p[..., index] for p in a_parts], [p[..., index, :] for p in b_parts]
                )
            )
            acc = partial if acc is None else self.dot_add(acc + partial)
        assert acc is not None
        return self._value(acc)

    def rounded(self, x: Bounded, fmt: Format, optional: bool) -> Bounded:
        if optional and self.coin():
            return self._value(x.value, x.fmt)
        return self._value(self._round_as_device(fmt, x.value), fmt)

    def softmax_dot(self, scores: Bounded, v: Bounded, p_format: Format) -> tuple[Bounded, Bounded]:
        """Flash attention's loop: a running max and sum, the weights of each key block rounded
        relative to the max so far, the accumulator rescaled whenever the max grows."""
        s = scores.value
        keys = s.shape[-1]
        block = self._choice(BLOCK_SIZES, keys)
        rows = s.shape[:-1]
        m = torch.full((*rows, 1), -math.inf, dtype=torch.float64)
        l_sum = torch.zeros((*rows, 1), dtype=torch.float64)
        acc = torch.zeros((*rows, v.shape[-1]), dtype=torch.float64)
        precision = self._precision(self._value(s, p_format))
        for start in range(0, keys, block):
            s_block = s[..., start : start + block]
            m_new = torch.maximum(m, s_block.amax(-1, keepdim=True))
            alpha = self.exp2(self._value(m - m_new)).value
            p = self.exp2(self._value(s_block - m_new)).value
            l_sum = _fp32(_fp32(l_sum * alpha) + self.reduce_sum(self._value(p), -1).value)
            weights = self._value(self._round_as_device(p_format, p), p_format)
            v_block = self._value(v.value[..., start : start + block, :], v.fmt)
            acc = _fp32(_fp32(acc * alpha) + self.multiply(weights, v_block, precision).value)
            m = m_new
        out = self._value(_fp32(acc / l_sum))
        log_sum = self._value(m) + self.log2(self._value(l_sum))
        return out, log_sum

    def _parts(self, x: Bounded, precision: DotPrecision) -> list[torch.Tensor]:
        fmt = precision.operand
        if fmt is None:
            return [x.value]
        first = self._round_as_device(fmt, x.value)
        parts, left = [first], x.value - first
        for _ in range(precision.pieces - 1):
            piece = self._round_as_device(precision.piece_format or fmt, left)
            parts.append(piece)
            left = left - piece
        return parts


def emulated_outputs(
    case: TritonCase,
    shape: Shape,
    dtype: torch.dtype,
    inputs: Tensors,
    env: CheckEnv,
    generator: torch.Generator,
    *,
    truncating_stores: bool | None = None,
) -> dict[str, torch.Tensor]:
    """What one correct kernel, drawn with ``generator``, would return for ``inputs``: the case's
    reference run on an :class:`EmulatedDevice`, stored in the outputs' dtypes (rounded to
    nearest or truncated: ``truncating_stores``, or at random when None)."""
    from diagnose.probes.triton.cases.reference import reference_of

    device = EmulatedDevice(env, case.kind, generator)
    values, _ = reference_of(case, inputs, dtype, env, device)
    specs = case.outputs_for(shape, dtype) if case.outputs_for else {}
    out_dtypes = {name: spec.dtype or dtype for name, spec in specs.items()}
    # Stores round to nearest, or toward zero (fp_downcast_rounding="rtz"; the interpreter's
    # bfloat16).
    if truncating_stores is None:
        truncating_stores = device.coin()
    store = _store_toward_zero if truncating_stores else _store_to_nearest
    return {
        name: store(value.value, out_dtypes.get(name, dtype))
        if value.fmt is not None
        else value.value
        for name, value in values.items()
    }


def _store_to_nearest(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.to(torch.float32).to(dtype)


def _store_toward_zero(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    single = value.to(torch.float32)
    stored = single.to(dtype)
    over = stored.to(torch.float32).abs() > single.abs()
    return torch.where(over, torch.nextafter(stored, torch.zeros_like(stored)), stored)


def judge_emulated(
    case: TritonCase, shape: Shape, dtype: torch.dtype, env: CheckEnv, run_seed: int
) -> list[OutputJudgement]:
    """Every output of one check of ``case`` (the inputs of ``run_seed``, as the harness draws
    them) computed by an emulated correct device and judged against the reference."""
    from diagnose.probes.triton.cases.check import check_seed
    from diagnose.probes.triton.cases.reference import reference_of

    seed = check_seed(run_seed, case.name, shape, dtype)
    inputs = case.make_inputs(shape, dtype, torch.Generator().manual_seed(seed))
    expected, _ = reference_of(case, inputs, dtype, env)
    # Another stream than the inputs': which correct kernel this is.
    device = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
    got = emulated_outputs(case, shape, dtype, inputs, env, device)
    return [judge_output(name, got[name], want) for name, want in expected.items()]
