"""`diagnose run --nproc N`: the ranks' processes, started, watched and collected.

Each rank is one ``python -m diagnose.distributed.worker SPEC`` process with torchrun's
environment (``MASTER_ADDR``/``MASTER_PORT`` on a free localhost port, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): gloo on the CPU, NCCL/RCCL on GPUs with one device per rank
(``cuda:LOCAL_RANK``). Every rank builds the same workload, wraps its denoiser for the strategy
(DDP or FSDP), runs the same measurement as a single-process run and writes its profiler trace and
a small record (its timing, phases, model) that the parent reads back.

The parent never waits on a rank that cannot finish: the first rank that fails stops the others
(a rank left alone would block in its next collective), and ranks that report no progress for
``idle_timeout_s`` are stopped as hung. Either becomes one :class:`DiagnoseError` line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from diagnose.config import RunConfig
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.output import note_created
from diagnose.record import RunRecord
from diagnose.record_io import load_record

WORKER_MODULE = "diagnose.distributed.worker"
#: Ranks that report nothing for this long are taken as hung (a model build on a slow disk and
#: a step of a full-size model on a slow GPU stay well under it). Also the collectives' timeout.
IDLE_TIMEOUT_S = 900.0
#: After the first failure, how long the other ranks get to fail on their own, so that the error
#: shown is the cause (a rank's own error) rather than its peers' lost connection.
_GRACE_S = 1.0
_POLL_S = 0.1
#: Seconds a rank gets to exit after SIGTERM before it is killed.
_TERM_WAIT_S = 5.0

Progress = Callable[[str], None]


@dataclass
class RankSpec:
    """What one rank is told to do (written as JSON, read by the worker)."""

    rank: int
    world_size: int
    #: ``RunConfig.to_dict()`` of the resolved configuration.
    config: dict[str, Any]
    #: "cpu" (gloo) or "cuda" (NCCL/RCCL, device cuda:LOCAL_RANK).
    device_kind: str
    #: Where the rank's profiler trace goes; None when no step is profiled.
    trace_path: str | None
    #: The rank's small record (timing, breakdown, model, config), written on success.
    result_path: str
    #: ``{"message": ..., "code": ...}`` written when the rank fails.
    error_path: str
    #: One line per progress message (the parent's heartbeat).
    progress_path: str
    #: torch CPU threads for this rank (CPU runs: the cores shared out); None = torch's choice.
    threads: int | None
    collective_timeout_s: float

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> RankSpec:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(**data)


@dataclass
class RankResult:
    """What one rank measured."""

    rank: int
    #: The rank's small record: timing, breakdown, model, config, notes.
    record: RunRecord
    #: Its profiler trace, or None when no step was profiled.
    trace_path: Path | None


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (rank 0's store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_threads_per_rank(nproc: int) -> int:
    """The CPU cores shared out among ``nproc`` ranks (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


@dataclass
class _Rank:
    spec: RankSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    progress_seen: int = 0
    last_message: str = ""


class RankJob:
    """The ranks of one run: :meth:`start` them, do other work, then :meth:`wait`.

    Use it as a context manager: leaving it stops any rank still running.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        device_kind: str,
        trace_dir: Path,
        scratch_dir: Path,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.world_size = config.nproc
        self.device_kind = device_kind
        self.trace_dir = trace_dir
        self.scratch_dir = scratch_dir
        self.idle_timeout_s = idle_timeout_s
        self._ranks: list[_Rank] = []

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        """Start every rank's process (they then build the model and measure on their own)."""
        world = self.world_size
        profiled = self.config.profiled_steps > 0
        if profiled:
            if not self.trace_dir.exists():
                self.trace_dir.mkdir(parents=True)
                note_created(self.trace_dir)
            # A --force rerun with fewer ranks must not leave an earlier run's ranks behind.
            for stale in self.trace_dir.glob("rank*.json.gz"):
                stale.unlink()
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
        )
        threads = cpu_threads_per_rank(world) if self.device_kind == "cpu" else None
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        for rank in range(world):
            work = self.scratch_dir / f"rank{rank}"
            work.mkdir(parents=True, exist_ok=True)
            spec = RankSpec(
                rank=rank,
                world_size=world,
                config=self.config.to_dict(),
                device_kind=self.device_kind,
                trace_path=str(self.trace_dir / f"rank{rank}.json.gz") if profiled else None,
                result_path=str(work / "result.json"),
                error_path=str(work / "error.json"),
                progress_path=str(work / "progress.txt"),
                threads=threads,
                collective_timeout_s=self.idle_timeout_s,
            )
            spec_path = work / "spec.json"
            spec.save(spec_path)
            Path(spec.progress_path).touch()
            log_path = work / "output.log"
            log = log_path.open("wb")
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, str(spec_path)],
                    env=rank_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own process group: stopping a rank stops its DataLoader workers too.
                    start_new_session=True,
                )
            except OSError as exc:
                log.close()
                raise DiagnoseError(
                    f"could not start rank {rank}: {exc}", ExitCode.INTERNAL_ERROR
                ) from None
            self._ranks.append(_Rank(spec=spec, process=process, log_path=log_path, log=log))

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The ranks' processes, by rank (empty before :meth:`start`)."""
        return [r.process for r in self._ranks]

    # ---------------------------------------------------------------- wait

    def wait(self, progress: Progress | None = None) -> list[RankResult]:
        """Wait for every rank; forward rank 0's progress. Raises DiagnoseError (after stopping
        every rank) when one fails or all stall."""
        say = progress or (lambda message: None)
        last_change = time.monotonic()
        while True:
            if self._read_progress(say):
                last_change = time.monotonic()
            codes = [r.process.poll() for r in self._ranks]
            if any(code not in (None, 0) for code in codes):
                time.sleep(_GRACE_S)
                failed = [r for r in self._ranks if r.process.poll() not in (None, 0)]
                error = self._failure(failed)
                self.stop()
                raise error
            if all(code == 0 for code in codes):
                break
            idle = time.monotonic() - last_change
            if idle > self.idle_timeout_s:
                waiting = [r for r in self._ranks if r.process.poll() is None]
                self.stop()
                where = "; ".join(
                    f"rank {r.spec.rank} after {r.last_message or 'starting'!r}" for r in waiting
                )
                raise DiagnoseError(
                    f"the ranks made no progress for {idle:.0f} s and were stopped ({where})",
                    ExitCode.INTERNAL_ERROR,
                )
            time.sleep(_POLL_S)
        self._read_progress(say)
        return [self._result(r) for r in self._ranks]

    def _read_progress(self, say: Progress) -> bool:
        """Forward rank 0's new progress lines; True when any rank said something new."""
        changed = False
        for r in self._ranks:
            try:
                with open(r.spec.progress_path, "rb") as handle:
                    handle.seek(r.progress_seen)
                    new = handle.read()
            except OSError:
                continue
            complete = new[: new.rfind(b"\n") + 1]
            if not complete:
                continue
            r.progress_seen += len(complete)
            changed = True
            lines = complete.decode("utf-8", "replace").splitlines()
            r.last_message = lines[-1]
            if r.spec.rank == 0:
                say(f"rank 0 of {self.world_size}: {lines[-1]}")
        return changed

    def _result(self, r: _Rank) -> RankResult:
        path = Path(r.spec.result_path)
        if not path.is_file():
            raise DiagnoseError(
                f"rank {r.spec.rank} of {self.world_size} exited without its result "
                f"({self._last_output(r)})",
                ExitCode.INTERNAL_ERROR,
            )
        record = load_record(path)
        trace = Path(r.spec.trace_path) if r.spec.trace_path else None
        if trace is not None and not trace.is_file():
            trace = None
        return RankResult(rank=r.spec.rank, record=record, trace_path=trace)

    def _failure(self, failed: list[_Rank]) -> DiagnoseError:
        """The error of the rank most likely at the root: one that raised a diagnose error
        (bad setting, missing package), else one that wrote any error, else the first."""
        errors = {r.spec.rank: self._error_of(r) for r in failed}

        def priority(r: _Rank) -> tuple[int, int]:
            error = errors[r.spec.rank]
            if error is not None and error[1] != ExitCode.INTERNAL_ERROR:
                return (0, r.spec.rank)
            return (1 if error is not None else 2, r.spec.rank)

        cause = min(failed, key=priority)
        error = errors[cause.spec.rank]
        prefix = f"rank {cause.spec.rank} of {self.world_size}"
        if error is not None:
            message, code = error
            return DiagnoseError(f"{prefix}: {message}", code)
        returncode = cause.process.returncode
        if returncode is not None and returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = str(-returncode)
            how = f"was killed by {name}"
        else:
            how = f"exited with status {returncode}"
        return DiagnoseError(
            f"{prefix} {how} ({self._last_output(cause)})", ExitCode.INTERNAL_ERROR
        )

    @staticmethod
    def _error_of(r: _Rank) -> tuple[str, ExitCode] | None:
        try:
            data = json.loads(Path(r.spec.error_path).read_text(encoding="utf-8"))
            message = " ".join(str(data["message"]).split())
            code = ExitCode(int(data["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return message, code

    @staticmethod
    def _last_output(r: _Rank) -> str:
        try:
            lines = r.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        if not last:
            return "no output"
        return "last output: " + (last if len(last) <= 300 else last[:297] + "...")

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """Stop every rank still running (SIGTERM, then SIGKILL) and close their logs."""
        running = [r for r in self._ranks if r.process.poll() is None]
        for r in running:
            _signal_group(r.process, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_WAIT_S
        for r in running:
            try:
                r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(r.process, signal.SIGKILL)
                r.process.wait()
        for r in self._ranks:
            # The rank's DataLoader workers share its group; none may outlive the run.
            _signal_group(r.process, signal.SIGKILL)
            r.log.close()

    def __enter__(self) -> RankJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


__all__ = [
    "IDLE_TIMEOUT_S",
    "RankJob",
    "RankResult",
    "RankSpec",
    "cpu_threads_per_rank",
    "free_port",
]
