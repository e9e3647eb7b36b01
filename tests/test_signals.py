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


def test_sigterm_mid_run_exits_143_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    code, err, out = _stop_mid_run(tmp_path, signal.SIGTERM, after_trace=True)
    assert code == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("diagnose: terminated")
    assert "Traceback" not in err
    # The trace was written before the probes; without its record it must not stay behind.
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_ctrl_c_mid_run_exits_130(tmp_path: Path) -> None:
    code, err, out = _stop_mid_run(tmp_path, signal.SIGINT, after_trace=False)
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("diagnose: interrupted")
    assert "Traceback" not in err and "Exception ignored" not in err
    assert not out.exists()


def test_clean_up_removes_what_the_run_wrote_and_nothing_it_found(tmp_path: Path) -> None:
    from diagnose.output import (
        RECORD_NAME,
        TRACE_NAME,
        created_files,
        prepare_out_dir,
        write_bytes_atomic,
    )

    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / RECORD_NAME).write_text("{}")  # an earlier run's record, kept when stopped
    new = tmp_path / "new" / "deeper"
    with created_files() as written:
        prepare_out_dir(folder, force=True)
        # Someone else's file appears meanwhile (a trainer's checkpoint): newer than the run's
        # start, named like a temporary file, never ours.
        (folder / ".ckpt.tmp").write_text("theirs")
        write_bytes_atomic(folder / TRACE_NAME, b"partial")
        prepare_out_dir(new, force=False)
        write_bytes_atomic(new / RECORD_NAME, b"{}")
        (new / "theirs.txt").write_text("x")  # keeps the folder it is in
        write_bytes_atomic(new / "report.html", b"<html>")
        (new / "report.html").unlink()
        (new / "report.html").write_text("replaced by someone else since")
    write_bytes_atomic(tmp_path / "after.txt", b"x")  # the ledger was closed: not noted
    written.remove()
    assert sorted(p.name for p in folder.iterdir()) == [".ckpt.tmp", RECORD_NAME]
    assert sorted(p.name for p in new.iterdir()) == ["report.html", "theirs.txt"]
    assert (tmp_path / "after.txt").exists()
    # A folder the run made and only it wrote into goes with its files.
    (new / "theirs.txt").unlink()
    (new / "report.html").unlink()
    written.remove()
    assert not new.exists() and not new.parent.exists()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_error_that_follows_a_swallowed_signal_is_reported_as_the_signal(
    sig: signal.Signals, code: int
) -> None:
    """A library that swallows the KeyboardInterrupt of an import leaves a module half-built; the
    error a later line then raises is the signal's doing, and the exit says the signal. Planted:
    `diagnose presets` whose listing swallows the signal, then fails as a broken import would."""
    script = (
        "import os, signal, sys\n"
        "import diagnose.commands.presets as presets\n"
        "from diagnose import cli, interrupts\n"
        "def listing(*args, **kwargs):\n"
        "    try:\n"
        f"        os.kill(os.getpid(), {int(sig)})\n"
        "        signal.pause()\n"
        "    except BaseException:\n"
        "        pass  # what a library's broad except does to the interrupt\n"
        "    raise AttributeError(\"module 'numpy' has no attribute 'matrix'\")\n"
        "presets.PresetsCommand.run = listing\n"
        "interrupts.install()\n"
        "sys.exit(cli.main(['presets']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr
    assert "internal error" not in done.stderr
    assert done.stderr.startswith("diagnose: ") and len(done.stderr.splitlines()) == 1
