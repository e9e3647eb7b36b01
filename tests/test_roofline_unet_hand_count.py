"""The FLOPs the trace rule counts for the tiny SD1.5 UNet's forward, against a count by hand from
its layers' shapes: every Linear and Conv2d the forward calls (LoRA's A and B included) and every
attention module's q·kᵀ and attention·v products, read by hooks during the same profiled step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.trace import analyze_parsed, read_trace


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


@pytest.fixture(scope="module")
def unet_forward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    from diagnose.config import RunConfig
    from diagnose.device import describe_device, select_device
    from diagnose.run import resolve_config
    from diagnose.timing import PhaseTimer
    from diagnose.workload import build_workload

    device = select_device("cpu")
    info = describe_device(device)
    workload = build_workload(resolve_config(RunConfig(), info.kind, info.memory_bytes), device)
    counter = HandCount(workload.components.denoiser)
    try:
        timer = PhaseTimer(lambda: None)
        batches = workload.batches()
        path = tmp_path_factory.mktemp("unet-hand") / "step.json"
        with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        ) as prof:
            workload.step(next(batches), timer)
            prof.step()
            counter.armed = True  # the active (exported) step only
            workload.step(next(batches), timer)
            counter.armed = False
            prof.step()
        yield path, counter.flops
    finally:
        counter.close()
        workload.close()


def test_unet_forward_flops_match_a_hand_count(unet_forward: tuple[Path, float]) -> None:
    path, by_hand = unet_forward
    data = analyze_parsed(read_trace(path)).rule_data["roofline"]
    assert data["steps"] == 1 and data["uncounted"] == {}
    assert by_hand > 1e6
    assert data["flops_by_phase"]["forward"] == pytest.approx(by_hand, rel=0.05)
