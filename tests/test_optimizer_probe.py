"""The optimizer probe: step time and syncs, the A/B table and the whole probe on the real tiny
workload (the 8-bit split and 8-bit numerics are ``test_optimizer_8bit.py``).

Real torch optimizers, real bitsandbytes (its CPU build), a real tiny SD1.5 LoRA workload. The GPU
sync rule is fed constructed profiler events, since no GPU is here. Timings are never asserted
on; only structure, counts and planted effects.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from typing import Any

import pytest
import torch

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.catalogs import specs
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.optimizer.probe import (
    CANDIDATES,
    ABRow,
    Candidate,
    OptimizerProbe,
    ProfiledEvent,
    bitsandbytes_inventory,
    count_step_syncs,
    implied_s_per_it,
    optimizer_key,
    profile_steps,
    slower_than_alternative_rule,
    sync_in_step_finding,
)
from diagnose.probes.optimizer.syncs import MeasuredCost, sync_question
from diagnose.record import DeviceInfo, Finding, RunRecord, StepSample, new_record
from diagnose.verdicts import WARN_SHARE, settle_findings
from diagnose.workload.optimizers import build_optimizer
from diagnose.workload.step import Workload
from tests.conftest import ok_lines, unjudged_lines

CPU = torch.device("cpu")
#: LoRA matrix shapes of a rank-16 adapter on 32/64-wide projections (the tiny preset's).
LORA_SHAPES = [(16, 32), (32, 16), (16, 64), (64, 16)]

needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)


def _fast_probe(**overrides: Any) -> OptimizerProbe:
    """The probe with few timed calls: these tests check what it reports, not the timings."""
    settings: dict[str, Any] = {
        "min_calls": 3,
        "max_calls": 4,
        "budget_s": 0.0,
        "profiled_calls": 1,
        "numerics_tensors": 2,
    }
    settings.update(overrides)
    return OptimizerProbe(**settings)


def _lora_tensors(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Small LoRA-shaped parameters and gradients spanning a few decades, like real ones."""
    generator = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for shape in LORA_SHAPES:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.05)
        magnitude = torch.exp(torch.randn(shape, generator=generator) * 1.5)
        grads.append(torch.randn(shape, generator=generator) * magnitude * 1e-3)
        params.append(param)
    return params, grads


# --------------------------------------------------------------------------------------------
# The tiny workload, shared by the module (built once: ~10 s)


class ItemOptimizer(torch.optim.Optimizer):
    """Plain SGD that reads one value per parameter into Python, as careless code does."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-4) -> None:
        super().__init__(params, {"lr": lr})
        self.read: list[float] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                self.read.append(param.grad.abs().max().item())
                param.add_(param.grad, alpha=-group["lr"])


def _ctx(workload: Workload, record: RunRecord) -> ProbeContext:
    return ProbeContext(
        config=workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=record,
        workload=workload,
    )


def _workload_state(workload: Workload) -> dict[str, Any]:
    optimizer = workload.optimizer
    return {
        "params": [p.detach().clone() for p in workload.lora_parameters()],
        "grads": [p.grad for p in workload.lora_parameters()],
        "state": {
            i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for i, s in enumerate(optimizer.state[p] for p in workload.lora_parameters())
        },
        "optimizer": optimizer,
    }


def _assert_unchanged(before: dict[str, Any], workload: Workload) -> None:
    after = _workload_state(workload)
    assert after["optimizer"] is before["optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert all(g is None for g in after["grads"])
    assert before["state"].keys() == after["state"].keys()
    for index, saved in before["state"].items():
        now = after["state"][index]
        assert saved.keys() == now.keys()
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, now[key]), (index, key)
            else:
                assert value == now[key]


# --------------------------------------------------------------------------------------------
# Syncs inside the step: .item() on the CPU is counted, never a stall


def test_item_reads_on_cpu_are_counted_not_called_stalls(
    tiny: tuple[Workload, RunRecord],
) -> None:
    workload, record = tiny
    configured = workload.optimizer
    params = workload.lora_parameters()
    workload.optimizer = ItemOptimizer(params)
    try:
        before = _workload_state(workload)
        result = run_probe(_fast_probe(candidates=(), numerics=False), _ctx(workload, record))
        _assert_unchanged(before, workload)
    finally:
        workload.optimizer = configured

    assert result.status == "ok", result.traceback
    syncs = result.data["configured"]["syncs"]
    assert syncs["scalar_reads_per_step"] == len(params)  # one .item() per parameter
    assert syncs["host_syncs"] == 0
    assert result.data["configured"]["key"] == "custom:ItemOptimizer"
    assert not [f for f in result.findings if f.id == "optimizer.sync_in_step"]
    assert any("not stalls" in line for line in ok_lines(result))
    assert "optimizer.sync_in_step" in {c.id for c in result.checks if c.outcome == "ok"}


def test_real_profiler_counts_item_reads_inside_the_step() -> None:
    params, grads = _lora_tensors()
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    optimizer = ItemOptimizer(params)
    events = profile_steps(optimizer.step, lambda: None, CPU, calls=2)
    syncs = count_step_syncs(events)
    assert syncs.steps == 2
    assert syncs.scalar_reads == 2 * len(params)
    assert syncs.host_syncs == 0 and not syncs.runtime_events_seen


def _gpu_step_events(*, with_syncs: bool, steps: int = 3) -> list[ProfiledEvent]:
    """What the profiler records around bitsandbytes' 8-bit step on a GPU: per parameter a
    kernel launch and (bitsandbytes.utils.sync_gpu) a device synchronisation."""
    # Runtime calls carry the OS thread id, torch's spans the profiler's own thread number.
    os_thread, torch_thread = 48151, 1
    events: list[ProfiledEvent] = []
    t = 0.0
    for _ in range(steps):
        begin = t
        t += 5
        for _ in range(4):
            events.append(ProfiledEvent("cudaLaunchKernel", t, t + 4, os_thread))
            t += 5
            if with_syncs:
                events.append(ProfiledEvent("cudaDeviceSynchronize", t, t + 40, os_thread))
                t += 45
        events.append(ProfiledEvent("Optimizer.step#AdamW8bit.step", begin, t + 1, torch_thread))
        # The probe's own span around the call, with torch's span nested in it.
        events.append(
            ProfiledEvent("diagnose::optimizer_probe.step", begin - 1, t + 2, torch_thread)
        )
        t += 10
        # A synchronisation after the step (the timer's) is not the step's.
        events.append(ProfiledEvent("cudaDeviceSynchronize", t, t + 3, os_thread))
        t += 10
    return events


def test_sync_inside_the_gpu_step_is_a_finding_and_the_clean_twin_is_quiet() -> None:
    planted = count_step_syncs(_gpu_step_events(with_syncs=True))
    assert planted.steps == 3
    assert planted.host_syncs == 12
    assert planted.by_name == {"cudaDeviceSynchronize": 12}
    assert planted.host_sync_seconds == pytest.approx(12 * 40e-6)
    finding = sync_in_step_finding(
        planted,
        device_kind="cuda",
        running="adamw8bit",
        running_label="bitsandbytes AdamW8bit",
        alone_seconds=0.02,
    )
    assert finding is not None
    assert finding.id == "optimizer.sync_in_step"
    # Bounded by the step, not the optimizer's phase: a wait drains what the step overlapped.
    assert finding.category == "optimizer" and finding.phases == []
    # The probe sees the waits, not the device idle they cause: it claims no saving.
    assert finding.est_seconds_saved_per_it is None
    assert finding.evidence["host_syncs_per_step"] == 4
    assert "fused=True" in finding.fix and "AdamW8bit`" not in finding.fix

    clean = count_step_syncs(_gpu_step_events(with_syncs=False))
    assert clean.steps == 3 and clean.host_syncs == 0 and clean.runtime_events_seen
    assert (
        sync_in_step_finding(clean, device_kind="cuda", running="adamw8bit", running_label="x")
        is None
    )
    # The same events from a CPU run would be no stall at all.
    assert (
        sync_in_step_finding(planted, device_kind="cpu", running="adamw8bit", running_label="x")
        is None
    )


def test_rocm_blocking_copy_counts_and_item_reads_stand_in_without_runtime_events() -> None:
    rocm = [
        ProfiledEvent("Optimizer.step#AdamW.step", 0, 100),
        ProfiledEvent("aten::item", 10, 30),
        ProfiledEvent("aten::_local_scalar_dense", 11, 29),
        ProfiledEvent("hipMemcpyWithStream", 12, 28),
    ]
    syncs = count_step_syncs(rocm)
    assert (syncs.host_syncs, syncs.scalar_reads) == (1, 1)
    assert sync_in_step_finding(
        syncs, device_kind="rocm", running="adamw-foreach", running_label="x"
    )
    # A device tracer that recorded no runtime call: an .item() may read a CPU tensor (torch
    # AdamW's step counters do), so nothing is called a stall and the question is not judged.
    no_runtime = count_step_syncs([e for e in rocm if not e.name.startswith("hip")])
    assert no_runtime.scalar_reads == 1
    assert (
        sync_in_step_finding(no_runtime, device_kind="rocm", running="custom:X", running_label="x")
        is None
    )
    said = sync_question(no_runtime, "rocm", "x")
    assert said is not None and "cannot be told" in said


def test_the_ab_against_fused_adamw_is_the_cost_of_a_synchronising_step() -> None:
    planted = count_step_syncs(_gpu_step_events(with_syncs=True))
    cost = MeasuredCost(0.019, 0.015, "torch AdamW (fused)")
    finding = sync_in_step_finding(
        planted,
        device_kind="cuda",
        running="adamw8bit",
        running_label="bitsandbytes AdamW8bit",
        measured=cost,
    )
    assert finding is not None
    assert finding.est_seconds_saved_per_it == 0.019 and finding.saving_basis == "measured"
    assert finding.sure_seconds_saved_per_it == 0.015
    assert "measured without the profiler against torch AdamW (fused)" in finding.title
    assert "4 cudaDeviceSynchronize" in finding.title


# --------------------------------------------------------------------------------------------
# The A/B rule


def _row(name: str, median_ms: float, spread_ms: float, *, configured: bool = False) -> ABRow:
    samples = [(median_ms + d * spread_ms) * 1e-3 for d in (-1.0, -0.5, 0.0, 0.5, 1.0)]
    key = {"AdamW8bit": "adamw8bit", "AdamW": "adamw-foreach"}.get(name, name)
    return ABRow(optimizer=name, key=key, configured=configured, step_seconds=samples)


def _graded(finding: Finding, s_per_it: float) -> str:
    """The severity the one rule of diagnose.verdicts gives ``finding`` in a run of s_per_it."""
    record = new_record("run")
    record.timing.samples = [StepSample(index=i, seconds=s_per_it) for i in range(3)]
    record.timing.summarize()
    record.findings = [finding]
    settle_findings(record, specs())
    return finding.severity


def test_a_clearly_faster_alternative_is_a_measured_finding() -> None:
    rows = [
        _row("AdamW8bit", 40.0, 1.0, configured=True),
        _row("AdamW", 8.0, 0.5),
        _row("Adafactor", 30.0, 1.0),
    ]
    finding = slower_than_alternative_rule(rows, s_per_it=0.2)
    assert finding is not None
    assert finding.id == "optimizer.slower_than_alternative"
    assert finding.saving_basis == "measured"
    assert finding.est_seconds_saved_per_it == pytest.approx(0.032)
    assert finding.sure_seconds_saved_per_it is not None
    assert 0 < finding.sure_seconds_saved_per_it < 0.032
    assert finding.evidence["fastest"] == "AdamW"
    assert "--optimizer_type AdamW`" in finding.fix
    assert _graded(finding, 0.2) == "warn"  # 16 % of s/it
    critical = slower_than_alternative_rule(rows, s_per_it=0.08)
    assert critical is not None and _graded(critical, 0.08) == "critical"


def test_severity_follows_the_saving_the_ab_is_sure_of() -> None:
    """A median saving of 12% of s/it whose interval reaches down to 8% stays info (it would flip
    between info and warn from run to run); the same saving measured tightly is warn."""
    fastest = ABRow("AdamW", "adamw-foreach", False, [x * 1e-3 for x in (9.5, 10, 10, 10, 10.5)])
    loose = ABRow("AdamW8bit", "adamw8bit", True, [x * 1e-3 for x in (30, 33, 40, 41, 42)])
    finding = slower_than_alternative_rule([loose, fastest], s_per_it=0.25)
    assert finding is not None and finding.evidence["share_of_s_per_it"] >= WARN_SHARE
    assert finding.evidence["share_of_s_per_it_low"] < WARN_SHARE
    assert _graded(finding, 0.25) == "info"
    tight = ABRow("AdamW8bit", "adamw8bit", True, [x * 1e-3 for x in (39.5, 40, 40, 40, 40.5)])
    tight_finding = slower_than_alternative_rule([tight, fastest], s_per_it=0.25)
    assert tight_finding is not None and _graded(tight_finding, 0.25) == "warn"


def test_no_finding_when_configured_is_fastest_or_within_noise_or_negligible() -> None:
    fastest = [_row("AdamW", 8.0, 0.5, configured=True), _row("AdamW8bit", 40.0, 1.0)]
    assert slower_than_alternative_rule(fastest, s_per_it=0.5) is None
    # 20 % faster by the median, but the spreads overlap: noise, not a result.
    noisy = [_row("AdamW8bit", 10.0, 8.0, configured=True), _row("AdamW", 8.0, 8.0)]
    assert slower_than_alternative_rule(noisy, s_per_it=0.5) is None
    # Clearly faster but a sliver of s/it.
    sliver = [_row("AdamW8bit", 4.0, 0.1, configured=True), _row("AdamW", 2.0, 0.1)]
    assert slower_than_alternative_rule(sliver, s_per_it=10.0) is None


def test_implied_s_per_it_swaps_the_step() -> None:
    assert implied_s_per_it(1.0, 0.2, 0.05) == pytest.approx(0.85)
    assert implied_s_per_it(None, 0.2, 0.05) is None
    assert implied_s_per_it(1.0, 0.2, math.nan) is None


# --------------------------------------------------------------------------------------------
# The whole probe on the real tiny workload


@needs_bnb
def test_ab_table_on_the_tiny_workload_and_the_workload_is_put_back(
    tiny: tuple[Workload, RunRecord],
) -> None:
    workload, record = tiny
    chosen = [c for c in CANDIDATES if c.key in ("adamw-foreach", "adamw8bit")]
    before = _workload_state(workload)
    result = run_probe(_fast_probe(candidates=chosen), _ctx(workload, record))
    _assert_unchanged(before, workload)

    assert result.status == "ok", result.traceback
    rows = {row["optimizer"]: row for row in result.data["ab"]["rows"]}
    assert list(rows) == [
        "torch AdamW (for-loop)",
        "torch AdamW (foreach)",
        "bitsandbytes AdamW8bit",
    ]
    assert rows["torch AdamW (for-loop)"]["configured"]
    elements = sum(p.numel() for p in workload.lora_parameters())
    for row in rows.values():
        assert not row["error"]
        assert row["samples"] >= 3 and row["step_ms_median"] > 0
        assert row["implied_s_per_it"] is not None
        assert row["state_bytes"]["float32"] >= 2 * 4 * elements
        # On the CPU only the configured optimizer is profiled: nothing waits for a device.
        assert row["host_syncs_per_step"] == (0 if row["configured"] else None)
    # torch AdamW reads its CPU step counters with .item(); bitsandbytes does not.
    assert rows["torch AdamW (for-loop)"]["scalar_reads_per_step"] >= len(before["params"])
    assert result.data["inventory"]["bitsandbytes"]["version"]
    assert result.data["inventory"]["configured_optimizer"]["key"] == "adamw-single"
    # 8-bit split of the A/B's AdamW8bit: data only, the configured optimizer is not 8-bit.
    assert result.data["eight_bit"]["fp32_share"] == 1.0
    assert not [f for f in result.findings if f.id == "optimizer.8bit_state_mostly_fp32"]
    numerics = result.data["numerics"]
    assert numerics["quantised_tensors"] == 2
    assert numerics["stats"]["share_outside_bound"] <= 0.01
    assert not [f for f in result.findings if f.id == "optimizer.8bit_numerics"]
    # The data is JSON a record can carry.
    saved = new_record("run")
    saved.probes.append(result)
    assert json.loads(saved.to_json())["probes"][0]["data"]["ab"]["rows"]


def test_past_its_time_budget_each_optimizer_takes_its_fewest_calls_and_says_why(
    tiny: tuple[Workload, RunRecord],
) -> None:
    """Two calls a side are too few for the A/B to be sure of anything, so "no other optimizer
    is clearly faster" would be an answer the budget made, not the measurement: with the budget
    planted spent each optimizer stops at its fewest calls and the answer stays open, saying
    why; within the budget the same probe takes its calls up to the most."""
    workload, record = tiny
    chosen = [c for c in CANDIDATES if c.key == "adamw-foreach"]
    probe = _fast_probe(
        candidates=chosen, numerics=False, min_calls=2, max_calls=12, budget_s=3600.0
    )
    spent = run_probe(probe, _ctx(workload, record), budgets={"optimizer": 0.0})
    assert spent.status == "ok", spent.traceback
    rows = spent.data["ab"]["rows"]
    assert len(rows) == 2 and all(r["samples"] == 2 and r["stopped_by_budget"] for r in rows)
    (answer,) = [c for c in spent.checks if c.id == catalog.SLOWER_THAN_ALTERNATIVE.id]
    assert answer.outcome == "not_judged" and BUDGET_STOPPED in answer.text
    within = run_probe(probe, _ctx(workload, record), budgets={"optimizer": 3600.0})
    rows = within.data["ab"]["rows"]
    assert all(r["samples"] == 12 and not r["stopped_by_budget"] for r in rows)
    assert not any(BUDGET_STOPPED in c.text for c in within.checks)


@needs_bnb
def test_configured_adamw8bit_on_small_lora_reports_the_fp32_state(
    tiny: tuple[Workload, RunRecord],
) -> None:
    workload, record = tiny
    configured = workload.optimizer
    workload.optimizer = build_optimizer(
        "adamw8bit", workload.lora_parameters(), workload.config.learning_rate, CPU
    )
    try:
        assert optimizer_key(workload.optimizer, CPU) == "adamw8bit"
        before = _workload_state(workload)
        # Judged as a model of this size: its small LoRA tensors keep fp32 state.
        as_real = _ctx(workload, record)
        as_real.config = dataclasses.replace(workload.config, size="full")
        result = run_probe(_fast_probe(candidates=(), numerics=False), as_real)
        _assert_unchanged(before, workload)
        # Judged as what it is, the tiny stand-in of SD1.5: the full-size preset's LoRA tensors
        # clear the threshold, so the split is said to be the shrunk model's, not advice.
        tiny_run = run_probe(_fast_probe(candidates=(), numerics=False), _ctx(workload, record))
    finally:
        workload.optimizer = configured
    assert result.status == "ok", result.traceback
    split = result.data["eight_bit"]
    assert split["of"] == "the configured optimizer"
    assert split["tensors_8bit"] == 0 and split["fp32_share"] == 1.0
    finding = next(f for f in result.findings if f.id == "optimizer.8bit_state_mostly_fp32")
    assert finding.evidence["bytes_fp32"] == split["bytes_fp32"] > 0
    assert result.data["numerics"] == {"skipped": "turned off"}

    assert not [f for f in tiny_run.findings if f.id == "optimizer.8bit_state_mostly_fp32"]
    [answer] = [c for c in tiny_run.checks if c.id == "optimizer.8bit_state_mostly_fp32"]
    assert answer.outcome == "ok" and "artefact of the shrunk model" in answer.text
    assert tiny_run.data["eight_bit"]["full_size"]["below_min_8bit_size"] == 0


def test_without_bitsandbytes_the_other_optimizers_still_run(
    tiny: tuple[Workload, RunRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    workload, record = tiny
    # A None entry makes `import bitsandbytes` fail and find_spec report it absent.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    inventory = bitsandbytes_inventory()
    assert inventory["installed"] is False and "not installed" in inventory["reason"]

    chosen = [c for c in CANDIDATES if c.key in ("adamw-foreach", "adamw8bit")]
    result = run_probe(_fast_probe(candidates=chosen), _ctx(workload, record))
    assert result.status == "ok", result.traceback
    rows = {row["key"]: row for row in result.data["ab"]["rows"]}
    assert rows["adamw-foreach"]["samples"] >= 3 and not rows["adamw-foreach"]["error"]
    assert rows["adamw8bit"]["error"].startswith("skipped: bitsandbytes is not installed")
    assert "not installed" in result.data["eight_bit"]["skipped"]
    assert "not installed" in result.data["numerics"]["skipped"]
    assert any("bitsandbytes is not installed" in line for line in unjudged_lines(result))
    assert "not_checked" not in result.data


@needs_bnb
def test_warnings_at_construction_and_first_step_are_kept(
    tiny: tuple[Workload, RunRecord],
) -> None:
    """bitsandbytes warns that paged optimizers fall back on the CPU: the row keeps it."""
    import bitsandbytes

    def paged(params: list[torch.nn.Parameter], lr: float) -> Any:
        return getattr(bitsandbytes.optim, "PagedAdamW8bit")(params, lr=lr)  # noqa: B009

    candidate = Candidate("adamw8bit-paged", "bitsandbytes PagedAdamW8bit", paged, "bitsandbytes")
    workload, record = tiny
    result = run_probe(_fast_probe(candidates=(candidate,), numerics=False), _ctx(workload, record))
    assert result.status == "ok", result.traceback
    row = next(r for r in result.data["ab"]["rows"] if r["key"] == "adamw8bit-paged")
    expected = "Paged optimizers are not supported on CPU"
    assert any(expected in line for line in row["warnings"])
    assert any(
        expected in line
        for line in result.data["inventory"]["bitsandbytes"]["construction_warnings"]
    )


def test_optimizer_keys_name_what_trainers_configure() -> None:
    params = _lora_tensors()[0]
    assert optimizer_key(torch.optim.AdamW(params), CPU) == "adamw-single"
    assert optimizer_key(torch.optim.AdamW(params), torch.device("cuda")) == "adamw-foreach"
    assert optimizer_key(torch.optim.AdamW(params, foreach=True), CPU) == "adamw-foreach"
    assert optimizer_key(torch.optim.AdamW(params, fused=True), CPU) == "adamw-fused"
    assert optimizer_key(build_optimizer("adafactor", params, 1e-4, CPU), CPU) == "adafactor"
    assert optimizer_key(torch.optim.SGD(params, lr=0.1), CPU) == "custom:SGD"
    if importlib.util.find_spec("bitsandbytes") is not None:
        eight = build_optimizer("adamw8bit", params, 1e-4, CPU)
        assert optimizer_key(eight, CPU) == "adamw8bit"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_sync_debug_mode_is_restored_on_a_gpu() -> None:  # pragma: no cover - GPU only
    from diagnose.probes.optimizer.probe import sync_debug_warnings

    value = torch.ones(4, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    caught = sync_debug_warnings(lambda: value.sum().item(), calls=2)
    assert torch.cuda.get_sync_debug_mode() == before
    assert len(caught) >= 2 and caught[0]["stack"]
