"""Several ranks' traces read together (``diagnose trace DIR``), on real multi-process runs.

One torchrun launch (2 ranks, gloo, CPU) of ``fixtures/distributed/ddp_trainer.py`` writes the
rank traces of every scenario: a planted straggler (slow data, slow forward) and its balanced
twin, waits that move between the ranks, gradients too large to hide and their compute-bound
twin.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diagnose.catalogs import distributed_catalog as catalog
from diagnose.cli import main
from diagnose.distributed.collectives import collective_kind
from diagnose.record import RunRecord
from diagnose.record_io import load_record
from diagnose.trace.analysis import analyze_trace
from tests.conftest import FIXTURES, ok_lines, unjudged_lines

TRAINER = FIXTURES / "distributed" / "ddp_trainer.py"
SCENARIOS = (
    "balanced",
    "slow_data",
    "slow_forward",
    "alternating",
    "comm_bound",
    "compute_bound",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(TRAINER),
            str(out),
            *SCENARIOS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _trace(folder: Path, tmp_path: Path, *extra: str) -> RunRecord:
    out = tmp_path / f"out-{folder.name}"
    assert main(["trace", str(folder), "--out", str(out), *extra]) == 0
    return load_record(out)


def _ids(record: RunRecord) -> set[str]:
    return {f.id for f in record.findings}


def _checked(record: RunRecord) -> list[str]:
    return [line for p in record.probes for line in ok_lines(p)]


def test_a_rank_slow_in_its_data_is_named_with_its_phase(runs: Path, tmp_path: Path) -> None:
    record = _trace(runs / "slow_data", tmp_path)
    finding = next(f for f in record.findings if f.id == catalog.DATA_WAIT_IMBALANCE_ID)
    assert finding.evidence["straggler_rank"] == 1
    assert finding.evidence["slow_phase"] == "data_wait"
    assert "Rank 1" in finding.title and "data wait" in finding.title
    # The straggler's starved loader is the same cause: said once, its evidence kept.
    assert "dataloader.gpu_starved" not in _ids(record)
    assert "loader" in finding.evidence
    # One record for both ranks; its timing is the pacing rank's (rank 1's) steps.
    assert [r.rank for r in record.ranks] == [0, 1]
    pacing = next(r for r in record.ranks if r.paces)
    assert pacing.rank == 1
    assert [s.seconds for s in record.timing.samples] == pacing.step_seconds
    # Rank 0 waits for rank 1; the saving is that wait, never more than the step.
    waiting = record.ranks[0]
    assert waiting.wait_seconds > 0.5 * waiting.comm_seconds > 0
    assert finding.est_seconds_saved_per_it is not None
    assert finding.est_seconds_saved_per_it <= record.timing.headline.median
    assert record.ranks[1].wait_seconds == 0.0


def test_a_rank_slow_in_its_forward_is_named_with_its_phase(runs: Path, tmp_path: Path) -> None:
    record = _trace(runs / "slow_forward", tmp_path)
    finding = next(f for f in record.findings if f.id == catalog.STRAGGLER_ID)
    assert finding.evidence["straggler_rank"] == 1
    assert finding.evidence["slow_phase"] == "forward"
    assert finding.category == "distributed"
    assert catalog.DATA_WAIT_IMBALANCE_ID not in _ids(record)


def _first_steps(source: Path, into: Path, keep: int) -> Path:
    """The rank traces of ``source`` with only their first ``keep`` ProfilerStep ranges: the
    steps a shorter profile would have marked."""
    into.mkdir()
    for path in sorted(source.glob("rank*.json.gz")):
        trace = json.loads(gzip.decompress(path.read_bytes()))
        steps = sorted(
            (e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")),
            key=lambda e: e["ts"],
        )
        dropped = {id(e) for e in steps[keep:]}
        trace["traceEvents"] = [e for e in trace["traceEvents"] if id(e) not in dropped]
        (into / path.name).write_bytes(gzip.compress(json.dumps(trace).encode()))
    return into


@pytest.mark.parametrize(
    ("scenario", "finding_id"),
    [
        ("slow_forward", catalog.STRAGGLER_ID),
        ("slow_data", catalog.DATA_WAIT_IMBALANCE_ID),
    ],
)
def test_a_straggler_is_named_from_three_profiled_steps(
    runs: Path, tmp_path: Path, scenario: str, finding_id: str
) -> None:
    """In each of 3 steps rank 0 waits for rank 1 by far more than the steps' jitter: the size
    of the waits names it, as a sign test over 3 steps (1 in 4 by chance) never could."""
    assert catalog.steps_to_name_a_straggler(2) == 3
    short = _first_steps(runs / scenario, tmp_path / "short", keep=3)
    record = _trace(short, tmp_path)
    finding = next(f for f in record.findings if f.id == finding_id)
    assert finding.evidence["straggler_rank"] == 1
    assert finding.severity in ("warn", "critical") and finding.borderline is None
    low, high = finding.evidence["wait_gap_share_interval"]
    assert catalog.RAISE_SHARE <= low <= high
    assert "jitter" in finding.detail


@pytest.mark.parametrize("keep", [1, 2])
def test_fewer_steps_than_a_jitter_needs_name_no_straggler(
    runs: Path, tmp_path: Path, keep: int
) -> None:
    short = _first_steps(runs / "slow_forward", tmp_path / "short", keep=keep)
    record = _trace(short, tmp_path)
    assert not {catalog.STRAGGLER_ID, catalog.DATA_WAIT_IMBALANCE_ID} & _ids(record)
    unjudged = [line for p in record.probes for line in unjudged_lines(p)]
    assert any("no step-to-step jitter to hold the wait against" in u for u in unjudged), unjudged


@pytest.mark.parametrize("keep", [3, 6])
def test_waits_that_move_between_ranks_name_no_straggler(
    runs: Path, tmp_path: Path, keep: int
) -> None:
    """Each rank is slow in every other step: the others wait as long, but not for one rank."""
    short = _first_steps(runs / "alternating", tmp_path / "short", keep=keep)
    record = _trace(short, tmp_path)
    assert not {catalog.STRAGGLER_ID, catalog.DATA_WAIT_IMBALANCE_ID} & _ids(record)
    judged = _checked(record) + [line for p in record.probes for line in unjudged_lines(p)]
    ranks = [line for line in judged if line.startswith("ranks:")]
    assert ranks and all("inconclusive" in line or "keep pace" in line for line in ranks)


def test_the_capture_profiles_as_many_steps_as_the_catalog_asks() -> None:
    from diagnose.profile import capture_contract as contract

    assert contract._STRAGGLER_STEPS == catalog.STRAGGLER_STEPS
    for world in range(1, 17):
        assert contract.steps_to_name_a_straggler(world) == catalog.steps_to_name_a_straggler(world)


def _machine_was_busy(runs: Path, scenario: str) -> bool:
    """Whether other work competed for the cores while a scenario's ranks ran (the trainer
    records each rank's load beside the traces)."""
    loads = [json.loads(p.read_text()) for p in (runs / "host-load").glob(f"{scenario}-rank*")]
    assert loads, "the trainer wrote no host load"
    return any(load["competing_share"] > 0 for load in loads)


def test_balanced_ranks_raise_no_straggler(runs: Path, tmp_path: Path) -> None:
    record = _trace(runs / "balanced", tmp_path)
    named = {catalog.STRAGGLER_ID, catalog.DATA_WAIT_IMBALANCE_ID} & _ids(record)
    if _machine_was_busy(runs, "balanced"):
        # Other work on a shared machine can really slow one rank: then it is slower in all of
        # its work alike, never in one phase, and the finding must not blame one.
        for finding in record.findings:
            if finding.id in named:
                assert finding.evidence["slow_phase"] is None, finding.title
    else:
        assert not named
    judged = _checked(record) + [line for p in record.probes for line in unjudged_lines(p)]
    # Either "keep pace" or, on a very busy machine, "inconclusive": never a named straggler.
    assert any(line.startswith("ranks:") for line in judged)
    assert len(record.ranks) == 2


def test_gradients_too_large_to_hide_are_exposed_communication(runs: Path, tmp_path: Path) -> None:
    record = _trace(runs / "comm_bound", tmp_path)
    finding = next(f for f in record.findings if f.id == catalog.EXPOSED_COMM_ID)
    assert "all-reduce" in finding.title
    assert finding.evidence["by_kind_seconds"]["all_reduce"] > 0
    assert finding.est_seconds_saved_per_it is not None
    assert 0 < finding.est_seconds_saved_per_it <= record.timing.headline.median


def test_compute_bound_ranks_raise_no_exposed_communication(runs: Path, tmp_path: Path) -> None:
    record = _trace(runs / "compute_bound", tmp_path)
    exposed = [f for f in record.findings if f.id == catalog.EXPOSED_COMM_ID]
    # On a busy shared machine a rank's all-reduce sometimes waits for the other one in a step:
    # then the steps straddle the line, which is borderline (info), never a warning.
    assert all(f.severity == "info" and f.borderline is not None for f in exposed), exposed
    if not exposed:
        assert any(line.startswith("communication:") for line in _checked(record))


def test_files_named_one_by_one_read_as_the_folder(runs: Path, tmp_path: Path) -> None:
    folder = runs / "slow_data"
    files = sorted(str(p) for p in folder.iterdir())
    out = tmp_path / "files"
    assert main(["trace", *files, "--out", str(out), "--jobs", "1"]) == 0
    record = load_record(out)
    assert catalog.DATA_WAIT_IMBALANCE_ID in _ids(record)


def test_one_rank_alone_judges_its_communication_but_names_no_straggler(runs: Path) -> None:
    """Rank 0 of the slow-data job waits for rank 1 in its all-reduce: alone, its trace shows
    exposed communication, said as transfer or a wait for a slower rank."""
    analysis = analyze_trace(runs / "slow_data" / "rank0.json.gz")
    assert analysis.rank == 0 and analysis.world_size == 2
    assert analysis.communication.where == "host"
    assert analysis.communication.median("comm_seconds") > 0
    ids = {f.id for f in analysis.findings}
    assert catalog.EXPOSED_COMM_ID in ids
    assert not {catalog.STRAGGLER_ID, catalog.DATA_WAIT_IMBALANCE_ID} & ids
    finding = next(f for f in analysis.findings if f.id == catalog.EXPOSED_COMM_ID)
    assert "a wait for a slower rank" in finding.detail and "diagnose trace DIR" in finding.fix


def test_the_html_report_has_every_rank(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main(["trace", str(runs / "slow_data"), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert 'id="ranks"' in html and "rank0.json.gz" in html and "rank1.json.gz" in html
    assert "(shown above)" in html and "all-reduce" in html


def test_compare_gates_the_pacing_rank_and_refuses_other_rank_counts(
    runs: Path, tmp_path: Path
) -> None:
    balanced = tmp_path / "balanced"
    slow = tmp_path / "slow"
    assert main(["trace", str(runs / "balanced"), "--out", str(balanced)]) == 0
    assert main(["trace", str(runs / "slow_data"), "--out", str(slow)]) == 0
    # The straggler makes the job's s/it several times slower: a regression.
    assert main(["compare", str(balanced), str(slow)]) == 6
    single = tmp_path / "single"
    assert main(["trace", str(runs / "balanced" / "rank0.json.gz"), "--out", str(single)]) == 0
    assert main(["compare", str(balanced), str(single)]) == 3


# --------------------------------------------------------------------------------------------
# Bad input: one line and an exit code, never a traceback


def test_a_folder_without_traces_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["trace", str(tmp_path), "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert "no trace files" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_two_files_of_one_rank_are_refused(
    tmp_path: Path, shared_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = shared_traces / "rocm" / "mi300x_resnet_ddp_bf16_train.json.gz"
    shutil.copy(source, tmp_path / "a.json.gz")
    shutil.copy(source, tmp_path / "b.json.gz")
    assert main(["trace", str(tmp_path), "--out", str(tmp_path / "o")]) == 3
    assert "both rank 0" in capsys.readouterr().err


def _as_rank(source: Path, target: Path, rank: int) -> None:
    with gzip.open(source, "rt") as stream:
        document = json.load(stream)
    document["distributedInfo"]["rank"] = rank
    with gzip.open(target, "wt") as stream:
        json.dump(document, stream)


def test_an_unreadable_rank_is_left_out_and_said(tmp_path: Path, shared_traces: Path) -> None:
    source = shared_traces / "rocm" / "mi300x_resnet_ddp_bf16_train.json.gz"
    folder = tmp_path / "ranks"
    folder.mkdir()
    _as_rank(source, folder / "rank0.json.gz", 0)
    _as_rank(source, folder / "rank1.json.gz", 1)
    (folder / "rank2.json").write_text('{"traceEvents": [')
    out = tmp_path / "o"
    assert main(["trace", str(folder), "--out", str(out), "--jobs", "2"]) == 0
    record = load_record(out)
    assert [r.rank for r in record.ranks] == [0, 1]
    assert any("rank2.json" in n and "left out" in n for n in record.notes)
    # Two of eight ranks: the report says the rest are missing.
    assert any("2 of 8 ranks" in n for n in record.notes)


def test_gpu_collectives_are_read_from_nccl_kernels(shared_traces: Path) -> None:
    analysis = analyze_trace(shared_traces / "rocm" / "mi300x_resnet_ddp_bf16_train.json.gz")
    comm = analysis.communication
    assert comm.where == "device"
    assert comm.median("comm_seconds") > 0
    assert comm.median("exposed_seconds") <= comm.median("comm_seconds")
    assert any("all_reduce" in s.by_kind for s in comm.steps)


def test_a_trace_without_collectives_has_none(shared_traces: Path) -> None:
    analysis = analyze_trace(shared_traces / "cuda" / "v100_resnet50_num_workers_0.json.gz")
    assert analysis.communication.where == ""
    assert analysis.communication.median("comm_seconds") == 0.0


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
        ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16", "reduce_scatter"),
        ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
        ("gloo:all_reduce", "all_reduce"),
        ("nccl:_all_gather_base", "all_gather"),
        ("c10d::broadcast_", "broadcast"),
        ("ncclDevKernel_SendRecv", "send_recv"),
        ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "other"),
    ],
)
def test_collective_kinds(name: str, kind: str) -> None:
    assert collective_kind(name) == kind
