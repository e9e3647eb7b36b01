"""The case format: what a kernel check is made of. Users write these for their own kernels.

A :class:`TritonCase` bundles a kernel launcher, an input generator and a reference. The harness
(:mod:`diagnose.probes.triton.cases.check`) generates seeded random inputs, allocates the outputs
filled with NaN inside a poisoned margin (so an element the kernel never writes, or one it writes
outside the output, is caught), launches, computes the reference on the CPU in float64 from the
very same inputs, and judges every element against its own bound (:mod:`~.judge`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: Named dimensions of one check, e.g. ``{"rows": 5, "cols": 77}``.
Shape = Mapping[str, int]
Tensors = dict[str, torch.Tensor]
#: "interpreter": Triton's interpreter on the CPU (kernel logic only); "device": compiled for a GPU.
Mode = Literal["interpreter", "device"]


@dataclass(frozen=True)
class OutputSpec:
    """An output buffer the harness allocates before the launch."""

    shape: tuple[int, ...]
    #: None: the dtype of the check.
    dtype: torch.dtype | None = None
    #: "nan" poisons the buffer so an unwritten element fails the check. "zero" is for accumulators
    #: a kernel adds into (atomics); an unwritten element still fails, since the inputs are never 0.
    fill: Literal["nan", "zero"] = "nan"


@dataclass(frozen=True)
class CheckEnv:
    """Where a check is about to run, for a case to decide whether it can run there."""

    mode: Mode
    #: "interpreter", "cuda" or "hip" (Triton's backend), or "cpu" for inductor on the CPU.
    backend: str
    #: "sm_90", "gfx1100", ... ("" in the interpreter).
    arch: str
    device: torch.device


@dataclass(frozen=True)
class TritonCase:
    """One kernel to check, over several shapes and dtypes.

    ``launch(inputs, outputs)`` runs the kernel on device tensors and either fills ``outputs`` (the
    buffers described by ``outputs_for``, poisoned with NaN) or returns a mapping of result
    tensors. The reference returns the expected results under the same names, in one of two forms:

    - ``reference(inputs, num)`` (preferred) gets the same inputs as
      :class:`~.numerics.Bounded` values and a :class:`~.numerics.Numerics`, and computes with its
      operations (``num.dot``, ``num.round``, ``num.sum``, ``num.exp2``...): that declares where
      the kernel rounds, so the reference is computed at the kernel's own precision and each
      element gets a bound on what a correct kernel may add to it;
    - ``reference(inputs)`` gets CPU float64 copies of the inputs and returns plain tensors,
      judged with a generic bound for the dtype (``tolerance_overrides`` picks another).
    """

    name: str
    #: ``(shape, dtype, generator) -> {name: CPU tensor}``; use :func:`random_tensor`.
    make_inputs: Callable[[Shape, torch.dtype, torch.Generator], Tensors]
    launch: Callable[[Tensors, Tensors], Mapping[str, torch.Tensor] | None]
    #: ``(inputs, num) -> {name: Bounded}`` or ``(inputs) -> {name: float64 tensor}``.
    reference: Callable[..., Mapping[str, Any]]
    #: Shapes checked everywhere; keep them small, the interpreter is slow.
    shapes: Sequence[Shape]
    dtypes: Sequence[torch.dtype] = (torch.float32,)
    #: ``(shape, dtype) -> {name: OutputSpec}``; None when ``launch`` returns its results.
    outputs_for: Callable[[Shape, torch.dtype], Mapping[str, OutputSpec]] | None = None
    #: Extra shapes and dtypes checked only when compiled for a GPU.
    gpu_shapes: Sequence[Shape] = ()
    gpu_dtypes: Sequence[torch.dtype] = ()
    #: "triton" for a Triton kernel, "inductor" for a torch.compile'd function.
    kind: Literal["triton", "inductor"] = "triton"
    #: For a ``reference(inputs)`` that declares nothing: the generic bound per dtype, by format
    #: name ("tf32" for an fp32 tl.dot on NVIDIA), instead of the dtype's own.
    tolerance_overrides: Mapping[torch.dtype, str] = field(default_factory=dict)
    #: ``(env, dtype) -> reason`` when this check cannot run here, else None.
    unsupported: Callable[[CheckEnv, torch.dtype], str | None] | None = None
    description: str = ""


def shape_label(shape: Shape) -> str:
    """``{"rows": 5, "cols": 77}`` -> ``"rows=5 cols=77"``."""
    return " ".join(f"{key}={value}" for key, value in shape.items())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def random_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    scale: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """Normal random values (times ``scale``, plus ``offset``) on the CPU, with no exact zeros.

    Zeros would hide bugs: a kernel that skips an element, or multiplies by a value it never
    loaded, is right by accident where the input is 0.
    """
    values = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
    values.mul_(scale).add_(offset)  # in place: at GPU shapes each temporary is hundreds of MB
    # Push values near zero away from it, keeping their sign, so no element rounds to 0 in bf16.
    tiny = 1e-3 * max(abs(scale), 1e-30)
    near_zero = values.abs() < tiny
    values[near_zero] = torch.copysign(torch.tensor(tiny, dtype=values.dtype), values[near_zero])
    return values.to(dtype)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
