"""Ctrl-C and SIGTERM in the middle of a real `diagnose run`: a prompt exit with the shell's code,
one line on stderr, no half-written output folder, no scratch folder left in the temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import QUICK

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _scratch_folders(tmp: Path) -> set[str]:
    return {p.name for p in tmp.glob("diagnose-scratch-*")}


def _stop_mid_run(
    tmp_path: Path, sig: signal.Signals, *, after_trace: bool
) -> tuple[int, str, Path]:
    """Start a real run, send ``sig`` once it has started (or, ``after_trace``, once it has
    written its profiler trace and gone on to the probes), return the exit code, stderr and the
    run's --out folder."""
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    process = subprocess.Popen(
        [sys.executable, "-m", "diagnose", "run", "--out", str(out), *QUICK],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    marker = out / "trace.json.gz" if after_trace else out
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the run never got that far"
    time.sleep(1.0 if after_trace else 3.0)  # into the probes, or into building and stepping
    assert process.poll() is None, "the run ended before the signal"
    process.send_signal(sig)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the run did not stop within 60 s of the signal")
    assert not _scratch_folders(scratch), "a scratch folder was left behind"
    return process.returncode, err, out


@pytest.mark.slow
def test_sigterm_mid_run_exits_143_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    code, err, out = _stop_mid_run(tmp_path, signal.SIGTERM, after_trace=True)
    assert code == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("diagnose: terminated")
    assert "Traceback" not in err
    # The trace was written before the probes; without its record it must not stay behind.
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.slow
def test_ctrl_c_mid_run_exits_130(tmp_path: Path) -> None:
    code, err, out = _stop_mid_run(tmp_path, signal.SIGINT, after_trace=False)
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("diagnose: interrupted")
    assert "Traceback" not in err and "Exception ignored" not in err
    assert not out.exists()


def test_a_rerun_into_an_earlier_runs_folder_keeps_its_files_when_stopped(
    tmp_path: Path,
) -> None:
    from diagnose.output import RECORD_NAME, TRACE_NAME, remove_partial_outputs

    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / RECORD_NAME).write_text("{}")
    old = time.time() - 3600
    os.utime(folder / RECORD_NAME, (old, old))
    started = time.time()
    (folder / TRACE_NAME).write_bytes(b"partial")
    remove_partial_outputs(folder, created=False, since=started)
    assert (folder / RECORD_NAME).exists() and not (folder / TRACE_NAME).exists()
