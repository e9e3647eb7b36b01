"""Communication judged on one rank's trace: collective time with no compute beside it.

Real traces: one rank of an MI300X DDP job (communication 11.2 ms of a 16.0 ms step) and a CPU
gloo trace (85% communication) must say so on the first screen, with the fixes. A compute-bound
step whose all-reduce runs beside its GEMMs stays quiet, and its twin with the all-reduce after
the compute is found (both written event by event: there is no GPU here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose.catalogs import distributed_catalog as catalog
from diagnose.catalogs import specs
from diagnose.record import RunRecord
from diagnose.reports.terminal import terminal_summary
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from diagnose.verdicts import contradictions, ranked, settle
from tests.conftest import ok_lines
from tests.test_trace_synthetic import TraceBuilder

ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def _record(path: Path) -> RunRecord:
    record = analysis_to_record(analyze_trace(path), path)
    settle(record, specs())
    return record


def _first_screen(record: RunRecord) -> str:
    """The terminal summary up to its top findings: what a reader sees first."""
    return terminal_summary(record, paths={})


@pytest.mark.parametrize(
    "name", ["rocm/mi300x_resnet_ddp_bf16_train.json.gz", "edge/cpu_only.json.gz"]
)
def test_one_ranks_trace_with_exposed_communication_says_so_first(
    shared_traces: Path, name: str
) -> None:
    record = _record(shared_traces / name)
    finding = next(f for f in record.findings if f.id == catalog.EXPOSED_COMM_ID)
    assert finding.severity in ("warn", "critical"), finding
    assert ranked(record.findings)[0].id == catalog.EXPOSED_COMM_ID
    assert "DistributedDataParallel(" in finding.fix
    assert "a wait for a slower rank" in finding.detail
    assert (
        finding.evidence["exposed_seconds_per_step"]
        >= 0.5 * finding.evidence["comm_seconds_per_step"]
    )
    screen = _first_screen(record)
    assert "Communication is not hidden behind compute" in screen
    assert "no slow-down found" not in screen
    assert not contradictions(record, specs())


def _ddp_steps(path: Path, *, overlapped: bool, steps: int = 4) -> Path:
    """Steps of about 1 ms: eight 100 µs GEMMs on stream 7, and a 300 µs all-reduce on stream 9
    that runs beside the GEMMs (``overlapped``) or after them."""
    b = TraceBuilder()
    ts = 0.0
    for number in range(steps):
        start = ts
        jitter = 4.0 * (number % 3)
        for _ in range(8):
            ts = b.op_with_kernel("aten::addmm", ts, GEMM, 100.0 + jitter)
        comm_start = b.gpu_free_at - 700.0 if overlapped else b.gpu_free_at + 2.0
        b._x("kernel", ALL_REDUCE, comm_start, 300.0, 0, 9, device=0, stream=9)
        end = max(b.gpu_free_at, comm_start + 300.0) + 20.0
        b.annotation(f"ProfilerStep#{number + 1}", start, end - start)
        ts = end + 1.0
        b.gpu_free_at = ts
    return b.save(path)


def test_an_all_reduce_beside_the_compute_stays_quiet(tmp_path: Path) -> None:
    record = _record(_ddp_steps(tmp_path / "overlapped.json", overlapped=True))
    assert catalog.EXPOSED_COMM_ID not in {f.id for f in record.findings}
    lines = [line for p in record.probes for line in ok_lines(p)]
    assert any(line.startswith("communication:") and "below 10%" in line for line in lines)


def test_an_all_reduce_after_the_compute_is_found(tmp_path: Path) -> None:
    record = _record(_ddp_steps(tmp_path / "exposed.json", overlapped=False))
    finding = next(f for f in record.findings if f.id == catalog.EXPOSED_COMM_ID)
    assert finding.severity in ("warn", "critical")
    assert finding.evidence["exposed_seconds_per_step"] == pytest.approx(300e-6, rel=0.01)
    assert "all-reduce" in finding.title
