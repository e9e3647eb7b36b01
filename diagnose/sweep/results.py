"""What a sweep keeps of its points: each one's outcome and numbers, and all of ``sweep.json``.

Every number comes from the point's own ``record.json``, read with
:func:`diagnose.record_io.load_record`; this module never measures. It also names the sweep
folder's files (``sweep.json``, ``points/<id>``, ``logs/``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from diagnose import __version__
from diagnose.output import RECORD_NAME, REPORT_NAME
from diagnose.record import RunRecord, utc_now_iso
from diagnose.sweep.grid import Fixed, Grid, Point

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
