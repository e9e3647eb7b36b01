"""The timing loop and profiler capture, on a small real training loop (not the diffusers one)."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from diagnose.capture import measure
from diagnose.record import PHASES
from diagnose.timing import PhaseTimer


class _SmallWorkload:
    """A real model, optimizer and DataLoader; the forward sleeps a known time when asked."""

    def __init__(self, forward_sleep: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        data = TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
        self.loader = DataLoader(data, batch_size=8, shuffle=True)
        self.forward_sleep = forward_sleep

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self.loader

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], timer: PhaseTimer) -> float:
        with timer.phase("h2d"):
            x, y = (t.to(self.device) for t in batch)
        with timer.phase("forward"):
            if self.forward_sleep:  # never sleep(0): it gives the core to another process
                time.sleep(self.forward_sleep)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def test_samples_phases_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json.gz"
    m = measure(_SmallWorkload(), steps=4, warmup=2, profiled_steps=2, trace_path=trace)
    timing = m.timing
    assert len(timing.warmup_seconds) == 2
    assert [s.profiled for s in timing.samples] == [False] * 4 + [True] * 2
    assert timing.unprofiled.n == 4 and timing.profiled.n == 2
    assert timing.first_batch_seconds is not None and timing.first_batch_seconds >= 0
    for sample in timing.samples:
        assert set(sample.phases) == {
            "data_wait",
            "h2d",
            "forward",
            "backward",
            "optimizer",
            "other",
        }
        # The phases and "other" add up to the step time.
        assert abs(sum(sample.phases.values()) - sample.seconds) < 1e-6
        assert sample.loss is not None
    assert timing.peak_rss_bytes and timing.peak_rss_bytes > 10 * 2**20
    assert m.breakdown.basis == "measured"
    assert [p for p in PHASES if p in m.breakdown.seconds] == list(m.breakdown.seconds)

    assert m.trace_path == trace
    with gzip.open(trace, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    names = {e.get("name", "") for e in events}
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert len(steps) == 2, steps  # the profiler warm-up step is not recorded
    assert {"diagnose::forward", "diagnose::backward", "diagnose::optimizer"} <= names
    assert any(e.get("args", {}).get("Input Dims") for e in events), "shapes were not recorded"
    # Exported through a temporary JSON beside it, compressed and renamed: nothing else is left.
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json.gz"]


def test_a_failed_trace_export_leaves_no_file(tmp_path: Path) -> None:
    """Planted: the export fails halfway (a full disk). Neither the trace nor a temporary file
    is left; the clean twin writes a gzip trace holding the profiled op, nothing beside it."""
    from diagnose.capture import export_trace

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8).add(1)

    class HalfWritten:
        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_text('{"traceEvents": [')
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        export_trace(HalfWritten(), tmp_path / "trace.json.gz")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []

    export_trace(prof, tmp_path / "trace.json.gz")
    with gzip.open(tmp_path / "trace.json.gz", "rt") as handle:
        names = {e.get("name") for e in json.load(handle)["traceEvents"]}
    assert "aten::add" in names
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json.gz"]


def test_a_slow_phase_shows_in_the_breakdown() -> None:
    m = measure(
        _SmallWorkload(forward_sleep=0.05), steps=3, warmup=0, profiled_steps=0, trace_path=None
    )
    assert m.trace_path is None
    assert m.timing.profiled.n == 0
    assert m.breakdown.seconds["forward"] >= 0.05
    assert max(m.breakdown.seconds, key=lambda k: m.breakdown.seconds[k]) == "forward"
    assert m.timing.unprofiled.median >= 0.05


class _Pixels:
    """A batch of images of one bucket, as the diffusers workload's loader yields them."""

    def __init__(self, side: int) -> None:
        self.pixels = torch.zeros(1, 3, side, side)


class _TwoBucketWorkload:
    """Steps alternate a small and a large bucket; the large one costs a known extra time."""

    def __init__(self, small: int, large: int, extra: float) -> None:
        self.device = torch.device("cpu")
        self.small, self.large, self.extra = small, large, extra

    def batches(self) -> Iterator[_Pixels]:
        while True:
            yield _Pixels(self.small)
            yield _Pixels(self.large)

    def step(self, batch: _Pixels, timer: PhaseTimer) -> float:
        with timer.phase("forward"):
            time.sleep(0.04 + (self.extra if batch.pixels.shape[-1] == self.large else 0.0))
        return 0.0


def test_two_buckets_are_timed_apart_and_not_called_noise() -> None:
    """Multi-bucket training is the normal case: steps of 64 and 96 px alternate, the larger
    costing several times more. Each step records its input shape; the run's s/it is the bucket
    mix, and the spread is judged within each bucket (the clean twin: one bucket, no mix)."""
    from diagnose.record import new_record
    from diagnose.reports.headline import build_headline

    m = measure(
        _TwoBucketWorkload(64, 96, 0.4), steps=8, warmup=0, profiled_steps=0, trace_path=None
    )
    assert {s.bucket for s in m.timing.samples} == {"64x64", "96x96"}
    buckets = m.timing.buckets()
    assert set(buckets) == {"64x64", "96x96"}
    assert buckets["96x96"].median > 3 * buckets["64x64"].median
    mix = (buckets["64x64"].median + buckets["96x96"].median) / 2
    assert m.timing.per_iteration == pytest.approx(mix)
    record = new_record("run")
    record.timing = m.timing
    headline = build_headline(record)
    # All steps together have an IQR far above the noise threshold; the noise verdict is each
    # bucket's own (quiet unless a loaded machine stretched the sleeps within one bucket).
    from diagnose.reports.headline import NOISY_RELATIVE_SPREAD

    assert m.timing.unprofiled.relative_spread > 0.5
    within = max(b.relative_spread for b in buckets.values())
    assert headline.noisy == (within > NOISY_RELATIVE_SPREAD), headline.noise_text
    assert "the mix" not in headline.noise_text
    assert "64x64" in headline.how and "96x96" in headline.how

    one = measure(
        _TwoBucketWorkload(64, 64, 0.0), steps=4, warmup=0, profiled_steps=0, trace_path=None
    )
    assert one.timing.buckets() == {}
    assert one.timing.per_iteration == one.timing.headline.median


def test_a_step_budget_ends_slow_steps_early_on_a_whole_bucket_cycle() -> None:
    """Slow steps (a CPU smoke test) end once the budget is spent and enough ran, on a whole
    cycle of the buckets so each shape keeps its share; the record and the headline say so.
    The clean twin: fast steps take every planned step and say nothing."""
    from diagnose.record import new_record
    from diagnose.reports.headline import build_headline

    slow = measure(
        _TwoBucketWorkload(64, 96, 0.02),
        steps=40,
        warmup=0,
        profiled_steps=0,
        trace_path=None,
        budget_s=0.2,
        min_steps=3,
        cycle=2,
    )
    n = slow.timing.unprofiled.n
    assert 4 <= n < 40 and n % 2 == 0
    assert slow.timing.step_budget_s == 0.2
    assert set(slow.timing.buckets()) == {"64x64", "96x96"}
    record = new_record("run")
    record.timing = slow.timing
    assert "--steps 30" in build_headline(record).how

    fast = measure(
        _TwoBucketWorkload(64, 96, 0.0),
        steps=6,
        warmup=0,
        profiled_steps=0,
        trace_path=None,
        budget_s=30.0,
        min_steps=3,
        cycle=2,
    )
    assert fast.timing.unprofiled.n == 6 and fast.timing.step_budget_s is None
    record.timing = fast.timing
    assert "--steps" not in build_headline(record).how


def test_an_explicit_step_count_is_taken_exactly_and_ranks_take_all_steps() -> None:
    from diagnose.config import MAX_TIMED_STEPS, TIMED_STEPS_BUDGET_S, RunConfig

    assert RunConfig().timed_step_plan() == (MAX_TIMED_STEPS, TIMED_STEPS_BUDGET_S)
    assert RunConfig(steps=12).timed_step_plan() == (12, None)
    assert RunConfig(nproc=2, device="cpu").timed_step_plan() == (MAX_TIMED_STEPS, None)
    assert "--steps" not in RunConfig().command_line()
    assert "--steps 12" in RunConfig(steps=12).command_line()
