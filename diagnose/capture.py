"""Timing and profiler capture of the training step.

The loop is: warm-up steps (timed, kept apart), unprofiled timed steps (the headline number), then
profiled steps under ``torch.profiler`` (one extra profiler warm-up step that is not a sample).
Every step is timed with the device synchronised at its end, and split into phases by
:class:`diagnose.timing.PhaseTimer`. The profiled steps carry ``ProfilerStep#N`` markers, the phase
labels, shapes and memory, and are saved as a gzip Chrome trace that Perfetto opens.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from diagnose import interrupts
from diagnose.contention import LoadWindow
from diagnose.output import TRACE_GZIP_LEVEL, write_stream_atomic
from diagnose.quiet import native_stderr_filtered
from diagnose.record import PHASES, Breakdown, StepSample, Timing
from diagnose.telemetry import TelemetrySampler, TelemetrySummary
from diagnose.timing import PhaseTimer, device_synchronizer


def input_shape(shape: Sequence[int]) -> str:
    """``"512x768"`` for a (B, C, H, W) batch of one image, ``"2x512x768"`` for a batch of two."""
    if len(shape) < 4:
        return ""
    batch, height, width = int(shape[0]), int(shape[-2]), int(shape[-1])
    return f"{height}x{width}" if batch == 1 else f"{batch}x{height}x{width}"


class SteppableWorkload(Protocol):
    """What the capture loop needs from a workload (diagnose.workload.Workload satisfies it)."""

    device: torch.device

    def batches(self) -> Iterator[Any]: ...

    def step(self, batch: Any, timer: PhaseTimer) -> float: ...


@dataclass
class Measurement:
    timing: Timing
    breakdown: Breakdown
    #: The saved trace, or None when no step was profiled.
    trace_path: Path | None
    #: Device telemetry sampled during the timed steps, when a sampler was given.
    telemetry: TelemetrySummary | None = None
    #: Wall seconds of the warm-up, timed and profiled steps (the profiler's export included).
    wall_seconds: dict[str, float] = field(default_factory=dict)


ProgressCallback = Callable[[str], None]


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class _StepRunner:
    def __init__(self, workload: SteppableWorkload) -> None:
        self.workload = workload
        self.device = workload.device
        self.sync = device_synchronizer(self.device)
        self.is_cuda = self.device.type == "cuda"
        self.batches = workload.batches()
        self.timer = PhaseTimer(self.sync)
        self.first_batch_seconds: float | None = None

    def run_one(self, index: int, *, profiled: bool) -> StepSample:
        interrupts.check()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.timer.reset()
        self.sync()
        start = time.perf_counter()
        with self.timer.phase("data_wait"):
            batch = next(self.batches)
        if self.first_batch_seconds is None:
            self.first_batch_seconds = self.timer.seconds["data_wait"]
        loss = self.workload.step(batch, self.timer)
        self.sync()
        seconds = time.perf_counter() - start
        phases = dict(self.timer.seconds)
        phases["other"] = max(0.0, seconds - sum(phases.values()))
        sample = StepSample(
            index=index,
            seconds=seconds,
            profiled=profiled,
            phases=phases,
            loss=float(loss),
            bucket=input_shape(getattr(getattr(batch, "pixels", None), "shape", ())),
        )
        if self.is_cuda:
            sample.peak_allocated_bytes = int(torch.cuda.max_memory_allocated(self.device))
            sample.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
        return sample


def measure(
    workload: SteppableWorkload,
    *,
    steps: int,
    warmup: int,
    profiled_steps: int,
    trace_path: Path | None,
    progress: ProgressCallback | None = None,
    telemetry: TelemetrySampler | None = None,
    budget_s: float | None = None,
    min_steps: int = 1,
    cycle: int = 1,
) -> Measurement:
    """Time the steps; profile ``profiled_steps`` more and save their trace to ``trace_path``.

    With ``budget_s``, the timed steps end early once they have taken that long, at least
    ``min_steps`` ran and the count is a whole number of ``cycle`` (the buckets the steps cycle
    through, so each input shape keeps its share of the samples).
    """
    say = progress or (lambda message: None)
    runner = _StepRunner(workload)
    timing = Timing(warmup_steps=warmup)

    wall: dict[str, float] = {}
    started = time.perf_counter()
    for i in range(warmup):
        say(f"warm-up step {i + 1}/{warmup}")
        timing.warmup_seconds.append(runner.run_one(i, profiled=False).seconds)
    wall["warm-up steps"] = time.perf_counter() - started

    index = warmup
    summary: TelemetrySummary | None = None
    # Telemetry and the machine's load cover the timed steps only: those are the ones the
    # headline number comes from.
    if telemetry is not None:
        telemetry.start()
    load = LoadWindow().open()
    started = time.perf_counter()
    try:
        for i in range(steps):
            say(f"timed step {i + 1}/{steps}")
            timing.samples.append(runner.run_one(index, profiled=False))
            index += 1
            done = i + 1
            if (
                budget_s is not None
                and done < steps
                and done >= min_steps
                and done % max(cycle, 1) == 0
                and time.perf_counter() - started >= budget_s
            ):
                timing.step_budget_s = budget_s
                break
    finally:
        wall["timed steps"] = time.perf_counter() - started
        timing.host_load = load.close()
        if telemetry is not None:
            summary = telemetry.stop()
    # The first batch of a fresh iterator pays for starting workers and filling their queues.
    timing.first_batch_seconds = runner.first_batch_seconds

    saved_trace: Path | None = None
    if profiled_steps > 0 and trace_path is not None:
        started = time.perf_counter()
        saved_trace = _profile(runner, timing, index, profiled_steps, trace_path, say)
        wall["profiled steps"] = time.perf_counter() - started

    timing.summarize()
    timing.peak_rss_bytes = _peak_rss_bytes()
    allocated = [s.peak_allocated_bytes for s in timing.samples if s.peak_allocated_bytes]
    reserved = [s.peak_reserved_bytes for s in timing.samples if s.peak_reserved_bytes]
    timing.peak_allocated_bytes = max(allocated) if allocated else None
    timing.peak_reserved_bytes = max(reserved) if reserved else None
    return Measurement(
        timing=timing,
        breakdown=phase_breakdown(timing),
        trace_path=saved_trace,
        telemetry=summary,
        wall_seconds=wall,
    )


def _profile(
    runner: _StepRunner,
    timing: Timing,
    first_index: int,
    profiled_steps: int,
    trace_path: Path,
    say: ProgressCallback,
) -> Path:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # One profiler warm-up step lets the profiler settle; it is not a sample. The schedule makes
    # the profiler emit ProfilerStep#N spans, which the trace analysis uses to find steps.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=profiled_steps, repeat=1)
    trace_path.parent.mkdir(parents=True, exist_ok=True)

    def save(prof: torch.profiler.profile) -> None:
        export_trace(prof, trace_path)

    with (
        native_stderr_filtered(),
        torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=save,
            record_shapes=True,
            with_stack=False,
        ) as prof,
    ):
        say("profiler warm-up step")
        runner.run_one(first_index, profiled=True)
        prof.step()
        for i in range(profiled_steps):
            say(f"profiled step {i + 1}/{profiled_steps}")
            timing.samples.append(runner.run_one(first_index + 1 + i, profiled=True))
            prof.step()
    return trace_path


def export_trace(prof: torch.profiler.profile, trace_path: Path) -> None:
    """The profiler's Chrome trace at ``trace_path`` (gzip when it ends in ``.gz``), written
    atomically: plain JSON to a temporary file beside it, then compressed in large blocks."""
    fd, raw_name = tempfile.mkstemp(
        dir=trace_path.parent, prefix=f".{trace_path.name}.", suffix=".json"
    )
    os.close(fd)
    raw = Path(raw_name)
    try:
        prof.export_chrome_trace(str(raw))

        def fill(handle: BinaryIO) -> None:
            target: contextlib.AbstractContextManager[Any] = (
                gzip.GzipFile(
                    filename="", fileobj=handle, mode="wb", compresslevel=TRACE_GZIP_LEVEL
                )
                if trace_path.suffix == ".gz"
                else contextlib.nullcontext(handle)
            )
            with raw.open("rb") as source, target as out:
                shutil.copyfileobj(source, out, 1 << 20)

        write_stream_atomic(trace_path, fill)
    finally:
        raw.unlink(missing_ok=True)


def phase_breakdown(timing: Timing) -> Breakdown:
    """Median seconds per phase over the unprofiled steps (profiled ones if there are none)."""
    samples = [s for s in timing.samples if not s.profiled] or timing.samples
    seconds: dict[str, float] = {}
    for phase in PHASES:
        values = [s.phases[phase] for s in samples if phase in s.phases]
        if values:
            seconds[phase] = statistics.median(values)
    return Breakdown(seconds=seconds, basis="measured")
