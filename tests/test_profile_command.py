"""`diagnose profile -- CMD`: the user's own script, run unmodified, analysed end to end.

The scripts are real training loops (a small MLP, AdamW, a real DataLoader) run in real child
processes through the CLI; the capture layer itself is tested in test_profile_capture.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.profile.claims import precision_claim
from diagnose.profile.launch import LaunchResult, RankCapture
from diagnose.sampling import find_py_spy

needs_py_spy = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")


def _may_read_other_processes() -> bool:
    """Whether py-spy may read a DataLoader worker forked by the process that started it."""
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    import os

    return os.geteuid() == 0 or not scope.exists() or scope.read_text().strip() == "0"


# A loop that says --mixed_precision on its command line; --ignore-precision plants the fault
# trainers have: the flag is parsed but never reaches the autocast.
TRAIN = textwrap.dedent(
    """
    import sys, time, torch
    from torch.utils.data import DataLoader, Dataset
    torch.manual_seed(0)
    args = sys.argv[1:]
    decode_s = float(args[args.index("--decode-ms") + 1]) / 1000 if "--decode-ms" in args else 0.004
    # --work-ms: CPU time the step itself spends, so a window of steps outlasts py-spy's attach
    # however fast this machine runs the small model.
    work_s = float(args[args.index("--work-ms") + 1]) / 1000 if "--work-ms" in args else 0.0

    class Images(Dataset):
        # --slow-loader plants a decode that costs more than the step, on the training thread
        # (CPU work, as decoding is: py-spy samples running threads).
        def __init__(self):
            self.x = torch.randn(256, 64)
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            if "--slow-loader" in args:
                end = time.perf_counter() + decode_s
                while time.perf_counter() < end:
                    pass
            return (self.x[i],)

    # Enough compute per step that an ordinary loader's own cost is a small share of it.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 64),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 0
    data = DataLoader(Images(), batch_size=16, shuffle=True, num_workers=workers)
    asked = args[args.index("--mixed_precision") + 1] if "--mixed_precision" in args else "no"
    low = asked == "bf16" and "--ignore-precision" not in args
    step = 0
    while step < 20:
        for (x,) in data:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            busy_until = time.perf_counter() + work_s
            while time.perf_counter() < busy_until:
                pass
            opt.step()
            opt.zero_grad()
            step += 1
            if step == 20:
                break
    print("trained", step, "loss", repr(loss.item()))
    sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args else 0)
    """
)
FAST = ["--skip-steps", "1", "--steps", "4", "--profile-steps", "2"]


def _script(folder: Path, text: str = TRAIN, name: str = "train.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _profile(out: Path, *command: str, options: list[str] = FAST) -> int:
    return main(["profile", "--out", str(out), *options, "--", *command])


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def ignored_flag(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    folder = tmp_path_factory.mktemp("ignored")
    script = _script(folder)
    out = folder / "out"
    # Two independent faults: a flag that never reaches the autocast, and a slow loader.
    faults = ["--mixed_precision", "bf16", "--ignore-precision", "--slow-loader"]
    # Profiled steps enough for py-spy, which attaches while they run, to sample the loader.
    options = [*FAST[:-1], "6"]
    code = _profile(out, sys.executable, str(script), *faults, options=options)
    return code, out


@pytest.fixture(scope="module")
def applied_flag(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    folder = tmp_path_factory.mktemp("applied")
    script = _script(folder)
    out = folder / "out"
    # Its steps would be short on a fast machine: each spends some CPU time of its own, so that
    # the profiled window outlasts py-spy's attach, which a count of steps alone cannot promise.
    options = [*FAST[:-1], "12"]
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = _profile(
            out,
            sys.executable,
            str(script),
            "--mixed_precision",
            "bf16",
            "--work-ms",
            "40",
            "--exit",
            "3",
            options=options,
        )
    (folder / "diagnose-stderr.txt").write_text(said.getvalue())
    return code, out


# --------------------------------------------------------------------------------------------
# The command line's claims


@pytest.mark.parametrize(
    ("argv", "dtype", "said"),
    [
        (
            ["accelerate", "launch", "--mixed_precision", "bf16", "t.py"],
            "bf16",
            "--mixed_precision bf16",
        ),
        (["python", "t.py", "--mixed_precision=fp16"], "fp16", "--mixed_precision=fp16"),
        (["python", "t.py", "--mixed_precision", "no"], "fp32", "--mixed_precision no"),
        (
            ["python", "fit.py", "--trainer.precision", "bf16-mixed"],
            "bf16",
            "--trainer.precision bf16-mixed",
        ),
        (["python", "run.py", "--bf16"], "bf16", "--bf16"),
        (["python", "t.py", "--full_fp16"], "fp16", "--full_fp16"),
        # A later flag overrides an earlier one, as argparse reads them.
        (
            ["python", "t.py", "--mixed_precision", "fp16", "--mixed_precision", "bf16"],
            "bf16",
            "--mixed_precision bf16",
        ),
    ],
)
def test_precision_claims_in_the_trainers_flags(argv: list[str], dtype: str, said: str) -> None:
    claim = precision_claim(argv)
    assert claim is not None and (claim.dtype, claim.said) == (dtype, said)


def test_a_command_without_a_precision_flag_claims_none() -> None:
    assert precision_claim(["python", "train.py", "--lr", "1e-4", "--precision_note"]) is None
    assert precision_claim(["python", "train.py", "--mixed_precision"]) is None


# --------------------------------------------------------------------------------------------
# End to end


def test_a_flag_that_never_reaches_the_autocast_is_found(ignored_flag: tuple[int, Path]) -> None:
    code, out = ignored_flag
    assert code == 0
    record = _record(out)
    assert record["mode"] == "profile"
    assert "--ignore-precision" in record["command"]
    # The s/it is the steps timed without the profiler; the trace's steps stay profiled samples.
    assert record["timing"]["unprofiled"]["n"] == 4
    assert record["timing"]["profiled"]["n"] >= 1
    assert (out / "trace.json.gz").is_file() and not (out / ".diagnose-capture").exists()
    findings = {f["id"]: f for f in record["findings"]}
    fp32 = findings["precision.fp32_training"]
    assert "--mixed_precision bf16" in fp32["title"]
    assert "did not reach the training step" in fp32["fix"]
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    assert capture["data"]["precision_claim"] == {"dtype": "bf16", "said": "--mixed_precision bf16"}
    assert record["config"]["precision"] == "fp32"
    assert record["config"]["optimizer"] == "AdamW" and record["config"]["batch"] == 16
    assert "your command, profiled" in (out / "report.html").read_text()


def test_the_slow_loader_is_found_and_its_twin_stays_quiet(
    ignored_flag: tuple[int, Path], applied_flag: tuple[int, Path]
) -> None:
    slow = {f["id"]: f for f in _record(ignored_flag[1])["findings"]}
    assert "dataloader.gpu_starved" in slow
    assert "dataloader.gpu_starved" not in {f["id"] for f in _record(applied_flag[1])["findings"]}
    # What the capture saw of the loader is kept for the report's reader.
    capture = next(p for p in _record(ignored_flag[1])["probes"] if p["name"] == "capture")
    loaders = capture["data"]["ranks"]["0"]["dataloaders"]
    assert [(d["num_workers"], d["batch_size"]) for d in loaders] == [(0, 16)]


def _capture_data(out: Path) -> dict[str, Any]:
    record = _record(out)
    return next(p for p in record["probes"] if p["name"] == "capture")["data"]  # type: ignore[no-any-return]


@needs_py_spy
def test_py_spy_names_the_slow_loading_code_and_not_in_the_twin(
    ignored_flag: tuple[int, Path], applied_flag: tuple[int, Path]
) -> None:
    starved = next(
        f for f in _record(ignored_flag[1])["findings"] if f["id"] == "dataloader.gpu_starved"
    )
    hot = starved["evidence"]["hot_frames"][0]
    assert hot["function"] == "Images.__getitem__" and hot["file"] == "train.py"
    assert hot["share"] > 0.5 and hot["by_role"] == {"main": hot["samples"]}
    assert "Images.__getitem__ (train.py:" in starved["detail"]
    # The twin's loader is cheap: the training step, not the loader, is what runs.
    twin = _capture_data(applied_flag[1])["stacks"]
    assert twin["all"]["samples"] > 0
    assert twin["loading"]["samples"] < twin["all"]["samples"] / 4
    # The samples of the capture's own hooks (the probe step) are left out.
    functions = {f["file"] for f in twin["all"]["top_frames"]}
    assert not any("diagnose/profile" in name for name in functions)


@needs_py_spy
@pytest.mark.skipif(not _may_read_other_processes(), reason="ptrace is restricted here")
def test_py_spy_follows_the_dataloader_workers(tmp_path: Path) -> None:
    script = _script(tmp_path)
    out = tmp_path / "out"
    # py-spy finds the workers some tenths of a second after it attaches: a slow loader and
    # profiled steps enough to outlast that.
    slow = ["--slow-loader", "--decode-ms", "8", "--workers", "2"]
    code = _profile(out, sys.executable, str(script), *slow, options=[*FAST[:-1], "12"])
    assert code == 0
    stacks = _capture_data(out)["stacks"]
    assert stacks["loading"]["processes"].get("worker", 0) >= 1
    top = stacks["loading"]["top_frames"][0]
    assert top["function"] == "Images.__getitem__" and set(top["by_role"]) == {"worker"}


def test_no_stacks_leaves_py_spy_out_and_says_so(tmp_path: Path) -> None:
    script = _script(tmp_path)
    out = tmp_path / "out"
    assert _profile(out, sys.executable, str(script), options=[*FAST, "--no-stacks"]) == 0
    assert "not sampled" in _capture_data(out)["stacks"]["error"]
    assert "Not sampled" in (out / "report.html").read_text()


def test_the_training_result_is_unchanged(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The hooks only read: the loss after the last step is the same bit for bit."""
    script = _script(tmp_path)
    plain = subprocess.run(
        [sys.executable, str(script), "--mixed_precision", "bf16"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    capfd.readouterr()
    assert _profile(tmp_path / "out", sys.executable, str(script), "--mixed_precision", "bf16") == 0
    profiled = capfd.readouterr().out
    loss = plain.split("loss", 1)[1].split()[0]
    assert f"loss {loss}" in profiled


def test_its_twin_with_the_flag_applied_stays_quiet_and_keeps_the_exit_code(
    applied_flag: tuple[int, Path],
) -> None:
    code, out = applied_flag
    assert code == 3  # the script's own exit code, with the outputs written
    said = (out.parent / "diagnose-stderr.txt").read_text()
    assert "the command exited with code 3 after its steps were captured: the report stands" in said
    record = _record(out)
    assert "precision.fp32_training" not in {f["id"] for f in record["findings"]}
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    claim = next(c for c in capture["checks"] if c["id"] == "profile.precision_claim")
    assert claim["outcome"] == "ok" and "autocast bf16" in claim["text"]
    assert record["config"]["precision"] == "bf16-mixed"
    # The parent samples the GPU a rank trains on; a CPU rank has none, and the record says so.
    during = record["inventory"]["telemetry"]["during_steps"]
    assert during["available"] is False and "cpu device" in during["reason"]


def test_how_the_command_ended_is_said_with_whether_its_steps_were_captured(
    tmp_path: Path,
) -> None:
    """A torchrun job whose rank torch aborts at exit after its work is done (gloo does, now and
    then) ends by a signal or a failing status with complete captures: the line says the report
    stands; a capture cut short does not get that line."""

    def ended(returncode: int, *statuses: str) -> str:
        captures = [
            RankCapture(rank, 100 + rank, status, tmp_path / f"rank{rank}.json", None, {})
            for rank, status in enumerate(statuses)
        ]
        result = LaunchResult(("torchrun",), returncode, captures, [], False, None, 1.0)
        return result.ending()

    stands = "after its steps were captured: the report stands"
    aborted = ended(-int(signal.SIGABRT), "complete", "complete")
    assert aborted == f"the command was ended by SIGABRT {stands}"
    assert ended(1, "complete", "complete") == f"the command exited with code 1 {stands}"
    cut = ended(-int(signal.SIGKILL), "complete", "partial: the process was killed")
    assert cut == "the command was ended by SIGKILL"
    assert ended(7) == "the command exited with code 7"


def test_a_command_that_fails_before_its_first_step_writes_nothing(tmp_path: Path) -> None:
    script = _script(tmp_path, "import torch, sys\nsys.exit(7)\n", "broken.py")
    out = tmp_path / "out"
    assert _profile(out, sys.executable, str(script)) == 7
    assert not out.exists()


def test_a_script_that_never_steps_an_optimizer_is_stopped_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "import time, torch\ntime.sleep(60)\n", "idle.py")
    out = tmp_path / "out"
    code = _profile(out, sys.executable, str(script), options=[*FAST, "--timeout", "4"])
    assert code == 3
    assert "no optimizer step in 4 s" in capsys.readouterr().err
    assert not out.exists()


def test_too_few_steps_to_time_any_is_nothing_captured_and_says_what_to_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diagnose.errors import ExitCode

    two_steps = _script(
        tmp_path,
        "import torch\n"
        "m = torch.nn.Linear(8, 8)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    m(torch.randn(4, 8)).sum().backward(); o.step(); o.zero_grad()\n",
        "two.py",
    )
    out = tmp_path / "out"
    code = _profile(out, sys.executable, str(two_steps), options=["--skip-steps", "5"])
    assert code == ExitCode.NOTHING_CAPTURED == 10
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith("diagnose: the command made 2 optimizer steps"), said
    assert "--skip-steps 1" in said and said.endswith("nothing was written")
    assert not out.exists()
    # Its twin, told to skip one: a step is timed and the outputs are written.
    assert _profile(out, sys.executable, str(two_steps), options=["--skip-steps", "1"]) == 0
    assert _record(out)["timing"]["unprofiled"]["n"] >= 1


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["profile", "--out", str(tmp_path / "out")]) == 2
    assert main(["profile", "--out", str(tmp_path / "out"), "--"]) == 2


DDP = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(16):
        if dist.get_rank() == 1 and "--straggle" in sys.argv:
            time.sleep(0.05)  # the planted straggler: its data comes late every step
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()  # else torch's gloo now and then aborts a rank at exit
    dist.destroy_process_group()
    # Even so, torch's gloo aborts a rank at interpreter exit now and then ("terminate called
    # without an active exception"; plain torchrun of this script, no diagnose: 2 runs in 12).
    # The capture was complete many steps ago; leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def test_every_rank_of_a_torchrun_job_is_captured_and_the_straggler_named(tmp_path: Path) -> None:
    script = _script(tmp_path, DDP, "ddp.py")
    out = tmp_path / "out"
    # --force into the folder of an earlier, four-rank profile: its ranks 2 and 3 and its single
    # trace must not be read as this job's; a file of the user's there stays.
    (out / "traces").mkdir(parents=True)
    for stale in ("rank2.pt.trace.json.gz", "rank3-pid7.pt.trace.json.gz"):
        (out / "traces" / stale).write_bytes(b"earlier")
    (out / "traces" / "notes.txt").write_text("mine")
    (out / "trace.json.gz").write_bytes(b"earlier")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    code = _profile(
        out,
        *torchrun,
        "--nproc_per_node",
        "2",
        str(script),
        "--straggle",
        options=[*FAST, "--force"],
    )
    assert code == 0
    record = _record(out)
    assert sorted(r["rank"] for r in record["ranks"]) == [0, 1]
    assert sorted(p.name for p in (out / "traces").iterdir()) == [
        "notes.txt",
        "rank0.pt.trace.json.gz",
        "rank1.pt.trace.json.gz",
    ]
    assert not (out / "trace.json.gz").exists()
    (out / "traces" / "notes.txt").unlink()
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    assert sorted(capture["data"]["ranks"]) == ["0", "1"]
    if find_py_spy() is not None:
        # Each rank ran its own py-spy; its steps are too short to be sure of samples, so the
        # rank's table holds either its frames or why there are none.
        for rank in capture["data"]["ranks"].values():
            stacks = rank["stacks"]
            assert "all" in stacks or stacks["error"], stacks
    straggler = next(f for f in record["findings"] if f["id"] == "distributed.straggler")
    assert straggler["title"].startswith("Rank 1 is the straggler")
    # The folder of rank traces reads again on its own, as `diagnose trace` input.
    assert main(["trace", str(out / "traces"), "--out", str(tmp_path / "again")]) == 0


def test_a_balanced_torchrun_job_names_no_straggler(tmp_path: Path) -> None:
    script = _script(tmp_path, DDP, "ddp.py")
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert _profile(out, *torchrun, "--nproc_per_node", "2", str(script)) == 0
    record = _record(out)
    assert sorted(r["rank"] for r in record["ranks"]) == [0, 1]
    assert not [f for f in record["findings"] if f["id"] == "distributed.straggler"]
    checks = [c for p in record["probes"] for c in p["checks"]]
    (straggler,) = [c for c in checks if c["id"] == "distributed.straggler"]
    # Found fine, or not judged when the shared machine's noise is larger than any gap.
    assert straggler["outcome"] in ("ok", "not_judged"), straggler


def _timed_steps(capture: Path) -> int:
    """Steps a capture file has timed so far (0 before it is written, or while it is)."""
    try:
        facts = json.loads(capture.read_text())
    except (OSError, ValueError):
        return 0
    return len(facts.get("timed_step_s") or [])


def test_ctrl_c_reaches_the_trainer_and_what_was_timed_is_written(tmp_path: Path) -> None:
    import signal
    import time

    script = _script(
        tmp_path,
        "import time, torch\n"
        "m = torch.nn.Linear(8, 8)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(10_000):\n"
        "    m(torch.randn(4, 8)).sum().backward(); o.step(); o.zero_grad(); time.sleep(0.05)\n",
        "forever.py",
    )
    out = tmp_path / "out"
    command = [sys.executable, "-m", "diagnose", "profile", "--out", str(out), "--skip-steps", "1"]
    process = subprocess.Popen(
        [*command, "--steps", "1000", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Ctrl-C once three steps are timed, however long a busy machine takes to time them (the
    # capture rewrites its facts after each timed step); the deadline only ends a hang.
    capture = out / ".diagnose-capture" / "rank0.capture.json"
    deadline = time.monotonic() + 600
    while _timed_steps(capture) < 3:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    record = _record(out)
    assert record["timing"]["unprofiled"]["n"] >= 3 and record["timing"]["profiled"]["n"] == 0
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    steps = next(c for c in capture["checks"] if c["id"] == "profile.steps_captured")
    assert steps["outcome"] == "not_judged" and "interrupted" in steps["text"]
    assert not (out / ".diagnose-capture").exists()


# What the profiled command sees of the hub's offline switches, written before it trains.
SEES_ITS_ENVIRONMENT = textwrap.dedent(
    """
    import json, os, sys, torch
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    with open(sys.argv[1], "w") as handle:
        json.dump({name: os.environ.get(name) for name in names}, handle)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(8):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    """
)


def test_diagnose_stays_offline_and_the_trainer_keeps_the_users_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from diagnose.offline import hub_offline, user_environ

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")  # the user's own choice, for their trainer
    # diagnose's own process: every switch on for the command, then as it was.
    with hub_offline():
        assert all(os.environ[n] == "1" for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
        users = user_environ()
        assert "HF_HUB_OFFLINE" not in users and users["TRANSFORMERS_OFFLINE"] == "0"
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    # The trainer and the record's environment are the user's.
    seen = tmp_path / "seen.json"
    out = tmp_path / "out"
    script = _script(tmp_path, SEES_ITS_ENVIRONMENT, "sees.py")
    assert _profile(out, sys.executable, str(script), str(seen)) == 0
    assert json.loads(seen.read_text()) == {
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": None,
    }
    env = _record(out)["inventory"]["env"]
    assert "HF_HUB_OFFLINE" not in env and env.get("TRANSFORMERS_OFFLINE") == "0"
