"""Kernel correctness checks: the built-in corpus, and the API to check your own kernels.

``diagnose triton`` (and the ``triton`` probe of ``diagnose run``) runs each case on seeded random
inputs, with its output buffers filled with NaN first, and judges every element against a float64
reference computed on the CPU at the kernel's own precision (:mod:`.numerics`, :mod:`.judge`):
pass, drift or mismatch. On a GPU the kernels are compiled for it (CUDA or HIP backend);
elsewhere they run in Triton's interpreter, which checks the kernel's logic but not the GPU
compiler.

Checking your own kernel: write a module with a ``CASES`` list and run
``diagnose triton --cases my_cases.py`` (a file, or an importable module name)::

    import torch, triton, triton.language as tl
    from diagnose.probes.triton.cases import OutputSpec, TritonCase, random_tensor

    @triton.jit
    def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
        tl.store(out_ptr + offs, (2.0 * x).to(out_ptr.dtype.element_ty), mask=offs < n)

    def launch(inputs, outputs):          # device tensors; outputs are NaN-filled buffers
        n = inputs["x"].numel()
        scale_kernel[(triton.cdiv(n, 256),)](inputs["x"], outputs["out"], n, BLOCK=256)

    CASES = [
        TritonCase(
            name="scale",
            make_inputs=lambda shape, dtype, gen: {"x": random_tensor((shape["n"],), dtype, gen)},
            launch=launch,
            # The inputs as Bounded values; `num` declares how the kernel computes (here: fp32).
            reference=lambda inputs, num: {"out": 2.0 * inputs["x"]},
            outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["n"],))},
            shapes=[{"n": 1000}, {"n": 4097}],
            dtypes=[torch.float32, torch.float16],
        )
    ]

A kernel with a ``tl.dot`` says so with ``num.dot(a, b.mT)`` (its fp32 operands are then rounded
as the backend's tl.dot rounds them: TF32 on NVIDIA), a cast with ``num.round(p, torch.float16)``,
a row sum with ``num.sum(x, -1)``; see :class:`.numerics.Numerics`. A ``reference(inputs)`` that
returns plain float64 tensors also works, judged with a generic bound for the dtype.

It exits 0 when no check fails (drift is reported, not a failure), 7 when any does (see
``diagnose triton --help``). In the interpreter, do arithmetic on bfloat16 values only after
``.to(tl.float32)``: the interpreter stores bfloat16 as raw bits and computes wrong answers on them
(triton-lang/triton#11584).

This package imports torch but not triton; the corpus modules import triton.
"""

from __future__ import annotations

from diagnose.catalogs.triton_catalog import DEFAULT_SEED
from diagnose.probes.triton.cases.api import (
    CheckEnv,
    Mode,
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    cdiv,
    dtype_name,
    next_power_of_2,
    random_tensor,
    shape_label,
)
from diagnose.probes.triton.cases.check import (
    FAILING,
    VERDICTS,
    CheckResult,
    Verdict,
)
from diagnose.probes.triton.cases.formats import Format
from diagnose.probes.triton.cases.judge import OutputJudgement, judge_output
from diagnose.probes.triton.cases.loading import CaseLoadError, load_cases
from diagnose.probes.triton.cases.numerics import Bounded, Numerics
from diagnose.probes.triton.cases.reference import TOLERANCES, Tolerance

__all__ = [
    "DEFAULT_SEED",
    "FAILING",
    "TOLERANCES",
    "VERDICTS",
    "Bounded",
    "CaseLoadError",
    "CheckEnv",
    "CheckResult",
    "Format",
    "Mode",
    "Numerics",
    "OutputJudgement",
    "OutputSpec",
    "Shape",
    "Tensors",
    "Tolerance",
    "TritonCase",
    "Verdict",
    "cdiv",
    "dtype_name",
    "judge_output",
    "load_cases",
    "next_power_of_2",
    "random_tensor",
    "shape_label",
]
