"""Row softmax with row lengths that are not powers of two (77 = CLIP's token count)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diagnose.probes.triton.cases.api import (
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    next_power_of_2,
    random_tensor,
)
from diagnose.probes.triton.cases.numerics import Bounded, Numerics


@triton.jit  # type: ignore[untyped-decorator]
def _softmax_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    n_cols: tl.tensor,
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Masked lanes load -inf: they must not win the max nor add to the sum.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    shifted = x - tl.max(x, axis=0)
    numerator = tl.exp(shifted)
    denominator = tl.sum(numerator, axis=0)
    tl.store(
        out_ptr + row * stride_out + cols,
        (numerator / denominator).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    # Scale 4: logits spread like attention scores, so the max subtraction matters.
    return {"x": random_tensor((shape["rows"], shape["cols"]), dtype, gen, scale=4.0)}


def _launch(inputs: Tensors, outputs: Tensors) -> None:
    x, out = inputs["x"], outputs["out"]
    _softmax_kernel[(x.shape[0],)](
        x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=next_power_of_2(x.shape[1])
    )


def _reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    x = inputs["x"]
    numerator = num.exp(x - num.shift(x, -1))
    return {"out": numerator / num.sum(numerator, -1)}


CASES = [
    TritonCase(
        name="softmax",
        description="row softmax, one program per row, masked tail lanes load -inf",
        make_inputs=_inputs,
        launch=_launch,
        reference=_reference,
        outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["rows"], shape["cols"]))},
        shapes=({"rows": 5, "cols": 77}, {"rows": 3, "cols": 1000}),
        gpu_shapes=({"rows": 256, "cols": 4097}, {"rows": 1031, "cols": 333}),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
    ),
]
