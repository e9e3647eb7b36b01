"""One classification of compute precision, shared by the ``precision`` probe and trace rule.

Both ask the same question of an operator: in a run that asked for bf16 or fp16, did this op
compute in the requested dtype, and if it computed in fp32, was that expected? The probe sees
live ops (``aten.addmm.default``, torch dtypes) and the trace rule sees recorded ones
(``aten::addmm``, ``c10::BFloat16``); both go through the functions here so that an op is judged
the same way whichever of the two saw it:

- *low*: a matmul, convolution or attention op that ran in bf16/fp16/fp8;
- *unexpected*: one of those that ran in fp32 although low precision was requested (autocast
  would have lowered it; something kept it in fp32: an upcast, fp32 weights, autocast disabled);
- *by_policy*: softmax, norms, losses and reductions, which autocast deliberately runs in fp32;
- *deliberate*: fp32 or complex math a model asks for on purpose (RoPE tables in complex64 in an
  autocast-disabled region, a VAE kept in fp32 under ``force_upcast``);
- *other*: everything else (elementwise ops follow their inputs and are not judged).

Light module: no torch import, so ``diagnose trace`` stays torch-free.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from diagnose.record import DeviceInfo
from diagnose.units import pct

# --------------------------------------------------------------------------------------------
# Constants

#: Dtypes that count as "the low precision a user asked for".
LOW_PRECISION_DTYPES: frozenset[str] = frozenset({"bf16", "fp16", "fp8"})

OpKind = Literal["matmul", "conv", "attention", "fp32_by_policy", "other"]
Verdict = Literal["low", "unexpected", "by_policy", "deliberate", "other"]
#: The op kinds that should run in the requested low precision.
COMPUTE_KINDS: tuple[OpKind, ...] = ("matmul", "conv", "attention")

# --------------------------------------------------------------------------------------------
# Op names

_MATMUL = re.compile(
    r"^(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation|_scaled_mm|einsum"
    r"|addmv|mv|dot|vdot|linalg_vecdot|_int_mm|_weight_int\w*mm\w*|\w*gemm\w*)$"
)
_CONV = re.compile(
    r"^(conv[123]d|conv_transpose[123]d|_?convolution|convolution_overrideable|_convolution_mode"
    r"|convolution_backward\w*|_conv_depthwise2d\w*|slow_conv\w*|thnn_conv\w*"
    r"|cudnn_convolution\w*|miopen_convolution\w*|miopen_depthwise_convolution\w*"
    r"|mkldnn_convolution\w*|conv_tbc)$"
)
#: Any op named for attention is an attention kernel: aten's SDPA family and the custom ops of
#: xformers ("xformers::efficient_attention_forward_cutlass") or flash-attn ("flash_attn::...").
_ATTENTION = re.compile(
    r"^(scaled_dot_product_attention|_scaled_dot_product_\w+|\w*flash_attn\w*|\w*attention\w*"
    r"|_native_multi_head_attention|\w*fmha\w*|flash_fwd\w*|flash_bwd\w*)$"
)
#: What autocast runs in fp32 on purpose (its fp32 op lists), and the norms, losses and
#: reductions a mixed-precision recipe keeps in fp32, with their backward ops.
_BY_POLICY = re.compile(
    r"^(_?(log_)?softmax(_backward_data)?|_?(log_)?softmax_backward\w*"
    r"|\w*_norm(_backward)?\w*|native_\w*norm\w*|_native_batch_norm_legit\w*|batch_norm\w*"
    r"|_fused_rms_norm\w*|norm|renorm|linalg_vector_norm|linalg_norm|frobenius_norm"
    r"|\w*_loss(_backward)?\w*|binary_cross_entropy\w*|cross_entropy\w*|kl_div|nll_loss\w*"
    r"|sum|mean|prod|cumsum|cumprod|logsumexp|var|std|var_mean|std_mean|dist|cdist|pdist"
    r"|_cdist_\w+|cosine_similarity|_euclidean_dist"
    r"|exp|expm1|log|log10|log2|log1p|reciprocal|rsqrt|pow|erfinv|softplus(_backward)?"
    r"|acos|asin|cosh|sinh|tan)$"
)


def op_base_name(name: str) -> str:
    """The operator without namespace or overload: "aten::addmm", "aten.addmm.default" and
    "addmm.default" are all "addmm"."""
    text = name.strip()
    if "::" in text:
        text = text.split("::", 1)[1]
    elif text.startswith(("aten.", "prims.")):
        text = text.split(".", 1)[1]
    return text.split(".", 1)[0]


def op_kind(name: str) -> OpKind:
    """What kind of op ``name`` is (any of the spellings :func:`op_base_name` takes)."""
    base = op_base_name(name)
    if _ATTENTION.match(base):
        return "attention"
    if _MATMUL.match(base):
        return "matmul"
    if _CONV.match(base):
        return "conv"
    if _BY_POLICY.match(base):
        return "fp32_by_policy"
    return "other"


def is_compute_op(name: str) -> bool:
    """A matmul, convolution or attention op: one that should run in the requested dtype."""
    return op_kind(name) in COMPUTE_KINDS


def is_attention_op(name: str) -> bool:
    return op_kind(name) == "attention"


# --------------------------------------------------------------------------------------------
# Dtypes

_DTYPES = {
    "float": "fp32",
    "float32": "fp32",
    "c10::float": "fp32",
    "tf32": "fp32",
    "c10::bfloat16": "bf16",
    "bfloat16": "bf16",
    "c10::half": "fp16",
    "half": "fp16",
    "float16": "fp16",
    "double": "fp64",
    "float64": "fp64",
    "c10::complex<float>": "complex64",
    "complex64": "complex64",
    "complexfloat": "complex64",
    "c10::complex<double>": "complex128",
    "complex128": "complex128",
    "complexdouble": "complex128",
    "c10::complex<c10::half>": "complex32",
    "complex32": "complex32",
    "complexhalf": "complex32",
}
#: Lower rank wins a tie: ``_scaled_mm(fp8, fp8, fp32 scale, fp32 scale)`` is an fp8 op.
_RANK = {"fp8": 0, "fp16": 1, "bf16": 1, "complex32": 1, "fp32": 2, "complex64": 2, "fp64": 3}


def normalize_dtype(text: str) -> str | None:
    """Short dtype name ("fp32", "bf16", "fp16", "fp8", "fp64", "complex64"...) of a torch dtype
    string ("torch.bfloat16") or a profiler ``Input type`` entry ("c10::BFloat16"), else None
    (integers, bools, non-tensor arguments)."""
    lowered = text.strip().lower().removeprefix("torch.")
    if lowered in _DTYPES:
        return _DTYPES[lowered]
    if "float8" in lowered:
        return "fp8"
    return None


def is_complex(dtype: str | None) -> bool:
    return bool(dtype) and str(dtype).startswith("complex")


def majority_dtype(dtypes: Iterable[str | None]) -> str | None:
    """The compute dtype of an op from its inputs' dtypes (normalised names or None): the majority
    float input, ties to the lower precision."""
    found = [d for d in dtypes if d]
    if not found:
        return None
    counts = Counter(found)
    return min(counts, key=lambda d: (-counts[d], _RANK.get(d, 9)))


def requested_low_dtype(precision: str) -> str | None:
    """The low-precision dtype a ``--precision`` value asks the compute to run in (None: fp32)."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision in ("fp16", "16-mixed", "16"):
        return "fp16"
    return None


# --------------------------------------------------------------------------------------------
# Judging one op

#: Modules that compute rotary / sinusoidal position tables in fp32 on purpose.
_DELIBERATE_MODULE = re.compile(
    r"(^|[._])(rotary\w*|rope\w*|pos_embed\w*|position_embed\w*|freqs\w*)($|\.)", re.IGNORECASE
)
_DELIBERATE_CLASS = re.compile(r"(Rotary|Rope|PosEmbed|PositionalEmbedding)", re.IGNORECASE)


def deliberate_reason(
    *,
    dtype: str | None,
    module_path: str = "",
    module_class: str = "",
    component_reason: str = "",
) -> str | None:
    """Why an op's fp32 (or complex) math is deliberate, or None when it is not.

    ``component_reason`` is set by the caller when the whole component (or this module) is kept
    in fp32 on purpose (the VAE under ``force_upcast``, a module in ``_keep_in_fp32_modules``).
    """
    if is_complex(dtype):
        return "complex arithmetic (rotary position embedding tables)"
    if component_reason:
        return component_reason
    if module_path and _DELIBERATE_MODULE.search(module_path):
        return "position embedding computed in fp32 on purpose"
    if module_class and _DELIBERATE_CLASS.search(module_class):
        return "position embedding computed in fp32 on purpose"
    return None


#: Python-level attention calls: the compute ops inside one (the math path's bmm) are judged
#: with the attention call, which the attention probe and rule examine, not one by one.
ATTENTION_FUNCTIONS: frozenset[str] = frozenset({"scaled_dot_product_attention"})


def judge(
    kind: OpKind,
    dtype: str | None,
    requested_low: str | None,
    deliberate: str | None,
    *,
    inside_attention: bool = False,
) -> Verdict:
    """The verdict on one op (see the module docstring). ``requested_low`` None (an fp32 run)
    judges nothing: every op is ``other``; so is a matmul inside an attention call. Elementwise
    fp32 ops stay ``other`` even in a deliberate region: only compute and complex math is
    called deliberate."""
    if requested_low is None or dtype is None:
        return "other"
    if inside_attention and kind in ("matmul", "conv"):
        return "other"
    if dtype in LOW_PRECISION_DTYPES or dtype == "complex32":
        return "low" if kind in COMPUTE_KINDS else "other"
    if is_complex(dtype):
        return "deliberate" if deliberate else "other"
    if dtype in ("fp32", "fp64"):
        if kind in COMPUTE_KINDS:
            return "deliberate" if deliberate else "unexpected"
        if kind == "fp32_by_policy":
            return "by_policy"
    return "other"


# --------------------------------------------------------------------------------------------
# Warnings

#: Warnings that say a dtype mismatch made torch skip a fused kernel or cast behind the user's
#: back ("Mismatch dtype between input and weight: ... Cannot dispatch to fused implementation"
#: from the fused RMSNorm/LayerNorm, and their relatives).
_DTYPE_WARNING = re.compile(
    r"mismatch(ed)? dtype|dtype mismatch|cannot dispatch to fused|different dtypes?"
    r"|expected .{0,40}dtype|upcast(ed|ing)? to (float32|fp32)|casting .{0,40}to float32",
    re.IGNORECASE,
)


def is_dtype_warning(message: str) -> bool:
    """Whether a warning's text is about a dtype mismatch or a silent upcast."""
    return bool(_DTYPE_WARNING.search(message))


# --------------------------------------------------------------------------------------------
# Device and fixes


def device_bf16_native(info: DeviceInfo) -> bool | None:
    """Whether ``info``'s device computes bf16 natively (None when it cannot be told)."""
    from diagnose.bf16_hardware import bf16_native

    return bf16_native(info)


def recommended_low_dtype(info: DeviceInfo) -> str:
    """bf16 where the device computes it natively (or it cannot be told), else fp16 (pre-Ampere
    NVIDIA, RDNA1/RDNA2 and Vega AMD)."""
    return "fp16" if info.kind != "cpu" and device_bf16_native(info) is False else "bf16"


# --------------------------------------------------------------------------------------------
# Claimed vs actual


def dtype_shares(seconds_by_dtype: Mapping[str, float]) -> dict[str, float]:
    """Share of the total per dtype (0..1), largest first; empty when nothing was timed."""
    total = sum(v for v in seconds_by_dtype.values() if v > 0)
    if total <= 0:
        return {}
    shares = {d: v / total for d, v in seconds_by_dtype.items() if v > 0}
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def claimed_vs_actual(
    requested: str, seconds_by_dtype: Mapping[str, float], fp32_where: Sequence[str] = ()
) -> str:
    """ "requested bf16-mixed → actual: 93% of GEMM/conv/attention time in bf16, 7% in fp32
    (fp32: down_blocks.1.attentions.0.proj_in, ...)" from the compute time per dtype; without
    ``requested`` (a trace, where it is unknown) only the "actual: ..." part."""
    shares = dtype_shares(seconds_by_dtype)
    prefix = f"requested {requested} → actual: " if requested else "actual: "
    if not shares:
        return prefix + "no matmul/conv/attention time measured"
    parts = [f"{pct(share)} in {dtype}" for dtype, share in shares.items()]
    parts[0] = parts[0].replace(" in ", " of GEMM/conv/attention time in ", 1)
    text = prefix + ", ".join(parts)
    if fp32_where:
        shown = list(fp32_where[:4])
        more = len(fp32_where) - len(shown)
        text += " (fp32: " + ", ".join(shown) + (f" and {more} more" if more > 0 else "") + ")"
    return text


__all__ = [
    "ATTENTION_FUNCTIONS",
    "COMPUTE_KINDS",
    "LOW_PRECISION_DTYPES",
    "OpKind",
    "Verdict",
    "claimed_vs_actual",
    "deliberate_reason",
    "device_bf16_native",
    "dtype_shares",
    "is_attention_op",
    "is_complex",
    "is_compute_op",
    "is_dtype_warning",
    "judge",
    "majority_dtype",
    "normalize_dtype",
    "op_base_name",
    "op_kind",
    "recommended_low_dtype",
    "requested_low_dtype",
]
