"""`diagnose sweep`: a grid of `diagnose run` points, one process each, in one table and page."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diagnose.commands import comma_ints
from diagnose.config import ATTENTIONS, OPTIMIZERS, PRECISIONS, PRESETS, SIZES
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.progress import ProgressLine
from diagnose.sweep.grid import (
    DEFAULT_PROFILED_STEPS,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    Fixed,
    Grid,
)
from diagnose.sweep.results import (
    LOGS_DIR,
    POINTS_DIR,
    STATUS_LABELS,
    SWEEP_CSV,
    SWEEP_JSON,
    SWEEP_REPORT,
    PointResult,
    Sweep,
)

#: The exit status of a sweep in which some point failed, ran out of memory or timed out (the
#: others were measured): "not possible on this machine", as for a single run.
SOME_POINTS_FAILED = ExitCode.UNSUPPORTED


def _names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [part for part in text.replace(" ", "").split(",") if part]
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        for value in values:
            if value not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown value {value!r}; choose from {', '.join(choices)}"
                )
        return values

    return parse


def _switches(text: str) -> list[bool]:
    words = {"on": True, "off": False}
    values = [part for part in text.replace(" ", "").lower().split(",") if part]
    if not values or any(v not in words for v in values):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return [words[v] for v in values]


class SweepCommand:
    name = "sweep"
    help = (
        "run a grid of configurations (rank, resolution, batch, optimizer, ...), each a "
        "`diagnose run` in its own process, and tabulate s/it and peak memory"
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        grid = parser.add_argument_group(
            "swept settings (comma-separated values; one value = fixed)"
        )
        grid.add_argument(
            "--rank", type=comma_ints, metavar="N[,N...]", help="LoRA ranks (default: 16)"
        )
        grid.add_argument(
            "--resolution",
            type=comma_ints,
            metavar="PX[,PX...]",
            help="one resolution per point (default: the preset's buckets)",
        )
        grid.add_argument(
            "--batch", type=comma_ints, metavar="N[,N...]", help="batch sizes (default: 1)"
        )
        grid.add_argument(
            "--optimizer",
            type=_names(OPTIMIZERS),
            metavar="NAME[,NAME...]",
            help=f"{', '.join(OPTIMIZERS)} (default: adamw)",
        )
        grid.add_argument(
            "--precision",
            type=_names(PRECISIONS),
            metavar="NAME[,NAME...]",
            help=f"{', '.join(PRECISIONS)} (default: bf16-mixed)",
        )
        grid.add_argument(
            "--grad-checkpointing",
            type=_switches,
            metavar="on|off|on,off",
            help="gradient checkpointing (default: off)",
        )
        grid.add_argument(
            "--cache-latents",
            type=_switches,
            metavar="on|off|on,off",
            help="encode images once before timing (default: off)",
        )
        shared = parser.add_argument_group("the same for every point")
        shared.add_argument(
            "--preset", choices=PRESETS, help="architecture (default: the device's)"
        )
        shared.add_argument("--size", choices=SIZES, help="full or tiny (default: the device's)")
        shared.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
        shared.add_argument("--seed", type=int, default=0)
        shared.add_argument("--data", metavar="DIR", help="your image folder")
        shared.add_argument("--workers", type=int, default=0, help="DataLoader workers")
        shared.add_argument("--attention", choices=ATTENTIONS, default="auto")
        measure = parser.add_argument_group("measurement")
        measure.add_argument(
            "--steps",
            type=int,
            default=DEFAULT_STEPS,
            help=f"timed steps per point (default: {DEFAULT_STEPS})",
        )
        measure.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="warm-up steps")
        measure.add_argument(
            "--profiled-steps", type=int, default=DEFAULT_PROFILED_STEPS, help="profiled steps"
        )
        measure.add_argument(
            "--probes", action="store_true", help="run the probes in every point (default: off)"
        )
        measure.add_argument(
            "--timeout",
            type=float,
            metavar="SECONDS",
            help="stop a point that runs longer and report it as timed out (default: no limit)",
        )
        output = parser.add_argument_group("output")
        output.add_argument(
            "--out",
            type=Path,
            required=True,
            metavar="DIR",
            help="the sweep folder; run the same command again to resume (measured points are "
            "skipped)",
        )
        output.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.probes.registry import probe_names
        from diagnose.sweep.grid import point_argv
        from diagnose.sweep.run_points import plan, run_sweep

        if args.timeout is not None and args.timeout <= 0:
            raise DiagnoseError("--timeout must be positive", ExitCode.USAGE)
        data_dir = None
        if args.data is not None:
            if not Path(args.data).is_dir():
                raise DiagnoseError(f"--data {args.data}: no such folder", ExitCode.BAD_INPUT)
            data_dir = str(Path(args.data).resolve())
        grid = Grid()
        for name in (
            "rank",
            "resolution",
            "batch",
            "optimizer",
            "precision",
            "grad_checkpointing",
            "cache_latents",
        ):
            if getattr(args, name) is not None:
                setattr(grid, name, getattr(args, name))
        fixed = Fixed(
            preset=args.preset,
            size=args.size,
            device=args.device,
            seed=args.seed,
            data_dir=data_dir,
            workers=args.workers,
            attention=args.attention,
            steps=args.steps,
            warmup=args.warmup,
            profiled_steps=args.profiled_steps,
            skip_probes=[] if args.probes else probe_names(),
        )
        _refuse_impossible_points(grid, fixed)
        out: Path = args.out
        _prepare_sweep_dir(out)
        results, stale = plan(out, grid.points(), fixed)
        sweep = Sweep(grid=grid, fixed=fixed, points=results, command=_command_line(args))
        _carry_forward(sweep, out)
        to_run = [r for r in results if not r.resumed]
        print(
            f"sweep: {len(results)} points, {len(results) - len(to_run)} measured before "
            f"(skipped), {len(to_run)} to run → {out}"
        )
        for index, result in enumerate(results, start=1):
            if result.resumed:
                print(f"[{index}/{len(results)}] {result.id}: skipped (measured before)")
            elif result.id in stale:
                print(f"[{index}/{len(results)}] {result.id}: measured again, {stale[result.id]}")
        write_outputs(sweep, out)
        position = {r.id: i for i, r in enumerate(results, start=1)}

        with SweepProgress(len(to_run), enabled=False if args.no_progress else None) as progress:

            def started(result: PointResult) -> None:
                progress.start(position[result.id], len(results), result)

            def finished(result: PointResult) -> None:
                progress.done(result)
                progress.write(f"[{position[result.id]}/{len(results)}] {_point_line(result)}")
                write_outputs(sweep, out)

            try:
                run_sweep(
                    sweep,
                    out,
                    argv_for=lambda point, point_dir: point_argv(point, fixed, point_dir),
                    timeout=args.timeout,
                    on_start=started,
                    on_done=finished,
                    tick=progress.tick,
                )
            except KeyboardInterrupt:
                write_outputs(sweep, out)
                progress.close()
                kept = sweep.count("measured")
                print(
                    f"sweep: interrupted; {kept} measured point{'' if kept == 1 else 's'} kept "
                    f"in {out}; run the same command again to measure the rest",
                    file=sys.stderr,
                )
                raise
        _print_summary(sweep, out)
        return int(ExitCode.OK if sweep.complete else SOME_POINTS_FAILED)


def _prepare_sweep_dir(out: Path) -> None:
    """Create the sweep folder; an existing one is resumed, any other non-empty folder refused."""
    from diagnose.output import refuse_special_file

    if out.exists() and not out.is_dir():
        raise DiagnoseError(f"--out {out}: exists and is not a folder", ExitCode.OUTPUT_EXISTS)
    for name in (SWEEP_JSON, SWEEP_CSV, SWEEP_REPORT):
        refuse_special_file(out / name, "--out")  # a FIFO by an output's name: never replaced
    is_sweep = (out / SWEEP_JSON).is_file() or (out / POINTS_DIR).is_dir()
    if out.is_dir() and any(out.iterdir()) and not is_sweep:
        raise DiagnoseError(
            f"--out {out}: folder exists, is not empty and holds no sweep; choose another",
            ExitCode.OUTPUT_EXISTS,
        )
    try:
        (out / POINTS_DIR).mkdir(parents=True, exist_ok=True)
        (out / LOGS_DIR).mkdir(exist_ok=True)
    except OSError as exc:
        raise DiagnoseError(
            f"--out {out}: cannot create: {exc.strerror}", ExitCode.BAD_INPUT
        ) from None


def _carry_forward(sweep: Sweep, out: Path) -> None:
    """From an earlier invocation's sweep.json: when the sweep started, and how long each point
    it measured took (an unreadable file is ignored: the records are the truth)."""
    import json

    try:
        previous = json.loads((out / SWEEP_JSON).read_text(encoding="utf-8"))
        points = {p["id"]: p for p in previous["points"]}
        created = previous["created"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(created, str) and created:
        sweep.created = created
    for result in sweep.points:
        old = points.get(result.id)
        if result.resumed and isinstance(old, dict):
            wall = old.get("wall_seconds")
            if isinstance(wall, (int, float)):
                result.wall_seconds = float(wall)


def write_outputs(sweep: Sweep, out: Path) -> None:
    """sweep.json, sweep.csv and report.html, each replaced atomically (json first: the page is
    the one that could fail, and the numbers must not depend on it)."""
    from diagnose.output import write_text_atomic
    from diagnose.redact import redact_dataclass
    from diagnose.reports.sweep import render_sweep_html, sweep_csv

    sweep = redact_dataclass(sweep)  # its command line and the points' failure lines
    write_text_atomic(out / SWEEP_JSON, sweep.to_json())
    write_text_atomic(out / SWEEP_CSV, sweep_csv(sweep))
    write_text_atomic(out / SWEEP_REPORT, render_sweep_html(sweep))


def _command_line(args: argparse.Namespace) -> str:
    """The `diagnose sweep` command that repeats (and so resumes) this sweep."""
    parts = ["diagnose", "sweep"]
    lists = ("rank", "resolution", "batch", "optimizer", "precision")
    for name in lists:
        value = getattr(args, name)
        if value is not None:
            parts += [f"--{name}", ",".join(map(str, value))]
    for name in ("grad_checkpointing", "cache_latents"):
        value = getattr(args, name)
        if value is not None:
            parts += ["--" + name.replace("_", "-"), ",".join("on" if v else "off" for v in value)]
    defaults: dict[str, Any] = {
        "preset": None,
        "size": None,
        "device": "auto",
        "seed": 0,
        "data": None,
        "workers": 0,
        "attention": "auto",
        "steps": DEFAULT_STEPS,
        "warmup": DEFAULT_WARMUP,
        "profiled_steps": DEFAULT_PROFILED_STEPS,
        "timeout": None,
    }
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            parts += [
                "--" + name.replace("_", "-"),
                f"{value:g}" if name == "timeout" else str(value),
            ]
    if args.probes:
        parts.append("--probes")
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def _point_line(result: PointResult) -> str:
    from diagnose.units import format_bytes, format_per_iteration

    if result.status == "measured" and result.summary is not None:
        kind = "device" if result.summary.memory_kind == "device" else "host (RSS)"
        wall = f" in {result.wall_seconds:.0f} s" if result.wall_seconds is not None else ""
        return (
            f"{result.id}: {format_per_iteration(result.seconds_per_it)}, peak "
            f"{format_bytes(result.peak_bytes)} {kind}{wall}"
        )
    code = f" (exit {result.exit_code})" if result.exit_code is not None else ""
    return f"{result.id}: {STATUS_LABELS[result.status]}{code}: {result.reason}"


def _print_summary(sweep: Sweep, out: Path) -> None:
    from diagnose.reports.sweep import build_sweep_view

    view = build_sweep_view(sweep, with_charts=False)
    print()
    print(view.headline)
    print(view.counts + ".")
    if view.memory_kind:
        word = "device memory" if view.memory_kind == "device" else "host memory (peak RSS)"
        print(f"Fastest point that fits, by {word}:")
        groups: dict[str, list[int]] = {}
        for fit in view.fits:
            best = (
                f"#{fit.index} {fit.label}: {fit.seconds_per_it}, peak {fit.peak}"
                if fit.index
                else "none fits"
            )
            groups.setdefault(best, []).append(fit.gib)
        for best, sizes in groups.items():
            print(f"  {', '.join(map(str, sizes))} GiB: {best}")
    failed = [r for r in sweep.points if r.status not in ("measured", "pending")]
    for result in failed:
        print(f"{STATUS_LABELS[result.status]}: {result.id}: {result.reason}")
    print(f"\nreport: {out / SWEEP_REPORT}\ntable:  {out / SWEEP_JSON}, {out / SWEEP_CSV}")


class SweepProgress(ProgressLine):
    """A progress bar on stderr: points done of those to run, the ETA, the running point and the
    last point's s/it. Off when stderr is not a terminal, or with ``enabled=False``."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        super().__init__(
            enabled,
            total=total,
            bar_format="diagnose sweep {n_fmt}/{total_fmt} |{bar:10}| "
            "[{elapsed}<{remaining}] {desc}{postfix}",
        )

    def start(self, index: int, count: int, result: PointResult) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"point {index}/{count} {result.id}", refresh=True)

    def tick(self) -> None:
        if self._bar is not None:
            self._bar.refresh()

    def done(self, result: PointResult) -> None:
        if self._bar is None:
            return
        from diagnose.units import format_per_iteration

        last = (
            format_per_iteration(result.seconds_per_it)
            if result.status == "measured"
            else STATUS_LABELS[result.status]
        )
        self._bar.set_postfix_str(f"last: {last}", refresh=False)
        self._bar.update(1)

    def write(self, line: str) -> None:
        """A line on stdout that does not tear the bar."""
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)


def _refuse_impossible_points(grid: Grid, fixed: Fixed) -> None:
    """Each point's `diagnose run` command line, judged as `diagnose run` judges it, before the
    first point runs: a value no run can use (``--resolution 0``, ``--batch -1``) is one line
    and ExitCode.USAGE, not a sweep whose every point fails."""
    from diagnose.commands import ArgumentParser
    from diagnose.commands.run import RunCommand, config_of

    parser = ArgumentParser(prog="diagnose sweep")
    RunCommand().prepare_parser(parser)
    for point in grid.points():
        config_of(parser.parse_args([*point.run_args(), *fixed.run_args()])).validate()
