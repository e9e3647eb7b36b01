"""A flash-attention forward: online softmax over key blocks, two ``tl.dot`` per block.

Head dims that are not powers of two (40 and 80 in SD1.5, 64 in SDXL) are padded by masking,
and key counts like 77 (the text tokens of cross-attention) leave a partial last block.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from diagnose.probes.triton.cases.api import (
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    cdiv,
    next_power_of_2,
    random_tensor,
)
from diagnose.probes.triton.cases.matmul import bf16_dot_unsupported
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

_BLOCK_M = 32
_BLOCK_N = 32
_LN2 = math.log(2.0)


@triton.jit  # type: ignore[untyped-decorator]
def _attention_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    out_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    seq_q: tl.tensor,
    seq_kv: tl.tensor,
    head_dim: tl.tensor,
    scale_log2: tl.tensor,
    stride_qb: tl.tensor,
    stride_qs: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_vb: tl.tensor,
    stride_vs: tl.tensor,
    stride_ob: tl.tensor,
    stride_os: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + head * stride_qb + rows[:, None] * stride_qs + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    # Running max (in log2 units), running denominator, and the unnormalised output.
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, seq_kv, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_kv
        k_t = tl.load(
            k_ptr + head * stride_kb + keys[None, :] * stride_ks + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k_t) * scale_log2
        scores = tl.where(key_ok[None, :], scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + head * stride_vb + keys[:, None] * stride_vs + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + head * stride_ob + rows[:, None] * stride_os + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    # The log-sum-exp a backward pass reads, in natural-log units.
    tl.store(lse_ptr + head * seq_q + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def _inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    heads, seq_q, seq_kv, dim = shape["bh"], shape["sq"], shape["skv"], shape["d"]
    return {
        "q": random_tensor((heads, seq_q, dim), dtype, gen, scale=1.5),
        "k": random_tensor((heads, seq_kv, dim), dtype, gen, scale=1.5),
        "v": random_tensor((heads, seq_kv, dim), dtype, gen),
    }


def _launch(inputs: Tensors, outputs: Tensors) -> None:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    out, lse = outputs["out"], outputs["lse"]
    heads, seq_q, dim = q.shape
    seq_kv = k.shape[1]
    scale_log2 = (1.0 / math.sqrt(dim)) / _LN2
    _attention_kernel[(cdiv(seq_q, _BLOCK_M), heads)](
        q, k, v, out, lse, seq_q, seq_kv, dim, scale_log2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_D=max(16, next_power_of_2(dim)),
    )  # fmt: skip


def _reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    # Both dots at tl.dot's default precision; p cast to v's dtype before the second.
    out, lse = num.attend(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
    return {"out": out, "lse": lse}


def _outputs(shape: Shape, dtype: torch.dtype) -> dict[str, OutputSpec]:
    return {
        "out": OutputSpec((shape["bh"], shape["sq"], shape["d"])),
        "lse": OutputSpec((shape["bh"], shape["sq"]), torch.float32),
    }


CASES = [
    TritonCase(
        name="flash_attention",
        description="flash-attention forward (+ log-sum-exp), masked head dim and key tail",
        make_inputs=_inputs,
        launch=_launch,
        reference=_reference,
        outputs_for=_outputs,
        shapes=({"bh": 2, "sq": 40, "skv": 40, "d": 40}, {"bh": 2, "sq": 33, "skv": 77, "d": 64}),
        gpu_shapes=(
            {"bh": 16, "sq": 1024, "skv": 1024, "d": 64},
            {"bh": 10, "sq": 1025, "skv": 77, "d": 80},
        ),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        unsupported=bf16_dot_unsupported,
    ),
]
