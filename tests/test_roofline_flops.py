"""The FLOPs of one op (diagnose.roofline.op_work) against hand-computed numbers, on the args torch
really records: a CPU trace made here with ``record_shapes`` (its "Input Dims", "Input type" and
"Concrete Inputs" as the trace reader keeps them), and for the CUDA-only attention variants the
layouts a real H100 trace holds and the aten schemas of the installed torch define."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from diagnose.roofline import op_work as ow
from diagnose.roofline.op_inputs import OpInputs, op_inputs
from diagnose.roofline.op_traffic import memory_traffic
from diagnose.roofline.op_work import (
    ATTENTION,
    GEMM,
    ConvHint,
    NotCounted,
    Work,
    compute_dtype,
    op_work,
)


def _recorded(event: dict[str, Any]) -> OpInputs:
    """An op's args as the trace reader keeps them (JSON text of the dims, types joined by ", ")."""
    args = event.get("args", {})
    concrete = args.get("Concrete Inputs")
    return op_inputs(
        event["name"],
        orjson.dumps(args["Input Dims"]).decode() if "Input Dims" in args else "",
        ", ".join(str(t) for t in args.get("Input type", [])),
        orjson.dumps(concrete).decode() if isinstance(concrete, list) else "",
    )


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[OpInputs]]:
    """Every recorded call of a CPU profile of the ops whose formulas are pinned, by op name."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    bias = torch.randn(7)
    ba, bb, bbias = torch.randn(3, 6, 5), torch.randn(3, 5, 7), torch.randn(3, 6, 7)
    # Odd spatial size, stride 2, padding 1, 2 groups: every term of the output size matters.
    img = torch.randn(2, 4, 17, 17, requires_grad=True)
    frozen_in = torch.randn(2, 4, 17, 17)
    conv = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
    frozen = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2).requires_grad_(False)
    # Different query and key lengths (and, on the math path, value dims): the formulas must
    # keep them apart.
    q = torch.randn(2, 3, 10, 16, requires_grad=True)
    k = torch.randn(2, 3, 7, 16, requires_grad=True)
    v = torch.randn(2, 3, 7, 16, requires_grad=True)
    v8 = torch.randn(2, 3, 7, 8)  # the CPU flash kernel needs equal dims: this takes the math path
    path = tmp_path_factory.mktemp("flops") / "ops.json"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a, b)
        torch.addmm(bias, a, b)
        torch.bmm(ba, bb)
        torch.baddbmm(bbias, ba, bb)
        conv(img).sum().backward()  # output_mask [True, True, True]
        conv(frozen_in).sum().backward()  # the input needs no gradient: [False, True, True]
        frozen(img).sum().backward()  # a frozen weight (LoRA's base): [True, False, False]
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v8)
    prof.export_chrome_trace(str(path))
    found: dict[str, list[OpInputs]] = {}
    for event in orjson.loads(path.read_bytes())["traceEvents"]:
        if event.get("cat") == "cpu_op":
            found.setdefault(event["name"], []).append(_recorded(event))
    for ops in found.values():
        ops.sort(key=lambda op: str(op.concrete))  # stable order independent of thread timing
    return found


def _work(op: OpInputs, hint: ConvHint | None = None) -> Work:
    outcome = op_work(op, hint)
    assert isinstance(outcome, Work), outcome
    return outcome


def test_matrix_products_are_2mnk_bias_not_counted(calls: dict[str, list[OpInputs]]) -> None:
    m, k, n = 6, 5, 7
    for name, batch in (
        ("aten::mm", 1),
        ("aten::addmm", 1),
        ("aten::bmm", 3),
        ("aten::baddbmm", 3),
    ):
        work = _work(calls[name][0])
        assert (work.op_class, work.dtype) == (GEMM, "float32")
        assert work.flops == 2 * batch * m * n * k, name
        assert work.mnk == (batch * m, n, k)
        assert not work.assumption


def test_linear_and_matmul_fold_leading_dims_into_m() -> None:
    linear = op_inputs(
        "aten::linear",
        "[[2,77,768],[320,768],[320]]",
        "c10::BFloat16, c10::BFloat16, c10::BFloat16",
    )
    work = _work(linear)
    assert work.flops == 2 * (2 * 77) * 320 * 768
    assert (work.mnk, work.dtype) == ((154, 320, 768), "bfloat16")
    # Broadcast batch dims: [2, 1, 10, 16] @ [3, 16, 4] -> batch 2 x 3.
    matmul = op_inputs("aten::matmul", "[[2,1,10,16],[3,16,4]]", "float, float")
    assert _work(matmul).flops == 2 * 6 * 10 * 4 * 16
    # A matrix-vector product: torch.utils.flop_counter counts none, so neither does this.
    assert op_work(op_inputs("aten::matmul", "[[10,16],[16]]", "float, float")) is None


def test_conv2d_forward_reads_stride_padding_groups(calls: dict[str, list[OpInputs]]) -> None:
    # [2, 4, 17, 17] * [8, 2, 3, 3], stride 2, padding 1, dilation 1, groups 2:
    # out = (17 + 2 - 2 - 1) // 2 + 1 = 9; FLOPs = 2 * N * Cout * 9 * 9 * (Cin / groups) * 3 * 3.
    expected = 2 * 2 * 8 * 9 * 9 * 2 * 9
    conv2d = calls["aten::conv2d"][0]
    assert conv2d.value(3) == "[2, 2]" and conv2d.value(6) == "2"
    assert _work(conv2d).flops == expected
    # The ops nested under it record their args in other orders (mkldnn: padding before stride);
    # each must still give the same count.
    for name in ("aten::convolution", "aten::_convolution", "aten::mkldnn_convolution"):
        if name in calls:
            assert _work(calls[name][0]).flops == expected, name


def test_conv_forward_without_concrete_inputs_is_not_guessed(
    calls: dict[str, list[OpInputs]],
) -> None:
    recorded = calls["aten::conv2d"][0]
    bare = OpInputs(recorded.name, recorded.shapes, recorded.lists, recorded.types, None)
    outcome = op_work(bare)
    assert isinstance(outcome, NotCounted) and "stride/padding" in outcome.reason
    hinted = _work(bare, ConvHint(output=(9, 9), output_from="from the backward"))
    assert hinted.flops == 2 * 2 * 8 * 9 * 9 * 2 * 9
    assert hinted.assumption == "from the backward"


def test_convolution_backward_follows_output_mask(calls: dict[str, list[OpInputs]]) -> None:
    forward = 2 * 2 * 8 * 9 * 9 * 2 * 9
    # torch counts the weight gradient with the full Cin (groups x the forward's FLOPs).
    grad_weight = 2 * 9 * (9 * 9) * 4 * 8 * 2
    assert grad_weight == 2 * forward
    by_mask = {}
    for op in calls["aten::convolution_backward"]:
        assert op.shape(0) == (2, 8, 9, 9) and op.shape(1) == (2, 4, 17, 17)
        by_mask[op.value(10)] = _work(op).flops
    assert by_mask == {
        "[True, True, True]": forward + grad_weight,
        "[False, True, True]": grad_weight,
        "[True, False, False]": forward,
    }
    # Without the mask: the hint decides, and the count says it assumed.
    op = calls["aten::convolution_backward"][0]
    bare = OpInputs(op.name, op.shapes, op.lists, op.types, None)
    assert isinstance(op_work(bare), NotCounted)
    hinted = _work(bare, ConvHint(mask=(True, False), mask_from="frozen weight"))
    assert (hinted.flops, hinted.assumption) == (forward, "frozen weight")


def test_cpu_attention_forward_and_backward(calls: dict[str, list[OpInputs]]) -> None:
    rows, s_q, s_k, d = 2 * 3, 10, 7, 16
    # Q K^T and (softmax) V: two batched products.
    forward = 2 * rows * s_q * s_k * d + 2 * rows * s_q * s_k * d
    # Recomputed scores, grad scores, grad V, grad Q, grad K.
    backward = 2 * rows * s_q * s_k * (3 * d + 2 * d)
    flash = _work(calls["aten::_scaled_dot_product_flash_attention_for_cpu"][0])
    assert (flash.op_class, flash.flops, flash.dtype) == (ATTENTION, forward, "float32")
    work = _work(calls["aten::_scaled_dot_product_flash_attention_for_cpu_backward"][0])
    assert (work.op_class, work.flops, work.dtype) == (ATTENTION, backward, "float32")
    # The math path (value dim 8) is counted like a forward where it is recorded as one op.
    math_path = 2 * rows * s_q * s_k * d + 2 * rows * s_q * s_k * 8
    outer = sorted(_work(op).flops for op in calls["aten::scaled_dot_product_attention"])
    assert outer == sorted([forward, math_path])
    assert _work(calls["aten::_scaled_dot_product_attention_math"][0]).flops == math_path


# Layouts of the CUDA variants. The forward ones are as a real H100 trace records them
# (../shared/gpu-traces/cuda/h100_bert_small_infer.json.gz): the _scaled_dot_product_* ops take
# [batch, heads, seq, dim], the _flash/_efficient kernels' own ops [batch, seq, heads, dim].
_BHSD = "[[1,8,141,64],[1,8,141,64],[1,8,141,64]"
_BSHD = "[[1,141,8,64],[1,141,8,64],[1,141,8,64]"
_BF16 = "c10::BFloat16, c10::BFloat16, c10::BFloat16"
_FORWARD = 2 * 8 * 141 * 141 * (64 + 64)
_BACKWARD = 2 * 8 * 141 * 141 * (3 * 64 + 2 * 64)


@pytest.mark.parametrize(
    ("name", "dims", "types", "expected"),
    [
        ("aten::_scaled_dot_product_flash_attention", _BHSD + ",[],[],[],[]]", _BF16, _FORWARD),
        ("aten::_flash_attention_forward", _BSHD + ",[],[],[],[],[]]", _BF16, _FORWARD),
        ("aten::_scaled_dot_product_efficient_attention", _BHSD + ",[],[],[]]", _BF16, _FORWARD),
        ("aten::_efficient_attention_forward", _BSHD + ",[],[],[]]", _BF16, _FORWARD),
        ("aten::_scaled_dot_product_cudnn_attention", _BHSD + ",[],[]]", _BF16, _FORWARD),
        # grad_out first, then query, key, value (the schemas; see the schema test below).
        (
            "aten::_scaled_dot_product_flash_attention_backward",
            "[[1,8,141,64]," + _BHSD[1:] + ",[1,8,141,64],[1,8,141]]",
            _BF16 + ", " + _BF16,
            _BACKWARD,
        ),
        (
            "aten::_scaled_dot_product_efficient_attention_backward",
            "[[1,8,141,64]," + _BHSD[1:] + ",[],[1,8,141,64],[1,8,160]]",
            _BF16 + ", c10::BFloat16, , c10::BFloat16, float",
            _BACKWARD,
        ),
        (
            "aten::_flash_attention_backward",
            "[[1,141,8,64]," + _BSHD[1:] + ",[1,141,8,64],[1,8,141]]",
            _BF16 + ", " + _BF16,
            _BACKWARD,
        ),
        (
            "aten::_efficient_attention_backward",
            "[[1,141,8,64]," + _BSHD[1:] + ",[],[1,141,8,64]]",
            _BF16 + ", c10::BFloat16, , c10::BFloat16",
            _BACKWARD,
        ),
        (
            "aten::_scaled_dot_product_cudnn_attention_backward",
            "[[1,8,141,64]," + _BHSD[1:] + ",[1,8,141,64],[1,8,141,1]]",
            _BF16 + ", " + _BF16,
            _BACKWARD,
        ),
    ],
)
def test_cuda_attention_variants(name: str, dims: str, types: str, expected: int) -> None:
    work = _work(op_inputs(name, dims, types))
    assert (work.op_class, work.flops, work.dtype) == (ATTENTION, expected, "bfloat16")


def test_variable_length_attention_is_not_guessed() -> None:
    packed = op_inputs(
        "aten::_flash_attention_forward", "[[300,8,64],[300,8,64],[300,8,64]]", _BF16
    )
    outcome = op_work(packed)
    assert isinstance(outcome, NotCounted) and "variable-length" in outcome.reason


def test_h100_trace_layouts(shared_traces: Path) -> None:
    """The two forward layouts as the real trace records them give the same FLOPs."""
    import gzip

    events = orjson.loads(
        gzip.decompress((shared_traces / "cuda/h100_bert_small_infer.json.gz").read_bytes())
    )["traceEvents"]
    seen: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "cpu_op" and event["name"] in (
            "aten::_scaled_dot_product_flash_attention",
            "aten::_flash_attention_forward",
        ):
            seen[event["name"]] = _work(_recorded(event)).flops
    assert seen == {
        "aten::_scaled_dot_product_flash_attention": _FORWARD,
        "aten::_flash_attention_forward": _FORWARD,
    }


def _arguments(name: str) -> list[str] | None:
    """The positional argument names of the op's longest overload; None when this torch has no
    such op (the pre-1.11 convolution backward ops: their positions come from the V100 trace)."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return None
    return max(
        (
            [a.name for a in getattr(packet, o)._schema.arguments if not a.kwarg_only]
            for o in packet.overloads()
        ),
        key=len,
    )


def test_argument_positions_match_the_installed_torch() -> None:
    """The profiler records inputs in schema order: every position op_work reads is checked
    against the schema of the installed torch, for the ops that cannot run on this machine."""
    checked = 0
    for name, spec in ow._ATTENTION.items():
        args = _arguments(name)
        if args is None:
            continue
        checked += 1
        if spec.backward:
            assert args[0].startswith("grad_out"), (name, args)
        assert args[spec.query : spec.query + 3] == ["query", "key", "value"], (name, args)
    for name, conv in ow._CONV_FORWARD.items():
        args = _arguments(name)
        if args is None:
            continue
        checked += 1
        assert args[:2] in (["input", "weight"], ["self", "weight"]), (name, args)
        assert args[conv.stride] == "stride" and args[conv.padding] == "padding", (name, args)
        if conv.dilation >= 0:
            assert args[conv.dilation] == "dilation", (name, args)
        if not isinstance(conv.transposed, bool):
            assert args[conv.transposed] == "transposed", (name, args)
    for name, back in ow._CONV_BACKWARD.items():
        args = _arguments(name)
        if args is None:
            continue
        checked += 1
        assert args[back.grad_output] == "grad_output" and args[back.weight] == "weight", name
        assert args[back.input] in ("input", "self"), (name, args)
        assert args[back.mask if back.mask >= 0 else -1] == "output_mask", (name, args)
        if not isinstance(back.transposed, bool):
            assert args[back.transposed] == "transposed", (name, args)
    assert checked >= 25


def test_compute_dtype_and_memory_traffic() -> None:
    lora_b = op_inputs("aten::linear", "[[1,256,16],[32,16],[]]", "c10::BFloat16, float, ")
    assert compute_dtype(lora_b) == "bfloat16"
    # add_ of two [8, 4, 3, 3] fp32 tensors: both read, one written.
    add = memory_traffic(
        op_inputs("aten::add_", "[[8,4,3,3],[8,4,3,3],[]]", "float, float, Scalar")
    )
    assert add is not None and add.bytes == 3 * 288 * 4
    norm = memory_traffic(
        op_inputs(
            "aten::group_norm",
            "[[1,8,128,128],[],[8],[8],[],[]]",
            "c10::BFloat16, Scalar, c10::BFloat16, c10::BFloat16, Scalar, Scalar",
        )
    )
    assert norm is not None and norm.bytes == 2 * 8 * 128 * 128 * 2 + 2 * 8 * 2
    cat = memory_traffic(op_inputs("aten::cat", "[[[1,16],[1,16]],[]]", "TensorList, Scalar"))
    # The list is one input (32 elements read) and the output as big: 2 x 32 x 4 bytes.
    assert cat is not None and cat.assumed_list_dtype and cat.bytes == 2 * 32 * 4
    assert memory_traffic(op_inputs("aten::mm", "[[2,2],[2,2]]", "float, float")) is None
    assert op_work(op_inputs("aten::add_", "[[2],[2],[]]", "float, float, Scalar")) is None


def test_not_recorded_shapes() -> None:
    outcome = op_work(op_inputs("aten::mm", "", ""))
    assert isinstance(outcome, NotCounted) and outcome.no_shapes
