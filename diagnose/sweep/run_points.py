"""Running a sweep's points: which were measured already (resume), and each pending one in a child
process of its own, with a timeout and Ctrl-C handling, its outcome read from its record or its
stderr."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.offline import user_environ
from diagnose.output import RECORD_NAME
from diagnose.record import RunRecord, utc_now_iso
from diagnose.record_io import load_record
from diagnose.sweep.grid import Fixed, Point
from diagnose.sweep.results import LOGS_DIR, PointResult, PointSummary, Status, Sweep

#: Longest failure reason kept (the last line of the child's stderr).
_REASON_CHARS = 400
_ERROR_PREFIXES = ("diagnose: error: ", "diagnose: internal error: ", "diagnose: ")


# --- resume: was this point measured already? --------------------------------------------------


def expected_config(point: Point, fixed: Fixed) -> dict[str, Any]:
    """The values a point's ``record.json`` config must hold for the point to count as measured.

    Settings left to `diagnose run` (the preset, the size, the resolution buckets when none is
    given) are not compared: the record holds what the run resolved them to.
    """
    expected: dict[str, Any] = {
        "rank": point.rank,
        "batch": point.batch,
        "optimizer": point.optimizer,
        "precision": point.precision,
        "grad_checkpointing": point.grad_checkpointing,
        "cache_latents": point.cache_latents,
        "device": fixed.device,
        "seed": fixed.seed,
        "workers": fixed.workers,
        "attention": fixed.attention,
        "steps": fixed.steps,
        "warmup": fixed.warmup,
        "profiled_steps": fixed.profiled_steps,
        "skip_probes": sorted(fixed.skip_probes),
    }
    if point.resolution is not None:
        expected["resolution"] = [point.resolution]
    for name in ("preset", "size", "data_dir"):
        value = getattr(fixed, name)
        if value is not None:
            expected[name] = value
    return expected


def config_differences(config: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """``"steps 3 → 10"`` for each expected value the record's config does not hold."""
    differences = []
    for name, want in expected.items():
        have = config.get(name)
        if name == "skip_probes" and isinstance(have, list):
            have = sorted(have)
        if have != want:
            differences.append(f"{name} {have!r} → {want!r}")
    return differences


def measured_record(point_dir: Path, expected: Mapping[str, Any]) -> tuple[RunRecord | None, str]:
    """The point's record when it is a loadable `run` record of this configuration, else None
    and why it is not (empty when there is no record at all)."""
    if not (point_dir / RECORD_NAME).is_file():
        return None, ""
    try:
        record = load_record(point_dir / RECORD_NAME)
    except DiagnoseError as exc:
        return None, f"its record could not be read ({exc.message})"
    if record.mode != "run":
        return None, f"its record is a {record.mode!r} record, not a run"
    differences = config_differences(record.config, expected)
    if differences:
        return None, "its settings changed: " + ", ".join(differences)
    return record, ""


# --- running ----------------------------------------------------------------------------------


def plan(
    sweep_dir: Path, points: Sequence[Point], fixed: Fixed
) -> tuple[list[PointResult], dict[str, str]]:
    """Every point's starting state: measured (resumed) when its folder holds a matching record,
    else pending. Also returns, per pending point that has a stale folder, why it is re-run."""
    results: list[PointResult] = []
    stale: dict[str, str] = {}
    for point in points:
        result = PointResult(id=point.id, point=point)
        record, why_not = measured_record(sweep_dir / result.dir, expected_config(point, fixed))
        if record is not None:
            result.status = "measured"
            result.resumed = True
            result.summary = PointSummary.of(record)
        elif why_not:
            stale[result.id] = why_not
        results.append(result)
    return results, stale


#: Called about twice a second while a point runs (progress refresh).
Tick = Callable[[], None]
#: Builds the child's command line for a point and its output folder (tests swap it).
ArgvBuilder = Callable[[Point, Path], list[str]]


def run_point(
    result: PointResult,
    sweep_dir: Path,
    argv: list[str],
    *,
    timeout: float | None = None,
    tick: Tick | None = None,
) -> None:
    """Run one point's child process to its end and fill ``result`` from its record or failure.

    The child writes its own folder (``points/<id>``); stdout and stderr go to ``logs/``. On
    Ctrl-C the child is terminated and KeyboardInterrupt goes on up.
    """
    point_dir = sweep_dir / result.dir
    if point_dir.exists():
        # A stale folder (a failed, interrupted or differently configured run): `diagnose run`
        # refuses a non-empty --out, and this folder is the sweep's own.
        if point_dir.is_dir() and not point_dir.is_symlink():
            shutil.rmtree(point_dir)
        else:
            point_dir.unlink()
    point_dir.parent.mkdir(parents=True, exist_ok=True)
    log_dir = sweep_dir / LOGS_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = sweep_dir / result.log
    stdout_path = log_dir / f"{result.id}.stdout.txt"
    start = time.monotonic()
    timed_out = False
    process: subprocess.Popen[bytes] | None = None
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        try:
            # Inside the try: a Ctrl-C that lands as the child starts (a busy machine may run
            # the child before this process gets back) must still stop it. The child gets the
            # user's environment: its record lists it, and it goes offline on its own.
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=user_environ()
            )
            while True:
                try:
                    process.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if timeout is not None and time.monotonic() - start > timeout:
                    timed_out = True
                    _stop(process)
                    break
                if tick is not None:
                    tick()
        except BaseException:
            if process is not None:
                _stop(process)
            raise
    result.wall_seconds = time.monotonic() - start
    result.exit_code = process.returncode
    result.resumed = False
    result.summary = None
    stderr = stderr_path.read_text(encoding="utf-8", errors="replace")
    if timed_out:
        result.status = "timeout"
        result.reason = f"no result after {timeout:g} s (--timeout); the process was stopped"
        return
    if process.returncode == 0:
        try:
            record = load_record(point_dir / RECORD_NAME)
        except DiagnoseError as exc:
            result.status = "failed"
            result.reason = f"exited 0 but left no usable record: {exc.message}"
            return
        result.status = "measured"
        result.reason = ""
        result.summary = PointSummary.of(record)
        return
    result.status, result.reason = classify_failure(process.returncode, stderr)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate the child, then kill it if it does not go within a few seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def classify_failure(returncode: int, stderr: str) -> tuple[Status, str]:
    """(status, reason) of a child that exited with ``returncode`` and wrote ``stderr``.

    ``oom`` when the run said it cannot be done here (ExitCode.UNSUPPORTED), ran out of memory,
    or was killed by SIGKILL (what the kernel's out-of-memory killer sends); else ``failed``.
    The reason is the last line of stderr (the one-line error every diagnose failure ends with).
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    for prefix in _ERROR_PREFIXES:
        if last.startswith(prefix):
            last = last[len(prefix) :]
            break
    if len(last) > _REASON_CHARS:
        last = last[: _REASON_CHARS - 1] + "…"
    out_of_memory = any("out of memory" in line.lower() for line in lines[-50:])
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            why = f"killed by {name} (the kernel's out-of-memory killer sends it)"
            return "oom", f"{why}: {last}" if last else why
        return "failed", f"killed by {name}" + (f": {last}" if last else "")
    if not last:
        last = f"exited with status {returncode} and no message"
    if returncode == ExitCode.UNSUPPORTED or out_of_memory:
        return "oom", last
    return "failed", last


def run_sweep(
    sweep: Sweep,
    sweep_dir: Path,
    *,
    argv_for: ArgvBuilder,
    timeout: float | None = None,
    on_start: Callable[[PointResult], None] | None = None,
    on_done: Callable[[PointResult], None] | None = None,
    tick: Tick | None = None,
) -> None:
    """Run every pending point of ``sweep`` in order, one child process at a time.

    ``on_done`` is called after each point (the caller rewrites the outputs there); a failed
    point never stops the sweep. On Ctrl-C the running child is stopped, ``sweep.interrupted``
    is set, ``on_done`` is not called for the unfinished point, and KeyboardInterrupt goes on up.
    """
    for result in sweep.points:
        if result.resumed:
            continue
        if on_start is not None:
            on_start(result)
        try:
            run_point(
                result,
                sweep_dir,
                argv_for(result.point, sweep_dir / result.dir),
                timeout=timeout,
                tick=tick,
            )
        except KeyboardInterrupt:
            result.status = "pending"
            result.reason = "interrupted (Ctrl-C) before it finished"
            result.exit_code = None
            result.summary = None
            sweep.interrupted = True
            raise
        sweep.updated = utc_now_iso()
        if on_done is not None:
            on_done(result)
