"""Element-wise kernels: axpy, SiLU-mul (SwiGLU) and GEGLU (diffusers' feed-forward gate).

Loads upcast to float32 before any arithmetic, as production kernels do; it also keeps the checks
valid in Triton's interpreter, which does no arithmetic on bfloat16 values.
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

_HALF_AND_FULL = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 256


@triton.jit  # type: ignore[untyped-decorator]
def _axpy_kernel(
    x_ptr: tl.tensor,
    y_ptr: tl.tensor,
    out_ptr: tl.tensor,
    alpha: tl.tensor,
    n: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


def _axpy_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    n = shape["n"]
    return {
        "x": random_tensor((n,), dtype, gen),
        "y": random_tensor((n,), dtype, gen),
        "alpha": torch.tensor(0.75),
    }


def _axpy_launch(inputs: Tensors, outputs: Tensors) -> None:
    n = inputs["x"].numel()
    alpha = float(inputs["alpha"])
    _axpy_kernel[(cdiv(n, _BLOCK),)](
        inputs["x"], inputs["y"], outputs["out"], alpha, n, BLOCK=_BLOCK
    )


def _axpy_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    # alpha reaches the kernel as an fp32 scalar; x and y are upcast exactly.
    return {"out": inputs["alpha"] * inputs["x"] + inputs["y"]}


@triton.jit  # type: ignore[untyped-decorator]
def _silu_mul_kernel(
    a_ptr: tl.tensor, b_ptr: tl.tensor, out_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr
) -> None:
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask).to(tl.float32)
    silu = a / (1.0 + tl.exp(-a))
    tl.store(out_ptr + offsets, (silu * b).to(out_ptr.dtype.element_ty), mask=mask)


def _silu_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    size = (shape["rows"], shape["cols"])
    return {"a": random_tensor(size, dtype, gen, scale=3.0), "b": random_tensor(size, dtype, gen)}


def _silu_launch(inputs: Tensors, outputs: Tensors) -> None:
    n = inputs["a"].numel()
    _silu_mul_kernel[(cdiv(n, _BLOCK),)](inputs["a"], inputs["b"], outputs["out"], n, BLOCK=_BLOCK)


def _silu_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    return {"out": num.sigmoid_mul(inputs["a"]) * inputs["b"]}


@triton.jit  # type: ignore[untyped-decorator]
def _geglu_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    hidden: tl.tensor,
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    # One row per program along axis 0, column blocks along axis 1. The input row holds
    # [value | gate] halves (diffusers' GEGLU: proj(x).chunk(2, dim=-1)).
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    value = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(tl.float32)
    gate = tl.load(x_ptr + row * stride_x + hidden + cols, mask=mask).to(tl.float32)
    gelu = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    tl.store(
        out_ptr + row * stride_out + cols, (value * gelu).to(out_ptr.dtype.element_ty), mask=mask
    )


def _geglu_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    return {"x": random_tensor((shape["rows"], 2 * shape["hidden"]), dtype, gen, scale=2.0)}


def _geglu_launch(inputs: Tensors, outputs: Tensors) -> None:
    x, out = inputs["x"], outputs["out"]
    hidden = out.shape[1]
    block = 128
    _geglu_kernel[(x.shape[0], cdiv(hidden, block))](
        x, out, hidden, x.stride(0), out.stride(0), BLOCK=block
    )


def _geglu_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    value, gate = inputs["x"].chunk(2, dim=-1)
    gelu = 0.5 * gate * (1.0 + num.erf(gate * 0.7071067811865476))
    return {"out": value * gelu}


CASES = [
    TritonCase(
        name="axpy",
        description="out = alpha·x + y, 1-D, tail block masked",
        make_inputs=_axpy_inputs,
        launch=_axpy_launch,
        reference=_axpy_reference,
        outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["n"],))},
        shapes=({"n": 1000}, {"n": 4099}),
        gpu_shapes=({"n": (1 << 20) + 3},),
        dtypes=_HALF_AND_FULL,
    ),
    TritonCase(
        name="silu_mul",
        description="SiLU(a)·b (SwiGLU gate)",
        make_inputs=_silu_inputs,
        launch=_silu_launch,
        reference=_silu_reference,
        outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["rows"], shape["cols"]))},
        shapes=({"rows": 3, "cols": 333}, {"rows": 2, "cols": 256}),
        gpu_shapes=({"rows": 77, "cols": 5120},),
        dtypes=_HALF_AND_FULL,
    ),
    TritonCase(
        name="geglu",
        description="value·GELU(gate) over the two halves of each row (diffusers GEGLU)",
        make_inputs=_geglu_inputs,
        launch=_geglu_launch,
        reference=_geglu_reference,
        outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["rows"], shape["hidden"]))},
        shapes=({"rows": 3, "hidden": 200}, {"rows": 2, "hidden": 130}),
        gpu_shapes=({"rows": 257, "hidden": 1280},),
        dtypes=_HALF_AND_FULL,
    ),
]
