"""`diagnose sweep`: a grid of `diagnose run` points, each in its own process, resumable.

This module holds the grid (axes, points, stable point ids), the command line of each point, the
rule that says a point was already measured, the running of one point in a child process (with a
timeout and Ctrl-C handling), and the summary dataclasses that ``sweep.json`` holds. It never
measures anything itself: every number comes from the point's own ``record.json``, read with
:func:`diagnose.record_io.load_record`. No torch import.

Rendering (table, charts, VRAM fits, CSV, HTML) is :mod:`diagnose.reports.sweep`'s job.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from diagnose import __version__
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.offline import user_environ
from diagnose.output import RECORD_NAME, REPORT_NAME
from diagnose.record import RunRecord, utc_now_iso
from diagnose.record_io import load_record

SWEEP_JSON = "sweep.json"
SWEEP_CSV = "sweep.csv"
SWEEP_REPORT = "report.html"
POINTS_DIR = "points"
LOGS_DIR = "logs"
#: Bumped when a field of sweep.json changes meaning.
SWEEP_SCHEMA_VERSION = 1

#: What became of a point. ``oom`` is "out of memory or not possible on this device": the child
#: exited with ExitCode.UNSUPPORTED, said "out of memory", or was killed by SIGKILL.
Status = Literal["measured", "failed", "oom", "timeout", "pending"]
STATUS_LABELS: dict[str, str] = {
    "measured": "measured",
    "failed": "failed",
    "oom": "OOM/unsupported",
    "timeout": "timed out",
    "pending": "not run yet",
}

#: Defaults of a sweep point's measurement: fewer steps than `diagnose run` (a grid of runs).
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 1
DEFAULT_PROFILED_STEPS = 1

#: Longest failure reason kept (the last line of the child's stderr).
_REASON_CHARS = 400
_ERROR_PREFIXES = ("diagnose: error: ", "diagnose: internal error: ", "diagnose: ")


# --- the grid ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """One swept setting: its RunConfig field, the `diagnose run` flag and its label."""

    name: str
    label: str
    flag: str
    #: True for on/off settings (the flag is given only when on).
    switch: bool = False


#: The swept settings, in grid order (the last one changes fastest).
AXES: tuple[Axis, ...] = (
    Axis("rank", "rank", "--rank"),
    Axis("resolution", "resolution", "--resolution"),
    Axis("batch", "batch", "--batch"),
    Axis("optimizer", "optimizer", "--optimizer"),
    Axis("precision", "precision", "--precision"),
    Axis("grad_checkpointing", "grad checkpointing", "--grad-checkpointing", switch=True),
    Axis("cache_latents", "cached latents", "--cache-latents", switch=True),
)
AXIS_BY_NAME: dict[str, Axis] = {axis.name: axis for axis in AXES}

Setting = int | str | bool | None
_S = TypeVar("_S")


@dataclass(frozen=True)
class Point:
    """One configuration of the grid. ``resolution`` None = the preset's own buckets."""

    rank: int = 16
    resolution: int | None = None
    batch: int = 1
    optimizer: str = "adamw"
    precision: str = "bf16-mixed"
    grad_checkpointing: bool = False
    cache_latents: bool = False

    @property
    def id(self) -> str:
        """Stable and readable: the folder name resume looks for, e.g.
        ``rank16-res512-batch1-adamw-bf16-mixed-gc_off-cache_off``."""
        res = "res_preset" if self.resolution is None else f"res{self.resolution}"
        return "-".join(
            (
                f"rank{self.rank}",
                res,
                f"batch{self.batch}",
                self.optimizer,
                self.precision,
                f"gc_{_on_off(self.grad_checkpointing)}",
                f"cache_{_on_off(self.cache_latents)}",
            )
        )

    def settings(self) -> dict[str, Setting]:
        return {axis.name: getattr(self, axis.name) for axis in AXES}

    def run_args(self) -> list[str]:
        """The `diagnose run` flags of this point's settings."""
        args: list[str] = []
        for axis in AXES:
            value = getattr(self, axis.name)
            if axis.switch:
                if value:
                    args.append(axis.flag)
            elif value is not None:
                args += [axis.flag, str(value)]
        return args


def _on_off(value: bool) -> str:
    return "on" if value else "off"


@dataclass
class Grid:
    """The values of each swept setting; a setting with one value is held fixed."""

    rank: list[int] = field(default_factory=lambda: [16])
    resolution: list[int | None] = field(default_factory=lambda: [None])
    batch: list[int] = field(default_factory=lambda: [1])
    optimizer: list[str] = field(default_factory=lambda: ["adamw"])
    precision: list[str] = field(default_factory=lambda: ["bf16-mixed"])
    grad_checkpointing: list[bool] = field(default_factory=lambda: [False])
    cache_latents: list[bool] = field(default_factory=lambda: [False])

    def points(self) -> list[Point]:
        """Every combination, in :data:`AXES` order, each value list deduplicated in its order."""
        combos = itertools.product(
            _unique(self.rank),
            _unique(self.resolution),
            _unique(self.batch),
            _unique(self.optimizer),
            _unique(self.precision),
            _unique(self.grad_checkpointing),
            _unique(self.cache_latents),
        )
        return [Point(*combo) for combo in combos]  # Point's fields are in AXES order

    def swept(self) -> list[str]:
        """The names of the settings with more than one value."""
        return [axis.name for axis in AXES if len(_unique(getattr(self, axis.name))) > 1]

    def to_dict(self) -> dict[str, list[Setting]]:
        return {axis.name: _unique(getattr(self, axis.name)) for axis in AXES}


def _unique(values: Iterable[_S]) -> list[_S]:
    seen: list[_S] = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen


@dataclass
class Fixed:
    """The settings every point shares (passed through to each `diagnose run`)."""

    preset: str | None = None
    size: str | None = None
    device: str = "auto"
    seed: int = 0
    #: Absolute, so a resumed sweep started from another folder still matches.
    data_dir: str | None = None
    workers: int = 0
    attention: str = "auto"
    steps: int = DEFAULT_STEPS
    warmup: int = DEFAULT_WARMUP
    profiled_steps: int = DEFAULT_PROFILED_STEPS
    #: Probes turned off in each point (every probe unless --probes).
    skip_probes: list[str] = field(default_factory=list)

    def run_args(self) -> list[str]:
        args: list[str] = []
        for name, flag in (("preset", "--preset"), ("size", "--size"), ("data_dir", "--data")):
            value = getattr(self, name)
            if value is not None:
                args += [flag, str(value)]
        args += ["--device", self.device, "--seed", str(self.seed)]
        args += ["--workers", str(self.workers), "--attention", self.attention]
        args += ["--steps", str(self.steps), "--warmup", str(self.warmup)]
        args += ["--profiled-steps", str(self.profiled_steps)]
        for probe in self.skip_probes:
            args += ["--skip", probe]
        return args


def point_argv(point: Point, fixed: Fixed, out_dir: Path) -> list[str]:
    """The child process of one point: a plain `diagnose run`, without a progress line."""
    return [
        sys.executable,
        "-m",
        "diagnose",
        "run",
        *point.run_args(),
        *fixed.run_args(),
        "--out",
        str(out_dir),
        "--no-progress",
    ]


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


# --- what sweep.json says about each point -----------------------------------------------------


@dataclass
class PointSummary:
    """What the sweep keeps of a point's RunRecord (the full record stays in its folder)."""

    #: Median s/it of the unprofiled steps (the run's headline) and its quartiles.
    seconds_per_it: float | None = None
    q1: float | None = None
    q3: float | None = None
    steps: int = 0
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_rss_bytes: int | None = None
    device_kind: str = ""
    device_name: str = ""
    preset: str = ""
    size: str = ""
    #: The resolution buckets the run trained at (the preset's when the sweep gave none).
    resolution: list[int] = field(default_factory=list)
    created: str = ""
    #: The machine's load from other work while the point's steps ran (its record's
    #: ``timing.host_load``): mean cores others took of the cores it could use, and the share of
    #: its s/it that load could explain (0: not contended). None: not measured.
    others_cores: float | None = None
    cpus: int | None = None
    load_share: float = 0.0

    @property
    def busy(self) -> bool:
        """Whether other work competed for the cores while the point's steps ran."""
        return self.load_share > 0

    @property
    def peak_device_bytes(self) -> int | None:
        """Peak device memory: reserved (what the allocator held) else allocated."""
        if self.peak_reserved_bytes is not None:
            return self.peak_reserved_bytes
        return self.peak_allocated_bytes

    @property
    def peak_bytes(self) -> int | None:
        """The memory figure a VRAM fit uses: device memory, else (a CPU run) the peak RSS."""
        device = self.peak_device_bytes
        return device if device is not None else self.peak_rss_bytes

    @property
    def memory_kind(self) -> Literal["device", "host", ""]:
        if self.peak_device_bytes is not None:
            return "device"
        return "host" if self.peak_rss_bytes is not None else ""

    @classmethod
    def of(cls, record: RunRecord) -> PointSummary:
        headline = record.timing.headline
        load = record.timing.host_load
        resolution = record.config.get("resolution")
        return cls(
            seconds_per_it=_finite(headline.median),
            q1=_finite(headline.q1),
            q3=_finite(headline.q3),
            steps=headline.n,
            peak_allocated_bytes=record.timing.peak_allocated_bytes,
            peak_reserved_bytes=record.timing.peak_reserved_bytes,
            peak_rss_bytes=record.timing.peak_rss_bytes,
            device_kind=record.device.kind,
            device_name=record.device.name,
            preset=str(record.config.get("preset") or record.model.preset or ""),
            size=str(record.config.get("size") or record.model.size or ""),
            resolution=[int(r) for r in resolution] if isinstance(resolution, list) else [],
            created=record.created,
            others_cores=load.others_cores if load is not None else None,
            cpus=load.cpus if load is not None else None,
            load_share=load.competing_share if load is not None else 0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["peak_bytes"] = self.peak_bytes
        data["memory_kind"] = self.memory_kind
        return data


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass
class PointResult:
    """One point of the sweep: its settings, what became of it and, once measured, its numbers."""

    id: str
    point: Point
    status: Status = "pending"
    #: True when a previous invocation measured it and this one skipped it.
    resumed: bool = False
    #: The child's exit status (negative: killed by that signal); None when it did not run.
    exit_code: int | None = None
    #: Why it failed: the last line of the child's stderr, or what stopped it.
    reason: str = ""
    #: Wall time of the child process (None when skipped or not run).
    wall_seconds: float | None = None
    summary: PointSummary | None = None

    @property
    def dir(self) -> str:
        """The point's folder, relative to the sweep folder."""
        return f"{POINTS_DIR}/{self.id}"

    @property
    def log(self) -> str:
        """The child's stderr, relative to the sweep folder."""
        return f"{LOGS_DIR}/{self.id}.stderr.txt"

    @property
    def seconds_per_it(self) -> float | None:
        return self.summary.seconds_per_it if self.summary is not None else None

    @property
    def peak_bytes(self) -> int | None:
        return self.summary.peak_bytes if self.summary is not None else None

    def per_image(self) -> tuple[float, float, float] | None:
        """(median, q1, q3) seconds per trained image: s/it over the batch, so points of
        different batch sizes compare by what each image costs. None when not measured."""
        summary = self.summary
        if summary is None or summary.seconds_per_it is None:
            return None
        batch = max(self.point.batch, 1)
        median = summary.seconds_per_it
        q1 = summary.q1 if summary.q1 is not None else median
        q3 = summary.q3 if summary.q3 is not None else median
        return median / batch, q1 / batch, q3 / batch

    def to_dict(self) -> dict[str, Any]:
        measured = self.status == "measured"
        return {
            "id": self.id,
            "settings": self.point.settings(),
            "status": self.status,
            "status_label": STATUS_LABELS[self.status],
            "resumed": self.resumed,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "wall_seconds": self.wall_seconds,
            "record": f"{self.dir}/{RECORD_NAME}" if measured else None,
            "report": f"{self.dir}/{REPORT_NAME}" if measured else None,
            "log": self.log if self.exit_code is not None else None,
            "summary": self.summary.to_dict() if self.summary is not None else None,
        }


@dataclass
class Sweep:
    """The whole sweep: what ``sweep.json`` holds, rewritten after every point."""

    grid: Grid
    fixed: Fixed
    points: list[PointResult]
    command: str = ""
    created: str = field(default_factory=utc_now_iso)
    updated: str = ""
    #: True when Ctrl-C stopped the sweep before every point had run.
    interrupted: bool = False
    tool_version: str = __version__

    def count(self, *statuses: Status) -> int:
        return sum(1 for p in self.points if p.status in statuses)

    @property
    def complete(self) -> bool:
        """Every point ran and was measured."""
        return all(p.status == "measured" for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "diagnose-sweep",
            "schema_version": SWEEP_SCHEMA_VERSION,
            "tool_version": self.tool_version,
            "created": self.created,
            "updated": self.updated,
            "command": self.command,
            "interrupted": self.interrupted,
            "swept": self.grid.swept(),
            "grid": self.grid.to_dict(),
            "fixed": dataclasses.asdict(self.fixed),
            "counts": {status: self.count(status) for status in STATUS_LABELS},  # type: ignore[arg-type]
            "points": [p.to_dict() for p in self.points],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


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
