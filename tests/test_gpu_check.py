"""scripts/gpu_check dry-run on the CPU, so the one script a lent GPU runs cannot rot: it passes,
writes every file it promises, counts them under its limits, and its fault table has a row per
planted fault."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from planted_faults import FAULTS, SUITE

PROMISED = (
    "summary.md",
    "faults.md",
    "env.txt",
    "triton.json",
    "trace.json.gz",
    "runs.tar.gz",
    "faults.tar.gz",
    "log.txt",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    env = {**os.environ, "OUT": str(out), "SIZE": "tiny", "DEVICE": "cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        [str(REPO_ROOT / "scripts" / "gpu_check")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return out


def test_writes_every_promised_file_within_the_limits(dry_run: Path) -> None:
    written = sorted(path.name for path in dry_run.iterdir())
    assert written == sorted(PROMISED)
    assert all(path.is_file() and path.stat().st_size <= 16 << 20 for path in dry_run.iterdir())
    trace = json.loads(gzip.decompress((dry_run / "trace.json.gz").read_bytes()))
    assert trace["traceEvents"]
    assert json.loads((dry_run / "triton.json").read_text())["counts"]["pass"] > 0
    with tarfile.open(dry_run / "runs.tar.gz") as packed:
        names = set(packed.getnames())
    for run in ("run1", "run2", "quant"):
        assert f"runs/{run}/record.json" in names
        assert f"runs/{run}/report.html" in names
    assert {"runs/gate.md", "runs/faults.json", "runs/steps.tsv"} <= names
    with tarfile.open(dry_run / "faults.tar.gz") as packed:
        traces = {Path(name).name for name in packed.getnames()}
    assert {f"{fault}.json.gz" for fault in ("none", *SUITE)} <= traces


def test_fault_table_has_a_row_per_fault(dry_run: Path) -> None:
    rows = [line for line in (dry_run / "faults.md").read_text().splitlines()[2:] if line]
    assert [row.split("|")[1].strip() for row in rows] == list(SUITE)
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert len(cells) == 9
        assert cells[2].startswith(("yes: ", "no")), row  # each fault ran and was diagnosed
        assert cells[5] != "–", row  # a measured saving against the clean twin
        # The dry run profiles one fault with diagnose profile, as the GPU check profiles a few.
        assert (cells[8] != "–") == (cells[0] == "math-sdpa"), row


def test_summary_says_what_held_with_stage_times_and_probes(dry_run: Path) -> None:
    summary = (dry_run / "summary.md").read_text()
    for step in ("env", "triton", "run1", "run2", "quant", "faults"):
        assert f"step {step} ran" in summary
    for run in ("run1", "run2", "quant"):
        stages = next(line for line in summary.splitlines() if line.startswith(f"- {run}: build"))
        assert "start-up" in stages and "probes" in stages
    assert "A/A: run2 has run1's findings" in summary
    assert "torch " in summary
    for fault in SUITE:
        assert f"fault {fault}: found" in summary
        assert FAULTS[fault].what in (dry_run / "faults.md").read_text()
