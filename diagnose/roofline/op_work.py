"""The work of one operator, from what a profiler trace records about it: its name, the dims and
types of its inputs (``record_shapes``) and, in recent torch, its ``Concrete Inputs`` (the values
of its int, bool and list arguments: stride, padding, output_mask...).

Pure: no torch import, so a trace is analysed anywhere. The FLOPs conventions are exactly those of
``torch.utils.flop_counter`` (one multiply-add is 2 FLOPs, a bias add is not counted), so
``FlopCounterMode`` over the same step is an independent check of this module:

* ``mm``/``addmm``/``bmm``/``baddbmm``/``_scaled_mm``: ``2*m*n*k`` per matrix product;
  ``linear`` and ``matmul`` (composites recorded around them) fold their leading dims into ``m``;
* convolution forward: ``2 * N * Cout * prod(out spatial) * (Cin/groups) * prod(kernel)``
  (transposed: the *input* spatial dims instead of the output's);
* ``convolution_backward``: the grad-input term (one forward's worth) when ``output_mask[0]``,
  plus the grad-weight term when ``output_mask[1]``. torch counts the grad-weight term with the
  full ``Cin``: for a grouped convolution that is ``groups`` times the forward, and so is it here;
* fused attention forward ``2*B*H*Sq*Sk*(D + Dv)`` (two batched products), backward five
  products (the scores are recomputed), for every aten variant; the math path is ``bmm``/``matmul``
  ops (or, recorded around them, ``scaled_dot_product_attention`` itself, counted like a
  forward). One deliberate difference: ``_flash_attention_*``/``_efficient_attention_*`` take
  [batch, seq, heads, dim]; torch.utils.flop_counter reads them as [batch, heads, seq, dim] (it
  only meets them alone when called directly, under an SDPA op it counts that op), here they are
  transposed first.

Memory-bound ops get a byte count instead: :mod:`diagnose.roofline.op_traffic`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnose.roofline.op_inputs import OpInputs, Shape, parse_bools, parse_ints

#: Compute classes, in report order.
GEMM, CONV, ATTENTION = "gemm", "conv", "attention"
COMPUTE_CLASSES: tuple[str, ...] = (GEMM, CONV, ATTENTION)

# --------------------------------------------------------------------------------------------
# What a count is


@dataclass(frozen=True)
class Work:
    """The FLOPs of one counted op."""

    op_class: str
    flops: float
    #: Torch name of the compute dtype (the matrix operands' dtype), "" when not recorded.
    dtype: str
    #: (m, n, k) of a matrix product, batch folded into m; None for conv and attention.
    mnk: tuple[int, int, int] | None = None
    #: What the count assumes beyond the recorded args ("" when it rests on them alone).
    assumption: str = ""


@dataclass(frozen=True)
class NotCounted:
    """A compute op whose FLOPs the trace does not give, and why."""

    reason: str
    dtype: str = ""
    #: True when the reason is that the call's shapes were not recorded.
    no_shapes: bool = False


@dataclass(frozen=True)
class ConvHint:
    """What the rest of the trace tells about a convolution when its own args do not."""

    #: The output's spatial dims (from the matching backward's grad_output).
    output: Shape | None = None
    output_from: str = ""
    #: (grad input, grad weight) of a backward whose output_mask was not recorded.
    mask: tuple[bool, bool] | None = None
    mask_from: str = ""


NO_SHAPES = "input shapes not recorded"
#: More FLOPs than any training step does (the fastest device's dense peak for minutes): a count
#: beyond it is a misread of the trace, for one op or for a whole step.
MAX_STEP_FLOPS = 1e18
OVERSIZED = "a recorded input shape is larger than any device's memory (a misread of the trace)"
BEYOND_A_STEP = "more FLOPs than any training step does (a misread of the trace)"


def bounded(work: Work) -> Work | NotCounted:
    """``work`` when its FLOPs are a count a step can hold: finite, not negative, at most
    :data:`MAX_STEP_FLOPS` (recorded shapes and ``flops`` args are read from a file)."""
    if 0.0 <= work.flops <= MAX_STEP_FLOPS:
        return work
    return NotCounted(BEYOND_A_STEP, work.dtype)


# --------------------------------------------------------------------------------------------
# Matrix products

#: name -> (index of the first operand, index of the second, form).
_GEMMS: dict[str, tuple[int, int, str]] = {
    "aten::mm": (0, 1, "mm"),
    "aten::addmm": (1, 2, "mm"),
    "aten::_addmm_activation": (1, 2, "mm"),
    "aten::_scaled_mm": (0, 1, "mm"),
    "aten::bmm": (0, 1, "bmm"),
    "aten::baddbmm": (1, 2, "bmm"),
    "aten::linear": (0, 1, "linear"),
    "aten::matmul": (0, 1, "matmul"),
}


def _gemm(op: OpInputs, a_at: int, b_at: int, form: str) -> Work | NotCounted | None:
    a, b = op.shape(a_at), op.shape(b_at)
    dtype = op.dtype(a_at)
    if a is None or b is None:
        return NotCounted(NO_SHAPES, dtype, no_shapes=True)
    if form == "linear":
        # weight is [out, in]; every leading dim of the input is a row of one product.
        if len(a) < 1 or len(b) != 2 or a[-1] != b[1]:
            return NotCounted(f"linear shapes {list(a)} x {list(b)} do not chain", dtype)
        m, k, n = math.prod(a[:-1]), a[-1], b[0]
        return Work(GEMM, 2.0 * m * n * k, dtype, (m, n, k))
    if form == "matmul":
        if len(b) < 2 or len(a) < 1:
            # A matrix-vector or dot product: torch.utils.flop_counter counts no FLOPs for mv/dot
            # (memory-bound); so neither does this.
            return None
        a2 = (1, *a) if len(a) == 1 else a
        batch_dims = _broadcast(a2[:-2], b[:-2])
        if batch_dims is None or a2[-1] != b[-2]:
            return NotCounted(f"matmul shapes {list(a)} x {list(b)} do not chain", dtype)
        m, k, n = math.prod(batch_dims) * a2[-2], a2[-1], b[-1]
        return Work(GEMM, 2.0 * m * n * k, dtype, (m, n, k))
    rank = 2 if form == "mm" else 3
    if len(a) != rank or len(b) != rank or a[-1] != b[-2] or (rank == 3 and a[0] != b[0]):
        return NotCounted(f"{form} shapes {list(a)} x {list(b)} do not chain", dtype)
    batch = a[0] if rank == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    return Work(GEMM, 2.0 * batch * m * n * k, dtype, (batch * m, n, k))


def _broadcast(a: Shape, b: Shape) -> Shape | None:
    """numpy broadcasting of two batch shapes, None when they do not broadcast."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(reversed(out))


# --------------------------------------------------------------------------------------------
# Convolutions


@dataclass(frozen=True)
class _ConvArgs:
    """Where a convolution op's arguments are (input 0 and weight 1 always)."""

    stride: int
    padding: int
    dilation: int  # -1: the op has no dilation argument (1)
    transposed: int | bool  # index of the "transposed" bool, or fixed by the op


_CONV_FORWARD: dict[str, _ConvArgs] = {
    # (input, weight, bias, stride, padding, dilation, groups)
    **{f"aten::conv{d}d": _ConvArgs(3, 4, 5, False) for d in (1, 2, 3)},
    "aten::_convolution_mode": _ConvArgs(3, 4, 5, False),
    "aten::cudnn_convolution_relu": _ConvArgs(3, 4, 5, False),
    # (self, weight, z, alpha, bias, stride, padding, dilation, groups)
    "aten::cudnn_convolution_add_relu": _ConvArgs(5, 6, 7, False),
    # (input, weight, bias, stride, padding, output_padding, groups, dilation)
    **{f"aten::conv_transpose{d}d": _ConvArgs(3, 4, 7, True) for d in (1, 2, 3)},
    # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, ...)
    "aten::convolution": _ConvArgs(3, 4, 5, 6),
    "aten::_convolution": _ConvArgs(3, 4, 5, 6),
    "aten::convolution_overrideable": _ConvArgs(3, 4, 5, 6),
    # (self, weight, padding, stride, dilation, groups, ...)
    "aten::cudnn_convolution": _ConvArgs(3, 2, 4, False),
    # (self, weight, padding, output_padding, stride, dilation, groups, ...)
    "aten::cudnn_convolution_transpose": _ConvArgs(4, 2, 5, True),
    # (self, weight, bias, padding, stride, dilation, groups, ...)
    "aten::miopen_convolution": _ConvArgs(4, 3, 5, False),
    "aten::miopen_depthwise_convolution": _ConvArgs(4, 3, 5, False),
    "aten::mkldnn_convolution": _ConvArgs(4, 3, 5, False),
    # (self, weight, bias, padding, output_padding, stride, dilation, groups, ...)
    "aten::miopen_convolution_transpose": _ConvArgs(5, 3, 6, True),
    # (self, weight, kernel_size, bias, stride, padding[, dilation])
    "aten::thnn_conv2d": _ConvArgs(4, 5, -1, False),
    "aten::_slow_conv2d_forward": _ConvArgs(4, 5, -1, False),
    "aten::slow_conv3d": _ConvArgs(4, 5, -1, False),
    "aten::slow_conv3d_forward": _ConvArgs(4, 5, -1, False),
    "aten::_conv_depthwise2d": _ConvArgs(4, 5, 6, False),
    "aten::slow_conv_dilated2d": _ConvArgs(4, 5, 6, False),
    "aten::slow_conv_dilated3d": _ConvArgs(4, 5, 6, False),
}


@dataclass(frozen=True)
class _ConvBackwardArgs:
    grad_output: int
    input: int
    weight: int
    transposed: int | bool
    #: Index of output_mask; -1: the last input.
    mask: int


_CONV_BACKWARD: dict[str, _ConvBackwardArgs] = {
    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #  output_padding, groups, output_mask)
    "aten::convolution_backward": _ConvBackwardArgs(0, 1, 2, 7, 10),
    "aten::convolution_backward_overrideable": _ConvBackwardArgs(0, 1, 2, 6, 9),
    "aten::_slow_conv2d_backward": _ConvBackwardArgs(0, 1, 2, False, 6),
    # Before convolution_backward (torch < 1.11): (self, grad_output, weight, ..., output_mask)
    "aten::cudnn_convolution_backward": _ConvBackwardArgs(1, 0, 2, False, -1),
    "aten::cudnn_convolution_transpose_backward": _ConvBackwardArgs(1, 0, 2, True, -1),
    "aten::miopen_convolution_backward": _ConvBackwardArgs(1, 0, 2, False, -1),
    "aten::miopen_convolution_transpose_backward": _ConvBackwardArgs(1, 0, 2, True, -1),
    "aten::miopen_depthwise_convolution_backward": _ConvBackwardArgs(1, 0, 2, False, -1),
    "aten::mkldnn_convolution_backward": _ConvBackwardArgs(1, 0, 2, False, -1),
}

#: Old schemas split the backward into one op per gradient: (self_size, grad_output, weight) for
#: the input's, (weight_size, grad_output, self) for the weight's. Their names also tell a parent
#: backward which gradients it computed.
GRAD_INPUT_SUFFIX = "_backward_input"
GRAD_WEIGHT_SUFFIXES = ("_backward_weight", "_backward_weights")


def _conv_flops(x: Shape, w: Shape, out: Shape, transposed: bool) -> float:
    """torch.utils.flop_counter.conv_flop_count: only ``out`` or ``x``'s spatial dims are read."""
    spatial = x[2:] if transposed else out[2:]
    return 2.0 * math.prod(spatial) * math.prod(w[2:]) * x[0] * w[0] * w[1]


def _is_transposed(op: OpInputs, where: int | bool) -> bool | None:
    if isinstance(where, bool):
        return where
    flags = parse_bools(op.value(where))
    return flags[0] if flags and len(flags) == 1 else None


def conv_operands(op: OpInputs) -> tuple[Shape, Shape] | None:
    """(input, weight) dims of a convolution forward op, None when not one or not recorded."""
    if op.name not in _CONV_FORWARD:
        return None
    x, w = op.shape(0), op.shape(1)
    return (x, w) if x is not None and w is not None and len(x) == len(w) >= 3 else None


def conv_backward_operands(op: OpInputs) -> tuple[Shape, Shape, Shape] | None:
    """(grad_output, input, weight) dims of a convolution backward op, when recorded."""
    args = _CONV_BACKWARD.get(op.name)
    if args is None:
        return None
    g, x, w = op.shape(args.grad_output), op.shape(args.input), op.shape(args.weight)
    if g is None or x is None or w is None or not len(g) == len(x) == len(w) >= 3:
        return None
    return g, x, w


def _conv_forward(op: OpInputs, args: _ConvArgs, hint: ConvHint | None) -> Work | NotCounted:
    dtype = op.dtype(0)
    operands = conv_operands(op)
    if operands is None:
        return NotCounted(NO_SHAPES, dtype, no_shapes=not op.recorded or op.shape(0) is None)
    x, w = operands
    transposed = _is_transposed(op, args.transposed)
    assumption = ""
    if transposed is None:
        transposed = False
        assumption = f"{op.name}: 'transposed' not recorded, taken as a regular convolution"
    if transposed:
        # The transposed count reads only the input's spatial dims.
        return Work(CONV, _conv_flops(x, w, x, True), dtype, assumption=assumption)
    spatial = _output_spatial(op, args, x, w)
    if spatial is None and hint is not None and hint.output is not None:
        spatial = hint.output
        assumption = assumption or hint.output_from
    if spatial is None:
        return NotCounted(
            "stride/padding/dilation not recorded (no Concrete Inputs) and no backward of the "
            "same shapes to read the output size from",
            dtype,
        )
    out = (x[0], w[0], *spatial)
    return Work(CONV, _conv_flops(x, w, out, False), dtype, assumption=assumption)


def _output_spatial(op: OpInputs, args: _ConvArgs, x: Shape, w: Shape) -> Shape | None:
    """The output's spatial dims from the recorded stride, padding and dilation."""
    spatial, kernel = x[2:], w[2:]
    n = len(spatial)
    stride = _per_dim(parse_ints(op.value(args.stride)), n)
    pad_text = op.value(args.padding)
    if pad_text is not None and pad_text.strip("'\"") in ("same", "valid"):
        padding: tuple[int, ...] | None = None if pad_text.strip("'\"") == "same" else (0,) * n
    else:
        padding = _per_dim(parse_ints(pad_text), n)
        if padding is None:
            return None
    dilation = (1,) * n if args.dilation < 0 else _per_dim(parse_ints(op.value(args.dilation)), n)
    if stride is None or dilation is None or 0 in stride:
        return None
    if padding is None:  # "same": the output keeps the input's size (torch requires stride 1)
        return spatial
    return tuple(
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, p, d, k, s in zip(spatial, padding, dilation, kernel, stride, strict=True)
    )


def _per_dim(values: tuple[int, ...] | None, n: int) -> tuple[int, ...] | None:
    if values is None:
        return None
    if len(values) == 1:  # torch expands a single value to every spatial dim
        return values * n
    return values if len(values) == n else None


def _conv_backward(
    op: OpInputs, args: _ConvBackwardArgs, hint: ConvHint | None
) -> Work | NotCounted:
    dtype = op.dtype(args.grad_output)
    operands = conv_backward_operands(op)
    if operands is None:
        return NotCounted(NO_SHAPES, dtype, no_shapes=not op.recorded)
    g, x, w = operands
    notes: list[str] = []
    transposed = _is_transposed(op, args.transposed)
    if transposed is None:
        transposed = _transposed_from_shapes(g, x, w)
    if transposed is None:
        transposed = False
        notes.append(f"{op.name}: 'transposed' not recorded, taken as a regular convolution")
    at = args.mask if args.mask >= 0 else len(op.types) - 1
    recorded = parse_bools(op.value(at))
    if recorded is not None and len(recorded) >= 2:
        mask = (recorded[0], recorded[1])
    elif hint is not None and hint.mask is not None:
        mask = hint.mask
        notes.append(hint.mask_from)
    else:
        return NotCounted("output_mask not recorded", dtype)
    flops = 0.0
    if mask[0]:
        # grad input is a transposed convolution of grad_output with the weight (torch's count).
        flops += _conv_flops(g, w, x, not transposed)
    if mask[1]:
        if transposed:
            flops += _conv_flops(_swap(g), _swap(x), _swap(w), False)
        else:
            flops += _conv_flops(_swap(x), _swap(g), _swap(w), False)
    return Work(CONV, flops, dtype, assumption="; ".join(n for n in notes if n))


def _transposed_from_shapes(g: Shape, x: Shape, w: Shape) -> bool | None:
    """Whether a backward is a transposed convolution's, from its shapes: a regular one's weight
    is [Cout, Cin/groups, ...] (grad_output has w[0] channels), a transposed one's
    [Cin, Cout/groups, ...] (the input has w[0] channels). With as many channels in as out, a
    regular convolution keeps or shrinks the spatial size and a transposed one grows it; where
    it keeps it both counts are equal. None: the shapes fit neither."""
    regular, transposed = g[1] == w[0], x[1] == w[0]
    if regular != transposed:
        return transposed
    if not regular:
        return None
    return math.prod(g[2:]) > math.prod(x[2:])


def _swap(shape: Shape) -> Shape:
    return (shape[1], shape[0], *shape[2:])


def _conv_backward_part(op: OpInputs) -> Work | NotCounted:
    """The old per-gradient ops, counted only when no parent backward was."""
    dtype = op.dtype(1)
    g = op.shape(1)
    if g is None:
        return NotCounted(NO_SHAPES, dtype, no_shapes=True)
    if op.name.endswith(GRAD_INPUT_SUFFIX):
        w = op.shape(2)
        if w is None or len(w) != len(g):
            return NotCounted(NO_SHAPES, dtype, no_shapes=True)
        return Work(CONV, _conv_flops(g, w, g, True), dtype)
    x = op.shape(2)
    kernel = parse_ints(op.value(0))
    if x is None or kernel is None or len(kernel) != len(x):
        return NotCounted("weight size not recorded", dtype)
    return Work(CONV, _conv_flops(_swap(x), _swap(g), _swap(kernel), False), dtype)


def is_conv_backward_part(name: str) -> bool:
    return (
        name.startswith("aten::")
        and (name.endswith(GRAD_INPUT_SUFFIX) or name.endswith(GRAD_WEIGHT_SUFFIXES))
        and "convolution" in name
    )


# --------------------------------------------------------------------------------------------
# Attention


@dataclass(frozen=True)
class _Attention:
    #: Index of the query (key and value follow it); grad_out is at 0 for a backward.
    query: int
    #: True: [batch, seq, heads, dim] (the flash/efficient kernels' own layout), else
    #: [batch, heads, seq, dim] (or any leading dims before [seq, dim]).
    seq_first: bool
    backward: bool


_ATTENTION: dict[str, _Attention] = {
    **{
        name: _Attention(0, False, False)
        for name in (
            "aten::scaled_dot_product_attention",
            "aten::_scaled_dot_product_attention_math",
            "aten::_scaled_dot_product_attention_math_for_mps",
            "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_fused_attention_overrideable",
            "aten::_cudnn_attention_forward",
        )
    },
    "aten::_flash_attention_forward": _Attention(0, True, False),
    "aten::_efficient_attention_forward": _Attention(0, True, False),
    **{
        name: _Attention(1, False, True)
        for name in (
            "aten::_scaled_dot_product_flash_attention_backward",
            "aten::_scaled_dot_product_efficient_attention_backward",
            "aten::_scaled_dot_product_cudnn_attention_backward",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            "aten::_scaled_dot_product_fused_attention_overrideable_backward",
            "aten::_cudnn_attention_backward",
        )
    },
    "aten::_flash_attention_backward": _Attention(1, True, True),
    "aten::_efficient_attention_backward": _Attention(1, True, True),
}


def _attention(op: OpInputs, spec: _Attention) -> Work | NotCounted:
    dtype = op.dtype(spec.query)
    q, k, v = (op.shape(spec.query + i) for i in range(3))
    if q is None or k is None or v is None:
        return NotCounted(NO_SHAPES, dtype, no_shapes=True)
    if spec.seq_first:
        if not len(q) == len(k) == len(v) == 4:
            # [total tokens, heads, dim]: packed variable-length batches, whose per-sequence
            # lengths are tensor values the trace does not hold.
            return NotCounted("variable-length attention: sequence lengths not recorded", dtype)
        q, k, v = (_heads_first(s) for s in (q, k, v))
    if min(len(q), len(k), len(v)) < 2 or q[-1] != k[-1] or k[-2] != v[-2]:
        return NotCounted(f"attention shapes q{list(q)} k{list(k)} v{list(v)} disagree", dtype)
    # Every leading dim of the query (batch x query heads; grouped key/value heads broadcast).
    rows = math.prod(q[:-2])
    s_q, d_q, s_k, d_v = q[-2], q[-1], k[-2], v[-1]
    if spec.backward:
        # Recompute the scores, then grad scores, grad V, grad Q and grad K: five products.
        flops = 2.0 * rows * s_q * s_k * (3 * d_q + 2 * d_v)
    else:
        flops = 2.0 * rows * s_q * s_k * (d_q + d_v)
    return Work(ATTENTION, flops, dtype)


def _heads_first(shape: Shape) -> Shape:
    return (shape[0], shape[2], shape[1], shape[3])


# --------------------------------------------------------------------------------------------
# The entry points


def compute_class(name: str) -> str | None:
    """The compute class an op name belongs to ("gemm", "conv", "attention"), else None."""
    if name in _GEMMS:
        return GEMM
    if name in _CONV_FORWARD or name in _CONV_BACKWARD or is_conv_backward_part(name):
        return CONV
    if name in _ATTENTION:
        return ATTENTION
    return None


def op_work(op: OpInputs, hint: ConvHint | None = None) -> Work | NotCounted | None:
    """The FLOPs of one call; None when it is not a compute op (or, like a matrix-vector product,
    one torch counts no FLOPs for)."""
    name = op.name
    if compute_class(name) is None:
        return None
    if not op.recorded:
        return NotCounted(NO_SHAPES, no_shapes=True)
    if op.oversized:
        return NotCounted(OVERSIZED, compute_dtype(op))
    outcome = _counted(op, name, hint)
    return bounded(outcome) if isinstance(outcome, Work) else outcome


def _counted(op: OpInputs, name: str, hint: ConvHint | None) -> Work | NotCounted | None:
    gemm = _GEMMS.get(name)
    if gemm is not None:
        return _gemm(op, *gemm)
    forward = _CONV_FORWARD.get(name)
    if forward is not None:
        return _conv_forward(op, forward, hint)
    backward = _CONV_BACKWARD.get(name)
    if backward is not None:
        return _conv_backward(op, backward, hint)
    if is_conv_backward_part(name):
        return _conv_backward_part(op)
    return _attention(op, _ATTENTION[name])


def compute_dtype(op: OpInputs) -> str:
    """The dtype of the op's matrix operands ("" when not recorded or not a compute op)."""
    gemm = _GEMMS.get(op.name)
    if gemm is not None:
        return op.dtype(gemm[0])
    if op.name in _CONV_FORWARD:
        return op.dtype(0)
    backward = _CONV_BACKWARD.get(op.name)
    if backward is not None:
        return op.dtype(backward.grad_output)
    attention = _ATTENTION.get(op.name)
    if attention is not None:
        return op.dtype(attention.query)
    return op.dtype(1) if is_conv_backward_part(op.name) else ""
