"""Shared fixtures and the global-state guard every test runs under."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The shared folder beside the checkout (real GPU traces and evidence); DIAGNOSE_SHARED_DIR
#: names another place for it.
SHARED = Path(os.environ.get("DIAGNOSE_SHARED_DIR") or REPO_ROOT.parent / "shared")
SHARED_TRACES = SHARED / "gpu-traces"
#: What the project did on its first GPU (README there).
SHARED_EVIDENCE = SHARED / "gpu-evidence" / "h200-2026-12-04"
FIXTURES = REPO_ROOT / "fixtures"


def shares(text: str) -> list[float]:
    """Every unsigned percentage a text states ("12%", "1,260%"): a share of something. A signed
    one ("+28%", "−5%") is a change and a spread ("the interquartile range is 145% of the
    median") a ratio, either of which may be any size."""
    found = re.findall(r"(?<![+−\-0-9.,])([0-9][0-9,]*(?:\.[0-9]+)?)\s?%(?! of the median)", text)
    return [float(p.replace(",", "")) for p in found]


def percentages(text: str) -> list[float]:
    """Every percentage a text states ("12%", "1,260%", "−78%"): what a reader takes as a share."""
    found = re.findall(r"([−-]?[0-9][0-9,]*(?:\.[0-9]+)?)\s?%", text)
    return [float(p.replace(",", "").replace("−", "-")) for p in found]


#: What diagnose keeps between runs (diagnose.user_cache) goes to the suite's own folder, never
#: the user's, and every suite run starts cold.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="diagnose-tests-cache-")

#: A suite started as a background job of a non-interactive shell (``pytest &`` in a script)
#: inherits SIGINT ignored, and so does every process it starts: the trainers of the Ctrl-C and
#: ``--timeout`` tests were then deaf to the SIGINT those tests are about, and a test waited on
#: one forever. The tests model a terminal, where Ctrl-C is delivered: Python's own handler
#: again here, and the default action in every process started from here.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: Variables that pytest or torch itself set (torch.profiler sets the inductor cache folder).
_ENV_SET_BY_OTHERS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def _torch_switches() -> dict[str, object]:
    import torch

    from diagnose.torch_compat import is_autocast_enabled

    switches: dict[str, object] = {
        "grad": torch.is_grad_enabled(),
        "autocast_cpu": is_autocast_enabled("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "threads": torch.get_num_threads(),
    }
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled"):
        switches[name] = getattr(torch.backends.cuda, name)()
    return switches


@pytest.fixture(autouse=True)
def _global_state_guard() -> Iterator[None]:
    """Fail a test that leaves a profiler running, torch switches flipped or env changed.

    pyinstrument's conftest does the same: one leaking test would otherwise make later ones
    measure something else.
    """
    from diagnose.torch_compat import profiler_is_running

    env_before = dict(os.environ)
    switches_before = _torch_switches()
    yield
    assert profiler_is_running() is not True, "a profiler is still running"
    assert _torch_switches() == switches_before, "torch switches were not restored"
    changed = {
        k
        for k in set(env_before) | set(os.environ)
        if env_before.get(k) != os.environ.get(k) and k not in _ENV_SET_BY_OTHERS
    }
    assert not changed, f"environment variables changed: {sorted(changed)}"


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real GPU traces not present at {SHARED_TRACES}")
    return SHARED_TRACES


@pytest.fixture(scope="session")
def shared_evidence() -> Path:
    if not SHARED_EVIDENCE.is_dir():
        pytest.skip(f"the GPU evidence is not present at {SHARED_EVIDENCE}")
    return SHARED_EVIDENCE


def ok_lines(result: Any) -> list[str]:
    """The text of the checks found fine, of a ProbeResult or a TraceAnalysis."""
    return [c.text for c in result.checks if c.outcome == "ok"]


def unjudged_lines(result: Any) -> list[str]:
    """The text of the checks that could not be judged, of a ProbeResult or a TraceAnalysis."""
    return [c.text for c in result.checks if c.outcome == "not_judged"]


#: Small but complete: warm-up, timed and profiled steps (keeps the suite fast on 2 cores).
QUICK = ["--steps", "3", "--warmup", "1", "--profiled-steps", "1", "--no-progress"]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real default run (tiny SD1.5 on the CPU), shared by the tests that read its outputs."""
    from diagnose.cli import main

    out = tmp_path_factory.mktemp("runs") / "default"
    assert main(["run", "--out", str(out), *QUICK]) == 0
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A stepped tiny SD1.5 LoRA workload on the CPU (torch AdamW) and a record of its timing."""
    import torch

    from diagnose.capture import measure
    from diagnose.config import RunConfig
    from diagnose.record import new_record
    from diagnose.workload import build_workload
    from diagnose.workload.synthetic_images import generate_images

    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=3, seed=1, size=(96, 80))
    config = RunConfig(
        preset="sd15", size="tiny", resolution=[64], data_dir=str(folder), steps=3, warmup=1
    )
    workload = build_workload(config, torch.device("cpu"))
    try:
        measured = measure(workload, steps=3, warmup=1, profiled_steps=0, trace_path=None)
        record = new_record("run")
        record.timing = measured.timing
        record.breakdown = measured.breakdown
        yield workload, record
    finally:
        workload.close()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch computes on one intra-op thread inside (put back after), as ``diagnose run`` does
    on a busy machine (:func:`diagnose.contention.threads_for_load`).

    For what a test times or reads as shares of a step: on a 2-core machine shared with other
    processes, every parallel region of a two-thread op waits for the thread that shares its
    core with someone else, and a step swings tenfold (a 100 ms stall in a 0.2 ms call), which
    is noise no planted effect stands above. One thread slows with the load, and steadily."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def profile_steps(step: Callable[[], object], path: Path, active: int = 3) -> Path:
    """A real CPU profiler trace of ``active`` calls of ``step`` (after one warm-up call), one
    ``ProfilerStep#N`` each, as a training loop under a schedule writes it (on one torch
    thread: the tests read shares of its steps)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with (
        one_torch_thread(),
        profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=active),
            record_shapes=True,
            on_trace_ready=lambda done: done.export_chrome_trace(str(path)),
        ) as prof,
    ):
        for _ in range(active + 1):
            step()
            prof.step()
    return path


@pytest.fixture
def busy_core() -> Iterator[None]:
    """Another process spinning on one of this process's cores for the length of the test: a
    machine other work keeps busy. It is started outside this process's tree (its parent exits
    at once), as another user's job is: diagnose counts its own children as its own work."""
    import subprocess

    spawn = (
        "import os, sys\n"
        "pid = os.fork()\n"
        "if pid:\n"
        "    print(pid, flush=True)\n"
        "    os._exit(0)\n"
        "os.setsid()\n"
        "null = os.open(os.devnull, os.O_RDWR)\n"
        "for fd in (0, 1, 2):\n"
        "    os.dup2(null, fd)\n"
        "while True:\n"
        "    pass\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", spawn], capture_output=True, text=True, check=True, timeout=30
    )
    pid = int(parent.stdout.strip())
    try:
        os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
        yield
    finally:
        os.kill(pid, signal.SIGKILL)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves the ``slow`` group (deep variants of what the default run already covers) out of a
    plain ``pytest``, so the README's test command stays within its time on a 2-core machine.
    ``-m slow`` runs the group, ``-m "slow or not slow"`` everything; a slow test named by its
    node id on the command line runs too."""
    if config.option.markexpr:
        return
    named = {arg for arg in config.args if "::" in arg}
    kept, left_out = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        wanted = any(item.nodeid == n or item.nodeid.startswith(n + "[") for n in named)
        (left_out if slow and not wanted else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


#: The most test processes ``-n auto`` starts: each imports torch and builds its models, and on a
#: machine with many cores the memory runs out before the cores do.
MOST_TEST_PROCESSES = 4
#: How long the cores are watched before the suite starts: long enough for several readings.
LOAD_LOOK_S = 1.0


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (the README's command): one test process per core that other work leaves
    free, watched for a moment before the suite starts; at least one. On an idle machine the
    suite uses every core; beside a browser and a build it runs in the cores they leave, as it
    would alone, instead of adding processes that race the load (the tests that compare
    timings are proven beside one busy process, not beside their own crowd).
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides when set (pytest-xdist's own answer)."""
    import time

    from diagnose.contention import LoadWindow

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    window = LoadWindow().open()
    time.sleep(LOAD_LOOK_S)
    seen = window.close()
    cores = seen.cpus or os.cpu_count() or 1
    processes = max(1, min(MOST_TEST_PROCESSES, round(cores - seen.others_cores)))
    # pytest captures sys.stdout and sys.stderr by now: the terminal's own stream.
    assert sys.__stderr__ is not None
    sys.__stderr__.write(
        f"-n auto: {processes} test process(es); other work held {seen.others_cores:.1f} of "
        f"{cores} cores\n"
    )
    return processes
