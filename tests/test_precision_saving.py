"""Regression: ``precision.bf16_slower_than_fp32`` claimed "saves about 2.08 s/it (148% of the
step)" on a 1.41 s/it run.

A real audited step of a small bf16 autocast loop, a device whose bf16 is planted 80x slower than
fp32 (what a CPU without AVX512-BF16/AMX does), and a run whose headline step is much shorter
than the audit's inflated op times: the probe's own saving must already fit in the run's compute
phases (settle() has nothing to cap) and the title must not quote numbers the report contradicts.
The clean twin (bf16 faster than fp32) stays quiet.
"""

from __future__ import annotations

import re

import torch

from diagnose.catalogs import specs
from diagnose.catalogs.precision_catalog import BF16_SLOWER_ID, COMPUTE_PHASES
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.precision.audit import audit_step
from diagnose.probes.precision.probe import PrecisionProbe
from diagnose.probes.precision.replay import BenchResult
from diagnose.probes.precision.speed import Bencher
from diagnose.record import DeviceInfo, ProbeResult, RunRecord, StepSample, new_record, phase_bound
from diagnose.verdicts import contradictions, settle
from tests.conftest import ok_lines
from tests.test_precision_probe import CPU, TinyLoop, _tiny_config

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class _PlantedSpeed(PrecisionProbe):  # type: ignore[misc]
    """The real audit, with the device's bf16 speed planted: ``bf16_factor`` x fp32's time."""

    def __init__(self, bf16_factor: float) -> None:
        super().__init__(bench_signatures=4, upcast_bench_signatures=2)
        self.bf16_factor = bf16_factor

    def _bencher(self, device: torch.device, deadline: float | None = None) -> Bencher:
        factors = {"fp32": 1.0, "bf16": self.bf16_factor, "fp16": 0.5}

        def bench(spec: object, base: torch.dtype, low: torch.dtype) -> tuple[BenchResult, ...]:
            return tuple(  # type: ignore[return-value]
                BenchResult(
                    _NAMES[dtype],
                    [1e-4 * factors[_NAMES[dtype]] * (1 + 0.01 * i) for i in range(6)],
                )
                for dtype in (base, low)
            )

        return bench


def _run(bf16_factor: float) -> tuple[RunRecord, ProbeResult]:
    loop = TinyLoop()
    # What the audit will count, to plant a headline run far shorter than it (the audit times
    # every op alone with the device synchronised, so on a real run it is the longer one).
    audited = audit_step(loop, precision="bf16-mixed", requested_low="bf16", device=CPU)
    audited_compute = sum(g.seconds for g in audited.groups if g.phase in COMPUTE_PHASES)
    step = audited_compute / 4
    record = new_record("run")
    record.timing.samples = [StepSample(index=i, seconds=step) for i in range(5)]
    record.timing.summarize()
    record.breakdown.seconds = {"forward": 0.3 * step, "backward": 0.5 * step, "other": 0.2 * step}
    info = DeviceInfo(kind="cpu", name="test CPU", arch="x86_64", extra={"isa": ["avx512_bf16"]})
    ctx = ProbeContext(
        config=_tiny_config(), device=CPU, device_info=info, record=record, workload=loop
    )
    result = run_probe(_PlantedSpeed(bf16_factor), ctx)
    assert result.status == "ok", result.traceback
    record.probes = [result]
    record.findings = list(result.findings)
    return record, result


def test_bf16_slower_saving_fits_in_the_runs_compute_phases() -> None:
    record, _ = _run(bf16_factor=80.0)
    finding = next(f for f in record.findings if f.id == BF16_SLOWER_ID)
    bound = phase_bound(record, COMPUTE_PHASES)
    assert bound is not None
    saving = finding.est_seconds_saved_per_it
    assert saving is not None and 0 < saving <= bound
    sure = finding.sure_seconds_saved_per_it
    assert sure is not None and 0 < sure <= saving
    settle(record, specs())
    assert "saving_cap" not in finding.evidence  # the probe's number needed no cap
    assert finding.est_seconds_saved_per_it == saving
    assert contradictions(record, specs()) == []
    # The title quotes the measured ratio, the one number it is sure of, and no share of a step.
    ratio = re.search(r"([\d.]+)x slower", finding.title)
    assert ratio and float(ratio.group(1)) == round(finding.evidence["bf16_over_fp32_time"], 2)
    assert "%" not in finding.title and " s/it" not in finding.title


def test_bf16_faster_than_fp32_stays_quiet() -> None:
    record, result = _run(bf16_factor=0.5)
    assert BF16_SLOWER_ID not in {f.id for f in record.findings}
    assert any("not a measurable slowdown" in line for line in ok_lines(result))
    settle(record, specs())
    assert contradictions(record, specs()) == []
