"""The "roofline" trace rule on real traces: the FLOPs it counts per step against
torch.utils.flop_counter.FlopCounterMode over the same step and against a hand count from the
layers' shapes (a small module, and the UNet forward of the tiny SD1.5 LoRA step of this
project); the shared real GPU traces; and the clean twin without record_shapes.

The reader keeps each op's "Concrete Inputs" (stride, padding, output_mask), which torch records
since 2.1. A trace from an older torch has none: :func:`_without_args` is the same trace with
those columns empty, so the tests run the rule both ways, with them (exact) and without (what it
infers, and what it lists as not counted).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from diagnose.trace.analysis import TraceAnalysis, analyze_parsed, read_trace
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.rules.roofline import CHECK_ID, MASK_FROM_GRADS, OUTPUT_FROM_BACKWARD

aten = torch.ops.aten


def _without_args(parsed: ParsedTrace) -> ParsedTrace:
    """``parsed`` as an older torch records it: no Concrete Inputs, no flops arg."""
    n = len(parsed.host)
    host = dataclasses.replace(
        parsed.host,
        concrete_inputs=np.full(n, -1, dtype=np.int32),
        flops=np.full(n, np.nan),
    )
    return dataclasses.replace(parsed, host=host)


def _roofline(analysis: TraceAnalysis) -> tuple[dict[str, Any], str, str]:
    """The rule's data, "ok" and its summary when it counted, or its check's "not_judged" and
    text (a count is a number, not a verdict: only a count that failed is a check)."""
    data = analysis.rule_data.get("roofline", {})
    checks = [c for c in analysis.checks if c.id == CHECK_ID]
    if not checks:
        return data, "ok", str(data["summary"])
    (check,) = checks
    assert check.source == "trace:roofline" and check.outcome == "not_judged"
    assert "summary" not in data
    return data, check.outcome, check.text


def _raw(op: Any) -> Callable[..., int]:
    """torch's own formula for ``op``, unwrapped (custom_mapping wraps it again)."""
    formula: Callable[..., int] = flop_registry[op].__wrapped__
    return formula


#: torch.utils.flop_counter has no formula for the CPU flash attention ops: map them to its own
#: formulas for the CUDA ones (same arguments first: grad_out, query, key, value).
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _raw(
        aten._scaled_dot_product_flash_attention
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _raw(
        aten._scaled_dot_product_flash_attention_backward
    ),
}


def flop_counter_total(step: Callable[[], None]) -> int:
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        step()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------------------------
# A small module: Linear + strided Conv2d + grouped Conv2d + scaled_dot_product_attention


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 48)
        self.conv = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.gconv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.queries: list[tuple[torch.Size, bool]] = []

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        q = self.lin(x).view(2, 10, 3, 16).transpose(1, 2)
        self.queries.append((q.shape, q.requires_grad))
        attended = F.scaled_dot_product_attention(q, q, q)
        features: torch.Tensor = self.gconv(self.conv(img))
        loss: torch.Tensor = attended.pow(2).mean() + features.pow(2).mean()
        return loss


@dataclasses.dataclass
class Layer:
    module: torch.nn.Module
    input: torch.Size
    output: torch.Size
    input_grad: bool


def hand_count(layers: list[Layer], queries: list[tuple[torch.Size, bool]]) -> dict[str, float]:
    """FLOPs of one step by phase, from the shapes the hooks saw (torch's conventions: a bias is
    not counted; a convolution's weight gradient with the full input channels)."""
    forward = backward = 0.0
    for layer in layers:
        if isinstance(layer.module, torch.nn.Linear):
            one = 2.0 * layer.input[:-1].numel() * layer.input[-1] * layer.output[-1]
            weight_grad = one
        else:
            assert isinstance(layer.module, torch.nn.Conv2d)
            n, c_out, h, w = layer.output
            kh, kw = layer.module.kernel_size
            one = 2.0 * n * c_out * h * w * (layer.input[1] // layer.module.groups) * kh * kw
            weight_grad = one * layer.module.groups
        forward += one
        backward += weight_grad + (one if layer.input_grad else 0.0)
    for (b, h, s, d), needs_grad in queries:
        forward += 2.0 * b * h * s * s * d * 2
        backward += 2.0 * b * h * s * s * (3 * d + 2 * d) if needs_grad else 0.0
    return {"forward": forward, "backward": backward}


@dataclasses.dataclass
class Capture:
    path: Path
    hand: dict[str, float]
    flop_counter: int
    #: FunctionEvent flops of the profiled steps (with_flops), by op name, in time order.
    profiler_flops: dict[str, list[float]]


def capture_small(folder: Path, *, record_shapes: bool = True, with_flops: bool = False) -> Capture:
    torch.manual_seed(0)
    model = Small()
    x, img = torch.randn(2, 10, 32), torch.randn(2, 4, 16, 16)
    layers: list[Layer] = []

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        layers.append(Layer(module, args[0].shape, output.shape, args[0].requires_grad))

    for module in (model.lin, model.conv, model.gconv):
        module.register_forward_hook(hook)

    def step() -> None:
        model(x, img).backward()

    step()  # warm-up, outside the profile
    path = folder / f"small_{record_shapes}_{with_flops}.json"
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=record_shapes, with_flops=with_flops
    ) as prof:
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # outside the steps: not counted
        # Four steps: a busy machine that stretches one of them cannot make another read as the
        # stub torch.profiler leaves at its end (a last step far shorter than the median).
        for number in (1, 2, 3, 4):
            with record_function(f"ProfilerStep#{number}"):
                step()
    prof.export_chrome_trace(str(path))
    layers.clear()
    model.queries.clear()
    counted = flop_counter_total(step)
    profiler_flops: dict[str, list[float]] = {}
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        profiler_flops.setdefault(event.name, []).append(float(event.flops or 0))
    return Capture(path, hand_count(layers, model.queries), counted, profiler_flops)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    return capture_small(tmp_path_factory.mktemp("small"))


def test_small_module_matches_flop_counter_and_hand_count(small: Capture) -> None:
    parsed = read_trace(small.path)
    data, outcome, text = _roofline(analyze_parsed(parsed))
    assert outcome == "ok" and data["basis"] == "trace shapes"
    assert data["steps"] == 4
    hand = small.hand["forward"] + small.hand["backward"]
    counted = data["flops_per_step"]
    assert counted == pytest.approx(small.flop_counter, rel=0.05)
    assert counted == pytest.approx(hand, rel=0.05)
    # The phases split as the hand count does: forward ops in forward, autograd in backward.
    assert data["flops_by_phase"] == pytest.approx(small.hand)
    assert data["flops_by_class"]["conv"] > 0 and data["flops_by_class"]["attention"] > 0
    assert data["flops_by_dtype"] == {"float32": pytest.approx(counted)}
    assert data["largest_gemm"]["m"] * data["largest_gemm"]["k"] == 20 * 32
    assert data["uncounted"] == {} and data["assumptions"] == []
    assert data["memory_bytes_per_step"] > 0 and data["memory_host_seconds"] > 0
    assert "counted from the ops' recorded shapes" in text
    assert json.loads(json.dumps(data)) == data  # plain JSON types, as the record writes them


def test_small_module_without_concrete_inputs_infers_and_says_so(small: Capture) -> None:
    """The reader as it is: each conv's output size is read from its backward; the backward's
    output_mask from the gradients the step accumulates, the input's gradient taken as needed.
    The first conv's input needs none: that one term is over-counted, and the count says what
    it assumed."""
    data, outcome, _ = _roofline(analyze_parsed(_without_args(read_trace(small.path))))
    assert outcome == "ok" and data["uncounted"] == {}
    assert any(a.startswith(OUTPUT_FROM_BACKWARD) for a in data["assumptions"])
    assert any(a.startswith(MASK_FROM_GRADS) for a in data["assumptions"])
    first_conv_grad_input = 2.0 * 2 * 8 * 8 * 8 * 4 * 3 * 3
    assert data["flops_per_step"] == pytest.approx(small.flop_counter + first_conv_grad_input)
    assert data["flops_by_phase"]["forward"] == pytest.approx(small.hand["forward"])


def test_without_record_shapes_nothing_is_counted(tmp_path: Path, small: Capture) -> None:
    twin = capture_small(tmp_path, record_shapes=False)
    data, outcome, text = _roofline(analyze_parsed(read_trace(twin.path)))
    assert outcome == "not_judged" and "record_shapes was off" in text
    assert data["basis"] == "none"
    # Unknown, not zero: a reader must never take 0 FLOPs for a count.
    assert data["flops_per_step"] is None and data["memory_bytes_per_step"] is None
    shaped, shaped_outcome, _ = _roofline(analyze_parsed(read_trace(small.path)))
    assert shaped_outcome == "ok" and shaped["flops_per_step"] > 0


def test_the_trace_flops_arg_is_preferred(tmp_path: Path) -> None:
    """A strided conv without backward: its output size is nowhere in the shapes; with a flops arg
    (torch's profiler computes it for aten::conv2d with with_flops) it is counted from that."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
    img = torch.randn(1, 3, 33, 33)
    path = tmp_path / "frozen_conv.json"
    with (
        torch.no_grad(),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof,
        record_function("ProfilerStep#1"),
    ):
        conv(img)
    prof.export_chrome_trace(str(path))
    parsed = read_trace(path)
    bare, outcome, _ = _roofline(analyze_parsed(_without_args(parsed)))
    assert outcome == "not_judged" and bare["uncounted"] == {"aten::conv2d": 1.0}
    assert "stride/padding/dilation not recorded" in bare["notes"][0]

    (event,) = [e for e in prof.events() if e.name == "aten::conv2d"]
    rows = [i for i in range(len(parsed.host)) if parsed.names[parsed.host.name[i]] == event.name]
    hand = 2.0 * 1 * 8 * 17 * 17 * 3 * 3 * 3  # out = (33 + 2 - 2 - 1) // 2 + 1 = 17
    assert float(event.flops) == hand
    # torch's exporter does not write the flops it computed: place them where a trace that has
    # the arg keeps them.
    bare_trace = _without_args(parsed)
    n = len(parsed.host)
    flops = np.where(np.arange(n) == rows[0], float(event.flops), np.nan)
    no_concrete = dataclasses.replace(
        bare_trace, host=dataclasses.replace(bare_trace.host, flops=flops)
    )
    data, outcome, text = _roofline(analyze_parsed(no_concrete))
    assert outcome == "ok" and data["basis"] == "trace flops args"
    assert data["flops_per_step"] == hand and data["uncounted"] == {}
    assert "flops args" in text


# --------------------------------------------------------------------------------------------
# The tiny SD1.5 LoRA step of this project


class HandCount:
    """Forward FLOPs of the modules it hooks, 2 per multiply-add, bias adds not counted."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.flops = 0.0
        self.armed = False
        self.handles: list[Any] = []
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                self.handles.append(module.register_forward_hook(self._layer))
            elif type(module).__name__ == "Attention" and hasattr(module, "to_q"):
                self.handles.append(
                    module.register_forward_pre_hook(self._attention, with_kwargs=True)
                )

    def _layer(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if not self.armed:
            return
        x = inputs[0]
        if isinstance(module, torch.nn.Linear):
            self.flops += 2.0 * x[..., 0].numel() * module.in_features * module.out_features
            return
        assert isinstance(module, torch.nn.Conv2d)
        n, c_out, h, w = output.shape
        kh, kw = module.kernel_size
        self.flops += 2.0 * n * c_out * h * w * (module.in_channels // module.groups) * kh * kw

    def _attention(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.armed:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        context = kwargs.get("encoder_hidden_states")
        if context is None and len(args) > 1:
            context = args[1]
        batch, queries = hidden.shape[0], hidden.shape[1]
        keys = queries if context is None else context.shape[1]
        head_dim = module.to_q.out_features // module.heads
        # q·kᵀ and attention·v: two products of b·h·q·k·d multiply-adds each.
        self.flops += 2 * (2.0 * batch * module.heads * queries * keys * head_dim)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclasses.dataclass
class UnetCapture:
    path: Path
    flop_counter: int
    #: FLOPs of the UNet's forward in the profiled (exported) step, counted by hand.
    forward_by_hand: float


@pytest.fixture(scope="module")
def unet_step(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UnetCapture]:
    from diagnose.config import RunConfig
    from diagnose.device import describe_device, select_device
    from diagnose.run import resolve_config
    from diagnose.timing import PhaseTimer
    from diagnose.workload import build_workload

    device = select_device("auto")
    info = describe_device(device)
    config = resolve_config(RunConfig(), info.kind, info.memory_bytes)
    workload = build_workload(config, device)
    hand = HandCount(workload.components.denoiser)
    try:
        timer = PhaseTimer(lambda: None)
        batches = workload.batches()
        workload.step(next(batches), timer)
        path = tmp_path_factory.mktemp("unet") / "step.json"
        with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        ) as prof:
            workload.step(next(batches), timer)
            prof.step()
            hand.armed = True  # the active (exported) step only
            workload.step(next(batches), timer)
            hand.armed = False
            prof.step()

        def one_step() -> None:
            workload.step(next(batches), timer)

        yield UnetCapture(path, flop_counter_total(one_step), hand.flops)
    finally:
        hand.close()
        workload.close()


def test_unet_lora_step_matches_flop_counter(unet_step: UnetCapture) -> None:
    parsed = read_trace(unet_step.path)
    exact, outcome, _ = _roofline(analyze_parsed(parsed))
    assert outcome == "ok" and exact["steps"] == 1
    assert exact["flops_per_step"] == pytest.approx(unet_step.flop_counter, rel=0.05)
    assert exact["uncounted"] == {}
    assert set(exact["flops_by_phase"]) >= {"encode", "forward", "backward"}
    # bf16-mixed: autocast runs the fp32 LoRA weights' products in bf16, and so are they counted.
    assert set(exact["flops_by_dtype"]) == {"bfloat16"}

    # Without Concrete Inputs: the VAE encoder's and the first UNet convs have no backward to
    # read their output size from; they are listed, never guessed.
    bare, bare_outcome, text = _roofline(analyze_parsed(_without_args(parsed)))
    assert bare_outcome == "ok" and "aten::conv2d" in bare["uncounted"]
    assert "aten::conv2d" in text
    assert bare["flops_per_step"] < exact["flops_per_step"]
    # The backward needs no stride: frozen base convs (LoRA) accumulate no weight gradient, and
    # the mask inferred from that is the recorded one.
    assert bare["flops_by_phase"]["backward"] == pytest.approx(exact["flops_by_phase"]["backward"])


def test_unet_forward_flops_match_a_hand_count(unet_step: UnetCapture) -> None:
    # The UNet forward's FLOPs in the profiled step, against a count by hand from its layers'
    # shapes: every Linear and Conv2d it calls (LoRA's A and B included) and every attention
    # module's q·kᵀ and attention·v products, read by hooks during that same step.
    by_hand = unet_step.forward_by_hand
    data = analyze_parsed(read_trace(unet_step.path)).rule_data["roofline"]
    assert data["steps"] == 1 and data["uncounted"] == {}
    assert by_hand > 1e6
    assert data["flops_by_phase"]["forward"] == pytest.approx(by_hand, rel=0.05)


# --------------------------------------------------------------------------------------------
# The shared real GPU traces

#: trace -> (outcome, FLOPs per step counted > 0)
GPU_TRACES = {
    "cuda/a100_alexnet_train.json.gz": ("not_judged", False),  # captured without record_shapes
    "cuda/a100_triton_example.json.gz": ("ok", False),  # one Triton kernel, no aten compute op
    "cuda/h100_bert_small_infer.json.gz": ("ok", True),
    "cuda/v100_resnet50_num_workers_0.json.gz": ("ok", True),
    "cuda/v100_resnet50_num_workers_4.json.gz": ("ok", True),
    "edge/cpu_only.json.gz": ("not_judged", False),  # no operator inside the steps
    "edge/mi210_gpu_only.json.gz": ("not_judged", False),  # no CPU ops at all
    "rocm/mi250_minitoy_train.json.gz": ("ok", True),
    "rocm/mi300x_bert_small_infer.json.gz": ("ok", True),
    "rocm/mi300x_normalization_train.json.gz": ("ok", False),  # norm layers only
    "rocm/mi300x_resnet_ddp_bf16_train.json.gz": ("ok", True),
    "rocm/mi300x_torch_compile_triton.json.gz": ("ok", True),
}


@pytest.mark.parametrize("name", sorted(GPU_TRACES))
def test_shared_gpu_traces(shared_traces: Path, name: str) -> None:
    path = shared_traces / name
    outcome, has_flops = GPU_TRACES[name]
    for parsed in (_without_args(read_trace(path)), read_trace(path)):
        data, got, text = _roofline(analyze_parsed(parsed))
        assert got == outcome, text
        if outcome == "not_judged":
            assert data["basis"] == "none" and data["flops_per_step"] is None
            continue
        assert data["basis"] == "trace shapes"
        assert (data["flops_per_step"] > 0) == has_flops
        assert data["uncounted"] == {}


def test_gpu_traces_agree_across_vendors_and_with_the_model(shared_traces: Path) -> None:
    """The same BERT on an H100 and an MI300X does the same work; ResNet-50 training at batch 32
    does about 3 x 4.1 GMAC x 2 x 32 (its first conv computes no input gradient)."""

    def flops(name: str) -> dict[str, Any]:
        path = shared_traces / name
        data, _, _ = _roofline(analyze_parsed(read_trace(path)))
        return data

    h100 = flops("cuda/h100_bert_small_infer.json.gz")
    mi300x = flops("rocm/mi300x_bert_small_infer.json.gz")
    assert h100["flops_per_step"] == mi300x["flops_per_step"]
    assert h100["flops_by_dtype"] == {"bfloat16": h100["flops_per_step"]}
    resnet = flops("cuda/v100_resnet50_num_workers_0.json.gz")
    assert resnet["flops_per_step"] == pytest.approx(3 * 4.1e9 * 2 * 32, rel=0.03)
    assert resnet["flops_by_phase"]["backward"] == pytest.approx(
        2 * resnet["flops_by_phase"]["forward"], rel=0.03
    )
