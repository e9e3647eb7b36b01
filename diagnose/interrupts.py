"""Ctrl-C and SIGTERM stop a run promptly and cleanly, whatever code they land in.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be; raised inside a
finaliser or a callback it is printed as "Exception ignored" and lost, and the run went on to exit
0. SIGTERM's default action kills the process at once, leaving scratch folders and a half-written
output folder. So both signals get a handler that remembers the signal and raises, and the long
loops (each training step, each probe) call :func:`check`, which raises again for a signal that was
swallowed. :class:`Terminated` is a KeyboardInterrupt, so every ``except KeyboardInterrupt: raise``
lets it through and every ``finally`` cleans up.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from diagnose.errors import ExitCode


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as an exception so that cleanup runs."""


_pending: int | None = None


def _raise_for(signum: int) -> None:
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = signum
    _raise_for(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM (main thread only; elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)


def ignore() -> None:
    """Once the exit code is decided: a late second signal must not turn a clean exit into a
    death by signal while the interpreter shuts down."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check() -> None:
    """Raise again for a signal that arrived and was swallowed on its way up."""
    if _pending is not None:
        _raise_for(_pending)


def arrived() -> ExitCode | None:
    """The exit code of a signal that was delivered, if one was. A KeyboardInterrupt raised inside
    an import that a library swallows leaves that module half-initialised, and a later line then
    fails with an error that is only the signal's consequence: the signal is the cause to report."""
    if _pending is None:
        return None
    return ExitCode.TERMINATED if _pending == signal.SIGTERM else ExitCode.INTERRUPTED


def exit_code(exc: KeyboardInterrupt) -> ExitCode:
    """130 for Ctrl-C, 143 for SIGTERM: what a shell reports for a process ended by them."""
    return ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED


__all__ = ["Terminated", "arrived", "check", "exit_code", "ignore", "install"]
