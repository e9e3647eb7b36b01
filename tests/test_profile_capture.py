"""``diagnose profile``'s capture layer on real training scripts (no mocks).

Each scenario writes nothing but a small training script, runs it through
:func:`diagnose.profile.launch.launch_profiled` (a real subprocess, the bootstrap injected through
``PYTHONPATH``) and checks what came back. Every process imports torch (several seconds on a
2-core machine), so the scenarios the selected tests need are started together, up to three at a
time, as soon as the first test asks for one; each test then waits for its own.

Why one file: the tests share that one pool of real subprocess runs; split, each file would
start its own scenarios and lose the overlap that keeps the module's wall time down.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diagnose.profile import capture_contract
from diagnose.profile.launch import (
    BOOTSTRAP_DIR,
    CaptureOptions,
    LaunchResult,
    RankCapture,
    capture_environment,
    launch_profiled,
    read_captures,
)
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and sessions")

#: Small phases keep every run to a few dozen tiny steps.
QUICK = CaptureOptions(skip_steps=2, timed_steps=4, profiled_steps=2)

TRAIN = """
import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--marker")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--say")
parser.add_argument("--optimizer", default="adamw")
parser.add_argument("--autocast", action="store_true")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--context")
parser.add_argument("--fail-before-step", action="store_true")
parser.add_argument("--no-optimizer", action="store_true")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--print-steps", action="store_true")
parser.add_argument("--ddp", action="store_true")


def main():
    args = parser.parse_args()
    if args.say:
        print(args.say, flush=True)
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    if args.no_optimizer:
        print("no optimizer here", flush=True)
        while True:
            time.sleep(0.1)
    if args.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=16)
    elif args.optimizer == "lbfgs":
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.fail_before_step:
        raise RuntimeError("the trainer fails before its first step")
    data = TensorDataset(torch.randn(16 * args.steps, 16), torch.randn(16 * args.steps, 1))
    loader = DataLoader(
        data,
        batch_size=4,
        shuffle=True,
        num_workers=args.workers,
        multiprocessing_context=args.context if args.workers else None,
    )
    step = 0
    while step < args.steps:
        for x, y in loader:
            def closure():
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                return loss

            if args.optimizer == "lbfgs":
                optimizer.step(closure)
            else:
                closure()
                optimizer.step()
            step += 1
            if args.print_steps:
                print(f"step {step}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
    if args.ddp:
        # Without the barrier, torch's gloo now and then aborts one rank at exit ("terminate
        # called without an active exception"), with or without diagnose around it.
        dist.barrier()
        dist.destroy_process_group()
    if args.marker:
        with open(args.marker, "w") as handle:
            handle.write("trained to the end")
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
"""

#: A sitecustomize of the user's, which ours shadows: it must still run.
USER_SITECUSTOMIZE = """
import os
with open(os.environ["USER_SITECUSTOMIZE_MARKER"], "a") as handle:
    handle.write(f"{os.getpid()}\\n")
"""

#: Runs launch_profiled in a process of its own, so that the test can signal it.
LAUNCHER = """
import json
import sys
from pathlib import Path

from diagnose.profile.launch import CaptureOptions, launch_profiled

options = CaptureOptions(skip_steps=2, timed_steps=200, profiled_steps=2)
result = launch_profiled(sys.argv[3:], Path(sys.argv[1]), options)
Path(sys.argv[2]).write_text(json.dumps({
    "returncode": result.returncode,
    "exit_code": result.exit_code,
    "statuses": [c.status for c in result.captures],
    "timed": [len(c.timed_step_s) for c in result.captures],
    "forwarded": list(result.signals_forwarded),
}))
sys.exit(result.exit_code)
"""


@dataclass
class Run:
    """One scenario's outcome and the files it used."""

    result: LaunchResult
    folder: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def marker(self) -> Path:
        return self.folder / "marker"

    @property
    def only(self) -> RankCapture:
        assert len(self.result.captures) == 1, self.result
        return self.result.captures[0]


def _env(**extra: str) -> dict[str, str]:
    # One thread per process: several scenarios share two cores.
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)


def _launch(
    folder: Path,
    args: list[str],
    options: CaptureOptions = QUICK,
    *,
    prefix: list[str] | None = None,
    **kwargs: Any,
) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "train.py"
    script.write_text(TRAIN)
    command = [*(prefix or [sys.executable]), str(script), "--marker", str(folder / "marker")]
    with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
        kwargs.setdefault("env", _env())
        result = launch_profiled(
            [*command, *args],
            folder / "capture",
            options,
            stdout=out,
            stderr=err,
            cwd=folder,
            **kwargs,
        )
    return Run(result, folder)


def _plain(folder: Path) -> Run:
    return _launch(folder, ["--steps", "20"])


def _transparent(folder: Path) -> Run:
    """Exit code 3, a line on stdout, a sitecustomize of the user's own, and autocast (the twin of
    the plain loop)."""
    user_site = folder / "user-site"
    user_site.mkdir(parents=True)
    (user_site / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    site_marker = folder.parent / f"{folder.name}-sitecustomize.txt"
    env = _env(PYTHONPATH=str(user_site), USER_SITECUSTOMIZE_MARKER=str(site_marker))
    args = ["--steps", "20", "--exit-code", "3", "--say", "hello from the trainer", "--autocast"]
    run = _launch(folder, args, env=env)
    run.extra["site_marker"] = site_marker
    return run


def _fails(folder: Path) -> Run:
    return _launch(folder, ["--fail-before-step"])


#: The no-optimizer trainer's timeout: long enough for it to import torch and say so first on a
#: busy machine (three scenarios run at once beside whatever else does).
NO_OPTIMIZER_TIMEOUT_S = 30


#: How long the trainer may take to end after the timeout's SIGINT before SIGTERM follows: a
#: torch process's exit (the traceback, atexit, the interpreter's teardown) is slow beside busy
#: processes, and only a process still alive after it meets SIGTERM.
NO_OPTIMIZER_GRACE_S = 20


def _no_optimizer(folder: Path) -> Run:
    start = time.monotonic()
    run = _launch(
        folder,
        ["--no-optimizer"],
        timeout_s=NO_OPTIMIZER_TIMEOUT_S,
        grace_s=NO_OPTIMIZER_GRACE_S,
    )
    run.extra["seconds"] = time.monotonic() - start
    return run


def _stop_after(folder: Path) -> Run:
    """With forked DataLoader workers, which must not outlive the stop either."""
    options = CaptureOptions(skip_steps=2, timed_steps=4, profiled_steps=2, stop_after=True)
    return _launch(folder, ["--steps", "40", "--workers", "2", "--context", "fork"], options)


def _ddp(folder: Path) -> Run:
    options = CaptureOptions(skip_steps=1, timed_steps=3, profiled_steps=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    prefix = [*torchrun, "--nproc_per_node", "2"]
    return _launch(folder, ["--steps", "12", "--ddp"], options, prefix=prefix)


def _spawn_workers(folder: Path) -> Run:
    options = CaptureOptions(skip_steps=1, timed_steps=3, profiled_steps=1)
    return _launch(folder, ["--steps", "12", "--workers", "2", "--context", "spawn"], options)


def _bnb(folder: Path) -> Run:
    return _launch(folder, ["--steps", "14", "--optimizer", "adamw8bit"])


def _lbfgs(folder: Path) -> Run:
    return _launch(folder, ["--steps", "14", "--optimizer", "lbfgs"])


def _interrupted(folder: Path) -> Run:
    """Ctrl-C to the launcher (its own process) once the trainer is in the timed phase."""
    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text(TRAIN)
    report = folder / "result.json"
    trainer = [sys.executable, str(script), "--steps", "100000", "--sleep", "0.05"]
    command = [sys.executable, "-c", LAUNCHER, str(folder / "capture"), str(report), *trainer]
    with (folder / "stderr.txt").open("wb") as err:
        launcher = subprocess.Popen(
            [*command, "--print-steps"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO_ROOT,
            env=_env(PYTHONPATH=str(REPO_ROOT)),
        )
        assert launcher.stdout is not None
        # 2 steps skipped: step 6 ends the 4th timed step (however long a busy machine takes
        # to get there; the launcher's end ends the loop too).
        for line in launcher.stdout:
            if line.strip() == "step 6":
                break
        launcher.send_signal(signal.SIGINT)
        try:
            rest, _ = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Say where it stuck (what the processes wrote, which signals the trainers ignore)
            # rather than only that it did. The trainers lead sessions of their own and hold the
            # launcher's stdout: they are ended too, or reading that pipe to its end waits on them.
            written = sorted(p.name for p in (folder / "capture").glob("*") if p.is_file())
            ignored = {}
            for status in (folder / "capture").glob("process-*.json"):
                pid = int(status.stem.removeprefix("process-"))
                with contextlib.suppress(OSError):
                    ignored[pid] = _ignored_signals(pid)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            launcher.kill()
            launcher.communicate(timeout=30)
            pytest.fail(
                f"the launcher outlived its SIGINT by 60 s; capture files: {written}; signals "
                f"each trainer ignored: {ignored}; stderr: "
                f"{(folder / 'stderr.txt').read_text()[-2000:]}"
            )
    result = launch_result_from(report)
    return Run(result, folder, {"launcher_returncode": launcher.returncode, "stdout": rest})


def _ignored_signals(pid: int) -> list[str]:
    """The signals a live process ignores (Linux's /proc: the SigIgn mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            named = (s for s in signal.valid_signals() if isinstance(s, signal.Signals))
            return [s.name for s in named if mask >> (s - 1) & 1]
    return []


def launch_result_from(report: Path) -> LaunchResult:
    data = json.loads(report.read_text())
    captures = read_captures(report.parent / "capture")
    return LaunchResult(
        command=(),
        returncode=data["returncode"],
        captures=captures,
        processes=[],
        timed_out=False,
        message=None,
        seconds=0.0,
        signals_forwarded=tuple(data["forwarded"]),
    )


#: Longest first, so that the pool ends together.
SCENARIOS: dict[str, Callable[[Path], Run]] = {
    "ddp": _ddp,
    "spawn": _spawn_workers,
    "no_optimizer": _no_optimizer,
    "bnb": _bnb,
    "interrupted": _interrupted,
    "plain": _plain,
    "transparent": _transparent,
    "stop_after": _stop_after,
    "fails": _fails,
    "lbfgs": _lbfgs,
}

#: Which scenarios each test reads (only the selected tests' scenarios run).
NEEDS: dict[str, tuple[str, ...]] = {
    "test_plain_loop_is_captured_and_trains_on": ("plain",),
    "test_exit_code_and_output_are_the_trainers": ("transparent",),
    "test_failure_before_the_first_step": ("fails",),
    "test_no_optimizer_step_times_out": ("no_optimizer",),
    "test_stop_after_ends_the_process_once_captured": ("stop_after",),
    "test_torchrun_two_ranks": ("ddp",),
    "test_dataloader_workers_are_not_ranks": ("spawn", "stop_after"),
    "test_bitsandbytes_8bit_optimizer_marks_steps": ("bnb",),
    "test_lbfgs_with_a_closure_marks_steps": ("lbfgs",),
    "test_autocast_is_recorded": ("transparent", "plain"),
    "test_users_sitecustomize_still_runs": ("transparent",),
    "test_ctrl_c_reaches_the_trainer_and_keeps_what_was_measured": ("interrupted",),
}


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Run]]]:
    module = sys.modules[__name__]
    selected = {
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if getattr(item, "module", None) is module
    }
    wanted = [name for name in SCENARIOS if any(name in NEEDS.get(t, ()) for t in selected)]
    if "bnb" in wanted and importlib.util.find_spec("bitsandbytes") is None:
        wanted.remove("bnb")
    base = tmp_path_factory.mktemp("profile")
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {name: pool.submit(SCENARIOS[name], base / name) for name in wanted}


def _get(runs: dict[str, Future[Run]], name: str) -> Run:
    return runs[name].result(timeout=300)


def _trace_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- the tests ---------------------------------------------------------------------------------


def test_plain_loop_is_captured_and_trains_on(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "plain")
    assert run.result.returncode == 0
    assert run.result.message is None and not run.result.timed_out
    facts = run.only.facts
    assert run.only.status == "complete"
    assert run.only.rank == 0 and facts["world_size"] == 1
    assert len(facts["timed_step_s"]) == QUICK.timed_steps
    assert all(s > 0 for s in facts["timed_step_s"])
    assert len(facts["profiled_step_s"]) == QUICK.profiled_steps
    assert facts["steps_seen"] == QUICK.steps_needed  # the hooks stop counting once done
    assert facts["first_step_s"] > 0
    assert facts["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert facts["optimizer"]["state_dtypes"]["exp_avg"] == {
        "float32": {"count": 4, "elements": 577}
    }
    assert facts["parameters"]["trainable"]["grads"] == {"float32": {"count": 4, "elements": 577}}
    assert facts["parameters"]["roots"] == ["torch.nn.modules.container.Sequential"]
    assert facts["device"]["kind"] == "cpu"
    (loader,) = facts["dataloaders"]
    assert loader["num_workers"] == 0 and loader["batch_size"] == 4
    assert loader["iterated_during_capture"]
    # The trace: one ProfilerStep per profiled step, each holding its optimizer step whole.
    assert run.only.trace_path == run.folder / "capture" / "rank0.pt.trace.json.gz"
    events = _trace_events(run.only.trace_path)
    steps = sorted(
        (e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]
    )
    assert [e["name"] for e in steps] == ["ProfilerStep#1", "ProfilerStep#2"]
    optimizer_steps = [e for e in events if e["name"].startswith("Optimizer.step#AdamW")]
    for step in steps:
        inside = [
            o
            for o in optimizer_steps
            if step["ts"] <= o["ts"] and o["ts"] + o["dur"] <= step["ts"] + step["dur"]
        ]
        assert len(inside) == 1, step
    # Training went on to its natural end, and the processes' files are all there is.
    assert run.marker.read_text() == "trained to the end"
    names = sorted(p.name for p in (run.folder / "capture").iterdir())
    assert names == sorted(
        [f"process-{run.only.pid}.json", "rank0.capture.json", "rank0.pt.trace.json.gz"]
    )


def test_exit_code_and_output_are_the_trainers(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "transparent")
    assert run.result.returncode == 3 and run.result.exit_code == 3
    assert "hello from the trainer" in (run.folder / "stdout.txt").read_text()
    assert run.only.status == "complete"
    assert run.marker.exists()


def test_users_sitecustomize_still_runs(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "transparent")
    pids = run.extra["site_marker"].read_text().split()
    assert pids == [str(run.only.pid)]  # once, in the trainer, with ours in front
    assert run.only.status == "complete"


def test_failure_before_the_first_step(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "fails")
    assert run.result.returncode == 1  # Python's exit status for an uncaught exception
    assert run.result.captures == []
    assert not list((run.folder / "capture").glob("rank*"))
    assert run.result.message is not None
    assert run.result.message.startswith(
        "no optimizer step was seen (the command exited with code 1)"
    )
    assert "torch.optim.adamw.AdamW" in run.result.message and "never stepped" in run.result.message
    (process,) = run.result.processes
    assert process.optimizers_built == 1 and not process.stepped


def test_no_optimizer_step_times_out(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "no_optimizer")
    result = run.result
    assert result.timed_out and result.captures == []
    said = f"no optimizer step in {NO_OPTIMIZER_TIMEOUT_S} s"
    assert result.message is not None and result.message.startswith(said)
    # SIGINT became a KeyboardInterrupt in time.sleep; Python then dies of SIGINT.
    assert result.returncode == -signal.SIGINT and result.exit_code == 130
    # Stopped at the timeout, not left to sleep forever (the slack is a busy machine's).
    assert run.extra["seconds"] < NO_OPTIMIZER_TIMEOUT_S + NO_OPTIMIZER_GRACE_S + 60
    assert result.processes, "the trainer had imported torch by then"
    assert "no optimizer was built" in result.message
    assert not any(_alive(p.pid) for p in result.processes)
    assert "no optimizer here" in (run.folder / "stdout.txt").read_text()


def test_stop_after_ends_the_process_once_captured(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "stop_after")
    assert run.result.returncode == 0
    assert run.only.status == "complete"
    assert run.only.trace_path is not None
    assert run.only.facts["steps_seen"] == QUICK.steps_needed
    assert not run.marker.exists(), "the trainer ran on after the capture"


def test_torchrun_two_ranks(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "ddp")
    said = (run.folder / "stderr.txt").read_text()
    # gloo now and then aborts a rank in its own teardown ("terminate called without an active
    # exception"), after both ranks met at the trainer's last barrier (the marker): torch's, not
    # the capture's (a plain torchrun of a gloo DDP loop, no diagnose, aborted 2 in 12 runs
    # without torch.profiler and 1 in 12 with it). Any other failure fails.
    torch_teardown_abort = run.marker.exists() and "terminate called without an active" in said
    assert run.result.returncode == 0 or torch_teardown_abort, said
    assert [c.rank for c in run.result.captures] == [0, 1]
    for one in run.result.captures:
        assert one.status == "complete"
        assert one.facts["world_size"] == 2 and one.facts["local_rank"] == one.rank
        assert len(one.facts["timed_step_s"]) == 3
        assert (
            one.trace_path is not None and one.trace_path.name == f"rank{one.rank}.pt.trace.json.gz"
        )
        names = {e["name"] for e in _trace_events(one.trace_path)}
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names
    # The torchrun launcher imported torch too, but is no rank.
    (launcher,) = [p for p in run.result.processes if not p.stepped]
    assert "--nproc_per_node" in launcher.argv
    assert sum(p.stepped for p in run.result.processes) == 2


@pytest.mark.parametrize(("context", "scenario"), [("spawn", "spawn"), ("fork", "stop_after")])
def test_dataloader_workers_are_not_ranks(
    runs: dict[str, Future[Run]], context: str, scenario: str
) -> None:
    run = _get(runs, scenario)
    assert run.result.returncode == 0
    assert run.only.status == "complete"
    (loader,) = run.only.facts["dataloaders"]
    assert loader["num_workers"] == 2 and loader["multiprocessing_context"] == context
    assert loader["iterated_during_capture"] and loader["batches_during_capture"] > 0
    children = [p for p in run.result.processes if p.multiprocessing_child]
    # spawn workers start Python afresh (bootstrap and all) and import torch; forked ones do not.
    assert len(children) == (2 if context == "spawn" else 0)
    assert not any(p.stepped for p in children)


def test_bitsandbytes_8bit_optimizer_marks_steps(runs: dict[str, Future[Run]]) -> None:
    if "bnb" not in runs:
        pytest.skip("bitsandbytes is not installed")
    run = _get(runs, "bnb")
    assert run.result.returncode == 0, (run.folder / "stdout.txt").read_text()
    facts = run.only.facts
    assert run.only.status == "complete"
    assert facts["optimizer"]["class"].endswith("AdamW8bit")
    assert "uint8" in facts["optimizer"]["state_dtypes"]["state1"]
    assert len(facts["timed_step_s"]) == QUICK.timed_steps


def test_lbfgs_with_a_closure_marks_steps(runs: dict[str, Future[Run]]) -> None:
    run = _get(runs, "lbfgs")
    assert run.result.returncode == 0
    facts = run.only.facts
    assert run.only.status == "complete"
    assert facts["optimizer"]["class"] == "torch.optim.lbfgs.LBFGS"
    assert len(facts["timed_step_s"]) == QUICK.timed_steps
    assert facts["autocast"]["sampled_steps"] == QUICK.timed_steps + QUICK.profiled_steps


def test_autocast_is_recorded(runs: dict[str, Future[Run]]) -> None:
    sampled = QUICK.timed_steps + QUICK.profiled_steps
    on = _get(runs, "transparent").only.facts["autocast"]
    assert on["sampled_steps"] == sampled
    assert on["states"] == [
        {
            "cpu": {"enabled": True, "dtype": "bfloat16"},
            "cuda": {"enabled": False, "dtype": None},
            "steps": sampled,
        }
    ]
    assert on["roots"][0]["cpu"] == {"enabled": True, "dtype": "bfloat16"}
    off = _get(runs, "plain").only.facts["autocast"]
    assert off["states"] == [
        {
            "cpu": {"enabled": False, "dtype": None},
            "cuda": {"enabled": False, "dtype": None},
            "steps": sampled,
        }
    ]


def test_ctrl_c_reaches_the_trainer_and_keeps_what_was_measured(
    runs: dict[str, Future[Run]],
) -> None:
    run = _get(runs, "interrupted")
    # The trainer died of the SIGINT the launcher forwarded: Python re-raises SIGINT on itself
    # after an uncaught KeyboardInterrupt (and after atexit), so the status is -2, 130 in a shell;
    # the launcher exits with that 130.
    assert run.result.signals_forwarded == (signal.SIGINT,)
    assert run.result.returncode == -signal.SIGINT and run.result.exit_code == 130
    assert run.extra["launcher_returncode"] == 130
    facts = run.only.facts
    assert run.only.status.startswith("partial: interrupted after ")
    assert 4 <= len(facts["timed_step_s"]) < 200
    assert run.only.status == f"partial: interrupted after {len(facts['timed_step_s'])} timed steps"
    assert run.only.trace_path is None


def test_timeout_escalates_when_sigint_is_ignored(tmp_path: Path) -> None:
    """A program that ignores SIGINT gets SIGTERM after the grace; no torch, no capture."""
    script = tmp_path / "stubborn.py"
    script.write_text("import time\ntime.sleep(600)\n")
    # SIGINT is ignored from the program's first instruction (an ignored signal stays ignored
    # across exec, and Python keeps it so): a busy machine may start it after the timeout.
    command = ["sh", "-c", 'trap "" INT; exec "$0" "$1"', sys.executable, str(script)]
    start = time.monotonic()
    result = launch_profiled(command, tmp_path / "capture", timeout_s=2, grace_s=1, env=_env())
    # Escalated after the grace, not left to sleep its 600 s (the slack is a busy machine's).
    assert time.monotonic() - start < 60
    assert result.timed_out and result.returncode == -signal.SIGTERM
    assert result.message is not None
    assert result.message.startswith("no optimizer step in 2 s: no Python process imported torch")


# -- without a subprocess ----------------------------------------------------------------------


def test_environment_puts_the_bootstrap_first(tmp_path: Path) -> None:
    env = capture_environment(tmp_path, QUICK, {"PYTHONPATH": "/theirs", "HOME": "/home/x"})
    assert env["PYTHONPATH"] == f"{BOOTSTRAP_DIR}{os.pathsep}/theirs"
    assert env[capture_contract.ENV_DIR] == str(tmp_path.resolve())
    assert (
        env[capture_contract.ENV_SKIP_STEPS] == "2" and env[capture_contract.ENV_STOP_AFTER] == "0"
    )
    assert capture_contract.Settings.from_environ(env) == capture_contract.Settings(
        str(tmp_path.resolve()), 2, 4, 2
    )
    assert capture_environment(tmp_path, QUICK, {})["PYTHONPATH"] == str(BOOTSTRAP_DIR)


def test_the_bootstrap_names_the_contracts_variables_and_process_files() -> None:
    """The bootstrap keeps its own copies (it loads nothing at start-up): read them, not run it."""
    tree = ast.parse((BOOTSTRAP_DIR / "sitecustomize.py").read_text(encoding="utf-8"))
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert constants["_DIR_VARIABLE"] == capture_contract.ENV_DIR
    assert constants["_CAPTURE_VARIABLE"] == capture_contract.ENV_CAPTURE
    assert constants["_PROCESS_PREFIX"] == capture_contract.PROCESS_PREFIX


def test_options_and_capture_folder_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timed_steps"):
        CaptureOptions(timed_steps=-1)
    (tmp_path / "stale.json").write_text("{}")
    with pytest.raises(FileExistsError):
        launch_profiled([sys.executable, "-c", "pass"], tmp_path)


def test_a_killed_rank_reads_as_partial(tmp_path: Path) -> None:
    (tmp_path / "rank1.capture.json").write_text(json.dumps({"status": "running", "rank": 1}))
    (one,) = read_captures(tmp_path)
    assert one.rank == 1 and one.status.startswith("partial: the process was killed")
