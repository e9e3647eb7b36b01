"""In-process capture of ``diagnose profile``: the state machine that times, profiles and describes
the user's own steps.

The bootstrap (``bootstrap/sitecustomize.py``) loads this file by path, under a private module
name, in every Python process of the user's command, the moment ``torch.optim.optimizer`` has been
executed. It must therefore import nothing from ``diagnose`` (the user's Python may not have it)
and nothing heavy at module level. Its parts are loaded by path from beside it the same way:
``capture_contract.py`` (the environment variables, settings and files it shares with the parent
side, :mod:`diagnose.profile.launch`, which imports that module by name), ``capture_describe.py``
(what the facts say about the modules, optimizer, device and DataLoaders), ``capture_process.py``
(torch's classes wrapped, the step-boundary deferral, SIGTERM, strict mode) and
``stack_sampler.py`` (py-spy).

A training step is the interval between two successive ``optimizer.step()`` returns of the first
optimizer instance that steps, seen through torch's global optimizer step hooks (they fire for
every ``torch.optim.Optimizer`` subclass: torch's, bitsandbytes', transformers' Adafactor,
Prodigy). Other optimizer instances are counted but do not mark steps. Phases, in steps::

    skip (options.skip_steps, warm-up and compilation; at least the first step, which has no start)
    timed (options.timed_steps, no profiler; the step times are the headline number)
    probe (one step, not measured: which root modules run, their parameters, the optimizer state,
           the DataLoaders; the profiler's warm-up step when steps are profiled)
    profiled (options.profiled_steps under torch.profiler, one ``ProfilerStep#N`` each)

then the trace and the facts are written and every hook becomes a no-op (or, with
``stop_after``, the process ends). Outside the phases the cost is one counter increment per
optimizer step; forward hooks are registered only for the steps that sample them. The work at a
step boundary runs once ``optimizer.step()`` has returned, outside torch's ``Optimizer.step#…``
range (``capture_process.DeferredWork`` says why and how).

Nothing here raises into the user's program: a failure is recorded in the facts' status
(``error: …``) and disables the capture. ``KeyboardInterrupt`` and ``SystemExit`` are never
caught: they are the user's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _load_by_path(name: str, path: str) -> ModuleType:
    """A module of diagnose's loaded from its file, under a private name, once per process
    (the user's Python may not have diagnose installed, or another one)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as the import system does, so that dataclasses can resolve it.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


#: This file's folder: the capture's other modules are loaded from beside it.
_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str) -> ModuleType:
    """``diagnose/profile/<name>.py``, loaded by path from beside this file."""
    return _load_by_path(f"_diagnose_profile_{name}", os.path.join(_HERE, f"{name}.py"))


def _torch_compat() -> Any:
    """``diagnose/torch_compat.py``: every private or version-dependent part of torch."""
    path = os.path.join(os.path.dirname(_HERE), "torch_compat.py")
    return _load_by_path("_diagnose_profile_torch_compat", path)


# In the user's processes by path (their Python may lack diagnose); mypy reads the package's.
if TYPE_CHECKING:
    from diagnose.profile import capture_contract as _contract
    from diagnose.profile import capture_describe as _describe
    from diagnose.profile import capture_process as _process
else:
    _contract = _sibling("capture_contract")
    _describe = _sibling("capture_describe")
    _process = _sibling("capture_process")


class _Capture:
    """The capture state of this process (one instance, created when torch.optim is imported)."""

    def __init__(
        self, settings: _contract.Settings, started_perf: float, started_unix: float
    ) -> None:
        self.settings = settings
        self.started_perf = started_perf
        self.started_unix = started_unix
        #: When torch.optim was imported (seconds since start-up): the process file says it.
        self.torch_imported_s = round(time.perf_counter() - started_perf, 6)
        self.reset_for_process()

    def reset_for_process(self) -> None:
        """Fresh state: at creation, and in a forked child (a DataLoader worker must not carry on
        the parent's capture; a rank forked from a launcher starts its own)."""
        self.pid = os.getpid()
        #: Steps of the boundary optimizer (post hooks seen).
        self.steps = 0
        #: The step count at which the next boundary needs work; huge when nothing is left.
        self.next_event = 1
        self.phase = "skip"
        self.off = False
        self.finished = False
        self.status: str | None = None
        self.boundary: Callable[[], object] | None = None
        self.other_steps: dict[str, int] = {}
        #: Optimizer classes constructed in this process (a few), for "no step" explanations.
        self.optimizers_built: list[str] = []
        self.optimizers_built_count = 0
        self.stem: str | None = None
        self.identity: dict[str, Any] = {}
        self.first_step_s: float | None = None
        self.mark = 0.0
        self.timed: list[float] = []
        self.profiled: list[float] = []
        self.timed_started_unix: float | None = None
        self.timed_ended_unix: float | None = None
        self.autocast_samples: list[dict[str, dict[str, Any]]] = []
        self.root_autocast: list[dict[str, Any]] = []
        self.called: dict[int, tuple[Any, dict[str, dict[str, Any]]]] = {}
        #: ids of the parameters the stepping optimizer trains (empty: sample the first module).
        self.trainable_ids: frozenset[int] = frozenset()
        #: The probe step's trainable modules, grouped by the autocast state they ran under.
        self.trainable_autocast: list[dict[str, Any]] = []
        self.forward_handle: Any = None
        self.register_forward: Callable[[Callable[..., None]], Any] | None = None
        self.parameters: dict[str, Any] = {}
        self.optimizer_facts: dict[str, Any] = {}
        self.device: dict[str, Any] = {}
        self.dynamo_before: dict[str, dict[str, int]] | None = None
        self.dynamo_timed_end: dict[str, dict[str, int]] | None = None
        self.profiler: Any = None
        self.profiler_active = False
        self.profiler_note: str | None = None
        self.trace_name: str | None = None
        #: py-spy sampling this process during the probe and profiled steps, and what it left.
        self.sampler: Any = None
        self.stacks: dict[str, Any] | None = None
        #: The boundary work waiting for ``optimizer.step()`` to return.
        self.deferred = _process.DeferredWork(self._guarded)
        self.error: str | None = None
        self.sigterm = _process.SigtermHandler(self.at_exit)
        self.process_stepped = False
        self.loaders = _describe.LoaderLog()

    # -- the process file -------------------------------------------------------------------

    def process_path(self) -> str:
        return os.path.join(self.settings.directory, f"{_contract.PROCESS_PREFIX}{self.pid}.json")

    def write_process(self) -> None:
        with contextlib.suppress(Exception):
            payload = {
                "schema": _contract.SCHEMA_VERSION,
                "pid": self.pid,
                **_describe.describe_process(),
                "torch_imported_s": self.torch_imported_s,
                "optimizers_built": self.optimizers_built_count,
                "optimizer_classes": list(self.optimizers_built),
                "stepped": self.process_stepped,
                "facts": f"{self.stem}{_contract.FACTS_SUFFIX}" if self.stem else None,
                "error": self.error,
            }
            _process.write_json_atomic(self.process_path(), payload)

    # -- hooks ------------------------------------------------------------------------------

    def note_optimizer(self, optimizer: object) -> None:
        if self.off or os.getpid() != self.pid:
            return
        self.optimizers_built_count += 1
        if len(self.optimizers_built) < 8:
            self.optimizers_built.append(_describe.qualified(type(optimizer)))
        if self.optimizers_built_count == 1:
            # Strict mode starts here, once torch is wholly imported and before the first step.
            failure = _process.ensure_strict(
                os.environ.get(_contract.ENV_STRICT, ""),
                os.environ.get(_contract.ENV_STRICT_PACKAGE, ""),
                self.settings.directory,
            )
            if failure is not None:
                self.error = f"strict mode: {_one_line(failure)}"
            self.write_process()

    def pre_hook(self, optimizer: object, args: object, kwargs: object) -> None:
        if self.deferred.pending is not None:
            self.deferred.run_late()

    def post_hook(self, optimizer: object, args: object, kwargs: object) -> None:
        if self.off:
            return
        try:
            if optimizer is not self._boundary_optimizer() and (
                self.boundary is not None or not self._first_step(optimizer)
            ):
                self._count_other(optimizer)
                return
            self.steps += 1
            if self.steps < self.next_event:
                return
            if self._touches_profiler():
                self.deferred.defer(sys._getframe(1), self._boundary_work)
            else:
                # Timed steps: nothing here shows in a trace, and deferring costs tens of
                # microseconds a step (a profile function sees every call until the step ends).
                self._boundary_work()
        except Exception as exc:
            self._fail(exc)

    def _boundary_optimizer(self) -> object:
        return self.boundary() if self.boundary is not None else None

    def _count_other(self, optimizer: object) -> None:
        name = _describe.qualified(type(optimizer))
        if name in self.other_steps or len(self.other_steps) < _describe.MAX_KEYS:
            self.other_steps[name] = self.other_steps.get(name, 0) + 1

    def _first_step(self, optimizer: object) -> bool:
        """The first optimizer that steps marks the steps (in a forked child, the child's first
        one: it starts afresh); False when the capture cannot start here."""
        if os.getpid() != self.pid:
            self.reset_for_process()
        try:
            self.boundary = weakref.ref(optimizer)
        except TypeError:  # a class with __slots__ and no __weakref__: keep it alive
            self.boundary = lambda: optimizer
        self.first_step_s = time.perf_counter() - self.started_perf
        self.process_stepped = True
        self.next_event = max(self.settings.skip_steps, 1)
        try:
            self.identity = _describe.describe_rank()
            # Before the claim, so that its first file tells the parent which GPU to watch.
            self.device = _describe.describe_device(optimizer)
            self.stem = self._claim(int(self.identity["rank"]))
            self.sigterm.install()
        except Exception as exc:
            self.off = True
            self.error = f"capture start: {_one_line(exc)}"
            self.write_process()
            return False
        self.write_process()
        return True

    # -- step boundaries --------------------------------------------------------------------

    def _touches_profiler(self) -> bool:
        """Whether this boundary's work starts, steps or stops the profiler."""
        s = self.settings
        if self.phase in ("probe", "profiled"):
            return True
        if not s.profiled_steps:
            return False
        if self.phase == "timed":
            return len(self.timed) + 1 >= s.timed_steps
        return s.timed_steps == 0

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:
            self._fail(exc)

    def _now(self) -> float:
        """The time at the end of a step, with the device drained when CUDA/ROCm is in use."""
        cuda = sys.modules.get("torch.cuda")
        if cuda is not None and cuda.is_initialized():
            cuda.synchronize()
        return time.perf_counter()

    def _boundary_work(self) -> None:
        s = self.settings
        now = self._now()
        if self.phase == "skip":
            self._start_capture()
            if s.timed_steps:
                self._enter("timed", self.steps + 1)
            else:
                self._start_probe()
        elif self.phase == "timed":
            self.timed.append(now - self.mark)
            # What is measured is kept: a process killed later (SIGKILL skips every handler)
            # leaves these steps in its facts. Written before the next step's mark.
            self._write_facts(_contract.STATUS_RUNNING)
            if len(self.timed) < s.timed_steps:
                self._enter("timed", self.steps + 1)
            else:
                self._start_probe()
        elif self.phase == "probe":
            self._finish_probe()
            if s.profiled_steps and self.profiler is not None:
                with _process.StderrFilter():
                    self.profiler.step()  # warm-up -> recording: ProfilerStep#1 starts now
                self.profiler_active = True
                self._enter("profiled", self.steps + 1)
            else:
                self._complete()
                return
        elif self.phase == "profiled":
            self.profiled.append(now - self.mark)
            if len(self.profiled) < s.profiled_steps:
                self.profiler.step()
                self._enter("profiled", self.steps + 1)
            else:
                self._complete()
                return
        self.mark = time.perf_counter()

    def _enter(self, phase: str, next_event: int) -> None:
        self.phase = phase
        self.next_event = next_event
        self._register_forward(collect=phase == "probe")

    def _start_capture(self) -> None:
        _process.strict_event("capture_started")
        self.timed_started_unix = time.time()
        optimizer: Any = self._boundary_optimizer()
        if optimizer is not None:
            self.trainable_ids = frozenset(
                id(p) for group in optimizer.param_groups for p in group["params"]
            )
        self.dynamo_before = _describe.dynamo_counters(_torch_compat())
        self.loaders.open_window()

    def _start_probe(self) -> None:
        self.timed_ended_unix = time.time()
        self.dynamo_timed_end = _describe.dynamo_counters(_torch_compat())
        s = self.settings
        if s.profiled_steps:
            if _torch_compat().profiler_is_running():
                self.profiler_note = "the program runs its own torch.profiler: no trace taken"
            else:
                self.profiler = _process.make_profiler(s.profiled_steps)
                with _process.StderrFilter():
                    self.profiler.start()
                # From the probe step on: py-spy needs a moment to attach, and the probe
                # step's own frames (ours) are left out when the samples are read.
                self._start_sampler()
        self._enter("probe", self.steps + 1)

    def _start_sampler(self) -> None:
        if not self.settings.py_spy or self.stem is None:
            return
        path = os.path.join(_HERE, "stack_sampler.py")
        try:
            module = _load_by_path("_diagnose_profile_stack_sampler", path)
        except ImportError:
            self.stacks = {"error": f"cannot load {path}"}
            return
        output = os.path.join(self.settings.directory, self.stem + _contract.STACKS_SUFFIX)
        self.sampler = module.StackSampler(self.settings.py_spy, output)
        self.sampler.start()

    def _stop_sampler(self) -> None:
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            self.stacks = sampler.stop()

    # -- forward sampling -------------------------------------------------------------------

    def _register_forward(self, *, collect: bool) -> None:
        register = self.register_forward
        if register is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            register = self.register_forward = register_module_forward_pre_hook
        self._remove_forward()
        self.forward_handle = register(self._forward_collect if collect else self._forward_once)

    def _remove_forward(self) -> None:
        handle, self.forward_handle = self.forward_handle, None
        if handle is not None:
            handle.remove()

    def _forward_once(self, module: Any, args: object) -> None:
        """Timed or profiled step: sample autocast at the first module that holds a parameter
        the optimizer trains, then unhook. Not at the first module called: a frozen VAE or text
        encoder often runs first, outside the autocast, and accelerate enters its autocast inside
        the prepared model's forward, after that model's own pre-hook has run."""
        try:
            if self.trainable_ids and not _describe.holds_any(module, self.trainable_ids):
                return
            self._remove_forward()
            if os.getpid() == self.pid and not self.off:
                self.autocast_samples.append(_describe.autocast_state(_torch_compat()))
        except Exception as exc:
            self._fail(exc)

    def _forward_collect(self, module: object, args: object) -> None:
        """Probe step: every module called (first call), with the autocast state it ran under."""
        try:
            called = self.called
            if id(module) not in called and os.getpid() == self.pid:
                called[id(module)] = (module, _describe.autocast_state(_torch_compat()))
        except Exception as exc:
            self._fail(exc)

    # -- the probe step ---------------------------------------------------------------------

    def _finish_probe(self) -> None:
        self._remove_forward()
        called, self.called = self.called, {}
        self.trainable_autocast = _describe.trainable_autocast(called, self.trainable_ids)
        roots = _describe.root_modules(called)
        self.root_autocast.extend(
            {"module": _describe.qualified(type(module)), **autocast} for module, autocast in roots
        )
        optimizer = self._boundary_optimizer()
        if optimizer is not None:
            self.optimizer_facts = _describe.describe_optimizer(optimizer)
            self.parameters["trainable"] = _describe.describe_trainable(optimizer)
            self.device = _describe.describe_device(optimizer)
        modules = [module for module, _ in roots]
        self.parameters["frozen_in_roots"] = _describe.frozen_in_roots(modules)
        self.parameters["roots"] = [
            _describe.qualified(type(root)) for root in modules[: _describe.MAX_KEYS]
        ]
        self.loaders.close_window()

    # -- DataLoaders ------------------------------------------------------------------------

    def note_iterator(self, loader: Any, iterator: Any) -> None:
        if self.off or os.getpid() != self.pid:
            return
        watching = self.phase != "skip" and not self.finished
        self.loaders.note(loader, iterator, self.steps, watching=watching)

    # -- rank, files ------------------------------------------------------------------------

    def _claim(self, rank: int) -> str:
        """The file stem of this process: ``rank<R>``, or ``rank<R>-pid<pid>`` when another
        process claimed the rank first (claims are exclusive file creations)."""
        import json

        for stem in (f"rank{rank}", f"rank{rank}-pid{self.pid}"):
            path = os.path.join(self.settings.directory, stem + _contract.FACTS_SUFFIX)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            self.stem = stem
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self._facts(_contract.STATUS_RUNNING), handle, default=str)
            return stem
        raise FileExistsError(f"rank {rank} was claimed twice by this process")

    def _facts(self, status: str) -> dict[str, Any]:
        dynamo_now = _describe.dynamo_counters(_torch_compat())
        return {
            "schema": _contract.SCHEMA_VERSION,
            "status": status,
            **_describe.capture_facts(self, dynamo_now),
        }

    def _write_facts(self, status: str) -> None:
        if self.stem is None:
            return
        self.status = status
        path = os.path.join(self.settings.directory, self.stem + _contract.FACTS_SUFFIX)
        _process.write_json_atomic(path, self._facts(status))

    # -- the end ----------------------------------------------------------------------------

    def _stop_profiler(self) -> None:
        """Stop the profiler and export what it recorded (nothing when it never recorded)."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        with _process.StderrFilter():
            profiler.stop()
        if not self.profiler_active or self.stem is None:
            return
        name = self.stem + _contract.TRACE_SUFFIX
        final = os.path.join(self.settings.directory, name)
        # The name must end in .gz: torch gzips by the suffix.
        temporary = os.path.join(
            self.settings.directory, f".{self.pid}.tmp{_contract.TRACE_SUFFIX}"
        )
        profiler.export_chrome_trace(temporary)
        os.replace(temporary, final)
        self.trace_name = name

    def _complete(self) -> None:
        self._stop_sampler()
        self._stop_profiler()
        self._finish(_contract.STATUS_COMPLETE)
        if self.settings.stop_after:
            _process.stop_process()

    def _finish(self, status: str) -> None:
        self.off = True
        self.finished = True
        self.next_event = sys.maxsize
        self._remove_forward()
        self._write_facts(status)
        self.sigterm.restore()
        _process.strict_event("capture_ended")

    def _progress(self) -> str:
        text = f"after {len(self.timed)} timed steps"
        if self.profiled:
            text += f" and {len(self.profiled)} profiled steps"
        return text

    def _fail(self, exc: Exception) -> None:
        """A failure of ours: record it, stop capturing, leave the program alone."""
        if self.finished:
            return
        try:
            self.deferred.pending = None
            with contextlib.suppress(Exception):
                self._stop_sampler()
            with contextlib.suppress(Exception):
                self._stop_profiler()
            self._finish(f"error: {_one_line(exc)}")
        except Exception:
            self.off = True

    def at_exit(self, reason: str | None = None) -> None:
        """The process ends: write what was measured if the capture did not complete."""
        if os.getpid() != self.pid or self.finished or self.stem is None:
            return
        with contextlib.suppress(Exception):
            self.deferred.cancel()
            if reason is None:
                reason = _process.exit_reason()
            with contextlib.suppress(Exception):
                self._stop_sampler()
            with contextlib.suppress(Exception):
                self._stop_profiler()
            self._finish(f"partial: {reason} {self._progress()}")


_capture: _Capture | None = None


def _after_fork_in_child() -> None:
    capture = _capture
    if capture is not None and capture.pid != os.getpid():
        handle = capture.forward_handle
        capture.reset_for_process()
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.remove()


def on_import(name: str, module: ModuleType, started_perf: float, started_unix: float) -> None:
    """Called by the bootstrap when a watched torch module has just been executed."""
    global _capture
    settings = _contract.Settings.from_environ(os.environ)
    if settings is None:
        return
    capture = _capture
    if capture is None:
        capture = _capture = _Capture(settings, started_perf, started_unix)
        atexit.register(capture.at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)
    if name == "torch.optim.optimizer":
        _process.install_optimizer_hooks(
            module, capture.pre_hook, capture.post_hook, capture.note_optimizer
        )
        capture.write_process()
    elif name == "torch.utils.data.dataloader":
        _process.install_dataloader_hook(module, capture.note_iterator)


__all__ = ["on_import"]
