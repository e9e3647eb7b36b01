"""The step's time beyond the training phases is named by what it is: collectives, allocator
calls, host code between ops, device work placed by its kernels; "other" stays small.

Real CPU traces captured here (a single-process gloo group runs real collectives) with a planted
phenomenon and a clean twin, and the shared real GPU traces (../shared/gpu-traces; skipped
without them)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from diagnose.trace.analysis import TraceAnalysis, analyze_trace
from tests.conftest import SHARED_TRACES

#: The issue's target: what stays "other" is under this share of the step, or a note says what.
OTHER_SHARE = 0.10


def _loop(path: Path, *, all_reduce: bool = False, python_pause: float = 0.0) -> TraceAnalysis:
    """Three profiled steps of a small compute loop, with a collective or a Python pause."""
    torch.manual_seed(0)
    weight = torch.randn(256, 256)
    started = False
    if all_reduce and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        started = True
    try:
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
        ) as prof:
            for _ in range(4):
                x = torch.randn(64, 256)
                for _ in range(4):
                    x = torch.tanh(x @ weight)
                if all_reduce:
                    grads = torch.randn(1 << 22)
                    dist.all_reduce(grads)
                if python_pause:
                    time.sleep(python_pause)  # host code between ops, as a slow Python loop
                prof.step()
        prof.export_chrome_trace(str(path))
    finally:
        if started:
            dist.destroy_process_group()
    return analyze_trace(path)


def _share(a: TraceAnalysis, phase: str) -> float:
    step = statistics.median(s.wall_seconds for s in a.steps)
    return a.breakdown.seconds.get(phase, 0.0) / step


def test_collectives_are_communication_and_the_twin_has_none(tmp_path: Path) -> None:
    planted = _loop(tmp_path / "allreduce.json", all_reduce=True)
    assert planted.breakdown.seconds.get("communication", 0.0) > 0
    clean = _loop(tmp_path / "plain.json")
    assert "communication" not in clean.breakdown.seconds


def test_python_between_ops_is_host_code(tmp_path: Path) -> None:
    pause = 0.05
    planted = _loop(tmp_path / "pause.json", python_pause=pause)
    assert planted.breakdown.seconds["host_code"] >= 0.8 * pause
    clean = _loop(tmp_path / "nopause.json")
    assert clean.breakdown.seconds.get("host_code", 0.0) < 0.8 * pause
    for a in (planted, clean):
        assert "other" not in a.breakdown.seconds


# --------------------------------------------------------------------------------------------
# The shared real GPU traces


def _shared(name: str) -> TraceAnalysis:
    path = SHARED_TRACES / name
    if not path.exists():
        pytest.skip(f"{path} is not here (../shared/gpu-traces is optional)")
    return analyze_trace(path)


def _shared_names() -> list[str]:
    if not SHARED_TRACES.is_dir():
        return ["missing"]
    return sorted(str(p.relative_to(SHARED_TRACES)) for p in SHARED_TRACES.glob("*/*.json.gz"))


@pytest.mark.parametrize("name", _shared_names())
def test_other_is_small_or_explained_on_every_shared_trace(name: str) -> None:
    a = _shared(name)
    other = _share(a, "other")
    assert other < OTHER_SHARE or any("could not be placed" in n for n in a.notes)
    unknown = _share(a, "device_work")
    if unknown >= OTHER_SHARE:
        assert any(n.startswith("GPU work of unknown phase") for n in a.notes)


def test_exposed_collectives_of_a_ddp_trace_are_communication() -> None:
    """An 8-rank DDP step on MI300X: the device mostly runs RCCL all-reduces with no compute
    beside them. The breakdown's communication is that exposed time, as the collective
    analysis measures it independently."""
    a = _shared("rocm/mi300x_resnet_ddp_bf16_train.json.gz")
    seconds = a.breakdown.seconds
    assert max(seconds, key=lambda p: seconds[p]) == "communication"
    exposed = a.communication.median("exposed_seconds")
    assert seconds["communication"] == pytest.approx(exposed, rel=0.1)


def test_gloo_wait_of_a_cpu_trace_is_communication() -> None:
    """A CPU rank whose training thread waits while gloo all-reduces run on gloo's threads."""
    a = _shared("edge/cpu_only.json.gz")
    exposed = a.communication.median("exposed_seconds")
    assert a.breakdown.seconds["communication"] == pytest.approx(exposed, rel=0.05)
    assert "other" not in a.breakdown.seconds


def test_allocator_calls_while_the_device_idles() -> None:
    """cudaMalloc/cudaFree calls with the device idle (the A100 benchmark frees and reallocates
    its cache between runs) are the allocator's; the V100 twin makes none."""
    planted = _shared("cuda/a100_alexnet_train.json.gz")
    assert planted.breakdown.seconds.get("allocator", 0.0) > 0
    clean = _shared("cuda/v100_resnet50_num_workers_4.json.gz")
    assert "allocator" not in clean.breakdown.seconds
