"""The grid of a sweep: the swept settings (axes), each point and its stable id, the settings every
point shares, and the `diagnose run` command line of one point. No torch import."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

#: Defaults of a sweep point's measurement: fewer steps than `diagnose run` (a grid of runs).
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 1
DEFAULT_PROFILED_STEPS = 1


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
