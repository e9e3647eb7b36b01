"""One cause, one finding: bf16 on a device without native bf16 units.

The reported problem: a default run on a CPU without AVX512-BF16/AMX raised both
``precision.bf16_not_native`` (a hardware fact) and ``precision.bf16_slower_than_fp32`` (measured);
both said "train in fp32" and read as one cause counted twice. When the slowdown is measured, its
finding now carries the hardware fact, and the hardware question is answered by a check that
points at it; when no measurement exists, the hardware finding stands alone.

Real probes on this machine's CPU (its real DeviceInfo) and a real tiny SD1.5 LoRA step, skipped
on a CPU that computes bf16 natively (where neither fact is true); and, so that the measured branch
is covered whatever the machine's load, the real audit of a small bf16 loop with bf16's speed
planted (as in ``test_precision_saving``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from diagnose.catalogs import specs
from diagnose.catalogs.precision_catalog import (
    BF16_NOT_NATIVE_ID,
    BF16_SLOWER_ID,
    CPU_WITHOUT_BF16_FIX,
)
from diagnose.config import RunConfig
from diagnose.device import bf16_native, cpu_info
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.precision.probe import PrecisionProbe
from diagnose.record import DeviceInfo, RunRecord, StepSample, new_record
from diagnose.timing import PhaseTimer
from diagnose.verdicts import contradictions, settle
from diagnose.workload import build_workload
from diagnose.workload.step import Workload
from diagnose.workload.synthetic_images import generate_images
from tests.test_precision_probe import TinyLoop, _tiny_config
from tests.test_precision_saving import _PlantedSpeed

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def this_cpu() -> DeviceInfo:
    info = cpu_info()
    if bf16_native(info) is not False:
        pytest.skip(f"this CPU computes bf16 natively or cannot say (ISA: {info.extra.get('isa')})")
    return info


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """The tiny SD1.5 LoRA step in bf16-mixed, stepped once (its optimizer state exists)."""
    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=2, seed=1, size=(136, 128))
    config = RunConfig(
        preset="sd15", size="tiny", resolution=[128], data_dir=str(folder), precision="bf16-mixed"
    )
    built = build_workload(config, CPU)
    built.step(next(built.batches()), PhaseTimer(lambda: None))
    try:
        yield built
    finally:
        built.close()
        gc.collect()


def _run(
    probe: PrecisionProbe,
    workload: Any,
    info: DeviceInfo,
    config: RunConfig | None = None,
    *,
    load_window: bool = True,
) -> RunRecord:
    """The probe's result in a settled record (one answer per question, severities graded) of a
    run whose steps took 0.5 s. ``load_window=False`` runs the probe outside the window that
    sets aside comparisons the machine's load could explain (the probe's own judgement alone)."""
    record = new_record("run")
    record.timing.samples = [StepSample(index=i, seconds=0.5) for i in range(3)]
    record.timing.summarize()
    ctx = ProbeContext(
        config=config or workload.config,
        device=CPU,
        device_info=info,
        record=record,
        workload=workload,
    )
    if load_window:
        result = run_probe(probe, ctx)
    else:
        result = probe.run(ctx)
        result.name = probe.name
        result.settle_checks(probe.name)
    assert result.status == "ok", result.traceback
    record.probes = [result]
    record.findings = list(result.findings)
    settle(record, specs())
    return record


def _outcomes(record: RunRecord, check_id: str) -> list[str]:
    return [c.outcome for c in record.all_checks() if c.id == check_id]


def _assert_one_finding_carrying_both(record: RunRecord, info: DeviceInfo) -> None:
    ids = [f.id for f in record.findings]
    assert BF16_SLOWER_ID in ids, record.probes[0].data.get("speed_summary")
    assert BF16_NOT_NATIVE_ID not in ids, "the hardware fact was raised as a second finding"
    finding = next(f for f in record.findings if f.id == BF16_SLOWER_ID)
    # Both facts, in the one finding: the measured ratio and the missing bf16 units.
    assert "x slower than fp32" in finding.title and "no native bf16" in finding.title
    hardware = finding.evidence["bf16_not_native"]
    assert hardware["bf16_native"] is False and hardware["isa"] == info.extra["isa"]
    assert "Measured" in finding.detail and "AVX512-BF16" in finding.detail
    assert finding.fix == CPU_WITHOUT_BF16_FIX
    # The hardware question is still answered, once, by a check that points at the finding.
    assert contradictions(record, specs()) == []
    assert _outcomes(record, BF16_SLOWER_ID) == ["finding"]
    assert _outcomes(record, BF16_NOT_NATIVE_ID) == ["ok"]
    check = next(c for c in record.all_checks() if c.id == BF16_NOT_NATIVE_ID)
    assert "no native bf16" in check.text and BF16_SLOWER_ID in check.text


def _assert_hardware_finding_alone(record: RunRecord) -> None:
    ids = [f.id for f in record.findings]
    assert BF16_NOT_NATIVE_ID in ids and BF16_SLOWER_ID not in ids
    finding = next(f for f in record.findings if f.id == BF16_NOT_NATIVE_ID)
    assert finding.evidence["bf16_native"] is False and finding.fix == CPU_WITHOUT_BF16_FIX
    assert BF16_SLOWER_ID in finding.detail  # says which finding would carry it, and when
    assert contradictions(record, specs()) == []
    assert _outcomes(record, BF16_NOT_NATIVE_ID) == ["finding"]
    assert len(_outcomes(record, BF16_SLOWER_ID)) == 1
    assert _outcomes(record, BF16_SLOWER_ID) != ["finding"]


def test_this_cpus_bf16_slowdown_is_one_finding(this_cpu: DeviceInfo, workload: Workload) -> None:
    """The real A/B on this CPU: bf16 is several times slower than fp32 at the model's shapes.
    When the A/B is sure of it, one finding carries both facts; when the machine's load keeps it
    from being sure (a shared machine: the comparison is set aside), the hardware fact alone.
    Never both."""
    record = _run(PrecisionProbe(bench_signatures=4, upcast_bench_signatures=2), workload, this_cpu)
    comparison = record.probes[0].data["speed_comparison"]
    assert comparison["speedup"] is not None and comparison["speedup"] < 1
    if BF16_SLOWER_ID in {f.id for f in record.findings}:
        _assert_one_finding_carrying_both(record, this_cpu)
    else:
        _assert_hardware_finding_alone(record)


def test_a_measured_slowdown_carries_the_hardware_fact() -> None:
    """The measured branch on every machine, busy or not: the real audit of a bf16 step, on a CPU
    without bf16 units, whose bf16 speed is planted 80x below fp32's (as when every op is
    converted), judged by the probe alone (outside the load window, which on a saturated shared
    machine rightly sets every comparison aside)."""
    old_cpu = DeviceInfo(kind="cpu", name="CPU without bf16", arch="x86_64")
    old_cpu.extra["isa"] = ["avx2", "fma"]
    slow = _PlantedSpeed(bf16_factor=80.0)
    record = _run(slow, TinyLoop(), old_cpu, _tiny_config(), load_window=False)
    _assert_one_finding_carrying_both(record, old_cpu)
    # The twin: bf16 as fast as fp32, so nothing is measured slower: the hardware fact alone.
    even = _PlantedSpeed(bf16_factor=1.0)
    twin = _run(even, TinyLoop(), old_cpu, _tiny_config(), load_window=False)
    _assert_hardware_finding_alone(twin)


def test_without_the_speed_measurement_the_hardware_finding_stands_alone(
    this_cpu: DeviceInfo, workload: Workload
) -> None:
    # The twin: the same probe with no benchmark time, so bf16 against fp32 is never measured.
    record = _run(PrecisionProbe(bench_signatures=4, total_bench_budget_s=0.0), workload, this_cpu)
    assert record.probes[0].data["speed_comparison"]["speedup"] is None
    _assert_hardware_finding_alone(record)
    assert _outcomes(record, BF16_SLOWER_ID) == ["not_judged"]
