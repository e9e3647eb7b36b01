"""A reduction through atomics: column sums and a grand total, added block by block.

Split-K matmuls, gradient reductions and loss sums accumulate this way. The output buffers start
at zero (an accumulator must); a block that never adds still shows, since no input is zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diagnose.probes.triton.cases.api import (
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    cdiv,
    random_tensor,
)
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

_BLOCK_M = 16
_BLOCK_N = 32


@triton.jit  # type: ignore[untyped-decorator]
def _column_sum_kernel(
    x_ptr: tl.tensor,
    col_sum_ptr: tl.tensor,
    total_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    stride: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    tl.atomic_add(col_sum_ptr + cols, tl.sum(x, axis=0), mask=cols < N)
    tl.atomic_add(total_ptr, tl.sum(tl.sum(x, axis=1), axis=0))


def _inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    # An offset keeps the sums away from zero, where relative errors mean little.
    return {"x": random_tensor((shape["m"], shape["n"]), dtype, gen, offset=0.5)}


def _launch(inputs: Tensors, outputs: Tensors) -> None:
    x = inputs["x"]
    m, n = x.shape
    grid = (cdiv(m, _BLOCK_M), cdiv(n, _BLOCK_N))
    _column_sum_kernel[grid](
        x, outputs["col_sum"], outputs["total"], m, n, x.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )  # fmt: skip


def _reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    # Each program sums its tile, then adds the sums with atomics, in whatever order they land.
    x = inputs["x"]
    total = num.sum(x.reshape(1, -1), -1, block=_BLOCK_M * _BLOCK_N).reshape(1)
    return {"col_sum": num.sum(x, 0, block=_BLOCK_M).reshape(-1), "total": total}


CASES = [
    TritonCase(
        name="atomic_reduction",
        description="column sums and a total accumulated with tl.atomic_add across blocks",
        make_inputs=_inputs,
        launch=_launch,
        reference=_reference,
        outputs_for=lambda shape, dtype: {
            "col_sum": OutputSpec((shape["n"],), torch.float32, fill="zero"),
            "total": OutputSpec((1,), torch.float32, fill="zero"),
        },
        shapes=({"m": 100, "n": 37}, {"m": 65, "n": 130}),
        gpu_shapes=({"m": 4099, "n": 1000},),
        dtypes=(torch.float32, torch.float16),
    ),
]
