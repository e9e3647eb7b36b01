"""GPU training loops written as torch.profiler writes their traces (there is no GPU here).

:class:`KinetoWriter` keeps a host clock per thread and a device stream, and writes what Kineto
writes: ``cpu_op`` ranges (nested, with ``Input Dims``/``Input type`` as ``record_shapes``
records them), ``user_annotation`` labels, ``cuda_runtime`` calls with correlation ids,
``kernel``/``gpu_memcpy`` activities on a stream that start when both their launch and the
stream's earlier work are done, the ``ac2g`` flow pairs between them, ``nn.Module`` ranges and
the process and thread metadata. A blocking call lasts until the device has done what it waits
for, so a sync's length, and the idle after it, come out of the timeline as on a GPU.

:func:`lora_loop` writes a LoRA-shaped training loop (a DataLoader, a forward of blocks under
modules, a backward on the autograd thread, a foreach AdamW that reads its CPU step counters
with ``.item()``, zero_grad), with one planted sync fault or none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

MAIN, AUTOGRAD, PID = 1101, 1102, 1100
STREAM = 7
Fault = Literal[
    "none", "loss_logging", "clipping", "in_step", "forward_cpu", "cpu_scalars", "closing_sync"
]
FAULTS: tuple[Fault, ...] = (
    "loss_logging",
    "clipping",
    "in_step",
    "forward_cpu",
    "cpu_scalars",
    "closing_sync",
)


class KinetoWriter:
    """Events of one profiled process with one GPU, written in Kineto's layout."""

    def __init__(self, *, launch_us: float = 8.0, latency_us: float = 6.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.clock: dict[int, float] = {MAIN: 1000.0, AUTOGRAD: 1000.0}
        self.device_free = 0.0
        self.launch_us = launch_us
        self.latency_us = latency_us
        self.ext = 0
        self.corr = 5000
        self._stack: dict[int, list[int]] = {MAIN: [], AUTOGRAD: []}

    # ---------------------------------------------------------------- host

    def now(self, tid: int = MAIN) -> float:
        return self.clock[tid]

    def python(self, us: float, tid: int = MAIN) -> None:
        """Host time with no op open (Python between calls)."""
        self.clock[tid] += us

    def wait_for(self, tid: int, other: int) -> None:
        """``tid`` waits (no op open) until ``other`` is done, as the main thread waits in
        ``backward()`` while the autograd thread runs."""
        self.clock[tid] = max(self.clock[tid], self.clock[other])

    def _open(self, cat: str, name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
        event = {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": PID,
            "tid": tid,
            "ts": self.clock[tid],
            "dur": 0.0,
            "args": args,
        }
        self.events.append(event)
        return event

    @contextmanager
    def op(
        self,
        name: str,
        dims: list[Any] | None = None,
        types: list[str] | None = None,
        *,
        tid: int = MAIN,
        cost_us: float = 4.0,
    ) -> Iterator[None]:
        """A ``cpu_op``; ``cost_us`` of host time at each end (dispatch, the profiler's record)."""
        self.ext += 1
        args: dict[str, Any] = {"External id": self.ext, "Record function id": 0}
        if dims is not None:
            args["Input Dims"] = dims
            args["Input type"] = types if types is not None else ["float"] * len(dims)
        event = self._open("cpu_op", name, tid, args)
        self._stack[tid].append(self.ext)
        self.clock[tid] += cost_us
        try:
            yield
        finally:
            self.clock[tid] += cost_us
            self._stack[tid].pop()
            event["dur"] = self.clock[tid] - event["ts"]

    @contextmanager
    def label(self, name: str, *, tid: int = MAIN) -> Iterator[None]:
        """A ``record_function`` range (``user_annotation``)."""
        self.ext += 1
        event = self._open("user_annotation", name, tid, {"External id": self.ext})
        self.clock[tid] += 1.0
        try:
            yield
        finally:
            self.clock[tid] += 1.0
            event["dur"] = self.clock[tid] - event["ts"]

    @contextmanager
    def module(self, name: str, *, tid: int = MAIN) -> Iterator[None]:
        """An ``nn.Module: <Class>_<n>`` range (with_stack/with_modules)."""
        event = self._open("python_function", f"nn.Module: {name}", tid, {})
        self.clock[tid] += 2.0
        try:
            yield
        finally:
            self.clock[tid] += 2.0
            event["dur"] = self.clock[tid] - event["ts"]

    # ---------------------------------------------------------------- runtime and device

    def _runtime(self, name: str, dur: float, tid: int) -> dict[str, Any]:
        self.clock[tid] += 0.5  # the call's entry: never at the very instant an op closed
        self.corr += 1
        ext = self._stack[tid][-1] if self._stack[tid] else 0
        event = self._open(
            "cuda_runtime", name, tid, {"External id": ext, "correlation": self.corr, "cbid": 211}
        )
        event["dur"] = dur
        return event

    def _activity(
        self, cat: str, name: str, call: dict[str, Any], dur: float, **args: Any
    ) -> float:
        start = max(call["ts"] + self.latency_us, self.device_free)
        corr = call["args"]["correlation"]
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 0,
                "tid": STREAM,
                "ts": start,
                "dur": dur,
                "args": {
                    "External id": call["args"]["External id"],
                    "device": 0,
                    "context": 1,
                    "stream": STREAM,
                    "correlation": corr,
                    **args,
                },
            }
        )
        for ph, pid, tid, ts in (("s", PID, call["tid"], call["ts"]), ("f", 0, STREAM, start)):
            flow = {"ph": ph, "id": corr, "pid": pid, "tid": tid, "ts": ts, "cat": "ac2g"}
            flow["name"] = "ac2g"
            if ph == "f":
                flow["bp"] = "e"
            self.events.append(flow)
        self.device_free = start + dur
        return self.device_free

    def kernel(self, name: str, kernel_us: float, *, tid: int = MAIN) -> None:
        call = self._runtime("cudaLaunchKernel", self.launch_us, tid)
        self._activity(
            "kernel", name, call, kernel_us, grid=[128, 1, 1], block=[256, 1, 1], registers=32
        )
        self.clock[tid] += self.launch_us

    def copy_to_device(self, nbytes: int, *, tid: int = MAIN) -> None:
        """A non-blocking copy from pinned memory: the call returns at once."""
        call = self._runtime("cudaMemcpyAsync", self.launch_us, tid)
        self._activity(
            "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", call, nbytes / 25e3, bytes=nbytes
        )
        self.clock[tid] += self.launch_us

    def copy_to_host(self, nbytes: int, *, tid: int = MAIN) -> None:
        """A copy into pageable memory: the call returns after the copy ended."""
        call = self._runtime("cudaMemcpyAsync", 0.0, tid)
        end = self._activity(
            "gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", call, 2.0 + nbytes / 20e3
        )
        call["dur"] = max(end + 2.0 - call["ts"], self.launch_us)
        self.clock[tid] = call["ts"] + call["dur"]

    def synchronize(self, name: str = "cudaStreamSynchronize", *, tid: int = MAIN) -> None:
        """The host blocks until the device has run everything queued."""
        call = self._runtime(name, 0.0, tid)
        call["dur"] = max(self.device_free + 2.0 - call["ts"], 3.0)
        self.clock[tid] = call["ts"] + call["dur"]

    # ---------------------------------------------------------------- reads on the host

    def item(self, *, on_device: bool, tid: int = MAIN) -> None:
        """``tensor.item()``: on the device a copy and a wait; on the CPU no runtime call."""
        types = ["c10::BFloat16" if on_device else "float"]
        with (
            self.op("aten::item", [[]], types, tid=tid),
            self.op("aten::_local_scalar_dense", [[]], types, tid=tid),
        ):
            if on_device:
                self.copy_to_host(4, tid=tid)
                self.synchronize(tid=tid)

    def to_host(self, dims: list[int], *, tid: int = MAIN) -> None:
        """``tensor.cpu()``: a blocking copy into pageable memory."""
        nbytes = 2
        for d in dims:
            nbytes *= d
        with (
            self.op("aten::to", [dims, [], [], [], []], tid=tid),
            self.op("aten::_to_copy", [dims], tid=tid),
            self.op("aten::copy_", [dims, dims, []], tid=tid),
        ):
            self.copy_to_host(nbytes, tid=tid)
            self.synchronize(tid=tid)

    # ---------------------------------------------------------------- the file

    def save(self, path: Path) -> Path:
        meta = [
            {"ph": "M", "name": "process_name", "pid": PID, "args": {"name": "python3"}},
            {"ph": "M", "name": "process_labels", "pid": PID, "args": {"labels": "CPU"}},
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python3"}},
            {"ph": "M", "name": "process_labels", "pid": 0, "args": {"labels": "GPU 0"}},
            {"ph": "M", "name": "thread_name", "pid": PID, "tid": MAIN, "args": {"name": "main"}},
            {
                "ph": "M",
                "name": "thread_name",
                "pid": PID,
                "tid": AUTOGRAD,
                "args": {"name": "autograd"},
            },
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": STREAM, "args": {"name": "7"}},
        ]
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [
                {
                    "id": 0,
                    "name": "NVIDIA H200",
                    "computeMajor": 9,
                    "computeMinor": 0,
                    "totalGlobalMem": 150 << 30,
                    "numSms": 132,
                }
            ],
            "record_shapes": 1,
            "cupti_version": 24,
            "cuda_runtime_version": 13000,
            "cuda_driver_version": 13000,
            "traceEvents": meta + self.events,
        }
        path.write_text(json.dumps(doc))
        return path


# --------------------------------------------------------------------------------------------
# A LoRA training loop


BATCH = [8, 3, 64, 64]
TOKENS = [8, 256, 512]


def lora_loop(
    path: Path,
    fault: Fault = "none",
    *,
    steps: int = 3,
    blocks: int = 4,
    params: int = 24,
    kernel_us: float = 40.0,
    batches: tuple[list[int], ...] = (BATCH,),
    new_epoch_at: int | None = None,
    stretched_us: tuple[float, ...] = (),
) -> Path:
    """A profiled LoRA loop of ``steps`` steps with ``fault`` planted in every step:

    * ``loss_logging``: ``loss.item()`` on the device after ``optimizer.step()``;
    * ``clipping``: each gradient's norm read with ``.item()`` before ``optimizer.step()``;
    * ``in_step``: the optimizer reads a device value per parameter inside its step;
    * ``forward_cpu``: one ``.cpu()`` per block in the forward;
    * ``cpu_scalars``: many ``.item()`` on CPU tensors (no sync: quiet);
    * ``closing_sync``: a bare ``torch.cuda.synchronize()`` closing each step (a timing loop's).

    ``batches``: the batch shape of each step in turn (resolution buckets); ``new_epoch_at``: the
    step whose DataLoader starts a new epoch (its sampler draws a permutation of the dataset);
    ``stretched_us``: host time added to each step in turn, no op open (a busy machine's
    descheduling).
    """
    w = KinetoWriter()
    for number in range(steps):
        with w.label(f"ProfilerStep#{number + 2}"):
            batch = batches[number % len(batches)]
            _step(w, fault, blocks, params, kernel_us, batch, number == new_epoch_at)
            if number < len(stretched_us):
                w.python(stretched_us[number])
        w.python(30.0)
    return w.save(path)


def _step(
    w: KinetoWriter,
    fault: Fault,
    blocks: int,
    params: int,
    kernel_us: float,
    batch: list[int],
    new_epoch: bool,
) -> None:
    with w.label("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"):
        if new_epoch:
            with (
                w.op("aten::randperm", [[], [], [], [], []], ["Scalar"] * 5),
                w.op("aten::resolve_conj", [[24]], ["long int"]),
            ):
                w.python(5.0)
        w.python(900.0)  # decoding images
        with w.op("aten::stack", [batch[1:]] * batch[0]):
            w.python(40.0)
        with w.op("aten::pin_memory", [batch, []]):
            w.python(30.0)
    w.python(20.0)
    nbytes = 4
    for d in batch:
        nbytes *= d
    with (
        w.op("aten::to", [batch, [], [], [], [], [], [], []]),
        w.op("aten::_to_copy", [batch]),
        w.op("aten::copy_", [batch, batch, []]),
    ):
        w.copy_to_device(nbytes)
    w.python(15.0)
    with w.module("Denoiser_0"):
        for block in range(blocks):
            with w.module(f"Block_{block}"):
                for name in ("aten::layer_norm", "aten::linear", "aten::linear", "aten::gelu"):
                    with w.op(name, [TOKENS, [512, 512]], ["c10::BFloat16"] * 2):
                        w.kernel(f"sm90_xmma_gemm_bf16bf16_bf16f32_{name[6:]}", kernel_us)
                    w.python(12.0)
                if fault == "forward_cpu":
                    w.to_host([8, 16])
                    w.python(10.0)
        with w.op("aten::mse_loss", [TOKENS, TOKENS, []], ["c10::BFloat16"] * 2):
            w.kernel("reduce_kernel<mse>", 8.0)
    w.python(20.0)
    # backward(): the autograd thread runs the engine while the main thread waits.
    w.clock[AUTOGRAD] = w.now()
    for _ in range(blocks * 4):
        with (
            w.op("autograd::engine::evaluate_function: MmBackward0", tid=AUTOGRAD, cost_us=6.0),
            w.op("MmBackward0", tid=AUTOGRAD),
            w.op("aten::mm", [TOKENS, [512, 512]], tid=AUTOGRAD),
        ):
            w.kernel("sm90_xmma_gemm_bf16bf16_bf16f32_dgrad", kernel_us * 1.5, tid=AUTOGRAD)
        w.python(5.0, AUTOGRAD)
    for _ in range(params):
        with (
            w.op(
                "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
                tid=AUTOGRAD,
            ),
            w.op("torch::autograd::AccumulateGrad", tid=AUTOGRAD),
        ):
            w.python(3.0, AUTOGRAD)
    w.wait_for(MAIN, AUTOGRAD)
    w.python(15.0)
    if fault == "clipping":
        for _ in range(params):
            with w.op("aten::linalg_vector_norm", [[16, 512], [], [], [], []]):
                w.kernel("reduce_kernel<norm>", 3.0)
            w.item(on_device=True)
            w.python(8.0)
    with w.label("Optimizer.step#AdamW.step"):
        for _ in range(params):
            w.item(on_device=False)  # torch AdamW reads each CPU step counter
            if fault == "in_step":
                w.item(on_device=True)
        for name in ("aten::_foreach_mul_", "aten::_foreach_add_", "aten::_foreach_addcdiv_"):
            with w.op(name, [[[16, 512]] * params]):
                w.kernel("multi_tensor_apply_kernel<AdamFunctor>", 6.0)
    with w.label("Optimizer.zero_grad#AdamW.zero_grad"):
        w.python(40.0)
    if fault == "loss_logging":
        w.python(10.0)
        w.item(on_device=True)
    if fault == "cpu_scalars":
        for _ in range(4 * params):
            w.item(on_device=False)
            w.python(3.0)
    if fault == "closing_sync":
        w.python(10.0)
        w.synchronize("cudaDeviceSynchronize")
    w.python(25.0)


__all__ = ["FAULTS", "Fault", "KinetoWriter", "lora_loop"]
