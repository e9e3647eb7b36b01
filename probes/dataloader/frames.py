"""Hot frames of the data loader: a fresh loader of the run's configuration, iterated alone in a
child process under ``py-spy record --subprocesses`` (main process and workers), its samples
ranked by the Python frames they land in (``ImageFile.load``, ``Image.resize`` ...).

py-spy is optional: without it (or without permission to sample) :class:`HotFrames` says why and
the rest of the dataloader probe still runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diagnose
from diagnose import sampling
from diagnose.probes.dataloader.facts import LoaderConfig
from diagnose.units import pct
from diagnose.workload.data import PreparedData

#: How long the child iterates the loader under py-spy, and py-spy's sampling rate.
SAMPLE_SECONDS = 2.0
SAMPLE_RATE = 100
#: How many hot frames the result keeps.
TOP_FRAMES = 8


@dataclass
class HotFrames:
    """What sampling the loader found, or why it did not run."""

    available: bool
    reason: str = ""
    profile: sampling.StackProfile | None = None
    #: Batches the loader delivered alone in the child, and over how many seconds.
    batches: int | None = None
    loader_seconds: float | None = None
    wall_seconds: float = 0.0
    summary: str = ""
    rate: int = SAMPLE_RATE

    @property
    def seconds_per_batch(self) -> float | None:
        if not self.batches or not self.loader_seconds:
            return None
        return self.loader_seconds / self.batches

    def headline(self, top: int = 3) -> str:
        """``ImageFile.load 48%, Image.resize 31%``: the frames a reader should look at."""
        if self.profile is None:
            return ""
        return ", ".join(f"{f.function} {pct(f.share)}" for f in self.profile.top_frames[:top])

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"available": self.available}
        if not self.available:
            data["reason"] = self.reason
            return data
        assert self.profile is not None
        profile = self.profile
        data.update(
            {
                "tool": "py-spy record --subprocesses --nonblocking --function --format raw",
                "rate_hz": self.rate,
                "samples": profile.samples,
                "samples_dropped_startup": profile.dropped,
                "samples_by_process": profile.samples_by_role,
                "processes": profile.processes_by_role,
                "top_frames": [dataclasses.asdict(f) for f in profile.top_frames],
                "categories": profile.categories,
                "busy_categories": profile.busy_categories,
                "loader_alone_batches": self.batches,
                "loader_alone_seconds": self.loader_seconds,
                "loader_alone_seconds_per_batch": self.seconds_per_batch,
                "wall_seconds": round(self.wall_seconds, 2),
                "py_spy": self.summary,
            }
        )
        return data


def _child_env() -> dict[str, str]:
    """The environment for the sampled child: this one, with this diagnose importable first."""
    env = dict(os.environ)
    root = str(Path(diagnose.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def sample_hot_frames(
    data: PreparedData,
    loader: LoaderConfig,
    *,
    batch: int,
    seed: int,
    folder: Path,
    seconds: float = SAMPLE_SECONDS,
    rate: int = SAMPLE_RATE,
    timeout: float = 120.0,
) -> HotFrames:
    """Iterate a fresh loader of this configuration alone in a child that py-spy samples."""
    exe = sampling.find_py_spy()
    if exe is None:
        return HotFrames(
            available=False,
            reason=f"py-spy is not installed or not on PATH ({sampling.INSTALL_HINT})",
        )
    dataset = data.dataset
    spec = sampling.LoaderSpec(
        paths=list(dataset.paths),
        captions=list(dataset.captions),
        buckets=list(dataset.buckets),
        batch=batch,
        workers=loader.num_workers,
        seed=seed,
        decode=loader.decodes_images,
        seconds=seconds,
        max_batches=100_000,
        result_path=str(folder / "loader_result.json"),
        info=dataclasses.asdict(data.info),
    )
    spec_path = folder / "loader_spec.json"
    spec.save(spec_path)
    recording = sampling.record(
        sampling.loader_command(spec_path),
        folder / "pyspy_raw.txt",
        rate=rate,
        timeout=timeout,
        py_spy=exe,
        env=_child_env(),
    )
    if not recording.ok:
        return HotFrames(
            available=False, reason=recording.reason, wall_seconds=recording.wall_seconds
        )
    profile = sampling.summarize(recording.stacks, keep=sampling.is_loader_work, top=TOP_FRAMES)
    if profile.samples == 0:
        return HotFrames(
            available=False,
            reason="py-spy sampled the child, but no sample fell inside the loader iteration",
            wall_seconds=recording.wall_seconds,
        )
    batches = loader_seconds = None
    result_path = Path(spec.result_path)
    if result_path.is_file():
        counts = json.loads(result_path.read_text(encoding="utf-8"))
        batches, loader_seconds = int(counts["batches"]), float(counts["seconds"])
    return HotFrames(
        available=True,
        profile=profile,
        batches=batches,
        loader_seconds=loader_seconds,
        wall_seconds=recording.wall_seconds,
        summary=recording.summary,
        rate=rate,
    )


__all__ = ["SAMPLE_RATE", "SAMPLE_SECONDS", "TOP_FRAMES", "HotFrames", "sample_hot_frames"]
