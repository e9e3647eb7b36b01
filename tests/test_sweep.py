"""`diagnose sweep`: real `diagnose run` children of the tiny preset on the CPU, resume, failures.

The slow tests share one real 2×2 sweep (module fixture). The fast ones drive the runner with
small stand-in child processes (a real subprocess each) to cover failure reasons, the per-point
timeout and Ctrl-C without paying for real training runs.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.record import RunRecord, StepSample, new_record
from diagnose.record_io import load_record
from diagnose.reports.sweep import CSV_COLUMNS, build_sweep_view, render_sweep_html, sweep_csv
from diagnose.reports.sweep_fits import fastest, vram_fits
from diagnose.sweep.grid import Fixed, Grid, Point, point_argv
from diagnose.sweep.results import PointResult, PointSummary, Sweep
from diagnose.sweep.run_points import classify_failure, expected_config, plan, run_sweep

#: The tiny SD1.5 on the CPU at the smallest resolution, one timed and one profiled step.
TINY = [
    # fp32: a CPU without bf16 units emulates bf16 matmuls many times slower, and the sweep's
    # mechanics, not the precision, are under test.
    "--precision",
    "fp32",
    "--preset",
    "sd15",
    "--size",
    "tiny",
    "--device",
    "cpu",
    "--resolution",
    "64",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--profiled-steps",
    "1",
]
#: Two real points (each a `diagnose run` process); the grid of two swept settings is the
#: stand-ins' and the page test's to cover.
GRID = ["--rank", "4", "--batch", "1,2"]


@dataclass
class Invocation:
    out: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _sweep_cli(out: Path, *extra: str, pythonpath: Path | None = None) -> Invocation:
    """`python -m diagnose sweep` as a user runs it (stderr is not a terminal: no bar);
    ``pythonpath`` goes first on the children's PYTHONPATH."""
    start = time.monotonic()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "diagnose", "sweep", *extra, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    return Invocation(out, done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@pytest.fixture(scope="module")
def one_by_two(tmp_path_factory: pytest.TempPathFactory) -> Invocation:
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    return _sweep_cli(out, *TINY, *GRID)


def _sweep_json(out: Path) -> dict[str, object]:
    data = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _points(out: Path) -> list[dict[str, object]]:
    points = _sweep_json(out)["points"]
    assert isinstance(points, list)
    return points


# --- real sweeps (slow) -----------------------------------------------------------------------


def test_a_real_sweep_measures_each_point_as_a_run_record(one_by_two: Invocation) -> None:
    assert one_by_two.returncode == 0, one_by_two.stderr
    points = _points(one_by_two.out)
    assert [p["status"] for p in points] == ["measured"] * 2
    settings = [(p["settings"]["rank"], p["settings"]["batch"]) for p in points]  # type: ignore[index]
    assert settings == [(4, 1), (4, 2)]
    schema = set(RunRecord().to_dict())
    for point in points:
        record_path = one_by_two.out / str(point["record"])
        record = load_record(record_path)
        # The same document a single `diagnose run` writes: every field, mode "run".
        assert set(json.loads(record_path.read_text(encoding="utf-8"))) == schema
        assert record.mode == "run"
        assert record.command.startswith("diagnose run")
        wanted = point["settings"]
        assert isinstance(wanted, dict)
        assert record.config["rank"] == wanted["rank"]
        assert record.config["batch"] == wanted["batch"]
        assert record.config["resolution"] == [64]
        assert record.config["steps"] == 1
        # Probes off by default (the trace analysis of the run's own trace still runs).
        assert {p.name: p.status for p in record.probes if p.name != "trace"} == {
            name: "skipped" for name in record.config["skip_probes"]
        }
        summary = point["summary"]
        assert isinstance(summary, dict)
        assert summary["seconds_per_it"] == pytest.approx(record.timing.headline.median)
        assert summary["peak_rss_bytes"] == record.timing.peak_rss_bytes
        assert summary["memory_kind"] == "host"  # a CPU run: no device memory
        assert (one_by_two.out / str(point["report"])).is_file()
    print(f"1x2 tiny sweep: {one_by_two.seconds:.0f} s wall")


def test_a_real_sweep_writes_table_csv_and_page(one_by_two: Invocation) -> None:
    out = one_by_two.out
    rows = list(csv.DictReader((out / "sweep.csv").read_text(encoding="utf-8").splitlines()))
    assert len(rows) == 2
    assert tuple(rows[0]) == CSV_COLUMNS
    assert all(float(row["seconds_per_it"]) > 0 for row in rows)
    page = (out / "report.html").read_text(encoding="utf-8")
    assert '<table class="sweep"' in page
    assert page.count("<svg") == 1  # one chart per swept setting: the batch
    assert "<script" not in page.lower() and "://" not in page
    assert "Fastest configuration that fits" in page
    assert "host memory" in page  # the CPU sizes are peak RSS, and the page says so
    for point in _points(out):
        assert f'href="{point["report"]}"' in page
        assert f'href="{point["record"]}"' in page
    # Batch is swept: the fastest point is the fastest per trained image.
    assert "Fastest per image:" in one_by_two.stdout and "report:" in one_by_two.stdout


def test_rerun_skips_measured_points_and_a_failing_point_does_not_stop_it(
    one_by_two: Invocation, tmp_path: Path
) -> None:
    assert one_by_two.returncode == 0, one_by_two.stderr
    out = tmp_path / "sweep"
    shutil.copytree(one_by_two.out, out)  # copy2: the records keep their mtimes
    records = sorted(out.glob("points/*/record.json"))
    assert len(records) == 2
    before = {path: path.stat().st_mtime_ns for path in records}

    # Rank 8's `diagnose run` fails as it starts (a sitecustomize the children inherit plants a
    # failure; a bad value would be refused before any point runs): 2 new points that fail,
    # placed before the measured ones in grid order; the 2 measured points are skipped.
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(
        "import sys\n"
        "argv = sys.argv\n"
        "if 'run' in argv and '--rank' in argv and argv[argv.index('--rank') + 1] == '8':\n"
        "    print('diagnose: error: planted failure of rank 8', file=sys.stderr, flush=True)\n"
        "    import os\n"
        "    os._exit(3)\n",  # site would catch a SystemExit raised here
        encoding="utf-8",
    )
    grid = [*GRID]
    grid[grid.index("4")] = "8,4"
    again = _sweep_cli(out, *TINY, *grid, pythonpath=planted)

    assert again.returncode == ExitCode.UNSUPPORTED, again.stderr  # some points failed
    assert again.stdout.count("skipped (measured before)") == 2
    assert {path: path.stat().st_mtime_ns for path in records} == before  # nothing re-run
    points = _points(out)
    assert len(points) == 4
    by_status: dict[object, list[dict[str, object]]] = {}
    for point in points:
        by_status.setdefault(point["status"], []).append(point)
    assert len(by_status["measured"]) == 2
    assert all(p["resumed"] for p in by_status["measured"])
    assert len(by_status["failed"]) == 2
    for point in by_status["failed"]:
        assert point["exit_code"] == ExitCode.BAD_INPUT
        assert "planted failure of rank 8" in str(point["reason"])
        assert (out / str(point["log"])).is_file()
    # The failures come first in grid order and every later point was still handled.
    assert [p["status"] for p in points][:2] == ["failed", "failed"]
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "planted failure of rank 8" in page
    assert "2 failed" in page


# --- the runner with stand-in children (fast) -------------------------------------------------


def _saved_record(path: Path, *, rank: int, seconds: float, rss: int) -> Path:
    record = new_record("run")
    record.config = {"rank": rank, "batch": 1, "resolution": [64]}
    record.device.kind = "cpu"
    record.timing.samples = [StepSample(index=i, seconds=seconds) for i in range(3)]
    record.timing.summarize()
    record.timing.peak_rss_bytes = rss
    record.save(path)
    return path


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _sweep_of(points: list[Point]) -> Sweep:
    results = [PointResult(id=p.id, point=p) for p in points]
    return Sweep(grid=Grid(rank=[p.rank for p in points]), fixed=Fixed(), points=results)


def test_failures_timeouts_and_ooms_are_reported_and_the_sweep_goes_on(tmp_path: Path) -> None:
    record = _saved_record(tmp_path / "made.json", rank=5, seconds=0.5, rss=2 * 1024**3)
    children = {
        1: _child(
            "import sys; print('Traceback ...', file=sys.stderr); "
            "print('diagnose: error: boom', file=sys.stderr); sys.exit(1)"
        ),
        2: _child(
            "import sys; print('torch.OutOfMemoryError: CUDA out of memory.', "
            "file=sys.stderr); sys.exit(1)"
        ),
        3: _child("import time; time.sleep(120)"),
        4: _child(
            "import sys; print('diagnose: error: no such device cuda:3', file=sys.stderr); "
            "sys.exit(5)"
        ),
        5: _child(f"""
            import shutil, sys
            from pathlib import Path
            out = Path(sys.argv[1])
            out.mkdir()
            shutil.copy({str(record)!r}, out / "record.json")
            """),
    }
    sweep = _sweep_of([Point(rank=r) for r in children])
    done: list[str] = []
    run_sweep(
        sweep,
        tmp_path,
        argv_for=lambda point, out: [*children[point.rank], str(out)],
        timeout=5,
        on_done=lambda result: done.append(result.status),
    )
    assert done == ["failed", "oom", "timeout", "oom", "measured"]
    failed, oom, hung, unsupported, measured = sweep.points
    assert failed.reason == "boom" and failed.exit_code == 1
    assert "out of memory" in oom.reason
    assert "--timeout" in hung.reason and hung.exit_code is not None
    assert unsupported.reason == "no such device cuda:3"
    assert measured.seconds_per_it == pytest.approx(0.5)
    assert measured.peak_bytes == 2 * 1024**3
    assert not sweep.complete
    assert (tmp_path / failed.log).read_text(encoding="utf-8").endswith("boom\n")


def test_classify_failure() -> None:
    assert classify_failure(5, "diagnose: error: bf16 is not supported here\n") == (
        "oom",
        "bf16 is not supported here",
    )
    assert classify_failure(-signal.SIGKILL, "")[0] == "oom"
    status, reason = classify_failure(-signal.SIGTERM, "")
    assert status == "failed" and "SIGTERM" in reason
    assert classify_failure(3, "") == ("failed", "exited with status 3 and no message")
    status, reason = classify_failure(1, "x\n" * 10 + "RuntimeError: " + "y" * 1000)
    assert status == "failed" and len(reason) <= 400


def test_ctrl_c_keeps_finished_points_stops_the_child_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _saved_record(tmp_path / "made.json", rank=4, seconds=0.25, rss=1024**3)
    pid_file = tmp_path / "child.pid"
    measured = _child(f"""
        import shutil, sys
        from pathlib import Path
        out = Path(sys.argv[1])
        out.mkdir()
        shutil.copy({str(record)!r}, out / "record.json")
        """)
    # The second child stands in for a user's Ctrl-C: SIGINT to the sweep, then it waits.
    interrupting = _child(f"""
        import os, signal, sys, time
        from pathlib import Path
        Path({str(pid_file)!r}).write_text(str(os.getpid()))
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(120)
        """)

    def fake_argv(point: Point, fixed: Fixed, out: Path) -> list[str]:
        return [*(measured if point.rank == 4 else interrupting), str(out)]

    monkeypatch.setattr("diagnose.sweep.grid.point_argv", fake_argv)
    out = tmp_path / "sweep"
    code = main(
        ["sweep", "--rank", "4,8,16", "--device", "cpu", "--no-progress", "--out", str(out)]
    )

    # Each point's status and reason, should the interrupt not have reached the sweep.
    assert code == ExitCode.INTERRUPTED, [(p["status"], p.get("reason")) for p in _points(out)]
    data = _sweep_json(out)
    assert data["interrupted"] is True
    assert [p["status"] for p in _points(out)] == ["measured", "pending", "pending"]
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the running child was stopped (and reaped)
    assert (out / "report.html").is_file() and (out / "sweep.csv").is_file()


def test_resume_needs_a_record_of_the_same_configuration(tmp_path: Path) -> None:
    point = Point(rank=4, resolution=64)
    fixed = Fixed(device="cpu", steps=3)
    folder = tmp_path / "points" / point.id
    folder.mkdir(parents=True)
    record = new_record("run")
    record.config = dict(expected_config(point, fixed))
    record.save(folder / "record.json")
    results, stale = plan(tmp_path, [point], fixed)
    assert results[0].resumed and results[0].status == "measured" and not stale

    results, stale = plan(tmp_path, [point], Fixed(device="cpu", steps=10))
    assert not results[0].resumed and results[0].status == "pending"
    assert "steps 3 → 10" in stale[point.id]

    (folder / "record.json").write_text("{not json", encoding="utf-8")
    results, stale = plan(tmp_path, [point], fixed)
    assert not results[0].resumed and "could not be read" in stale[point.id]


def test_point_ids_and_child_command_line() -> None:
    point = Point(rank=16, resolution=512, grad_checkpointing=True)
    assert point.id == "rank16-res512-batch1-adamw-bf16-mixed-gc_on-cache_off"
    assert Point().id == "rank16-res_preset-batch1-adamw-bf16-mixed-gc_off-cache_off"
    argv = point_argv(point, Fixed(preset="sd15", steps=3, skip_probes=["attention"]), Path("o"))
    assert argv[:4] == [sys.executable, "-m", "diagnose", "run"]
    line = " ".join(argv[4:])
    assert "--rank 16 --resolution 512 --batch 1" in line
    assert "--grad-checkpointing" in argv and "--cache-latents" not in argv
    assert "--skip attention" in line and "--steps 3" in line and "--preset sd15" in line
    assert argv[-3:] == ["--out", "o", "--no-progress"]
    grid = Grid(rank=[8, 16, 8], batch=[1, 2])
    assert [p.rank for p in grid.points()] == [8, 8, 16, 16]
    assert grid.swept() == ["rank", "batch"]


def _measured(point: Point, seconds: float, peak: int) -> PointResult:
    summary = PointSummary(
        seconds_per_it=seconds,
        q1=seconds,
        q3=seconds,
        steps=3,
        peak_reserved_bytes=peak,
        device_kind="cuda",
        device_name="GPU",
    )
    return PointResult(id=point.id, point=point, status="measured", summary=summary)


def test_vram_fits_pick_the_fastest_point_under_each_size() -> None:
    gib = 1024**3
    points = [
        _measured(Point(rank=8), 1.0, 20 * gib),
        _measured(Point(rank=16), 0.8, 30 * gib),
        _measured(Point(rank=32), 2.0, 10 * gib),
        PointResult(id="x", point=Point(rank=64), status="oom", reason="CUDA out of memory"),
    ]
    fits = {fit.gib: fit.point.point.rank if fit.point else None for fit in vram_fits(points)}
    assert fits == {8: None, 12: 32, 16: 32, 24: 8, 48: 16, 80: 16}


def _spread(point: Point, median: float, q1: float, q3: float) -> PointResult:
    summary = PointSummary(seconds_per_it=median, q1=q1, q3=q3, steps=5, peak_rss_bytes=1)
    return PointResult(id=point.id, point=point, status="measured", summary=summary)


def test_fastest_is_per_image_and_names_the_points_noise_cannot_rank() -> None:
    # Batch 2 at 1.5x the step time of batch 1 trains an image faster.
    one, two = _spread(Point(batch=1), 1.0, 0.98, 1.02), _spread(Point(batch=2), 1.5, 1.48, 1.52)
    best = fastest([one, two])
    assert best is not None and best.point is two and best.ties == ()
    # Overlapping step times: the runner-up is named beside the fastest, not ranked below it.
    close = _spread(Point(rank=8), 0.256, 0.255, 0.278)
    near = _spread(Point(rank=16), 0.261, 0.253, 0.270)
    apart = _spread(Point(rank=32), 0.400, 0.390, 0.410)
    best = fastest([near, close, apart])
    assert best is not None and best.point is close and best.ties == (near,)


def test_a_grid_of_two_settings_gets_a_chart_for_each() -> None:
    grid = Grid(rank=[4, 8], batch=[1, 2])
    points = grid.points()
    results = [_spread(point, 0.1 * point.rank * point.batch, 0.1, 10.0) for point in points]
    sweep = Sweep(grid=grid, fixed=Fixed(), points=results)
    page = render_sweep_html(sweep)
    assert page.count("<svg") == 2  # one chart per swept setting: rank, batch
    assert all(r.id in page for r in results)


def test_page_escapes_reasons_and_sorts_without_script() -> None:
    hostile = '<img src=x onerror=alert(1)> "quoted"'
    points = [Point(rank=4), Point(rank=8)]
    sweep = _sweep_of(points)
    sweep.points[0] = _measured(points[0], 0.5, 3 * 1024**3)
    sweep.points[1].status = "failed"
    sweep.points[1].reason = hostile
    sweep.points[1].exit_code = 1
    page = render_sweep_html(sweep)
    assert "<img src=x" not in page and "&lt;img src=x" in page
    assert "<script" not in page.lower()
    assert 'id="sort-sit-asc"' in page and "--a-sit:" in page
    assert "none fits" not in page  # 3 GiB fits every size
    view = build_sweep_view(sweep, with_charts=False)
    assert view.rows[1].seconds_per_it == "—" and view.rows[1].log_href
    assert view.fits[0].index == 1
    rows = sweep_csv(sweep).splitlines()
    assert len(rows) == 3 and rows[2].split(",")[8] == "failed"
