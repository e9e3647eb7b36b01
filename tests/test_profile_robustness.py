"""`diagnose profile` of trainers that do what trainers do: write into the output folder, fork a
process that trains too, die by SIGKILL. Real trainers in real subprocesses.

- Clean-up after Ctrl-C or a failure removes exactly the files this run created: a trainer's own
  files in ``--out`` (a checkpoint's ``.tmp``, a ``traces/`` folder of its own) survive, and
  ``--force`` replaces only diagnose's outputs.
- A forked process that steps an optimizer (no torch.distributed) is a capture of its own, not a
  second rank 0: the run gets a record.
- A trainer killed by SIGKILL during its profiled steps keeps the steps timed before as measured.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and fork")

FAST = ["--skip-steps", "1", "--steps", "4", "--profile-steps", "2", "--no-stacks"]

#: A small real loop; what it does besides training comes from its command line.
TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    args = sys.argv[1:]
    out = args[args.index("--out") + 1] if "--out" in args else None
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 12
    kill_at = int(args[args.index("--kill-at") + 1]) if "--kill-at" in args else -1
    if out:  # a trainer that keeps its own files in the folder it was given
        os.makedirs(os.path.join(out, "traces"), exist_ok=True)
        with open(os.path.join(out, "traces", "mine.txt"), "w") as f:
            f.write("the trainer's own trace")
        with open(os.path.join(out, ".ckpt.tmp"), "w") as f:
            f.write("a checkpoint being written")

    def train(n):
        torch.manual_seed(os.getpid())
        model = torch.nn.Linear(32, 32)
        opt = torch.optim.AdamW(model.parameters())
        for step in range(n):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    if "--fork" in args:  # a child that trains too, without torch.distributed
        child = os.fork()
        if child == 0:
            train(steps)
            os._exit(0)
        train(steps)
        os.waitpid(child, 0)
    else:
        train(steps)
    if out:
        with open(os.path.join(out, "trainer-done"), "w") as f:
            f.write(str(os.getpid()))
    """
)


def _trainer(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAINER)
    return path


def _profile(tmp_path: Path, out: Path, *args: str, force: bool = False) -> list[str]:
    options = [*FAST, "--force"] if force else FAST
    return [
        *(sys.executable, "-m", "diagnose", "profile", "--out", str(out), *options),
        *("--", sys.executable, str(_trainer(tmp_path)), *args),
    ]


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_during_the_analysis_keeps_the_trainers_own_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own notes")  # found there: never ours to remove
    process = subprocess.Popen(
        _profile(tmp_path, out, "--out", str(out), force=True),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600  # ends a hang only: a busy machine may take minutes
    done = out / "trainer-done"
    while not (done.exists() and done.read_text() and _ended(int(done.read_text()))):
        assert process.poll() is None and time.monotonic() < deadline, "the trainer never ended"
        time.sleep(0.02)
    # The trainer has ended: diagnose reads its trace and runs its probes, for seconds.
    time.sleep(0.2)
    assert process.poll() is None, "diagnose ended before the signal"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    kept = _tree(out)
    assert kept.pop("traces/mine.txt") == b"the trainer's own trace"
    assert kept.pop(".ckpt.tmp") == b"a checkpoint being written"
    assert kept.pop("notes.txt") == b"the user's own notes"
    assert kept.pop("trainer-done")
    # Nothing of diagnose's is left half-written (no record, report, trace or capture).
    assert not kept, sorted(kept)
    assert {p.name for p in out.iterdir()} == {".ckpt.tmp", "notes.txt", "trainer-done", "traces"}


def test_force_into_a_folder_the_trainer_writes_replaces_only_diagnoses_outputs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    first = subprocess.run(_profile(tmp_path, out, "--out", str(out)), capture_output=True)
    assert first.returncode == 0, first.stderr[-2000:]
    before = _record(out)["created"]
    second = subprocess.run(
        _profile(tmp_path, out, "--out", str(out), force=True), capture_output=True
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert _record(out)["created"] >= before
    files = _tree(out)
    assert files["traces/mine.txt"] == b"the trainer's own trace"
    assert files[".ckpt.tmp"] == b"a checkpoint being written"
    assert {"record.json", "report.html", "trace.json.gz"} <= set(files)


def test_a_forked_child_that_trains_is_its_own_capture_not_a_second_rank_0(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        _profile(tmp_path, out, "--fork"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = _record(out)
    assert record["timing"]["unprofiled"]["n"] == 4
    assert not record["ranks"]  # one process's steps, not a job of two ranks
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    own = capture["data"]["separate_captures"]
    assert len(own) == 1 and own[0]["pid"] != capture["data"]["ranks"]["0"]["pid"]
    assert any("its own capture" in note for note in record["notes"]), record["notes"]
    # Its trace is kept beside the record, for `diagnose trace` to read on its own.
    kept = out / own[0]["trace"]
    assert kept.is_file() and kept.parent == out


def test_steps_timed_before_a_sigkill_stay_measured(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Killed in its first profiled step: skip 1, time 4, probe 1, then the profiled steps.
    done = subprocess.run(
        _profile(tmp_path, out, "--kill-at", "6"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-2000:]
    record = _record(out)
    assert record["timing"]["unprofiled"]["n"] == 4, record["timing"]["unprofiled"]
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    steps = next(c for c in capture["checks"] if c["id"] == "profile.steps_captured")
    assert "killed" in steps["text"] and "4 step(s) timed" in steps["text"], steps
    assert "no step was timed" not in (out / "report.html").read_text()
    assert "no step was timed" not in done.stdout
