"""In-process capture of ``diagnose profile``: times, profiles and describes the user's own steps.

The bootstrap (``bootstrap/sitecustomize.py``) loads this file by path, under a private module
name, in every Python process of the user's command, the moment ``torch.optim.optimizer`` has been
executed. It must therefore import nothing from ``diagnose`` (the user's Python may not have it)
and nothing heavy at module level; the parent side (:mod:`diagnose.profile.launch`) imports it as
``diagnose.profile.capture`` for the names and the file layout.

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
optimizer step; forward hooks are registered only for the steps that sample them.

The work at a step boundary runs just after ``optimizer.step()`` has returned, not inside the post
hook: the post hook runs inside torch's ``Optimizer.step#…`` profiler range, and a
``ProfilerStep`` range (or a device synchronisation) started there would cross it, so the trace
would no longer nest and the trace analysis would count our synchronisation as the optimizer's.
The post hook arms a one-shot ``sys.setprofile`` function that fires when the step wrapper's frame
returns; when another profile function is installed (the user's profiler) it falls back to doing
the work in the post hook.

Files in the capture folder (``DIAGNOSE_PROFILE_DIR``):

- ``process-<pid>.json``: every process that imported torch (launchers and DataLoader workers
  too): argv, the optimizers it built, whether it stepped, a failure of the bootstrap. Not a rank.
- ``rank<R>.capture.json`` (``rank<R>-pid<pid>`` when two processes claim rank R): created when
  the process's first step ends (``status: running``), rewritten atomically after each timed step
  (so a process killed later keeps them) and at the end with the facts.
- ``rank<R>.pt.trace.json.gz``: the Kineto trace of the profiled steps.
- ``rank<R>.pyspy.txt``: py-spy's stacks of the probe and profiled steps, when the parent named a
  py-spy (``DIAGNOSE_PROFILE_PY_SPY``; see ``stack_sampler.py``, loaded from beside this file).
- ``strict-<pid>.json``: strict mode's log (``--strict``: ``DIAGNOSE_STRICT``), written by
  ``diagnose.strict.runtime``, which this module starts at the first optimizer's construction and
  tells when the capture's window opens and closes.

Nothing here raises into the user's program: a failure is recorded in the facts' status
(``error: …``) and disables the capture. ``KeyboardInterrupt`` and ``SystemExit`` are never
caught: they are the user's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

#: Environment variables the parent sets for every process of the command.
ENV_DIR = "DIAGNOSE_PROFILE_DIR"
ENV_CAPTURE = "DIAGNOSE_PROFILE_CAPTURE"
ENV_SKIP_STEPS = "DIAGNOSE_PROFILE_SKIP_STEPS"
ENV_TIMED_STEPS = "DIAGNOSE_PROFILE_TIMED_STEPS"
ENV_PROFILED_STEPS = "DIAGNOSE_PROFILE_PROFILED_STEPS"
ENV_STOP_AFTER = "DIAGNOSE_PROFILE_STOP_AFTER"
#: The py-spy executable that samples the profiled steps' Python stacks (unset: none).
ENV_PY_SPY = "DIAGNOSE_PROFILE_PY_SPY"
#: ``--strict``: its options, and where the diagnose package's modules are for a Python that
#: lacks it (its folder first; as diagnose.strict.options.ENV_OPTIONS and ENV_PACKAGE, a test keeps
#: them equal).
ENV_STRICT = "DIAGNOSE_STRICT"
ENV_STRICT_PACKAGE = "DIAGNOSE_STRICT_PACKAGE"

FACTS_SUFFIX = ".capture.json"
TRACE_SUFFIX = ".pt.trace.json.gz"
#: py-spy's collapsed stacks of the probe and profiled steps (``--format raw``).
STACKS_SUFFIX = ".pyspy.txt"
PROCESS_PREFIX = "process-"
SCHEMA_VERSION = 1

STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"

#: Per-dtype and per-key tables are cut at this many entries (a corrupt state must not make the
#: facts file huge); dynamo counter names (graph-break reasons) at this many characters.
_MAX_KEYS = 64
_MAX_NAME = 200
#: DataLoaders remembered per process (one per distinct loader object).
_MAX_LOADERS = 32
#: Training frameworks whose import is recorded: which one drives the loop decides the words a
#: fix is written in (diagnose.trainers reads them; its SIGNS' modules are all here, which a test
#: holds: this file cannot import diagnose, which the trainer's Python may lack).
_FRAMEWORK_PACKAGES = (
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "diffusers",
    "peft",
    "bitsandbytes",
    # Modules of the trainers' own source trees (kohya's sd-scripts, OneTrainer, ai-toolkit,
    # SimpleTuner), imported from the folder their scripts run in.
    "library.train_util",
    "modules.trainer.GenericTrainer",
    "modules.trainer.BaseTrainer",
    "toolkit.job",
    "jobs.process.BaseSDTrainProcess",
    "simpletuner",
    "helpers.training.state_tracker",
    "helpers.training.trainer",
)


@dataclass(frozen=True)
class Settings:
    """What to capture, read from the environment the parent set."""

    directory: str
    skip_steps: int = 5
    timed_steps: int = 10
    profiled_steps: int = 3
    stop_after: bool = False
    py_spy: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings | None:
        directory = environ.get(ENV_DIR)
        if not directory:
            return None

        def count(name: str, default: int) -> int:
            try:
                return max(0, int(environ.get(name, "")))
            except ValueError:
                return default

        profiled = count(ENV_PROFILED_STEPS, cls.profiled_steps)
        world = count("WORLD_SIZE", 1)
        if profiled:
            # Enough that the waits between ranks have a jitter to be held against.
            profiled = max(profiled, steps_to_name_a_straggler(world))
        return cls(
            directory=directory,
            skip_steps=count(ENV_SKIP_STEPS, cls.skip_steps),
            timed_steps=count(ENV_TIMED_STEPS, cls.timed_steps),
            profiled_steps=profiled,
            stop_after=environ.get(ENV_STOP_AFTER, "") in {"1", "true", "yes"},
            py_spy=environ.get(ENV_PY_SPY, ""),
        )


#: As diagnose.catalogs.distributed_catalog.STRAGGLER_STEPS (this module imports nothing of
#: diagnose's: it runs in the user's processes); a test keeps the two equal.
_STRAGGLER_STEPS = 3


def steps_to_name_a_straggler(world_size: int) -> int:
    """As the catalog's function of that name: the fewest profiled steps a straggler among
    ``world_size`` ranks can be named from."""
    return _STRAGGLER_STEPS if world_size > 1 else 1


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _qualified(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _holds_any(module: Any, parameter_ids: frozenset[int]) -> bool:
    """Whether ``module`` itself (not a submodule) holds one of the parameters."""
    return any(id(p) in parameter_ids for p in getattr(module, "_parameters", {}).values())


def _state_group(
    groups: list[dict[str, Any]], state: Mapping[str, Any], counters: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The group of ``groups`` with ``state``'s autocast (CUDA and CPU alike), made with
    ``counters`` when there is none; None when ``groups`` is full."""
    for group in groups:
        if group["cuda"] == state["cuda"] and group["cpu"] == state["cpu"]:
            return group
    if len(groups) >= _MAX_KEYS:
        return None
    group = {**state, **counters}
    groups.append(group)
    return group


def _module_names(called: dict[int, tuple[Any, Any]]) -> dict[int, str]:
    """Dotted names of the called modules, from the first called module that holds each (its
    class name first): ``UNet2DConditionModel.mid_block.attentions.0...``."""
    names: dict[int, str] = {}
    for key, (module, _) in called.items():
        if key in names:
            continue
        with contextlib.suppress(Exception):
            prefix = type(module).__name__
            for name, sub in module.named_modules():
                names.setdefault(id(sub), f"{prefix}.{name}" if name else prefix)
    return names


def _distinguishing(names: list[str], others: list[str]) -> list[str]:
    """The shortest dotted prefixes that cover ``names`` and no name of ``others``, in order:
    the modules of one autocast state as the blocks that hold them (``UNet.mid_block``)."""
    found: list[str] = []
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if not any(o == prefix or o.startswith(prefix + ".") for o in others):
                break
        if not any(prefix == f or prefix.startswith(f + ".") for f in found):
            found.append(prefix)
    return found


def write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` so that a reader sees the old file or the new one, never half of it."""
    import json

    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, default=str)
    os.replace(temporary, path)


class _Tally:
    """Counts and element counts per key (a dtype name, usually)."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, int]] = {}

    def add(self, key: str, elements: int) -> None:
        row = self.table.get(key)
        if row is None:
            if len(self.table) >= _MAX_KEYS:
                return
            row = self.table[key] = {"count": 0, "elements": 0}
        row["count"] += 1
        row["elements"] += elements


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


def _torch_compat() -> Any:
    """``diagnose/torch_compat.py``: every private or version-dependent part of torch."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "torch_compat.py")
    return _load_by_path("_diagnose_profile_torch_compat", path)


def _autocast_state() -> dict[str, dict[str, Any]]:
    """Whether autocast is on for CUDA (ROCm too) and CPU, and its dtype, right now."""
    compat = _torch_compat()
    state: dict[str, dict[str, Any]] = {}
    for device in ("cuda", "cpu"):
        enabled = compat.is_autocast_enabled(device)
        dtype = compat.autocast_dtype(device) if enabled else None
        state[device] = {"enabled": enabled, "dtype": _dtype_name(dtype) if enabled else None}
    return state


def _dynamo_counters() -> dict[str, dict[str, int]] | None:
    """``torch._dynamo``'s counters when dynamo is loaded (never imported here)."""
    counters = _torch_compat().dynamo_counters()
    if counters is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for group, table in list(counters.items())[:_MAX_KEYS]:
        rows = {}
        for key, value in list(table.items())[:_MAX_KEYS]:
            try:
                rows[str(key)[:_MAX_NAME]] = int(value)
            except (TypeError, ValueError):
                continue
        out[str(group)] = rows
    return out


def _counter_delta(
    before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None
) -> dict[str, dict[str, int]]:
    if after is None:
        return {}
    before = before or {}
    delta: dict[str, dict[str, int]] = {}
    for group, rows in after.items():
        changed = {
            key: value - before.get(group, {}).get(key, 0)
            for key, value in rows.items()
            if value != before.get(group, {}).get(key, 0)
        }
        if changed:
            delta[group] = changed
    return delta


class _StderrFilter:
    """Drops the ``USDT:… profiler_start/stop`` lines Kineto writes to file descriptor 2 when the
    profiler starts and stops (the user's stderr is theirs); everything else written meanwhile is
    written back afterwards."""

    def __enter__(self) -> _StderrFilter:
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


class _Capture:
    """The capture state of this process (one instance, created when torch.optim is imported)."""

    def __init__(self, settings: Settings, started_perf: float, started_unix: float) -> None:
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
        self.pending: Callable[[], None] | None = None
        self.profile_function: Callable[[FrameType, str, object], None] | None = None
        self.error: str | None = None
        self.sigterm_installed = False
        self.process_stepped = False
        self.dataloaders: dict[int, dict[str, Any]] = {}
        self.yielded_before: dict[int, int] = {}

    # -- the process file -------------------------------------------------------------------

    def process_path(self) -> str:
        return os.path.join(self.settings.directory, f"{PROCESS_PREFIX}{self.pid}.json")

    def write_process(self) -> None:
        with contextlib.suppress(Exception):
            # A spawn/forkserver child: its sys.argv is the parent's by now, its command line not.
            original = list(getattr(sys, "orig_argv", []))
            parent = sys.modules.get("multiprocessing.process")
            child = "--multiprocessing-fork" in original or bool(
                parent and getattr(parent, "_parent_process", None) is not None
            )
            payload = {
                "schema": SCHEMA_VERSION,
                "pid": self.pid,
                "ppid": os.getppid(),
                "argv": list(sys.argv),
                "orig_argv": original,
                "executable": sys.executable,
                "multiprocessing_child": child,
                "torch_imported_s": self.torch_imported_s,
                "optimizers_built": self.optimizers_built_count,
                "optimizer_classes": list(self.optimizers_built),
                "stepped": self.process_stepped,
                "facts": f"{self.stem}{FACTS_SUFFIX}" if self.stem else None,
                "error": self.error,
            }
            write_json_atomic(self.process_path(), payload)

    # -- hooks ------------------------------------------------------------------------------

    def note_optimizer(self, optimizer: object) -> None:
        if self.off or os.getpid() != self.pid:
            return
        self.optimizers_built_count += 1
        if len(self.optimizers_built) < 8:
            self.optimizers_built.append(_qualified(type(optimizer)))
        if self.optimizers_built_count == 1:
            # Strict mode starts here, once torch is wholly imported and before the first step.
            _ensure_strict(self)
            self.write_process()

    def pre_hook(self, optimizer: object, args: object, kwargs: object) -> None:
        pending = self.pending
        if pending is not None:
            # The deferred boundary work never ran (no return event came): run it late rather
            # than never.
            self.pending = None
            self._guarded(pending)

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
                self._defer(sys._getframe(1))
            else:
                # Timed steps: nothing here shows in a trace, and deferring costs tens of
                # microseconds a step (a profile function sees every call until the step ends).
                self._boundary_work()
        except Exception as exc:
            self._fail(exc)

    def _boundary_optimizer(self) -> object:
        return self.boundary() if self.boundary is not None else None

    def _count_other(self, optimizer: object) -> None:
        name = _qualified(type(optimizer))
        if name in self.other_steps or len(self.other_steps) < _MAX_KEYS:
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
            self.identity = self._identify()
            # Before the claim, so that its first file tells the parent which GPU to watch.
            self.device = self._describe_device(optimizer)
            self.stem = self._claim(int(self.identity["rank"]))
            self._install_sigterm()
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

    def _defer(self, step_frame: FrameType | None) -> None:
        """Run the boundary work once the optimizer step wrapper (``step_frame``) has returned,
        so that it lies outside torch's ``Optimizer.step#…`` range."""
        work = self._boundary_work
        code = step_frame.f_code if step_frame is not None else None
        if (
            step_frame is None
            or code is None
            or code.co_name != "wrapper"
            or not code.co_filename.endswith("optimizer.py")
            or sys.getprofile() is not None
        ):
            self._guarded(work)
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
                self._guarded(pending)

        self.profile_function = on_event
        sys.setprofile(on_event)

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
            self._write_facts(STATUS_RUNNING)
            if len(self.timed) < s.timed_steps:
                self._enter("timed", self.steps + 1)
            else:
                self._start_probe()
        elif self.phase == "probe":
            self._finish_probe()
            if s.profiled_steps and self.profiler is not None:
                with _StderrFilter():
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
        _strict_event("capture_started")
        self.timed_started_unix = time.time()
        optimizer: Any = self._boundary_optimizer()
        if optimizer is not None:
            self.trainable_ids = frozenset(
                id(p) for group in optimizer.param_groups for p in group["params"]
            )
        self.dynamo_before = _dynamo_counters()
        self.yielded_before = {
            key: yielded
            for key, entry in self.dataloaders.items()
            if (yielded := self._yielded(entry)) is not None
        }

    def _start_probe(self) -> None:
        self.timed_ended_unix = time.time()
        self.dynamo_timed_end = _dynamo_counters()
        s = self.settings
        if s.profiled_steps:
            if _torch_compat().profiler_is_running():
                self.profiler_note = "the program runs its own torch.profiler: no trace taken"
            else:
                self.profiler = self._make_profiler(s.profiled_steps)
                with _StderrFilter():
                    self.profiler.start()
                # From the probe step on: py-spy needs a moment to attach, and the probe
                # step's own frames (ours) are left out when the samples are read.
                self._start_sampler()
        self._enter("probe", self.steps + 1)

    def _start_sampler(self) -> None:
        if not self.settings.py_spy or self.stem is None:
            return
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stack_sampler.py")
        try:
            module = _load_by_path("_diagnose_profile_stack_sampler", path)
        except ImportError:
            self.stacks = {"error": f"cannot load {path}"}
            return
        output = os.path.join(self.settings.directory, self.stem + STACKS_SUFFIX)
        self.sampler = module.StackSampler(self.settings.py_spy, output)
        self.sampler.start()

    def _stop_sampler(self) -> None:
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            self.stacks = sampler.stop()

    def _make_profiler(self, active: int) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and (
            ProfilerActivity.CUDA in torch.profiler.supported_activities()  # type: ignore[no-untyped-call]
        ):
            activities.append(ProfilerActivity.CUDA)  # CUDA also covers ROCm
        # One warm-up step (the probe step), then exactly ``active`` ProfilerStep ranges; the
        # boundaries call step(), so each range runs from one optimizer step's return to the next.
        plan = schedule(wait=0, warmup=1, active=active, repeat=1)
        try:
            return profile(
                activities=activities, schedule=plan, record_shapes=True, with_modules=True
            )
        except TypeError:  # a torch without with_modules
            return profile(activities=activities, schedule=plan, record_shapes=True)

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
            if self.trainable_ids and not _holds_any(module, self.trainable_ids):
                return
            self._remove_forward()
            if os.getpid() == self.pid and not self.off:
                self.autocast_samples.append(_autocast_state())
        except Exception as exc:
            self._fail(exc)

    def _forward_collect(self, module: object, args: object) -> None:
        """Probe step: every module called (first call), with the autocast state it ran under."""
        try:
            called = self.called
            if id(module) not in called and os.getpid() == self.pid:
                called[id(module)] = (module, _autocast_state())
        except Exception as exc:
            self._fail(exc)

    # -- the probe step ---------------------------------------------------------------------

    def _finish_probe(self) -> None:
        self._remove_forward()
        called, self.called = self.called, {}
        # Root modules: those called in the step that are no submodule of a module called before
        # them (a module called while no other module's forward runs, for ordinary models).
        covered: set[int] = set()
        roots = []
        fx = sys.modules.get("torch.fx")
        graph_module = getattr(fx, "GraphModule", None) if fx is not None else None
        self.trainable_autocast = self._trainable_autocast(called)
        for key, (module, autocast) in called.items():
            if key in covered:
                continue
            if graph_module is not None and isinstance(module, graph_module):
                continue  # a torch.compile graph, run inside a compiled module's forward
            roots.append(module)
            self.root_autocast.append({"module": _qualified(type(module)), **autocast})
            for sub in module.modules():
                covered.add(id(sub))
        optimizer = self._boundary_optimizer()
        if optimizer is not None:
            self.optimizer_facts = self._describe_optimizer(optimizer)
            self.parameters["trainable"] = self._describe_trainable(optimizer)
            self.device = self._describe_device(optimizer)
        frozen_params, frozen_seen = _Tally(), set()
        for root in roots:
            for parameter in root.parameters():
                if id(parameter) in frozen_seen or parameter.requires_grad:
                    continue
                frozen_seen.add(id(parameter))
                frozen_params.add(_dtype_name(parameter.dtype), parameter.numel())
        self.parameters["frozen_in_roots"] = frozen_params.table
        self.parameters["roots"] = [_qualified(type(root)) for root in roots[:_MAX_KEYS]]
        for key, entry in self.dataloaders.items():
            yielded = self._yielded(entry)
            before = self.yielded_before.get(key, 0)
            entry["batches_during_capture"] = None if yielded is None else max(0, yielded - before)
            entry["iterated_during_capture"] = bool(
                entry.get("iterated_during_capture") or (yielded or 0) > before
            )

    def _trainable_autocast(
        self, called: dict[int, tuple[Any, dict[str, dict[str, Any]]]]
    ) -> list[dict[str, Any]]:
        """The probe step's modules that hold trained parameters, grouped by autocast state:
        where a block ran with autocast off inside an autocast step, its group names it."""
        trainable = self.trainable_ids
        groups: list[dict[str, Any]] = []
        if not trainable:
            return groups
        names = _module_names(called)
        for key, (module, autocast) in called.items():
            if not _holds_any(module, trainable):
                continue
            group = _state_group(groups, autocast, {"modules": 0, "examples": []})
            if group is None:
                continue
            group["modules"] += 1
            group["examples"].append(names.get(key) or _qualified(type(module)))
        for group in groups:
            others = [n for g in groups if g is not group for n in g["examples"]]
            group["examples"] = [
                name[:_MAX_NAME] for name in _distinguishing(group["examples"], others)[:3]
            ]
        return groups

    def _describe_trainable(self, optimizer: Any) -> dict[str, Any]:
        params, grads = _Tally(), _Tally()
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                params.add(_dtype_name(parameter.dtype), parameter.numel())
                grad = parameter.grad
                grads.add("none" if grad is None else _dtype_name(grad.dtype), parameter.numel())
        return {"params": params.table, "grads": grads.table}

    def _describe_optimizer(self, optimizer: Any) -> dict[str, Any]:
        import torch

        state_dtypes: dict[str, _Tally] = {}
        count = elements = 0
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                count += 1
                elements += parameter.numel()
                for key, value in optimizer.state.get(parameter, {}).items():
                    name = str(key)[:_MAX_NAME]
                    if name not in state_dtypes:
                        if len(state_dtypes) >= _MAX_KEYS:
                            continue
                        state_dtypes[name] = _Tally()
                    if isinstance(value, torch.Tensor):
                        state_dtypes[name].add(_dtype_name(value.dtype), value.numel())
                    else:
                        state_dtypes[name].add(type(value).__name__, 0)
        hyper: dict[str, Any] = {}
        groups = optimizer.param_groups
        for key, value in groups[0].items() if groups else ():
            if key == "params":
                continue
            if value is None or isinstance(value, (bool, int, float, str)):
                hyper[str(key)] = value
            elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                hyper[str(key)] = list(value)
        return {
            "class": _qualified(type(optimizer)),
            "param_groups": len(groups),
            "params": count,
            "elements": elements,
            "state_dtypes": {key: tally.table for key, tally in state_dtypes.items()},
            "hyperparameters": hyper,
        }

    def _describe_device(self, optimizer: Any) -> dict[str, Any]:
        import torch

        device: Any = None
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                device = parameter.device
                break
            break
        kind = "unknown" if device is None else str(device.type)
        facts: dict[str, Any] = {"kind": kind, "type": kind}
        if kind == "cuda":
            if getattr(torch.version, "hip", None):
                facts["kind"] = "rocm"
            with contextlib.suppress(Exception):
                index = device.index
                index = torch.cuda.current_device() if index is None else index
                facts["index"] = int(index)
                props = torch.cuda.get_device_properties(index)
                facts["name"] = str(props.name)
                # Which GPU the driver's telemetry must read (the parent matches it by bus).
                for key in ("pci_domain_id", "pci_bus_id", "pci_device_id"):
                    value = getattr(props, key, None)
                    if isinstance(value, int):
                        facts[key] = value
        return facts

    # -- DataLoaders ------------------------------------------------------------------------

    def note_iterator(self, loader: Any, iterator: Any) -> None:
        if self.off or os.getpid() != self.pid:
            return
        key = id(loader)
        entry = self.dataloaders.get(key)
        if entry is None:
            if len(self.dataloaders) >= _MAX_LOADERS:
                return
            context = getattr(loader, "multiprocessing_context", None)
            entry = self.dataloaders[key] = {
                "class": _qualified(type(loader)),
                "dataset": type(getattr(loader, "dataset", None)).__name__,
                "num_workers": getattr(loader, "num_workers", None),
                "pin_memory": getattr(loader, "pin_memory", None),
                "persistent_workers": getattr(loader, "persistent_workers", None),
                "batch_size": getattr(loader, "batch_size", None),
                "prefetch_factor": getattr(loader, "prefetch_factor", None),
                "drop_last": getattr(loader, "drop_last", None),
                "multiprocessing_context": (
                    None if context is None else getattr(context, "_name", str(context))
                ),
                "iterations": 0,
                "first_iterated_at_step": self.steps,
                "iterated_during_capture": False,
            }
        entry["iterations"] += 1
        if self.phase != "skip" and not self.finished:
            entry["iterated_during_capture"] = True
            self.yielded_before.setdefault(key, 0)
        try:
            entry["_iterator"] = weakref.ref(iterator)
        except TypeError:
            entry["_iterator"] = None

    @staticmethod
    def _yielded(entry: dict[str, Any]) -> int | None:
        ref = entry.get("_iterator")
        iterator = ref() if ref is not None else None
        yielded = getattr(iterator, "_num_yielded", None)
        return yielded if isinstance(yielded, int) else None

    # -- rank, files ------------------------------------------------------------------------

    def _identify(self) -> dict[str, Any]:
        def env_int(name: str) -> int | None:
            try:
                return int(os.environ[name])
            except (KeyError, ValueError):
                return None

        rank, world = env_int("RANK"), env_int("WORLD_SIZE")
        source = "environment" if rank is not None else "default"
        dist = sys.modules.get("torch.distributed")
        with contextlib.suppress(Exception):
            if dist is not None and dist.is_available() and dist.is_initialized():
                rank, world = int(dist.get_rank()), int(dist.get_world_size())
                source = "torch.distributed"
        return {
            "rank": rank if rank is not None else 0,
            "local_rank": env_int("LOCAL_RANK"),
            "world_size": world if world is not None else 1,
            "rank_source": source,
        }

    def _claim(self, rank: int) -> str:
        """The file stem of this process: ``rank<R>``, or ``rank<R>-pid<pid>`` when another
        process claimed the rank first (claims are exclusive file creations)."""
        import json

        for stem in (f"rank{rank}", f"rank{rank}-pid{self.pid}"):
            path = os.path.join(self.settings.directory, stem + FACTS_SUFFIX)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            self.stem = stem
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self._facts(STATUS_RUNNING), handle, default=str)
            return stem
        raise FileExistsError(f"rank {rank} was claimed twice by this process")

    def _facts(self, status: str) -> dict[str, Any]:
        import torch

        autocast_states: list[dict[str, Any]] = []
        for sample in self.autocast_samples:
            state = _state_group(autocast_states, sample, {"steps": 0})
            if state is not None:
                state["steps"] += 1
        dynamo_after = _dynamo_counters()
        loaders = [
            {key: value for key, value in entry.items() if not key.startswith("_")}
            for entry in self.dataloaders.values()
        ]
        s = self.settings
        return {
            "schema": SCHEMA_VERSION,
            "status": status,
            **self.identity,
            "pid": self.pid,
            "ppid": os.getppid(),
            "argv": list(sys.argv),
            "executable": sys.executable,
            "python": sys.version.split()[0],
            "torch": getattr(torch, "__version__", None),
            "device": self.device,
            "options": {
                "skip_steps": s.skip_steps,
                "timed_steps": s.timed_steps,
                "profiled_steps": s.profiled_steps,
                "stop_after": s.stop_after,
            },
            "steps_seen": self.steps,
            "first_step_s": self.first_step_s,
            "process_started_unix": self.started_unix,
            "timed_started_unix": self.timed_started_unix,
            "timed_ended_unix": self.timed_ended_unix,
            "timed_step_s": list(self.timed),
            "profiled_step_s": list(self.profiled),
            "trace": self.trace_name,
            "profiler_note": self.profiler_note,
            "stacks": self.stacks,
            "autocast": {
                "sampled_steps": len(self.autocast_samples),
                "states": autocast_states,
                "roots": self.root_autocast,
                "trainable_modules": self.trainable_autocast,
            },
            "parameters": self.parameters,
            "optimizer": self.optimizer_facts,
            "other_optimizer_steps": dict(self.other_steps),
            "packages_loaded": [name for name in _FRAMEWORK_PACKAGES if name in sys.modules],
            "dataloaders": loaders,
            "dynamo": {
                "loaded": dynamo_after is not None,
                "counters": dynamo_after or {},
                "during_capture": _counter_delta(self.dynamo_before, dynamo_after),
                # The steps the s/it is timed in: what compiled there is in the s/it.
                "during_timed_steps": _counter_delta(self.dynamo_before, self.dynamo_timed_end),
            },
        }

    def _write_facts(self, status: str) -> None:
        if self.stem is None:
            return
        self.status = status
        path = os.path.join(self.settings.directory, self.stem + FACTS_SUFFIX)
        write_json_atomic(path, self._facts(status))

    # -- the end ----------------------------------------------------------------------------

    def _stop_profiler(self) -> None:
        """Stop the profiler and export what it recorded (nothing when it never recorded)."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        with _StderrFilter():
            profiler.stop()
        if not self.profiler_active or self.stem is None:
            return
        name = self.stem + TRACE_SUFFIX
        final = os.path.join(self.settings.directory, name)
        # The name must end in .gz: torch gzips by the suffix.
        temporary = os.path.join(self.settings.directory, f".{self.pid}.tmp{TRACE_SUFFIX}")
        profiler.export_chrome_trace(temporary)
        os.replace(temporary, final)
        self.trace_name = name

    def _complete(self) -> None:
        self._stop_sampler()
        self._stop_profiler()
        self._finish(STATUS_COMPLETE)
        if self.settings.stop_after:
            self._stop_process()

    def _finish(self, status: str) -> None:
        self.off = True
        self.finished = True
        self.next_event = sys.maxsize
        self._remove_forward()
        self._write_facts(status)
        self._restore_sigterm()
        _strict_event("capture_ended")

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
            self.pending = None
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
            self.pending = None
            if self.profile_function is not None and sys.getprofile() is self.profile_function:
                sys.setprofile(None)
            if reason is None:
                last = getattr(sys, "last_value", None)
                if isinstance(last, KeyboardInterrupt):
                    reason = "interrupted"
                elif isinstance(last, BaseException):
                    reason = f"the program raised {type(last).__name__}"
                else:
                    reason = "the program ended"
            with contextlib.suppress(Exception):
                self._stop_sampler()
            with contextlib.suppress(Exception):
                self._stop_profiler()
            self._finish(f"partial: {reason} {self._progress()}")

    def _stop_process(self) -> None:
        """``stop_after``: end the process now, with exit code 0.

        ``os._exit`` rather than ``sys.exit``: a SystemExit raised here would unwind through the
        user's training loop, its ``finally``/``except BaseException`` blocks and launcher
        wrappers (accelerate, Lightning) that report it as a failure, and interpreter shutdown can
        hang on DataLoader workers and other threads mid-step. Our files are written and closed;
        the streams are flushed and this process's multiprocessing children (DataLoader workers)
        are stopped first, since nothing else would.
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

    # -- SIGTERM ----------------------------------------------------------------------------

    def _install_sigterm(self) -> None:
        """torchrun stops its ranks with SIGTERM, whose default action skips ``atexit``: when the
        program has no handler of its own, write the partial capture, then die of SIGTERM as
        before."""
        import signal

        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.sigterm_installed = True

    def _restore_sigterm(self) -> None:
        import signal

        if not self.sigterm_installed:
            return
        self.sigterm_installed = False
        with contextlib.suppress(Exception):
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        import signal

        self.at_exit("terminated (SIGTERM)")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


_capture: _Capture | None = None
#: diagnose's strict mode in this process (``--strict``; see diagnose/strict/runtime.py), or None.
_strict: Any = None


def _start_strict(directory: str) -> Any:
    """Strict mode for this process when ``--strict`` was given: diagnose.strict.runtime,
    imported from the diagnose that launched the command when this Python has none."""
    if not os.environ.get(ENV_STRICT):
        return None
    import importlib
    import importlib.util

    path = [p for p in os.environ.get(ENV_STRICT_PACKAGE, "").split(os.pathsep) if p]
    if "diagnose" not in sys.modules and importlib.util.find_spec("diagnose") is None and path:
        spec = importlib.util.spec_from_file_location(
            "diagnose", os.path.join(path[0], "__init__.py"), submodule_search_locations=path
        )
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["diagnose"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop("diagnose", None)
                raise
    return importlib.import_module("diagnose.strict.runtime").start(os.environ, directory)


def _ensure_strict(capture: _Capture) -> None:
    global _strict
    if _strict is None:
        try:
            _strict = _start_strict(capture.settings.directory)
        except Exception as exc:
            _strict = False
            capture.error = f"strict mode: {_one_line(exc)}"


def _strict_event(name: str) -> None:
    """Tell strict mode that the capture's window of steps opened or closed."""
    handler = getattr(_strict, name, None)
    if handler is not None:
        with contextlib.suppress(Exception):
            handler()


def _after_fork_in_child() -> None:
    capture = _capture
    if capture is not None and capture.pid != os.getpid():
        handle = capture.forward_handle
        capture.reset_for_process()
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.remove()


def _install_optimizer_hooks(module: ModuleType, capture: _Capture) -> None:
    module.register_optimizer_step_pre_hook(capture.pre_hook)
    module.register_optimizer_step_post_hook(capture.post_hook)
    optimizer_class = module.Optimizer
    original = optimizer_class.__init__
    if getattr(original, "_diagnose_profile", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            capture.note_optimizer(self)

    functools.update_wrapper(__init__, original)
    __init__._diagnose_profile = True  # type: ignore[attr-defined]
    optimizer_class.__init__ = __init__


def _install_dataloader_hook(module: ModuleType, capture: _Capture) -> None:
    loader_class = module.DataLoader
    original = loader_class.__iter__
    if getattr(original, "_diagnose_profile", False):
        return

    def __iter__(self: Any) -> Any:
        iterator = original(self)
        with contextlib.suppress(Exception):
            capture.note_iterator(self, iterator)
        return iterator

    functools.update_wrapper(__iter__, original)
    __iter__._diagnose_profile = True  # type: ignore[attr-defined]
    loader_class.__iter__ = __iter__


def on_import(name: str, module: ModuleType, started_perf: float, started_unix: float) -> None:
    """Called by the bootstrap when a watched torch module has just been executed."""
    global _capture
    settings = Settings.from_environ(os.environ)
    if settings is None:
        return
    capture = _capture
    if capture is None:
        capture = _capture = _Capture(settings, started_perf, started_unix)
        atexit.register(capture.at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)
    if name == "torch.optim.optimizer":
        _install_optimizer_hooks(module, capture)
        capture.write_process()
    elif name == "torch.utils.data.dataloader":
        _install_dataloader_hook(module, capture)


__all__ = [
    "ENV_CAPTURE",
    "ENV_DIR",
    "ENV_PROFILED_STEPS",
    "ENV_PY_SPY",
    "ENV_SKIP_STEPS",
    "ENV_STOP_AFTER",
    "ENV_TIMED_STEPS",
    "FACTS_SUFFIX",
    "PROCESS_PREFIX",
    "SCHEMA_VERSION",
    "STACKS_SUFFIX",
    "STATUS_COMPLETE",
    "STATUS_RUNNING",
    "TRACE_SUFFIX",
    "Settings",
    "on_import",
    "write_json_atomic",
]
