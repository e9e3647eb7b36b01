"""The attention probe's capture: the recorder and the profiler attribution on a toy module (the
path, shapes, switches and backward of each call; torch's own event tree; checkpoint
recomputation; autocast's dtype). The probe on real steps is ``test_attention_probe.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diagnose import attention_paths as ap
from diagnose.probes.attention.attribution import attribute, events_from_profiler
from diagnose.probes.attention.capture import AttentionRecorder


class ToyAttention(torch.nn.Module):
    """Named like an attention module, so the recorder hooks it."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.manual = manual
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        if self.manual:
            out: torch.Tensor = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, dim=-1) @ v
            return out
        return F.scaled_dot_product_attention(q, k, v)


def _record(model: torch.nn.Module, backend: SDPBackend | None = None) -> list[Any]:
    x = torch.randn(2, 16, 32)
    recorder = AttentionRecorder({"toy": model})
    forced: Any = sdpa_kernel(backend) if backend is not None else torch.enable_grad()
    with torch.profiler.profile(record_shapes=True) as prof, recorder, forced:
        model(x).sum().backward()
    calls: list[Any] = attribute(
        recorder.calls,
        events_from_profiler(prof),
        op_owner=recorder.op_owner,
        module_spans=recorder.module_spans,
        on_device=False,
    )
    return calls


def test_recorder_sees_path_shapes_switches_and_backward() -> None:
    (fused,) = _record(ToyAttention())
    assert (fused.module, fused.processor, fused.entry) == ("toy", "ToyAttention", "sdpa")
    assert fused.path == ap.FLASH and fused.provider == "torch SDPA (CPU)"
    sig = fused.signature
    assert sig is not None and (sig.batch, sig.heads, sig.q_len, sig.head_dim) == (2, 4, 16, 8)
    assert sig.backward and sig.dtype == "float32"
    assert fused.switches["flash_sdp_enabled"] is True
    assert fused.forward_seconds > 0 and fused.backward_seconds > 0

    (forced,) = _record(ToyAttention(), SDPBackend.MATH)
    assert forced.path == ap.MATH and forced.switches["flash_sdp_enabled"] is False
    assert forced.ops == ["aten::_scaled_dot_product_attention_math"]
    assert forced.backward_seconds > 0  # the math path's bmm/softmax backward nodes

    (manual,) = _record(ToyAttention(manual=True))
    assert manual.entry == "manual" and manual.path == ap.MANUAL
    msig = manual.signature
    assert msig is not None and (msig.batch, msig.heads, msig.q_len, msig.kv_len) == (2, 4, 16, 16)
    assert manual.forward_seconds > 0 and manual.backward_seconds > 0


def _tree_shape(events: list[Any]) -> Counter[tuple[Any, ...]]:
    """Each event by what attribution reads of it, but its parent (ids differ by reading)."""
    return Counter(
        (
            e.name,
            e.sequence_nr,
            e.thread,
            e.fwd_thread,
            tuple(e.input_dtypes),
            repr(e.input_shapes),
        )
        for e in events
    )


def _parents_of_long_ops(fast: list[Any], slow: list[Any]) -> list[tuple[str, str, str]]:
    """The ops of ``fast`` that last long enough to have an unambiguous parent, with their
    parent's name in each reading: an op of a microsecond or two (a view, a fill) starts or ends
    within the clocks' rounding of a neighbour's edge, and the two readings may break that tie
    differently; attribution reads the parents of attention, matmul and softmax ops."""
    fast_names = {e.id: e.name for e in fast}
    slow_names = {e.id: e.name for e in slow}
    # The readings count time from different origins (the raw one from the clock's epoch).
    fast_origin = min(e.start_us for e in fast)
    slow_origin = min(e.start_us for e in slow)
    pairs = []
    for e in fast:
        if e.cpu_us < 20.0:
            continue
        twin = min(
            (o for o in slow if o.name == e.name and o.thread == e.thread),
            key=lambda o: abs((o.start_us - slow_origin) - (e.start_us - fast_origin)),
        )
        pairs.append(
            (
                e.name,
                fast_names.get(e.parent, "") if e.parent is not None else "",
                slow_names.get(twin.parent, "") if twin.parent is not None else "",
            )
        )
    return pairs


@pytest.mark.parametrize("checkpointed", [False, True])
def test_raw_reading_gives_torchs_own_tree(checkpointed: bool) -> None:
    # The probe reads the profiler's raw results on the CPU (torch's tree costs more than the
    # step); both readings must give the same events, parents, autograd numbers and shapes.
    model: torch.nn.Module = Checkpointed() if checkpointed else ToyAttention()
    x = torch.randn(2, 16, 32)
    with (
        torch.profiler.profile(record_shapes=True) as prof,
        torch.profiler.record_function("outer"),
    ):
        model(x).sum().backward()
    fast = events_from_profiler(prof)
    slow = events_from_profiler(prof, on_device=True)  # torch's own FunctionEvent tree
    assert len(fast) > 20 and any(e.parent is not None for e in fast)
    assert _tree_shape(fast) == _tree_shape(slow)
    long_ops = _parents_of_long_ops(fast, slow)
    assert len(long_ops) >= 5
    assert [(name, a) for name, a, _ in long_ops] == [(name, b) for name, _, b in long_ops]
    timed = {e.name: e.cpu_us for e in slow}
    assert all(abs(e.cpu_us - timed[e.name]) < 1.0 for e in fast if e.name == "outer")


class Checkpointed(torch.nn.Module):
    """Gradient checkpointing: the attention's forward runs again inside the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ToyAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return out


def test_checkpoint_recomputation_is_told_apart() -> None:
    first, again = _record(Checkpointed())
    assert not first.recomputed and again.recomputed
    # The recomputation runs inside the backward, where the mode does not see Python calls:
    # the profiler finds it, with its shapes, as an extra forward of the same module.
    assert again.entry == "op" and again.module == "toy.inner" and again.path == ap.FLASH
    assert again.signature is not None and not again.signature.backward
    assert (again.signature.batch, again.signature.heads, again.signature.q_len) == (2, 4, 16)
    # Autograd numbers the recomputed nodes as the first forward's: one forward+backward plus
    # one extra forward per step, which is what checkpointing costs.
    assert first.backward_nodes > 0 and first.signature is not None and first.signature.backward


def test_autocast_dtype_comes_from_the_kernel() -> None:
    model = ToyAttention()
    x = torch.randn(2, 16, 32)
    recorder = AttentionRecorder({"toy": model})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof, recorder, autocast, torch.no_grad():
        model(x)
    (call,) = attribute(
        recorder.calls,
        events_from_profiler(prof),
        op_owner=recorder.op_owner,
        module_spans=recorder.module_spans,
        on_device=False,
    )
    assert call.signature is not None and call.signature.dtype == "bfloat16"
    assert not call.signature.backward and call.backward_seconds == 0
