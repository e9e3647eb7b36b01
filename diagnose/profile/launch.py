"""Parent side of ``diagnose profile``: run the user's command with the bootstrap injected.

The command runs as is, its output and input inherited, in its own session, with
``PYTHONPATH`` starting with the bootstrap folder and ``DIAGNOSE_PROFILE_*`` variables carrying
the capture folder and options; every Python process it starts (``torchrun`` and ``accelerate
launch`` ranks included) inherits both, so each one that steps an optimizer captures itself (see
:mod:`diagnose.profile.capture` for what and when).

Why a session of its own: signals must reach the whole training job exactly once, however they
arrive. In a terminal, Ctrl-C goes to the terminal's foreground process group, which is then only
this launcher; ``kill`` hits only this launcher too. Either way the launcher forwards SIGINT,
SIGTERM and SIGHUP to the child's process group. (Sharing our group instead would hand the child a
terminal Ctrl-C twice, once from the terminal and once from us.) A session, not just a group: a
background group of the terminal's session is stopped (SIGTTIN) when it reads the terminal, while a
process in another session reads it like any file.

The costs of that choice: Ctrl-Z stops only the launcher (the job runs on), the command has no
controlling terminal (``/dev/tty`` cannot be opened; its standard streams still are the terminal),
and a launcher killed by SIGKILL leaves the job running.

Python processes run with ``-I``, ``-S`` or ``-E`` skip the bootstrap (``site`` does not load it);
a command made only of those shows up as "no Python process imported torch".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from diagnose.contention import LoadWindow
from diagnose.offline import user_environ
from diagnose.profile import capture_contract
from diagnose.profile.device_telemetry import CommandTelemetry, DeviceWindow, SamplerFactory
from diagnose.record import HostLoad
from diagnose.redact import redact_command
from diagnose.strict.options import StrictOptions

#: The folder put first on ``PYTHONPATH``; its ``sitecustomize.py`` is the bootstrap.
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
#: The capture code, loaded by path in the user's processes (which may lack ``diagnose``).
CAPTURE_FILE = Path(__file__).resolve().parent / "capture.py"
#: Signals passed on to the command's process group.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: What ``subprocess`` accepts for a standard stream (not ``subprocess.PIPE``: nobody reads it).
Stream = int | IO[Any] | None


@dataclass(frozen=True)
class CaptureOptions:
    """Which steps each process captures, counted in optimizer steps."""

    #: Steps left alone first (warm-up, ``torch.compile``, autotuning, allocator growth); at least
    #: one is skipped anyway, since the first step has no start.
    skip_steps: int = 5
    #: Steps timed without the profiler: the s/it samples.
    timed_steps: int = 10
    #: Steps recorded by ``torch.profiler`` after them (one ``ProfilerStep#N`` each).
    profiled_steps: int = 3
    #: End each capturing process (exit code 0) once its capture is written.
    stop_after: bool = False
    #: The py-spy executable each capturing process runs on itself during the probe and
    #: profiled steps ("": no stack sampling).
    py_spy: str = ""
    #: ``--strict``: the checks each process runs on its watched steps (None: off).
    strict: StrictOptions | None = None

    def __post_init__(self) -> None:
        for name in ("skip_steps", "timed_steps", "profiled_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")

    @property
    def steps_needed(self) -> int:
        """Optimizer steps a process must run for its capture to complete (the probe step, which
        is also the profiler's warm-up, included)."""
        return max(self.skip_steps, 1) + self.timed_steps + 1 + self.profiled_steps


@dataclass(frozen=True)
class ProcessSeen:
    """A Python process of the command that imported torch (a rank or not)."""

    pid: int
    argv: list[str]
    #: False for a process known only from a failure of the bootstrap.
    imported_torch: bool
    multiprocessing_child: bool
    optimizers_built: int
    optimizer_classes: list[str]
    stepped: bool
    #: A failure of the bootstrap in that process, if any.
    error: str | None


@dataclass(frozen=True)
class RankCapture:
    """The capture of one process that stepped an optimizer."""

    rank: int
    pid: int
    #: ``complete``; ``partial: …``; ``error: …``; ``partial: the process was killed …`` when it
    #: ended without writing its facts.
    status: str
    facts_path: Path
    trace_path: Path | None
    #: The whole ``rank<R>.capture.json`` (``capture_describe.capture_facts`` writes its keys).
    facts: dict[str, Any]

    @property
    def complete(self) -> bool:
        return self.status == capture_contract.STATUS_COMPLETE

    @property
    def timed_step_s(self) -> list[float]:
        return [float(v) for v in self.facts.get("timed_step_s", [])]


@dataclass(frozen=True)
class LaunchResult:
    command: tuple[str, ...]
    #: As ``subprocess`` reports it: the exit status, or ``-N`` when signal N ended the command.
    returncode: int
    captures: list[RankCapture]
    processes: list[ProcessSeen]
    #: True when ``timeout_s`` passed without any optimizer step and the command was stopped.
    timed_out: bool
    #: One line for the user when no step was captured (why, and what was seen); else None.
    message: str | None
    seconds: float
    signals_forwarded: tuple[int, ...] = field(default=())
    #: GPU telemetry sampled by this process while the ranks captured, by device ("cuda:0").
    telemetry: dict[str, DeviceWindow] = field(default_factory=dict)
    #: Processes that stepped an optimizer as a rank another process holds (a trainer's forked
    #: child that trains too): captures of their own, not part of the job (see
    #: :func:`one_capture_per_rank`).
    separate: list[RankCapture] = field(default_factory=list)
    #: How busy the machine was with other work while the command ran (diagnose.contention).
    host_load: HostLoad | None = None

    @property
    def exit_code(self) -> int:
        """The code a shell shows: the exit status, or 128 + N for death by signal N (130 for
        SIGINT: Python ends that way on an uncaught KeyboardInterrupt)."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def ending(self) -> str:
        """How the command ended, for a line to the user: its exit status or the signal that
        ended it, and whether that came after every rank's steps were captured (then the report
        stands whatever the command's status: torch's gloo, for one, now and then aborts a
        process at exit after its work is done)."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            how = f"was ended by {name}"
        else:
            how = f"exited with code {self.returncode}"
        captured = bool(self.captures) and all(c.complete for c in self.captures)
        return f"the command {how}" + (
            " after its steps were captured: the report stands" if captured else ""
        )

    @property
    def stepped(self) -> bool:
        return bool(self.captures)


def diagnose_search_path() -> list[str]:
    """Where ``diagnose``'s modules are found, its own folder first: a process whose Python lacks
    diagnose imports strict mode from there. In a source checkout ``diagnose.probes`` lies
    beside the package, not in it, so the folder that holds it is added."""
    import importlib.util

    import diagnose

    path = [str(Path(p).resolve()) for p in diagnose.__path__]
    probes = importlib.util.find_spec("diagnose.probes")
    for location in (probes.submodule_search_locations or []) if probes is not None else []:
        holder = str(Path(location).resolve().parent)
        if holder not in path:
            path.append(holder)
    return path


def capture_environment(
    capture_dir: Path, options: CaptureOptions, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of the profiled command: ``base`` (default: the user's, without the
    offline switches diagnose's own process runs under) plus the bootstrap on ``PYTHONPATH``
    and the capture settings."""
    env = dict(user_environ() if base is None else base)
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(BOOTSTRAP_DIR) + (os.pathsep + existing if existing else "")
    env[capture_contract.ENV_DIR] = str(Path(capture_dir).resolve())
    env[capture_contract.ENV_CAPTURE] = str(CAPTURE_FILE)
    env[capture_contract.ENV_SKIP_STEPS] = str(options.skip_steps)
    env[capture_contract.ENV_TIMED_STEPS] = str(options.timed_steps)
    env[capture_contract.ENV_PROFILED_STEPS] = str(options.profiled_steps)
    env[capture_contract.ENV_STOP_AFTER] = "1" if options.stop_after else "0"
    if options.py_spy:
        env[capture_contract.ENV_PY_SPY] = options.py_spy
    else:
        env.pop(capture_contract.ENV_PY_SPY, None)
    env.pop(capture_contract.ENV_STRICT, None)
    env.pop(capture_contract.ENV_STRICT_PACKAGE, None)
    if options.strict is not None:
        env[capture_contract.ENV_STRICT] = options.strict.to_env()
        env[capture_contract.ENV_STRICT_PACKAGE] = os.pathsep.join(diagnose_search_path())
    return env


def launch_profiled(
    command: Sequence[str],
    capture_dir: Path,
    options: CaptureOptions | None = None,
    *,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    grace_s: float = 10.0,
    telemetry_sampler: SamplerFactory | None = None,
) -> LaunchResult:
    """Run ``command`` with every Python process capturing itself into ``capture_dir``.

    ``capture_dir`` is created; it must not hold files already (a stale rank file would read as
    this run's). ``timeout_s``: when no process has finished an optimizer step that long after the
    start, the command is stopped (SIGINT to its process group, SIGTERM ``grace_s`` later, SIGKILL
    after another ``grace_s``) and ``timed_out`` is set. Signals this process receives meanwhile
    (SIGINT, SIGTERM, SIGHUP) are forwarded to the command, when called from the main thread.
    The streams default to ours. Raises ``OSError`` when the command cannot be started.
    The GPUs the ranks train on are sampled meanwhile (``telemetry_sampler`` makes a sampler for
    a device; default :class:`~diagnose.telemetry.TelemetrySampler`).
    """
    options = options or CaptureOptions()
    capture_dir = Path(capture_dir)
    capture_dir.mkdir(parents=True, exist_ok=True)
    if any(capture_dir.iterdir()):
        raise FileExistsError(f"{capture_dir}: the capture folder must be empty")
    started = time.monotonic()
    forwarded: list[int] = []
    # The command is our child: its processes count as ours, everyone else's as the load.
    load = LoadWindow().open()
    try:
        process = subprocess.Popen(
            list(command),
            env=capture_environment(capture_dir, options, env),
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    except BaseException:
        load.close()
        raise
    timed_out = False
    telemetry = CommandTelemetry(capture_dir, telemetry_sampler)
    try:
        with _forwarding(process, forwarded):
            deadline = None if timeout_s is None else started + timeout_s
            while True:
                try:
                    returncode = process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                telemetry.poll()
                if deadline is None:
                    continue
                if _any_rank(capture_dir):
                    deadline = None  # a step was seen: the timeout is over
                elif time.monotonic() >= deadline:
                    timed_out = True
                    returncode = _stop(process, grace_s)
                    break
    except BaseException:
        # We are going away (an error of ours, a KeyboardInterrupt from another thread's
        # handlers): the training job must not run on unsupervised.
        if process.poll() is None:
            _stop(process, grace_s)
        raise
    finally:
        windows = telemetry.finish()
        host_load = load.close()
    captures, separate = one_capture_per_rank(read_captures(capture_dir))
    processes = read_processes(capture_dir)
    message = None
    if timed_out:
        message = f"no optimizer step in {timeout_s:g} s: {_what_was_seen(processes)}"
    elif not captures:
        message = (
            f"no optimizer step was seen (the command exited with code "
            f"{128 - returncode if returncode < 0 else returncode}): {_what_was_seen(processes)}"
        )
    return LaunchResult(
        command=tuple(command),
        returncode=returncode,
        captures=captures,
        processes=processes,
        timed_out=timed_out,
        message=message,
        seconds=time.monotonic() - started,
        signals_forwarded=tuple(forwarded),
        telemetry=windows,
        separate=separate,
        host_load=host_load,
    )


@contextmanager
def _forwarding(process: subprocess.Popen[bytes], forwarded: list[int]) -> Iterator[None]:
    """Pass our SIGINT/SIGTERM/SIGHUP on to the command's process group meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.append(signum)
        _signal_group(process, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    # The child leads its own session, so its process group id is its pid.
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _stop(process: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGINT (the trainer's own Ctrl-C path, which writes partial captures), then SIGTERM, then
    SIGKILL, each after ``grace_s``; the exit status."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        _signal_group(process, signum)
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


def _any_rank(capture_dir: Path) -> bool:
    return any(capture_dir.glob(f"rank*{capture_contract.FACTS_SUFFIX}"))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_captures(capture_dir: Path) -> list[RankCapture]:
    """The rank captures in ``capture_dir``, by rank then pid."""
    captures = []
    for path in capture_dir.glob(f"rank*{capture_contract.FACTS_SUFFIX}"):
        facts = _read_json(path)
        if facts is None:
            facts = {"status": "error: the capture file cannot be read"}
        status = str(facts.get("status", ""))
        if status == capture_contract.STATUS_RUNNING:
            timed = len(facts.get("timed_step_s") or [])
            status = "partial: the process was killed before finishing its capture " + (
                f"(after {timed} timed steps)" if timed else "(after its first step)"
            )
        trace_name = facts.get("trace")
        trace = capture_dir / trace_name if isinstance(trace_name, str) else None
        captures.append(
            RankCapture(
                rank=int(facts.get("rank", -1)),
                pid=int(facts.get("pid", -1)),
                status=status,
                facts_path=path,
                trace_path=trace if trace is not None and trace.is_file() else None,
                facts=facts,
            )
        )
    return sorted(captures, key=lambda c: (c.rank, c.pid))


def one_capture_per_rank(
    captures: list[RankCapture],
) -> tuple[list[RankCapture], list[RankCapture]]:
    """The job's captures, one per rank, and the separate ones.

    Two processes claim one rank when a trainer forks a child that trains too (no
    torch.distributed: both say rank 0, or the parent's ``RANK``): the child is a capture of its
    own, not a second copy of the rank. The rank is held by the process torch.distributed says
    holds it, else the parent of the other, else one whose capture completed, else the first.
    """
    pids = {c.pid for c in captures}

    def holds(c: RankCapture) -> tuple[bool, bool, bool, bool, int]:
        return (
            c.facts.get("rank_source") != "torch.distributed",
            c.facts.get("ppid") in pids,
            not c.complete,
            c.trace_path is None,
            c.pid,
        )

    job: dict[int, RankCapture] = {}
    for candidate in sorted(captures, key=holds):
        job.setdefault(candidate.rank, candidate)
    kept = sorted(job.values(), key=lambda c: (c.rank, c.pid))
    held = {c.pid for c in kept}
    return kept, [c for c in captures if c.pid not in held]


def read_processes(capture_dir: Path) -> list[ProcessSeen]:
    """The Python processes of the command that imported torch, by pid."""
    seen = []
    for path in capture_dir.glob(f"{capture_contract.PROCESS_PREFIX}*.json"):
        data = _read_json(path)
        if data is None:
            continue
        seen.append(
            ProcessSeen(
                pid=int(data.get("pid", -1)),
                argv=[str(a) for a in data.get("argv", [])],
                imported_torch="torch_imported_s" in data,
                multiprocessing_child=bool(data.get("multiprocessing_child", False)),
                optimizers_built=int(data.get("optimizers_built", 0)),
                optimizer_classes=[str(c) for c in data.get("optimizer_classes", [])],
                stepped=bool(data.get("stepped", False)),
                error=data.get("error") if isinstance(data.get("error"), str) else None,
            )
        )
    return sorted(seen, key=lambda p: p.pid)


def _what_was_seen(processes: list[ProcessSeen]) -> str:
    """One sentence: which processes imported torch and whether any built an optimizer."""
    errors = [f"pid {p.pid}: {p.error}" for p in processes if p.error]
    processes = [p for p in processes if p.imported_torch]
    if not processes:
        text = (
            "no Python process imported torch (a command that is no Python program, or one "
            "run with -I, -S or -E, which skip the bootstrap)"
        )
    else:
        shown = [p for p in processes if not p.multiprocessing_child][:4]
        workers = sum(p.multiprocessing_child for p in processes)
        names = "; ".join(f"pid {p.pid}: {redact_command(p.argv)[:80]}" for p in shown)
        text = f"{len(processes)} Python process(es) imported torch ({names}"
        text += f"; {workers} multiprocessing child(ren))" if workers else ")"
        built = [p for p in processes if p.optimizers_built]
        if built:
            classes = sorted({c for p in built for c in p.optimizer_classes})
            text += (
                f"; optimizer(s) built ({', '.join(classes)}) in pid "
                f"{', '.join(str(p.pid) for p in built)} but never stepped"
            )
        else:
            text += "; no optimizer was built"
    if errors:
        text += f"; bootstrap failures: {'; '.join(errors[:3])}"
    return text


__all__ = [
    "BOOTSTRAP_DIR",
    "CAPTURE_FILE",
    "FORWARDED_SIGNALS",
    "CaptureOptions",
    "LaunchResult",
    "ProcessSeen",
    "RankCapture",
    "capture_environment",
    "launch_profiled",
    "one_capture_per_rank",
    "read_captures",
    "read_processes",
]
