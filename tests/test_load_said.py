"""`diagnose profile` and `diagnose sweep` measure the machine's load the way `diagnose run`
does and say it where their numbers appear: the profile's record (``timing.host_load``) and page,
each sweep point's row and the fastest point's line. With another process spinning on one of the
cores, both must say the machine was busy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from diagnose.cli import main
from diagnose.record_io import load_record
from tests.test_profile_command import FAST, _script
from tests.test_sweep import TINY


def test_profile_under_load_says_so_in_the_record_and_on_the_page(
    tmp_path: Path, busy_core: None, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path)
    out = tmp_path / "out"
    command = [sys.executable, str(script), "--work-ms", "30"]
    assert main(["profile", "--out", str(out), *FAST, "--", *command]) == 0
    record = load_record(out)
    load = record.timing.host_load
    assert load is not None and load.basis == "psutil"
    assert load.others_cores > 0.5, load  # the spinner held most of a core
    assert load.contended, load
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "While the profiled command ran, other processes took" in page
    assert "otherwise idle machine" not in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_under_load_marks_its_points_and_its_fastest(tmp_path: Path, busy_core: None) -> None:
    out = tmp_path / "sweep"
    # Enough steps that the load is read over several intervals (one is a blip, not a load).
    steps = [*TINY[: TINY.index("--steps")], "--steps", "10", "--warmup", "1"]
    assert main(["sweep", *steps, "--rank", "4", "--batch", "1,2", "--out", str(out)]) == 0
    points = json.loads((out / "sweep.json").read_text(encoding="utf-8"))["points"]
    summaries = [p["summary"] for p in points]
    assert all(s["others_cores"] is not None and s["others_cores"] > 0.5 for s in summaries)
    page = (out / "report.html").read_text(encoding="utf-8")
    busy = [s for s in summaries if s["load_share"] > 0]
    assert busy, summaries
    assert "busy: others held" in page
    assert f"{len(busy)} of {len(points)} measured points ran beside other work" in page
