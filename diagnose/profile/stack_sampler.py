"""py-spy started by a profiled process on itself, for the steps the capture profiles.

Loaded by path from :mod:`diagnose.profile.capture` inside the user's processes, so, like it, this
file imports nothing from ``diagnose`` and nothing heavy.

Why the process starts its own sampler: py-spy reads another process's memory, which Linux allows
to an ancestor of that process (``kernel.yama.ptrace_scope=1``, the usual setting) or to a process
the target named with ``prctl(PR_SET_PTRACER)``. Neither ``diagnose profile`` nor a py-spy it
starts is an ancestor of a ``torchrun`` rank, but the rank can name its own sampler. The sampler
starts as ``sh`` waiting on a line: its pid is named as the tracer, then the line lets it ``exec``
py-spy under the same pid, so no other process is ever allowed in. DataLoader workers forked
before do not inherit that permission: where the setting is strict, py-spy samples the rank and
says it could not read them.

py-spy runs ``--nonblocking`` (the program is never paused), without ``--idle`` (a thread
waiting on the GPU or on a queue is not sampled: the samples say where Python burns CPU time), and
writes collapsed stacks (``--format raw``) when it receives SIGINT.

Nothing waits for py-spy to attach (about a tenth of a second, and a few tenths more before it
finds the DataLoader workers): a training loop held back meanwhile would let its workers fill their
prefetch queues, and the profiled steps would hide the very data wait they should show. The
samples start late instead, which a step of a second or more does not notice.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any

#: ``prctl`` option of the Yama security module (linux/prctl.h).
_PR_SET_PTRACER = 0x59616D61
#: Samples a second. The window is a few steps, already slowed by the profiler; py-spy reads
#: the program's memory from outside, so a higher rate costs py-spy's core, not the program's.
RATE_HZ = 200
#: How long py-spy may take to write its file once asked to stop.
_STOP_WAIT_S = 15.0

#: The first lines of py-spy's own output kept in the facts (its errors say why nothing came).
_MAX_PRINTED = 2000


def _allow_tracer(pid: int) -> None:
    """Let ``pid`` read this process's memory where Yama restricts it (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0)  # EINVAL without Yama: nothing to allow


class StackSampler:
    """One ``py-spy record`` of this process and its children, from :meth:`start` to
    :meth:`stop`. Never raises: a failure is said in the facts :meth:`stop` returns."""

    def __init__(self, py_spy: str, output: str, rate_hz: int = RATE_HZ) -> None:
        self.py_spy = py_spy
        self.output = output
        self.rate_hz = rate_hz
        self.process: subprocess.Popen[bytes] | None = None
        self.printed_path = output + ".log"
        self.started = 0.0
        self.error: str | None = None

    def start(self) -> None:
        command = [
            self.py_spy,
            "record",
            "--pid",
            str(os.getpid()),
            "--subprocesses",
            "--nonblocking",
            "--function",
            "--format",
            "raw",
            "--rate",
            str(self.rate_hz),
            "--output",
            self.output,
        ]
        try:
            with open(self.printed_path, "wb") as printed:
                # ``read`` holds the exec until this process has named the sampler's pid.
                self.process = subprocess.Popen(
                    ["/bin/sh", "-c", 'read _ && exec "$@"', "sh", *command],
                    stdin=subprocess.PIPE,
                    stdout=printed,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the user's Ctrl-C is not py-spy's
                )
            _allow_tracer(self.process.pid)
            assert self.process.stdin is not None
            self.process.stdin.write(b"go\n")
            self.process.stdin.close()
            self.started = time.perf_counter()
        except Exception as exc:
            self.error = f"py-spy could not be started: {type(exc).__name__}: {exc}"[:300]
            self.process = None

    def stop(self) -> dict[str, Any]:
        """Stop py-spy, let it write its stacks, and say what it left."""
        process, self.process = self.process, None
        seconds = time.perf_counter() - self.started if self.started else 0.0
        facts: dict[str, Any] = {
            "tool": "py-spy record --subprocesses --nonblocking --function --format raw",
            "rate_hz": self.rate_hz,
            "seconds": round(seconds, 3),
            "file": os.path.basename(self.output),
        }
        if process is None:
            facts["error"] = self.error or "py-spy was not started"
            return facts
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            process.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
            facts["error"] = f"py-spy did not stop within {_STOP_WAIT_S:g} s"
        facts["exit_code"] = process.returncode
        with contextlib.suppress(OSError):
            with open(self.printed_path, "rb") as printed:
                facts["printed"] = printed.read(_MAX_PRINTED).decode("utf-8", "replace").strip()
            os.unlink(self.printed_path)
        if not os.path.isfile(self.output) or os.path.getsize(self.output) == 0:
            facts.setdefault("error", "py-spy wrote no samples")
        return facts

    def kill(self) -> None:
        """The process is going away without its capture: end py-spy, keep nothing."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(Exception):
                process.kill()
                process.wait(timeout=5)
