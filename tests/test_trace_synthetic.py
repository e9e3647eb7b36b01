"""GPU rules that need a GPU trace with a planted fault: there is no GPU here, so these traces are
built event by event in the Kineto layout (cpu_op ranges, cudaLaunchKernel calls with correlation
ids, kernels on a stream, an autograd thread), each planted fault with a clean twin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diagnose.trace.analysis import TraceAnalysis, analyze_trace
from tests.conftest import ok_lines

MAIN, AUTOGRAD, PID = 100, 101, 100


class TraceBuilder:
    """Writes events as torch.profiler does: host ranges, launches, kernels, flows."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.ext = 0
        self.corr = 1000
        self.gpu_free_at = 0.0  # when the GPU stream finishes its queued work

    def _x(
        self, cat: str, name: str, ts: float, dur: float, pid: int, tid: int, **args: Any
    ) -> None:
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": ts,
                "dur": dur,
                "args": args,
            }
        )

    def annotation(self, name: str, ts: float, dur: float, tid: int = MAIN) -> None:
        self.ext += 1
        self._x("user_annotation", name, ts, dur, PID, tid, **{"External id": self.ext})

    def op_with_kernel(
        self, name: str, ts: float, kernel: str, kernel_us: float, tid: int = MAIN
    ) -> float:
        """A 20 µs op that launches one kernel; the kernel queues behind earlier work."""
        self.ext += 1
        self.corr += 1
        self._x("cpu_op", name, ts, 20, PID, tid, **{"External id": self.ext})
        launch = ts + 5
        self._x(
            "cuda_runtime",
            "cudaLaunchKernel",
            launch,
            8,
            PID,
            tid,
            **{"External id": self.ext, "correlation": self.corr},
        )
        start = max(self.gpu_free_at + 2.0, launch + 10)  # 2 µs device-side gap when queued
        self._x(
            "kernel",
            kernel,
            start,
            kernel_us,
            0,
            7,
            device=0,
            stream=7,
            correlation=self.corr,
            **{"External id": self.ext},
        )
        self.gpu_free_at = start + kernel_us
        return ts + 20

    def sync(self, ts: float, tid: int = MAIN) -> float:
        """cudaStreamSynchronize: the host blocks until the queued work is done."""
        self.corr += 1
        end = max(ts + 3, self.gpu_free_at + 2)
        self._x(
            "cuda_runtime", "cudaStreamSynchronize", ts, end - ts, PID, tid, correlation=self.corr
        )
        return end

    def save(self, path: Path) -> Path:
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [
                {
                    "id": 0,
                    "name": "NVIDIA H100 80GB HBM3",
                    "computeMajor": 9,
                    "computeMinor": 0,
                    "totalGlobalMem": 85 << 30,
                }
            ],
            "cupti_version": 22,
            "cuda_runtime_version": 12040,
            "traceEvents": self.events,
        }
        path.write_text(json.dumps(doc))
        return path


def training_trace(
    path: Path,
    *,
    sync_in_optimizer: bool = False,
    kernel_us: float = 200.0,
    host_gap_us: float = 0.0,
    closure: bool = False,
) -> TraceAnalysis:
    """Three steps: data, 20 forward ops, 20 backward nodes on the autograd thread, an AdamW step
    of 10 foreach kernels, then a loss.item(). ``host_gap_us`` is Python time between forward
    ops."""
    b = TraceBuilder()
    t = 0.0
    for step in range(3):
        step_start = t
        b.annotation("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", t, 50)
        t += 60
        # optimizer.step(closure): the step's range opens before the closure's forward, and the
        # closure's loss.item() (a logged loss) syncs inside it, before the backward.
        closure_start = t
        for _ in range(20):
            t = b.op_with_kernel("aten::addmm", t, "sm90_xmma_gemm_bf16bf16_bf16f32", kernel_us)
            t += host_gap_us
        if closure:
            t = b.sync(t + 5) + 50  # training_step reads the loss before the backward
        for _ in range(20):
            b.annotation("autograd::engine::evaluate_function: AddmmBackward0", t, 25, AUTOGRAD)
            t = (
                b.op_with_kernel(
                    "aten::mm", t + 2, "sm90_xmma_gemm_bf16bf16_bf16f32", kernel_us, AUTOGRAD
                )
                + 5
            )
        # The main thread waits in backward() until the queue drains a little.
        opt_start = t
        for k in range(10):
            t = b.op_with_kernel(
                "aten::_foreach_add_", t, "multi_tensor_apply_kernel<AdamFunctor>", 30
            )
            if sync_in_optimizer and k == 4:
                # A per-step .item() inside the optimizer: block, then relaunch from scratch.
                t = b.sync(t) + 300
        if closure:
            b.annotation("Optimizer.step#AdamW.step", closure_start - 1, t - closure_start + 2)
        else:
            b.annotation("Optimizer.step#AdamW.step", opt_start - 1, t - opt_start + 2)
            # loss.item() for the progress bar: the usual once-per-step sync, outside the
            # optimizer.
            t = b.sync(t + 5) + 50
        b.annotation(f"ProfilerStep#{step}", step_start, t - step_start)
    return analyze_trace(b.save(path))


def ids(a: TraceAnalysis) -> set[str]:
    return {f.id for f in a.findings}


def test_a_sync_in_the_closure_is_not_the_optimizers(tmp_path: Path) -> None:
    """optimizer.step(closure): the closure's loss.item() lies inside the step's range but is
    not the optimizer's own; a sync in the update itself still is."""
    clean = training_trace(tmp_path / "closure.json", closure=True)
    assert "optimizer.sync_in_step" not in ids(clean)
    assert clean.breakdown.seconds["forward"] > 0.003  # 20 x 200 µs, not the optimizer's
    assert clean.breakdown.seconds["optimizer"] < 0.001
    planted = training_trace(tmp_path / "both.json", closure=True, sync_in_optimizer=True)
    finding = next(f for f in planted.findings if f.id == "optimizer.sync_in_step")
    assert finding.evidence["syncs_per_step"] == 1


def test_phases_of_a_gpu_step(tmp_path: Path) -> None:
    a = training_trace(tmp_path / "clean.json")
    assert a.device.kind == "cuda" and len(a.steps) == 3
    # Kernels are charged to the phase that launched them.
    assert a.breakdown.seconds["forward"] > 0.003  # 20 x 200 µs
    assert a.breakdown.seconds["backward"] > 0.003
    assert a.breakdown.seconds["optimizer"] > 0
    assert a.breakdown.seconds["data_wait"] > 0
    classes = {c.name: c for c in a.kernel_classes}
    assert classes["gemm"].calls == 3 * 40 and classes["optimizer"].calls == 30


def test_launch_bound_needs_the_host_to_be_late(tmp_path: Path) -> None:
    """Tiny kernels launched one by one with host time between them: the device waits for each
    launch. The twin has the same 2 µs gaps between kernels, but every kernel was queued in
    advance: that is device-side latency, not the host."""
    starved = training_trace(tmp_path / "tiny.json", kernel_us=5, host_gap_us=200)
    finding = next(f for f in starved.findings if f.id == "compute.launch_bound")
    assert "kernel launches" in finding.title
    assert finding.evidence["short_gaps_per_step"] >= 20

    queued = training_trace(tmp_path / "queued.json", kernel_us=400)
    assert "compute.launch_bound" not in ids(queued)
    assert any(line.startswith("host overhead") for line in ok_lines(queued))
