"""How the in-process capture sits in the user's process without disturbing it.

The plumbing :mod:`diagnose.profile.capture`'s state machine stands on: wrapping torch's
optimizer and DataLoader classes, running the step-boundary work once torch's step wrapper has
returned, the profiler and the Kineto lines it writes to stderr, SIGTERM from a launcher, ending
the process for ``--stop-after``, starting strict mode (imported from the diagnose that launched
the command) and telling it when the capture's window opens and closes, and writing a JSON file
atomically. Like the capture, this file is loaded by path inside the user's processes, so it
imports nothing from ``diagnose`` and torch only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any


def write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` so that a reader sees the old file or the new one, never half of it."""
    import json

    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, default=str)
    os.replace(temporary, path)


# -- torch's classes, wrapped -----------------------------------------------------------------


def install_optimizer_hooks(
    module: ModuleType,
    pre_hook: Callable[[object, object, object], None],
    post_hook: Callable[[object, object, object], None],
    on_built: Callable[[object], None],
) -> None:
    """Register the global optimizer step hooks of ``torch.optim.optimizer`` (``module``) and
    wrap ``Optimizer.__init__`` so that ``on_built`` sees every optimizer made (once)."""
    module.register_optimizer_step_pre_hook(pre_hook)
    module.register_optimizer_step_post_hook(post_hook)
    optimizer_class = module.Optimizer
    original = optimizer_class.__init__
    if getattr(original, "_diagnose_profile", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            on_built(self)

    functools.update_wrapper(__init__, original)
    __init__._diagnose_profile = True  # type: ignore[attr-defined]
    optimizer_class.__init__ = __init__


def install_dataloader_hook(module: ModuleType, on_iter: Callable[[Any, Any], None]) -> None:
    """Wrap ``DataLoader.__iter__`` of ``torch.utils.data.dataloader`` (``module``) so that
    ``on_iter`` sees each loader and the iterator it returns (once)."""
    loader_class = module.DataLoader
    original = loader_class.__iter__
    if getattr(original, "_diagnose_profile", False):
        return

    def __iter__(self: Any) -> Any:
        iterator = original(self)
        with contextlib.suppress(Exception):
            on_iter(self, iterator)
        return iterator

    functools.update_wrapper(__iter__, original)
    __iter__._diagnose_profile = True  # type: ignore[attr-defined]
    loader_class.__iter__ = __iter__


# -- the step boundary -----------------------------------------------------------------------


class DeferredWork:
    """Work run just after torch's optimizer step wrapper has returned, not inside the post hook.

    The post hook runs inside torch's ``Optimizer.step#…`` profiler range: a ``ProfilerStep``
    range (or a device synchronisation) started there would cross it, so the trace would no
    longer nest and the trace analysis would count the capture's synchronisation as the
    optimizer's. :meth:`defer` arms a one-shot ``sys.setprofile`` function that fires when the
    wrapper's frame returns; when another profile function is installed (the user's profiler)
    it runs the work at once instead. ``run`` runs a piece of work, catching its failures.
    """

    def __init__(self, run: Callable[[Callable[[], None]], None]) -> None:
        self._run = run
        self.pending: Callable[[], None] | None = None
        self.profile_function: Callable[[FrameType, str, object], None] | None = None

    def defer(self, step_frame: FrameType | None, work: Callable[[], None]) -> None:
        """Run ``work`` once ``step_frame`` (the optimizer step wrapper's) has returned."""
        code = step_frame.f_code if step_frame is not None else None
        if (
            step_frame is None
            or code is None
            or code.co_name != "wrapper"
            or not code.co_filename.endswith("optimizer.py")
            or sys.getprofile() is not None
        ):
            self._run(work)
            return
        self.pending = work

        def on_event(frame: FrameType, event: str, arg: object) -> None:
            if event != "return" or frame is not step_frame:
                return
            sys.setprofile(None)
            self.profile_function = None
            pending = self.pending
            self.pending = None
            if pending is not None:
                self._run(pending)

        self.profile_function = on_event
        sys.setprofile(on_event)

    def run_late(self) -> None:
        """The deferred work never ran (no return event came): run it late rather than never."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            self._run(pending)

    def cancel(self) -> None:
        """Drop the pending work and take the profile function out (the process ends)."""
        self.pending = None
        if self.profile_function is not None and sys.getprofile() is self.profile_function:
            sys.setprofile(None)


# -- the profiler -----------------------------------------------------------------------------


def make_profiler(active: int) -> Any:
    """A torch.profiler for one warm-up step (the probe step), then exactly ``active``
    ``ProfilerStep`` ranges; the capture calls step() at each boundary, so each range runs from
    one optimizer step's return to the next."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and (
        ProfilerActivity.CUDA in torch.profiler.supported_activities()  # type: ignore[no-untyped-call]
    ):
        activities.append(ProfilerActivity.CUDA)  # CUDA also covers ROCm
    plan = schedule(wait=0, warmup=1, active=active, repeat=1)
    try:
        return profile(activities=activities, schedule=plan, record_shapes=True, with_modules=True)
    except TypeError:  # a torch without with_modules
        return profile(activities=activities, schedule=plan, record_shapes=True)


class StderrFilter:
    """Drops the ``USDT:… profiler_start/stop`` lines Kineto writes to file descriptor 2 when the
    profiler starts and stops (the user's stderr is theirs); everything else written meanwhile is
    written back afterwards."""

    def __enter__(self) -> StderrFilter:
        import tempfile

        self._saved: int | None = None
        try:
            sys.stderr.flush()
            self._spool = tempfile.TemporaryFile()
            self._saved = os.dup(2)
            os.dup2(self._spool.fileno(), 2)
        except Exception:
            self._saved = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._spool.seek(0)
        kept = [
            line
            for line in self._spool.read().splitlines(keepends=True)
            if not (line.startswith(b"USDT:") and b"profiler_" in line)
        ]
        self._spool.close()
        if kept:
            os.write(2, b"".join(kept))


# -- the end of the process -------------------------------------------------------------------


class SigtermHandler:
    """torchrun stops its ranks with SIGTERM, whose default action skips ``atexit``: when the
    program has no handler of its own, ``on_term`` writes the partial capture, then the process
    dies of SIGTERM as before."""

    def __init__(self, on_term: Callable[[str], None]) -> None:
        self._on_term = on_term
        self.installed = False

    def install(self) -> None:
        import signal

        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.installed = True

    def restore(self) -> None:
        import signal

        if not self.installed:
            return
        self.installed = False
        with contextlib.suppress(Exception):
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        import signal

        self._on_term("terminated (SIGTERM)")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def exit_reason() -> str:
    """Why the process is ending, as far as the interpreter knows."""
    last = getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        return "interrupted"
    if isinstance(last, BaseException):
        return f"the program raised {type(last).__name__}"
    return "the program ended"


def stop_process() -> None:
    """``stop_after``: end the process now, with exit code 0.

    ``os._exit`` rather than ``sys.exit``: a SystemExit raised here would unwind through the
    user's training loop, its ``finally``/``except BaseException`` blocks and launcher wrappers
    (accelerate, Lightning) that report it as a failure, and interpreter shutdown can hang on
    DataLoader workers and other threads mid-step. The capture's files are written and closed
    by now; the streams are flushed and this process's multiprocessing children (DataLoader
    workers) are stopped first, since nothing else would.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    try:
        import multiprocessing

        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=5)
    except Exception:
        pass
    os._exit(0)


# -- strict mode ------------------------------------------------------------------------------

#: diagnose's strict mode in this process (``--strict``; see diagnose/strict/runtime.py), or None.
_strict: Any = None


def start_strict(options: str, package: str, directory: str) -> Any:
    """Strict mode for this process when ``--strict`` was given (``options``, its variable's
    value): diagnose.strict.runtime, imported from the diagnose that launched the command
    (``package``, its folders) when this Python has none."""
    if not options:
        return None
    path = [p for p in package.split(os.pathsep) if p]
    return import_strict_runtime(path).start(os.environ, directory)


def ensure_strict(options: str, package: str, directory: str) -> Exception | None:
    """Strict mode started once per process (:func:`start_strict`); what kept it from starting."""
    global _strict
    if _strict is None:
        try:
            _strict = start_strict(options, package, directory)
        except Exception as exc:
            _strict = False
            return exc
    return None


def strict_event(name: str) -> None:
    """Tell strict mode that the capture's window of steps opened or closed."""
    handler = getattr(_strict, name, None)
    if handler is not None:
        with contextlib.suppress(Exception):
            handler()


def import_strict_runtime(package_path: list[str]) -> ModuleType:
    """``diagnose.strict.runtime``, imported from the diagnose that launched the command (its
    package folders, ``package_path``) when this Python has none."""
    import importlib
    import importlib.util

    if (
        "diagnose" not in sys.modules
        and importlib.util.find_spec("diagnose") is None
        and package_path
    ):
        spec = importlib.util.spec_from_file_location(
            "diagnose",
            os.path.join(package_path[0], "__init__.py"),
            submodule_search_locations=package_path,
        )
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["diagnose"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop("diagnose", None)
                raise
    return importlib.import_module("diagnose.strict.runtime")


__all__ = [
    "DeferredWork",
    "SigtermHandler",
    "StderrFilter",
    "ensure_strict",
    "exit_reason",
    "import_strict_runtime",
    "install_dataloader_hook",
    "install_optimizer_hooks",
    "make_profiler",
    "start_strict",
    "stop_process",
    "strict_event",
    "write_json_atomic",
]
