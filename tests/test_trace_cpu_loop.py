"""CPU traces captured here by a plain user training loop (DataLoader, autocast, AdamW,
torch.profiler with a schedule), each with one planted fault and a clean twin."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, TensorDataset

from diagnose.trace.analysis import TraceAnalysis, analysis_to_record, analyze_trace
from tests.conftest import ok_lines, one_torch_thread, unjudged_lines
from tests.synthetic_gpu import lora_loop

# Big enough that a step takes ~10 ms on a CPU: a 1 ms scheduling hiccup while fetching a batch on
# a loaded CI machine must not read as a data-starved loop in the clean twin.
SEQ, DIM, HEADS = 128, 128, 4


class TinyAttentionModel(torch.nn.Module):
    """A projection, self-attention and an output projection; ``mode`` plants one fault."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if self.mode == "manual":  # the legacy hand-written attention
            weights = torch.softmax(q @ k.transpose(-1, -2) * (DIM // HEADS) ** -0.5, dim=-1)
            attended = weights @ v
        else:
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        h = attended.transpose(1, 2).reshape(b, SEQ, DIM)
        out: torch.Tensor
        if self.mode == "upcast":  # an fp32 island inside the bf16 autocast region
            with torch.autocast("cpu", enabled=False):
                out = h.float() @ self.out.weight.float().T + self.out.bias.float()
        elif self.mode == "float_under_autocast":  # autocast lowers this matmul back to bf16
            out = h.float() @ self.out.weight.float().T
        else:
            out = self.out(h)
        return out


#: Profiled steps: enough that the rank-based interval a rule holds a share against its line
#: with leaves out one step that waited most of its time (a process descheduled for a time slice
#: on a busy machine); with a few steps that one step's share stretches the interval across the
#: line.
PROFILED = 16


def capture(
    path: Path, mode: str = "clean", loader_sleep: float = 0.0, stall_at: int | None = None
) -> Path:
    """Profile :data:`PROFILED` steps of a user loop (after 1 profiler warm-up step) and save the
    trace. ``loader_sleep``: every batch takes that long to load; with ``stall_at``, only that
    batch does, for ``loader_sleep`` times the step before it (a stall the size of a step on any
    machine, fast or slow)."""
    torch.manual_seed(0)
    model = TinyAttentionModel(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(8 * (PROFILED + 2), SEQ, DIM))

    batches = 0
    last_step_s = 0.0

    def collate(batch: list[tuple[torch.Tensor]]) -> torch.Tensor:
        nonlocal batches
        # A slow decode/augment in the main process. Never time.sleep(0): it gives the core away,
        # and on a busy machine the clean twin would then wait a time slice for its batch.
        if loader_sleep and stall_at is None:
            time.sleep(loader_sleep)
        elif loader_sleep and batches == stall_at:
            time.sleep(loader_sleep * last_step_s)
        batches += 1
        return torch.stack([b[0] for b in batch])

    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    forced = sdpa_kernel(SDPBackend.MATH) if mode == "math" else contextlib.nullcontext()
    with (
        one_torch_thread(),  # the rules read shares of the steps (see one_torch_thread)
        forced,
        profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            schedule=schedule(wait=0, warmup=1, active=PROFILED, repeat=1),
        ) as prof,
    ):
        for i, x in enumerate(loader):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.step()
            last_step_s = time.perf_counter() - started
            if i == PROFILED:
                break
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TraceAnalysis]]:
    folder = tmp_path_factory.mktemp("cpu_traces")
    modes = {
        "clean": {},
        "math": {"mode": "math"},
        "manual": {"mode": "manual"},
        "upcast": {"mode": "upcast"},
        "float_under_autocast": {"mode": "float_under_autocast"},
        # Several steps' time per batch: far over a tenth of a step on a loaded 2-core machine.
        "slow_loader": {"loader_sleep": 0.05},
        # One profiled step waits about a step's time for its batch (half that step, a few
        # percent of all of them), the rest none.
        "one_stall": {"loader_sleep": 1.2, "stall_at": PROFILED // 2},
    }
    yield {
        name: analyze_trace(capture(folder / f"{name}.json", **kwargs))  # type: ignore[arg-type]
        for name, kwargs in modes.items()
    }


def finding_ids(a: TraceAnalysis) -> set[str]:
    return {f.id for f in a.findings}


def test_steps_and_phases_of_a_user_loop(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["clean"]
    assert a.device.kind == "cpu"
    assert [s.number for s in a.steps] == list(range(1, PROFILED + 1))
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert a.breakdown.seconds.get(phase, 0) > 0, phase
    for step in a.steps:
        assert sum(step.phases.values()) == pytest.approx(step.wall_seconds)
    assert a.top_ops and a.top_ops[0].self_cpu_seconds > 0
    assert any(o.input_dtypes for o in a.top_ops)
    record = analysis_to_record(a, Path(a.path))
    assert record.timing.profiled.n == PROFILED and record.timing.unprofiled.n == 0
    assert record.breakdown.basis == "trace"


def test_clean_loop_has_no_findings(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["clean"]
    assert not finding_ids(a)
    ok = " | ".join(ok_lines(a))
    assert "attention: the fused flash path ran" in ok
    assert "precision: all" in ok and "bf16" in ok
    assert "data loading:" in ok


def test_forced_math_attention_is_found(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["math"]
    assert "attention.math_fallback" in finding_ids(a)
    finding = next(f for f in a.findings if f.id == "attention.math_fallback")
    assert finding.evidence["calls_per_step"] == 1
    assert any("_scaled_dot_product_attention_math" in op for op in finding.evidence["ops"])
    assert finding.evidence["input_shapes"] and finding.saving_basis == "estimated"
    # The math path's internal fp32 bmm belongs to this finding, not to the precision rule.
    assert "precision.fp32_compute_in_low_precision_run" not in finding_ids(a)


def test_hand_written_attention_is_found(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["manual"]
    assert "attention.unfused_manual" in finding_ids(a)
    assert "attention.math_fallback" not in finding_ids(a)
    finding = next(f for f in a.findings if f.id == "attention.unfused_manual")
    assert finding.evidence["calls_per_step"] == 1
    assert "AttnProcessor2_0" in finding.fix


def test_fp32_island_in_bf16_run_is_found(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["upcast"]
    finding = next(f for f in a.findings if f.id == "precision.fp32_compute_in_low_precision_run")
    assert finding.severity == "warn"
    ops = finding.evidence["ops"]
    assert ops[0]["op"] in ("aten::mm", "aten::addmm") and ops[0]["op"] in finding.title
    assert ops[0]["input_shapes"]  # the shapes are in the evidence
    assert ops[0]["pass"] == "forward"
    assert "precision.fp32_training" not in finding_ids(a)


def test_float_under_autocast_is_lowered_and_not_flagged(
    analysed: dict[str, TraceAnalysis],
) -> None:
    """`x.float() @ w.float().T` inside autocast: the outer aten::matmul has fp32 inputs, but
    autocast casts them and the aten::mm that runs is bf16; children decide, so no finding."""
    a = analysed["float_under_autocast"]
    assert not any(f.category == "precision" for f in a.findings)
    assert any(line.startswith("precision: all") for line in ok_lines(a))


def test_slow_loader_is_found(analysed: dict[str, TraceAnalysis]) -> None:
    slow = analysed["slow_loader"]
    finding = next(f for f in slow.findings if f.id == "dataloader.gpu_starved")
    assert finding.evidence["num_workers_zero"] is True
    assert finding.evidence["data_wait_seconds_per_step"] >= 0.025
    assert "num_workers" in finding.fix
    assert "dataloader.gpu_starved" not in finding_ids(analysed["clean"])


def test_one_step_that_waited_is_not_a_starved_loop(analysed: dict[str, TraceAnalysis]) -> None:
    """A loop that waits in one step (a time slice lost to another process, a cold file) is not
    starved: the steps' shares hold the wait under the line, not at it."""
    stalled = analysed["one_stall"]
    waits = sorted(step.phases.get("data_wait", 0.0) / step.wall_seconds for step in stalled.steps)
    assert waits[-1] > 0.4 > waits[-2], waits  # the stall is there, in one step
    assert "dataloader.gpu_starved" not in finding_ids(stalled)
    assert any(line.startswith("data loading:") for line in ok_lines(stalled))


def test_gpu_rules_say_they_could_not_judge(analysed: dict[str, TraceAnalysis]) -> None:
    a = analysed["clean"]
    assert any(line.startswith("syncs:") for line in unjudged_lines(a))
    assert any(line.startswith("launch overhead") for line in unjudged_lines(a))
    # The record keeps them where the report's "could not be checked" reads them.
    trace_result = analysis_to_record(a, Path(a.path)).probes[0]
    assert (
        unjudged_lines(trace_result) == unjudged_lines(a) and "not_judged" not in trace_result.data
    )


def test_diagnose_phase_labels_take_precedence(tmp_path: Path) -> None:
    """The trace `diagnose run` writes carries diagnose::<phase> ranges; they decide the phases
    (an h2d phase exists on a CPU only through its label; a sleep in forward is forward)."""
    from diagnose.capture import measure
    from diagnose.timing import PhaseTimer

    class Workload:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.loader = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=4)

        def batches(self) -> Iterator[tuple[torch.Tensor]]:
            while True:
                yield from self.loader

        def step(self, batch: tuple[torch.Tensor], timer: PhaseTimer) -> float:
            with timer.phase("h2d"):
                x = batch[0].to(self.device, copy=True)
            with timer.phase("forward"):
                time.sleep(0.01)
                loss = self.model(x).pow(2).mean()
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad()
            return float(loss.detach())

    trace = tmp_path / "trace.json.gz"
    measure(Workload(), steps=1, warmup=1, profiled_steps=2, trace_path=trace)
    a = analyze_trace(trace)
    assert a.metadata["diagnose_phase_labels"] is True
    assert len(a.steps) == 2
    assert a.breakdown.seconds["h2d"] > 0
    assert a.breakdown.seconds["forward"] >= 0.009
    assert a.breakdown.seconds["backward"] > 0 and a.breakdown.seconds["optimizer"] > 0


class WrappingOptimizer(torch.optim.Optimizer):
    """A wrapper that steps an inner optimizer inside its own step (as accelerate's does): its
    Optimizer.step range holds the inner one."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, inner.defaults)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.inner.step(closure)


def capture_unscheduled(path: Path, iterations: int, *, wrap: bool = False) -> Path:
    """A loop profiled with a bare `with profile()`: no schedule, no prof.step() markers."""
    torch.manual_seed(0)
    model = TinyAttentionModel("clean")
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if wrap:
        optimizer = WrappingOptimizer(optimizer)
    x = torch.randn(8, SEQ, DIM)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(iterations):
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    prof.export_chrome_trace(str(path))
    return path


@pytest.mark.parametrize("wrap", [False, True])
def test_steps_are_read_from_optimizer_steps_without_profiler_step_markers(
    tmp_path: Path, wrap: bool
) -> None:
    """Five iterations and no prof.step(): four steps, optimizer step end to optimizer step end
    (a wrapping optimizer's nested step does not split them), each about one iteration long."""
    a = analyze_trace(capture_unscheduled(tmp_path / "loop.json", 5, wrap=wrap))
    assert [s.number for s in a.steps] == [1, 2, 3, 4]
    assert not a.whole_trace_window
    assert any("read from the optimizer steps" in note for note in a.notes)
    for step in a.steps:
        assert sum(step.phases.values()) == pytest.approx(step.wall_seconds)
        assert step.phases.get("forward", 0) > 0 and step.phases.get("optimizer", 0) > 0
    # Each step holds one iteration: four of the five fit in the trace, none holds two.
    events = json.loads((tmp_path / "loop.json").read_text())["traceEvents"]
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if "ts" in e and e.get("ph") == "X"
    ]
    whole = (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e6
    total = sum(s.wall_seconds for s in a.steps)
    assert total < whole
    assert statistics.median(s.wall_seconds for s in a.steps) < whole / 3


def test_one_optimizer_step_and_no_markers_is_one_window(tmp_path: Path) -> None:
    a = analyze_trace(capture_unscheduled(tmp_path / "once.json", 1))
    assert a.whole_trace_window and len(a.steps) == 1
    assert any("whole trace" in note for note in a.notes)


def test_a_short_last_step_is_a_step_and_the_profilers_stub_is_not(tmp_path: Path) -> None:
    """A busy machine stretched the first steps twenty times over: the last, short one still
    holds a backward pass and is a step (a duration rule alone took it for torch.profiler's
    closing stub). The twin, a real trace: the range a scheduled profiler leaves between its last
    step() and stop(), with no training in it, is left out."""
    plain = analyze_trace(lora_loop(tmp_path / "plain.json", steps=4))
    one = plain.steps[0].wall_seconds
    stretched = analyze_trace(
        lora_loop(tmp_path / "stretched.json", steps=4, stretched_us=(20 * one * 1e6,) * 3)
    )
    assert [s.number for s in stretched.steps] == [2, 3, 4, 5]
    assert stretched.steps[-1].wall_seconds < 0.1 * stretched.steps[0].wall_seconds
    assert not any("stub" in note for note in stretched.notes)

    torch.manual_seed(0)
    model = TinyAttentionModel("clean")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, SEQ, DIM)
    stub = tmp_path / "stub.json"
    with profile(
        activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=4)
    ) as prof:
        for _ in range(4):  # the profiler's warm-up step, then three recorded
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            time.sleep(0.2)
            prof.step()
    prof.export_chrome_trace(str(stub))
    b = analyze_trace(stub)
    assert len(b.steps) == 3
    assert any("is the stub torch.profiler leaves" in note for note in b.notes)
