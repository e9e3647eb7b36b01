"""`diagnose run --nproc N --strategy ddp|fsdp`: real multi-process runs (2 ranks, gloo, CPU)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from diagnose.catalogs.distributed_catalog import DATA_WAIT_IMBALANCE_ID, STRAGGLER_ID
from diagnose.cli import main
from diagnose.commands.run import measure_run
from diagnose.config import RunConfig
from diagnose.distributed.launch import RankJob, cpu_threads_per_rank, free_port
from diagnose.distributed.run_ranks import RANKS_DIR
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import RunRecord
from diagnose.record_io import load_record
from diagnose.run import resolve_config
from tests.conftest import ok_lines, unjudged_lines

PROBES = (
    "environment",
    "precision",
    "attention",
    "dataloader",
    "optimizer",
    "quantization",
    "triton",
)
#: Two timed steps per rank, one profiled, 64 px, fp32 (a CPU without bf16 units emulates bf16
#: many times slower): a record with every part, fast on 2 cores.
SHORT = [
    *("--steps", "2", "--warmup", "0", "--profiled-steps", "1"),
    *("--resolution", "64", "--precision", "fp32"),
]
SKIP_ALL = [arg for name in PROBES for arg in ("--skip", name)]


def _check_ranks_record(record: RunRecord, out: Path, strategy: str, wrapped_as: str) -> None:
    assert record.config["nproc"] == 2 and record.config["strategy"] == strategy
    assert "--nproc 2" in record.command
    assert ("--strategy fsdp" in record.command) == (strategy == "fsdp")
    # One record for the run, every rank in it with its timed (unprofiled) steps.
    assert [r.rank for r in record.ranks] == [0, 1]
    for stat in record.ranks:
        assert stat.world_size == 2
        assert len(stat.step_seconds) == 2 and all(s > 0 for s in stat.step_seconds)
        assert stat.source == f"rank{stat.rank}.json.gz"
        assert stat.comm_seconds > 0, "the ranks' collectives are in their traces"
        assert (out / RANKS_DIR / stat.source).is_file()
    # The job runs at the pace of one rank; the record's timing is that rank's.
    pacing = [r for r in record.ranks if r.paces]
    assert len(pacing) == 1
    timed = [s.seconds for s in record.timing.samples if not s.profiled]
    assert timed == pacing[0].step_seconds
    # That rank is the straggler when the traces show one (a loaded CI machine can make one),
    # else the rank whose timed steps are slowest.
    straggler = [f for f in record.findings if f.id in (STRAGGLER_ID, DATA_WAIT_IMBALANCE_ID)]
    if straggler:
        assert pacing[0].rank == straggler[0].evidence["straggler_rank"]
    else:
        assert pacing[0].median_seconds == max(r.median_seconds for r in record.ranks)
    assert record.breakdown.seconds["forward"] > 0
    assert record.trace_path == RANKS_DIR
    assert any(wrapped_as in note for note in record.notes), record.notes
    trace = next(p for p in record.probes if p.name == "trace")
    assert trace.status == "ok"
    # The ranks were compared: found in step, one found slower than the others, or waits that
    # moved from rank to rank (two ranks sharing two busy cores) said to be inconclusive.
    judged = [line for line in ok_lines(trace) if line.startswith("ranks:")]
    judged += [line for line in unjudged_lines(trace) if line.startswith("ranks: inconclusive")]
    assert judged or straggler, (ok_lines(trace), unjudged_lines(trace))
    assert {p.name for p in record.probes if p.status == "skipped"} == set(PROBES)
    assert load_record(out).ranks == record.ranks
    assert (out / "report.html").is_file()


def test_ddp_two_ranks_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    argv = ["run", "--nproc", "2", "--strategy", "ddp", *SHORT, *SKIP_ALL, "--no-progress"]
    argv += ["--out", str(out)]
    assert main(argv) == ExitCode.OK
    record = load_record(out)
    _check_ranks_record(record, out, "ddp", "DistributedDataParallel")
    # DDP all-reduces the LoRA gradients in the backward pass.
    assert all("all_reduce" in r.comm_by_kind for r in record.ranks), record.ranks


@pytest.mark.slow
def test_fsdp_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    out.mkdir()
    config = RunConfig(
        steps=2,
        warmup=0,
        profiled_steps=1,
        resolution=[64],
        precision="fp32",
        nproc=2,
        strategy="fsdp",
        skip_probes=list(PROBES),
    )
    said: list[str] = []
    outputs = measure_run(config, out, progress=said.append)
    record = outputs.record
    _check_ranks_record(record, out, "fsdp", "FSDP2 fully_shard")
    # FSDP gathers the sharded parameters before using them.
    assert all("all_gather" in r.comm_by_kind for r in record.ranks), record.ranks
    assert outputs.trace_path == out / RANKS_DIR
    assert any(message.startswith("rank 0 of 2: ") for message in said)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--nproc", "2", "--device", "cuda:1"], "--device must be auto, cpu or cuda"),
        (["--nproc", "2", "--strategy", "zero"], "invalid choice"),
    ],
)
def test_bad_nproc_is_a_usage_error(
    tmp_path: Path, capsys: Any, argv: list[str], needle: str
) -> None:
    out = tmp_path / "never"
    assert main(["run", *argv, "--out", str(out)]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and err.count("\n") == 1, err
    assert needle in err
    assert not out.exists()


def test_config_says_nproc_and_strategy() -> None:
    config = RunConfig(nproc=4, strategy="fsdp")
    config.validate()
    assert "--nproc 4 --strategy fsdp" in config.command_line()
    assert config.to_dict()["nproc"] == 4 and config.to_dict()["strategy"] == "fsdp"
    assert "--nproc" not in RunConfig().command_line()
    # --strategy without --nproc > 1 is harmless.
    RunConfig(strategy="fsdp").validate()
    with pytest.raises(DiagnoseError) as info:
        RunConfig(nproc=2, strategy="zero").validate()  # type: ignore[arg-type]
    assert info.value.code == ExitCode.USAGE


def test_launch_helpers() -> None:
    assert 0 < free_port() < 65536
    assert cpu_threads_per_rank(10_000) == 1
    assert cpu_threads_per_rank(1) >= 1


def _job(tmp_path: Path, *, idle_timeout_s: float = 60.0, batch: int = 1) -> RankJob:
    config = RunConfig(nproc=2, steps=1, warmup=0, profiled_steps=0, batch=batch)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return RankJob(
        resolve_config(config, "cpu", None),
        device_kind="cpu",
        trace_dir=tmp_path / "ranks",
        scratch_dir=scratch,
        idle_timeout_s=idle_timeout_s,
    )


def test_ranks_that_make_no_progress_are_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    with _job(tmp_path, idle_timeout_s=0.5) as job:
        job.start()
        with pytest.raises(DiagnoseError) as info:
            job.wait()
        assert all(p.poll() is not None for p in job.processes)
    assert "made no progress" in info.value.message and "\n" not in info.value.message
    assert time.monotonic() - started < 30


def test_a_killed_rank_stops_the_others(tmp_path: Path) -> None:
    with _job(tmp_path) as job:
        job.start()
        # As the OOM killer would: rank 1 dies; rank 0 must not wait for it in a collective.
        killer = threading.Timer(1.0, job.processes[1].send_signal, args=(signal.SIGKILL,))
        killer.start()
        try:
            with pytest.raises(DiagnoseError) as info:
                job.wait()
        finally:
            killer.cancel()
        assert all(p.poll() is not None for p in job.processes)
    assert info.value.message.startswith("rank 1 of 2 was killed by SIGKILL")
    assert info.value.code == ExitCode.INTERNAL_ERROR


def test_a_rank_whose_teardown_aborts_still_returns_its_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's gloo process group now and then aborts a process while its interpreter shuts down
    ("terminate called without an active exception", in plain torchrun scripts too), after the
    rank's work is done: planted here as an exit handler that aborts. A rank that has written its
    result leaves without that teardown, so its result is not lost to it; a rank that ends with
    an error still exits with its code (the test above)."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(plant), os.environ.get("PYTHONPATH")]))
    )
    with _job(tmp_path) as job:
        job.start()
        results = job.wait()
        assert [p.returncode for p in job.processes] == [0, 0]
    assert [r.rank for r in results] == [0, 1]
    assert all(r.record.timing is not None for r in results)


def test_a_rank_error_keeps_its_exit_code(tmp_path: Path) -> None:
    """A rank's own DiagnoseError (here: a setting no run can use) comes back as one line, named
    by rank, with its exit code."""
    with _job(tmp_path, batch=0) as job:
        job.start()
        with pytest.raises(DiagnoseError) as info:
            job.wait()
        assert all(p.poll() is not None for p in job.processes)
    assert info.value.code == ExitCode.USAGE
    assert info.value.message == "rank 0 of 2: --batch must be at least 1"
