"""Blocked matmul with ``tl.dot`` in the layout of a linear layer: out = a · wᵀ.

fp16 and bf16 operands accumulate in fp32; fp32 operands run once with the backend's default
precision (TF32 on NVIDIA and MI300: the reference rounds its operands the same way) and once with
``input_precision="ieee"`` (the reference keeps them fp32: a backend that silently drops to TF32
there is far outside the bound).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from diagnose.probes.triton.cases.api import (
    CheckEnv,
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    cdiv,
    random_tensor,
)
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

_BLOCK = 32


@triton.jit  # type: ignore[untyped-decorator]
def _matmul_kernel(
    a_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_am: tl.tensor,
    stride_ak: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        # w is (N, K) like nn.Linear.weight: read it transposed through the strides.
        w = tl.load(
            w_ptr + k[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(k[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def _inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    m, n, k = shape["m"], shape["n"], shape["k"]
    return {"a": random_tensor((m, k), dtype, gen), "w": random_tensor((n, k), dtype, gen)}


def _launcher(precision: str | None) -> Callable[[Tensors, Tensors], None]:
    """None: tl.dot's default precision for the backend (as most kernels leave it)."""

    def launch(inputs: Tensors, outputs: Tensors) -> None:
        a, w, out = inputs["a"], inputs["w"], outputs["out"]
        m, k = a.shape
        n = w.shape[0]
        _matmul_kernel[(cdiv(m, _BLOCK), cdiv(n, _BLOCK))](
            a, w, out, m, n, k,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, BLOCK_K=_BLOCK, PRECISION=precision,
        )  # fmt: skip

    return launch


def _reference_for(
    precision: str | None,
) -> Callable[[dict[str, Bounded], Numerics], dict[str, Bounded]]:
    """The reference of the kernel launched with ``input_precision=precision``."""

    def reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
        return {"out": num.dot(inputs["a"], inputs["w"].mT, input_precision=precision, name="a·wᵀ")}

    return reference


def _outputs(shape: Shape, dtype: torch.dtype) -> dict[str, OutputSpec]:
    return {"out": OutputSpec((shape["m"], shape["n"]))}


def bf16_dot_unsupported(env: CheckEnv, dtype: torch.dtype) -> str | None:
    """Why a bf16 ``tl.dot`` cannot be judged here, or None."""
    if dtype != torch.bfloat16:
        return None
    if env.mode == "interpreter":
        # triton-lang/triton#11584: the interpreter multiplies bf16's raw uint16 bit patterns.
        return "Triton's interpreter cannot run a bfloat16 tl.dot (checked on a GPU only)"
    sm = env.arch.removeprefix("sm_")
    if env.backend == "cuda" and env.arch.startswith("sm_") and sm.isdigit() and int(sm) < 80:
        return f"bfloat16 tl.dot needs sm_80 or newer; this GPU is {env.arch}"
    return None


_SHAPES = ({"m": 33, "n": 70, "k": 65}, {"m": 16, "n": 40, "k": 100})
_GPU_SHAPES = ({"m": 257, "n": 513, "k": 129}, {"m": 1024, "n": 1280, "k": 1000})

CASES = [
    TritonCase(
        name="matmul",
        description="a·wᵀ with tl.dot, fp32 accumulate, masked M/N/K tails",
        make_inputs=_inputs,
        launch=_launcher(None),
        reference=_reference_for(None),
        outputs_for=_outputs,
        shapes=_SHAPES,
        gpu_shapes=_GPU_SHAPES,
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        unsupported=bf16_dot_unsupported,
    ),
    TritonCase(
        name="matmul_ieee",
        description="fp32 a·wᵀ with tl.dot(input_precision='ieee'): must not use TF32",
        make_inputs=_inputs,
        launch=_launcher("ieee"),
        reference=_reference_for("ieee"),
        outputs_for=_outputs,
        shapes=_SHAPES,
        gpu_shapes=_GPU_SHAPES,
        dtypes=(torch.float32,),
    ),
]
