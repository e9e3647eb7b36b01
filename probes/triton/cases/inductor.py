"""torch.compile (inductor) cases: a LoRA linear (forward + backward) and an attention block.

On a GPU inductor writes Triton kernels for these, so they check Triton as torch.compile uses it;
on the CPU inductor writes C++ instead (its CPU backend), which is checked the same way. Each check
compiles its own copy of the function, so no compiled entry is shared across shapes and dynamo's
recompile limit can never quietly send a check to eager mode.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from diagnose.probes.triton.cases.api import Shape, Tensors, TritonCase, random_tensor
from diagnose.probes.triton.cases.numerics import Bounded, Numerics

_LORA_SCALE = 0.5  # alpha / rank, as peft applies it


def _lora_linear(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> torch.Tensor:
    """W x + B A x: a frozen base weight plus the low-rank adapter peft adds."""
    return x @ weight.t() + (x @ lora_a.t()) @ lora_b.t() * _LORA_SCALE


def _attention_block(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Pre-norm self-attention with a residual, as in a diffusion transformer block."""
    batch, seq, channels = x.shape
    h = F.layer_norm(x, (channels,), norm_weight, norm_bias)

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, channels // heads).transpose(1, 2)

    attended = F.scaled_dot_product_attention(
        split(h @ wq.t()), split(h @ wk.t()), split(h @ wv.t())
    )
    return x + attended.transpose(1, 2).reshape(batch, seq, channels) @ wo.t()


def fresh_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` of a copy of ``fn`` with its own code object (its own dynamo cache)."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, backend="inductor", dynamic=False, fullgraph=True)


#: One compiled copy per function and input signature: the harness launches a check twice on a
#: GPU (the second launch times the compiled code), and the second must not compile again.
_COMPILED: dict[tuple[Any, ...], Callable[..., Any]] = {}


def compiled_for(fn: Callable[..., Any], inputs: Tensors) -> Callable[..., Any]:
    signature = [
        (name, tuple(t.shape), t.dtype, str(t.device)) for name, t in sorted(inputs.items())
    ]
    key = (fn.__qualname__, *signature)
    if key not in _COMPILED:
        _COMPILED[key] = fresh_compiled(fn)
    return _COMPILED[key]


def _lora_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    n, d_in, d_out, rank = shape["n"], shape["d_in"], shape["d_out"], shape["r"]
    return {
        "x": random_tensor((n, d_in), dtype, gen),
        "weight": random_tensor((d_out, d_in), dtype, gen, scale=d_in**-0.5),
        # Not zero, unlike a fresh adapter's B: zeros would hide a wrong adapter path.
        "lora_a": random_tensor((rank, d_in), dtype, gen, scale=d_in**-0.5),
        "lora_b": random_tensor((d_out, rank), dtype, gen, scale=rank**-0.5),
        "grad_y": random_tensor((n, d_out), dtype, gen),
    }


def _lora_run(fn: Callable[..., torch.Tensor], inputs: Tensors) -> dict[str, torch.Tensor]:
    x = inputs["x"].detach().requires_grad_(True)
    lora_a = inputs["lora_a"].detach().requires_grad_(True)
    lora_b = inputs["lora_b"].detach().requires_grad_(True)
    # The base weight is frozen, as in LoRA training: no gradient for it.
    y = fn(x, inputs["weight"], lora_a, lora_b)
    torch.autograd.backward(y, inputs["grad_y"])
    assert x.grad is not None and lora_a.grad is not None and lora_b.grad is not None
    return {
        "y": y.detach(),
        "grad_x": x.grad,
        "grad_lora_a": lora_a.grad,
        "grad_lora_b": lora_b.grad,
    }


def _lora_launch(inputs: Tensors, outputs: Tensors) -> dict[str, torch.Tensor]:
    with torch.enable_grad():
        return _lora_run(compiled_for(_lora_linear, inputs), inputs)


class _Eager:
    """Rounding between ops as eager mode does it, which inductor may fuse away (so each is a
    cast that may or may not happen), for inputs of one dtype."""

    def __init__(self, num: Numerics, like: Bounded) -> None:
        self.num = num
        self.fmt = like.fmt or num.compute

    def __call__(self, x: Bounded, name: str) -> Bounded:
        return self.num.round(x, self.fmt, name=name, optional=True)

    def mm(self, a: Bounded, b: Bounded, name: str) -> Bounded:
        return self(self.num.dot(a, b, name=name), f"{name} output")


def _lora_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    """The forward and the gradients autograd takes through it, written out."""
    x, weight, lora_a, lora_b, grad_y = (
        inputs[n] for n in ("x", "weight", "lora_a", "lora_b", "grad_y")
    )
    eager = _Eager(num, x)
    down = eager.mm(x, lora_a.mT, "x·Aᵀ")
    y = eager(
        eager.mm(x, weight.mT, "x·Wᵀ") + eager.mm(down, lora_b.mT, "(x·Aᵀ)·Bᵀ") * _LORA_SCALE, "y"
    )
    grad_up = eager(grad_y * _LORA_SCALE, "dy·scale")
    grad_down = eager.mm(grad_up, lora_b, "dy·B")
    grad_x = eager(eager.mm(grad_y, weight, "dy·W") + eager.mm(grad_down, lora_a, "(dy·B)·A"), "dx")
    return {
        "y": y,
        "grad_x": grad_x,
        "grad_lora_a": eager.mm(grad_down.mT, x, "dA"),
        "grad_lora_b": eager.mm(grad_up.mT, down, "dB"),
    }


def _block_inputs(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> Tensors:
    channels = shape["c"]
    scale = channels**-0.5
    inputs = {
        "x": random_tensor((shape["b"], shape["s"], channels), dtype, gen),
        "norm_weight": random_tensor((channels,), dtype, gen, scale=0.2, offset=1.0),
        "norm_bias": random_tensor((channels,), dtype, gen, scale=0.1),
    }
    for name in ("wq", "wk", "wv", "wo"):
        inputs[name] = random_tensor((channels, channels), dtype, gen, scale=scale)
    inputs["heads"] = torch.tensor(shape["heads"])
    return inputs


def _block_call(fn: Callable[..., torch.Tensor], inputs: Tensors) -> dict[str, torch.Tensor]:
    names = ("x", "norm_weight", "norm_bias", "wq", "wk", "wv", "wo")
    return {"out": fn(*(inputs[n] for n in names), int(inputs["heads"]))}


def _block_launch(inputs: Tensors, outputs: Tensors) -> dict[str, torch.Tensor]:
    return _block_call(compiled_for(_attention_block, inputs), inputs)


def _block_reference(inputs: dict[str, Bounded], num: Numerics) -> dict[str, Bounded]:
    x = inputs["x"]
    batch, seq, channels = x.shape
    heads = int(inputs["heads"])
    eager = _Eager(num, x)
    h, _, _ = num.layer_norm(x, inputs["norm_weight"], inputs["norm_bias"], 1e-5)
    h = eager(h, "layer_norm")
    # SDPA's math path scales q and k by √scale in their dtype; fused kernels scale the scores.
    root_scale = (channels // heads) ** -0.25

    def split(t: Bounded, name: str) -> Bounded:
        scaled = eager(t * root_scale, f"{name}·√scale") if name != "v" else t
        return scaled.reshape(batch, seq, heads, channels // heads).transpose(1, 2)

    q, k, v = (split(eager.mm(h, inputs[f"w{n}"].mT, f"h·W{n}ᵀ"), n) for n in "qkv")
    attended, _ = num.attend(q, k, v, 1.0, name="sdpa")
    merged = eager(attended, "sdpa output").transpose(1, 2).reshape(batch, seq, channels)
    return {"out": eager(x + eager.mm(merged, inputs["wo"].mT, "attention·Woᵀ"), "out")}


_GPU_DTYPES = (torch.float16, torch.bfloat16)

CASES = [
    TritonCase(
        name="compiled_lora_linear",
        kind="inductor",
        description="torch.compile'd W·x + B·A·x (scale 0.5): forward and backward (dx, dA, dB)",
        make_inputs=_lora_inputs,
        launch=_lora_launch,
        reference=_lora_reference,
        shapes=(
            {"n": 7, "d_in": 24, "d_out": 20, "r": 4},
            {"n": 13, "d_in": 40, "d_out": 33, "r": 8},
        ),
        # One GPU shape: every (shape, dtype) is a cold compile the first time.
        gpu_shapes=({"n": 4096, "d_in": 320, "d_out": 320, "r": 16},),
        gpu_dtypes=_GPU_DTYPES,
    ),
    TritonCase(
        name="compiled_attention_block",
        kind="inductor",
        description="torch.compile'd LayerNorm → QKV → SDPA → out projection + residual",
        make_inputs=_block_inputs,
        launch=_block_launch,
        reference=_block_reference,
        shapes=({"b": 2, "s": 9, "c": 32, "heads": 2}, {"b": 1, "s": 17, "c": 48, "heads": 3}),
        # Not longer: the float64 CPU reference materialises the (s × s) scores per head.
        gpu_shapes=({"b": 2, "s": 1024, "c": 320, "heads": 5},),
        gpu_dtypes=_GPU_DTYPES,
    ),
]
