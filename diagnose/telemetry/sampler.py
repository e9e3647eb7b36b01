"""The sampler: GPU telemetry read in a background thread between start and stop, and the one-shot
reading of ``diagnose env``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType

from diagnose.record import DeviceInfo
from diagnose.telemetry.backends import (
    BackendOpener,
    TelemetryBackend,
    _exception_text,
    open_backend,
)
from diagnose.telemetry.readings import (
    DEFAULT_INTERVAL_S,
    MAX_SAMPLES,
    DeviceLimits,
    TelemetrySample,
    TelemetrySummary,
    unavailable,
)
from diagnose.telemetry.summary import decimate, summarize

_ALLOCATOR_KEYS = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
)


def _allocator_counters(info: DeviceInfo) -> dict[str, int] | None:
    """torch's caching-allocator counters for the device, or None off the GPU."""
    if info.kind not in ("cuda", "rocm") or not info.torch_device.startswith("cuda"):
        return None
    try:
        import torch

        stats = torch.cuda.memory_stats(info.torch_device)
    except Exception:
        return None
    return {key: int(stats[key]) for key in _ALLOCATOR_KEYS if key in stats}


class TelemetrySampler:
    """Samples GPU telemetry in a background thread between :meth:`start` and :meth:`stop`.

    Never raises and never prints: without a driver or library, :meth:`stop` returns a summary
    with ``available=False`` and the reason. Also a context manager (``summary`` is set on exit).
    """

    def __init__(
        self,
        device_info: DeviceInfo,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_samples: int = MAX_SAMPLES,
        opener: BackendOpener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device_info = device_info
        self.interval_s = interval_s
        self.max_samples = max_samples
        self._opener = opener
        self._clock = clock
        self._backend: TelemetryBackend | None = None
        self._reason = ""
        self._printed = ""
        self._limits = DeviceLimits()
        self._samples: list[TelemetrySample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        #: The wall-clock time of sample time 0 (to place samples against another process's
        #: timestamps); 0 until sampling starts.
        self.started_unix = 0.0
        self._allocator_before: dict[str, int] | None = None
        self._thread_error = ""
        self.summary: TelemetrySummary | None = None

    def start(self) -> TelemetrySampler:
        """Open the library (output captured) and start sampling. Call from the main thread:
        the capture redirects the process's file descriptors for the moment of opening."""
        if self._thread is not None or self._backend is not None:
            return self
        self._backend, self._reason, self._printed = open_backend(self.device_info, self._opener)
        self._allocator_before = _allocator_counters(self.device_info)
        if self._backend is None:
            return self
        self._started_at = self._clock()
        self.started_unix = time.time()
        try:
            self._limits = self._backend.limits()
            self._take_sample()
        except Exception as exc:
            self._fail(f"{self._backend.name}: {_exception_text(exc)}")
            return self
        self._thread = threading.Thread(target=self._run, name="diagnose-telemetry", daemon=True)
        self._thread.start()
        return self

    def _fail(self, reason: str) -> None:
        if self._backend is not None:
            self._backend.close()
        self._reason = reason
        self._backend = None

    def _take_sample(self) -> None:
        assert self._backend is not None
        sample = self._backend.sample(self._clock() - self._started_at)
        with self._lock:
            self._samples.append(sample)
            if len(self._samples) > self.max_samples:
                self._samples = decimate(self._samples, self.max_samples // 2)
                self.interval_s *= 2

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._take_sample()
            except Exception as exc:  # a driver hiccup ends sampling, not the run
                self._thread_error = _exception_text(exc)
                return

    def stop(self) -> TelemetrySummary:
        """Stop sampling and summarise. Safe to call more than once (returns the same summary)."""
        if self.summary is not None:
            return self.summary
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        allocator_after = _allocator_counters(self.device_info)
        allocator: dict[str, int] = {}
        if self._allocator_before is not None and allocator_after is not None:
            allocator = {
                key: allocator_after[key] - self._allocator_before.get(key, 0)
                for key in allocator_after
            }
        backend = self._backend
        if backend is None:
            self.summary = unavailable(self._reason, printed=self._printed)
            self.summary.allocator = allocator
            return self.summary
        with contextlib.suppress(Exception):
            if not self._thread_error:
                self._take_sample()  # the state at the end of the window
        backend.close()
        with self._lock:
            samples = list(self._samples)
        unreadable = dict(backend.unreadable)
        if self._thread_error:
            unreadable["sampling"] = self._thread_error
        self.summary = TelemetrySummary(
            available=True,
            backend=backend.name,
            interval_s=self.interval_s,
            limits=self._limits,
            stats=summarize(samples, self._limits),
            samples=samples,
            allocator=allocator,
            unreadable=unreadable,
            printed=self._printed,
        )
        self._backend = None
        return self.summary

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def read_telemetry_once(
    device_info: DeviceInfo, opener: BackendOpener | None = None
) -> TelemetrySummary:
    """One sample, for ``diagnose env``: the state of the GPU right now (idle, usually)."""
    sampler = TelemetrySampler(device_info, opener=opener, interval_s=3600.0)
    sampler.start()
    return sampler.stop()
