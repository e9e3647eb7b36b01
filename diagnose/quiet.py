"""Keep libraries' chatter off the user's terminal.

Libraries print on import (bitsandbytes, xformers, amdsmi) and Kineto writes lines like
``USDT:... profiler_start`` straight to file descriptor 2 each time the profiler starts or stops;
Python-level redirection cannot catch them, so capture happens at the file-descriptor level.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Captured:
    """What was written to stdout/stderr inside :func:`capture_output` (filled in on exit)."""

    text: str = ""


_FD_WRITERS: dict[int, io.TextIOWrapper] = {}


def _fd_writer(fd: int) -> io.TextIOWrapper:
    """A text stream writing straight to file descriptor ``fd``, kept for the process lifetime.

    Installed as sys.stdout/sys.stderr while capturing. A library that creates a logging handler
    during the capture keeps a reference to it; because it writes to the descriptor (not to a
    buffer of ours), that handler prints normally once the descriptor is restored.
    """
    writer = _FD_WRITERS.get(fd)
    if writer is None:
        writer = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="replace",
            line_buffering=True,
            write_through=True,
        )
        _FD_WRITERS[fd] = writer
    return writer


def _flush_c_stdio() -> None:
    """Flush C stdio buffers, so that text a C extension printf'ed lands in the right file."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


@contextlib.contextmanager
def capture_output() -> Iterator[Captured]:
    """Capture everything written to stdout and stderr, at the file-descriptor level.

    Libraries print junk on import (bitsandbytes, xformers, amdsmi), some of it from C code that
    bypasses ``sys.stdout``; redirecting descriptors 1 and 2 onto a temporary file catches all of
    it. ``sys.stdout``/``sys.stderr`` are pointed at those descriptors too, so Python-level writes
    are caught even when the current streams are not backed by them (pytest's capture, IDEs).
    Not thread-safe: descriptors are process-wide.
    """
    captured = Captured()
    _flush_python_streams()
    _flush_c_stdio()
    saved: dict[int, int] = {}
    old_stdout, old_stderr = sys.stdout, sys.stderr
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            for fd in (1, 2):
                try:
                    saved[fd] = os.dup(fd)
                except OSError:  # descriptor closed (daemon, pythonw): nothing to capture there
                    continue
                os.dup2(sink.fileno(), fd)
            sys.stdout = _fd_writer(1) if 1 in saved else io.StringIO()
            sys.stderr = _fd_writer(2) if 2 in saved else io.StringIO()
            yield captured
        finally:
            _flush_python_streams()
            _flush_c_stdio()
            leftovers = [
                s.getvalue() for s in (sys.stdout, sys.stderr) if isinstance(s, io.StringIO)
            ]
            sys.stdout, sys.stderr = old_stdout, old_stderr
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            captured.text = sink.read().decode("utf-8", errors="replace") + "".join(leftovers)


#: Lines from native code that carry no information for the user.
_CHATTER = re.compile(
    r"^(USDT:.*profiler_(start|stop)"
    r"|.*ActivityProfilerController.*"
    r"|STAGE:.*"
    # Any profiler with profile_memory=True: a tensor allocated before the profiled window was
    # freed inside it.
    r"|.*Memory block of unknown size was allocated before the profiling started.*)$"
)


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Capture output for the duration; afterwards re-emit on stderr what is not known chatter."""
    with capture_output() as captured:
        yield
    kept = [line for line in captured.text.splitlines() if line and not _CHATTER.match(line)]
    if kept:
        sys.stderr.write("\n".join(kept) + "\n")


@dataclass
class LibraryOutput:
    """What libraries printed (stdout and stderr, native code included) and warned."""

    lines: list[str]

    def masked(self) -> str:
        """The lines with secrets masked: they go to a terminal that may be recorded or shared."""
        from diagnose.redact import redact_text

        return redact_text("\n".join(self.lines))


@contextlib.contextmanager
def library_output() -> Iterator[LibraryOutput]:
    """Capture what libraries print and warn for the duration; filled in on exit, known chatter
    (the profiler's start/stop lines) left out. Python warnings are caught as well: a library's
    warning on each step would otherwise interleave with the progress line."""
    import warnings

    out = LibraryOutput([])
    caught: list[warnings.WarningMessage] = []
    captured = Captured()
    try:
        with warnings.catch_warnings(record=True) as recorded, capture_output() as captured:
            warnings.simplefilter("default")
            caught = recorded
            yield out
    finally:
        # After both contexts closed: the captured text is filled in on exit.
        warned = list(
            dict.fromkeys(
                f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught
            )
        )
        printed = [
            line for line in captured.text.splitlines() if line.strip() and not _CHATTER.match(line)
        ]
        out.lines[:] = printed + warned
