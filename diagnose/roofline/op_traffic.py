"""The bytes one memory-bound operator moves, from what a profiler trace records about it: its
name and the dims and types of its inputs (``record_shapes``).

Memory-bound ops (elementwise, norm, reduction, softmax) get a byte count where compute ops get a
FLOPs count (:mod:`diagnose.roofline.op_work`): every tensor input read once plus one output the
size of the largest input. Pure: no torch import, so a trace is analysed anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnose.roofline.op_inputs import TENSOR_TYPES, OpInputs


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


_ELEMENTWISE = _names(
    """add sub mul div neg exp exp2 log log1p pow sqrt rsqrt reciprocal sigmoid tanh relu gelu
    silu mish hardswish hardsigmoid leaky_relu elu softplus clamp clamp_min clamp_max where
    masked_fill copy fill zero abs sign sin cos lerp addcmul addcdiv maximum minimum rsub
    native_dropout dropout gelu_backward silu_backward threshold_backward sigmoid_backward
    tanh_backward native_dropout_backward mish_backward hardswish_backward leaky_relu_backward
    cat stack bitwise_and bitwise_or eq ne lt le gt ge logical_and logical_or logical_not
    erf erfinv floor ceil round trunc frac isnan isinf nan_to_num"""
)
_NORM = _names(
    """layer_norm native_layer_norm group_norm native_group_norm batch_norm native_batch_norm
    _native_batch_norm_legit _native_batch_norm_legit_no_training _batch_norm_impl_index
    cudnn_batch_norm miopen_batch_norm instance_norm rms_norm _fused_rms_norm
    native_layer_norm_backward native_group_norm_backward native_batch_norm_backward
    cudnn_batch_norm_backward miopen_batch_norm_backward _fused_rms_norm_backward
    batch_norm_backward _batch_norm_impl_index_backward"""
)
_REDUCTION = _names(
    """sum mean amax amin max min var std var_mean std_mean norm linalg_vector_norm mse_loss
    mse_loss_backward l1_loss smooth_l1_loss huber_loss nll_loss nll_loss_forward
    nll_loss_backward nll_loss2d_forward cross_entropy_loss logsumexp argmax argmin cumsum
    prod all any"""
)
_SOFTMAX = _names(
    """softmax _softmax log_softmax _log_softmax _softmax_backward_data
    _log_softmax_backward_data _safe_softmax"""
)
_MEMORY = _ELEMENTWISE | _NORM | _REDUCTION | _SOFTMAX

#: Bytes per element assumed for a tensor list, whose dtype torch does not record.
LIST_ITEM_BYTES = 4


def is_memory_op(name: str) -> bool:
    """Elementwise, norm, reduction and softmax ops (a trailing ``_`` in-place form included)."""
    if not name.startswith("aten::"):
        return False
    base = name[6:]
    if base.startswith("_foreach_"):
        return True
    return base in _MEMORY or base.rstrip("_") in _MEMORY


@dataclass(frozen=True)
class Traffic:
    """Bytes a memory-bound op moves: every input read once plus an output as big as the largest
    input (by the inputs' dtypes)."""

    bytes: float
    #: True when a tensor list's items were counted at LIST_ITEM_BYTES (dtype not recorded).
    assumed_list_dtype: bool = False


def memory_traffic(op: OpInputs) -> Traffic | None:
    """The op's bytes; None when it is not a memory-bound op or moves no recorded tensor."""
    if not is_memory_op(op.name) or not op.recorded or op.oversized:
        return None
    sizes: list[float] = []
    assumed = False
    typed = [TENSOR_TYPES[t][1] for t in op.types if t in TENSOR_TYPES]
    list_item = typed[0] if typed else LIST_ITEM_BYTES
    for index, shape in enumerate(op.shapes):
        if shape is not None:
            sizes.append(float(math.prod(shape)) * TENSOR_TYPES[op.types[index]][1])
            continue
        items = op.lists[index] if index < len(op.lists) else None
        if items:
            assumed = assumed or not typed
            sizes.append(float(sum(math.prod(s) for s in items)) * list_item)
    if not sizes:
        return None
    return Traffic(sum(sizes) + max(sizes), assumed)
