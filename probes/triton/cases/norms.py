"""Normalisation forwards: LayerNorm (looped blocks), RMSNorm (one block), GroupNorm (per group).

Each also stores the statistics a backward pass reads (mean, 1/std), so those writes are checked.
GroupNorm(32) is in every diffusion UNet; LayerNorm and RMSNorm in every transformer block.
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
    next_power_of_2,
    random_tensor,
)
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

_EPS = 1e-5
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: LayerNorm walks its row in blocks of at most this many: small, so short rows loop too.
_LAYERNORM_BLOCK = 256


@triton.jit  # type: ignore[untyped-decorator]
def _layernorm_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    mean_ptr: tl.tensor,
    rstd_ptr: tl.tensor,
    n_cols: tl.tensor,
    stride: tl.tensor,
    eps: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    x_row = x_ptr + row * stride
    y_row = y_ptr + row * stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / n_cols
    acc_var = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        centered = tl.where(cols < n_cols, x - mean, 0.0)
        acc_var += centered * centered
    rstd = 1.0 / tl.sqrt(tl.sum(acc_var, axis=0) / n_cols + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _layernorm_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    rows, cols = shape["rows"], shape["cols"]
    return {
        # An offset: a kernel that forgets to subtract the mean is visibly wrong.
        "x": random_tensor((rows, cols), dtype, gen, scale=2.0, offset=0.5),
        "weight": random_tensor((cols,), dtype, gen, scale=0.5, offset=1.0),
        "bias": random_tensor((cols,), dtype, gen, scale=0.1),
    }


def _layernorm_launch(inputs: Tensors, outputs: Tensors) -> None:
    x = inputs["x"]
    rows, cols = x.shape
    block = min(_LAYERNORM_BLOCK, next_power_of_2(cols))
    _layernorm_kernel[(rows,)](
        x, inputs["weight"], inputs["bias"], outputs["y"], outputs["mean"], outputs["rstd"],
        cols, x.stride(0), _EPS, BLOCK=block,
    )  # fmt: skip


def _layernorm_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    y, mean, rstd = num.layer_norm(inputs["x"], inputs["weight"], inputs["bias"], _EPS)
    return {"y": y, "mean": mean.reshape(-1), "rstd": rstd.reshape(-1)}


def _row_stats_outputs(shape: Shape, dtype: torch.dtype) -> dict[str, OutputSpec]:
    rows = shape["rows"]
    return {
        "y": OutputSpec((rows, shape["cols"])),
        "mean": OutputSpec((rows,), torch.float32),
        "rstd": OutputSpec((rows,), torch.float32),
    }


@triton.jit  # type: ignore[untyped-decorator]
def _rmsnorm_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    y_ptr: tl.tensor,
    rstd_ptr: tl.tensor,
    n_cols: tl.tensor,
    stride: tl.tensor,
    eps: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(y_ptr + row * stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def _rmsnorm_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    rows, cols = shape["rows"], shape["cols"]
    return {
        "x": random_tensor((rows, cols), dtype, gen, scale=2.0),
        "weight": random_tensor((cols,), dtype, gen, scale=0.5, offset=1.0),
    }


def _rmsnorm_launch(inputs: Tensors, outputs: Tensors) -> None:
    x = inputs["x"]
    rows, cols = x.shape
    _rmsnorm_kernel[(rows,)](
        x, inputs["weight"], outputs["y"], outputs["rstd"], cols, x.stride(0), _EPS,
        BLOCK=next_power_of_2(cols),
    )  # fmt: skip


def _rmsnorm_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    x = inputs["x"]
    rstd = num.rsqrt(num.mean(x.square(), -1) + _EPS)
    return {"y": x * rstd * inputs["weight"], "rstd": rstd.reshape(-1)}


@triton.jit  # type: ignore[untyped-decorator]
def _groupnorm_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    mean_ptr: tl.tensor,
    rstd_ptr: tl.tensor,
    channels_per_group: tl.tensor,
    spatial: tl.tensor,
    groups: tl.tensor,
    eps: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    # One program per (sample, group). In NCHW a group's channels are one contiguous run.
    sample = tl.program_id(0)
    group = tl.program_id(1)
    group_size = channels_per_group * spatial
    base = (sample * groups + group) * group_size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, group_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offsets, mask=offsets < group_size, other=0.0).to(tl.float32)
        acc += x
        acc_sq += x * x
    mean = tl.sum(acc, axis=0) / group_size
    var = tl.sum(acc_sq, axis=0) / group_size - mean * mean
    rstd = tl.rsqrt(var + eps)
    tl.store(mean_ptr + sample * groups + group, mean)
    tl.store(rstd_ptr + sample * groups + group, rstd)
    for start in range(0, group_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < group_size
        channel = group * channels_per_group + offsets // spatial
        x = tl.load(x_ptr + base + offsets, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + channel, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + channel, mask=mask).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_ptr + base + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _groupnorm_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    n, c, h, w = shape["n"], shape["c"], shape["h"], shape["w"]
    return {
        "x": random_tensor((n, c, h, w), dtype, gen, offset=0.3),
        "weight": random_tensor((c,), dtype, gen, scale=0.5, offset=1.0),
        "bias": random_tensor((c,), dtype, gen, scale=0.1),
    }


def _groupnorm_launch(inputs: Tensors, outputs: Tensors) -> None:
    x = inputs["x"].contiguous()
    n, c, h, w = x.shape
    groups = outputs["mean"].shape[1]
    block = min(256, next_power_of_2(c // groups * h * w))
    _groupnorm_kernel[(n, groups)](
        x, inputs["weight"], inputs["bias"], outputs["y"], outputs["mean"], outputs["rstd"],
        c // groups, h * w, groups, _EPS, BLOCK=block,
    )  # fmt: skip


def _groupnorm_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    x = inputs["x"]
    n, c, h, w = x.shape
    groups = _groups_of(c)
    grouped = x.reshape(n, groups, -1)
    # One pass, as the kernel does: var = E[x²] − mean².
    mean = num.mean(grouped, -1)
    var = num.mean(grouped.square(), -1) - mean.square()
    rstd = num.rsqrt(var + _EPS)
    normed = ((grouped - mean) * rstd).reshape(n, c, h, w)
    y = normed * inputs["weight"].reshape(1, c, 1, 1) + inputs["bias"].reshape(1, c, 1, 1)
    return {"y": y, "mean": mean.reshape(n, groups), "rstd": rstd.reshape(n, groups)}


def _groups_of(channels: int) -> int:
    """The shapes below pick groups = channels // 4 (at most 32, like diffusers' GroupNorm(32))."""
    return min(32, channels // 4)


def _groupnorm_outputs(shape: Shape, dtype: torch.dtype) -> dict[str, OutputSpec]:
    n, c = shape["n"], shape["c"]
    groups = _groups_of(c)
    return {
        "y": OutputSpec((n, c, shape["h"], shape["w"])),
        "mean": OutputSpec((n, groups), torch.float32),
        "rstd": OutputSpec((n, groups), torch.float32),
    }


CASES = [
    TritonCase(
        name="layernorm",
        description="LayerNorm forward (+ mean, rstd), row walked in blocks with a masked tail",
        make_inputs=_layernorm_inputs,
        launch=_layernorm_launch,
        reference=_layernorm_reference,
        outputs_for=_row_stats_outputs,
        shapes=({"rows": 4, "cols": 320}, {"rows": 3, "cols": 77}),
        gpu_shapes=({"rows": 1024, "cols": 1280}, {"rows": 77, "cols": 3072}),
        dtypes=_DTYPES,
    ),
    TritonCase(
        name="rmsnorm",
        description="RMSNorm forward (+ rstd), one block per row",
        make_inputs=_rmsnorm_inputs,
        launch=_rmsnorm_launch,
        reference=_rmsnorm_reference,
        outputs_for=lambda shape, dtype: {
            "y": OutputSpec((shape["rows"], shape["cols"])),
            "rstd": OutputSpec((shape["rows"],), torch.float32),
        },
        shapes=({"rows": 4, "cols": 120}, {"rows": 2, "cols": 1000}),
        gpu_shapes=({"rows": 4096, "cols": 3072},),
        dtypes=_DTYPES,
    ),
    TritonCase(
        name="groupnorm",
        description="GroupNorm forward (+ mean, rstd) in NCHW, per-channel affine",
        make_inputs=_groupnorm_inputs,
        launch=_groupnorm_launch,
        reference=_groupnorm_reference,
        outputs_for=_groupnorm_outputs,
        shapes=({"n": 2, "c": 12, "h": 5, "w": 7}, {"n": 1, "c": 32, "h": 9, "w": 9}),
        gpu_shapes=({"n": 2, "c": 320, "h": 64, "w": 64}, {"n": 1, "c": 128, "h": 33, "w": 31}),
        dtypes=_DTYPES,
    ),
]
