"""Regressions of the optimizer verdicts a user saw on the page:

1. one cause, two ids: the probe said ``optimizer.host_sync_in_step``, the trace rule
   ``optimizer.sync_in_step`` (now one id, one builder, one wording);
2. a finding said "optimizer.step() takes 103.5 ms" while the phase bar showed 9.14 ms (a finding
   now quotes the phase bar's number and says why the A/B's differs);
3. a fix proposed the optimizer the run already used.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.catalogs import specs
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.optimizer.ab import ABRow
from diagnose.probes.optimizer.numerics import compare_updates, numerics_rule
from diagnose.probes.optimizer.probe import (
    CANDIDATES,
    Candidate,
    OptimizerProbe,
    ProfiledEvent,
    count_step_syncs,
    slower_than_alternative_rule,
    sync_in_step_finding,
)
from diagnose.record import DeviceInfo, RunRecord
from diagnose.units import format_seconds
from diagnose.verdicts import contradictions, settle
from diagnose.workload.step import Workload
from tests.conftest import one_torch_thread
from tests.test_trace_synthetic import training_trace

CPU = torch.device("cpu")
PAIR = (
    Path(__file__).resolve().parent.parent / "fixtures" / "optimizer" / "adamw8bit_update_pair.pt"
)
#: Planted slowness of a step: far above the noise of a tiny LoRA's AdamW step on a busy CPU.
PLANTED_DELAY_S = 0.1


# --------------------------------------------------------------------------------------------
# 1. One id, one wording, whoever finds the sync


def _adamw_step_events(*, with_syncs: bool) -> list[ProfiledEvent]:
    """What a GPU profiler records around torch AdamW (foreach) stepping with a .item() inside:
    per step a few launches and, when planted, one blocking synchronisation."""
    events: list[ProfiledEvent] = []
    t = 0.0
    for _ in range(3):
        begin = t
        for _ in range(3):
            events.append(ProfiledEvent("cudaLaunchKernel", t + 1, t + 4, 777))
            t += 5
        if with_syncs:
            events.append(ProfiledEvent("cudaStreamSynchronize", t, t + 40, 777))
            t += 45
        events.append(ProfiledEvent("Optimizer.step#AdamW.step", begin, t + 1, 1))
        t += 20
    return events


def test_probe_and_trace_rule_report_one_sync_id_in_one_wording(tmp_path: Path) -> None:
    traced = training_trace(tmp_path / "sync.json", sync_in_optimizer=True)
    from_trace = next(f for f in traced.findings if f.category == "optimizer")
    from_probe = sync_in_step_finding(
        count_step_syncs(_adamw_step_events(with_syncs=True)),
        device_kind="cuda",
        running="adamw-foreach",
        running_label=catalog.label("adamw-foreach"),
    )
    assert from_probe is not None
    assert from_probe.id == from_trace.id == "optimizer.sync_in_step"
    # The same cause on the same optimizer reads the same: one title up to the trace's cost,
    # one fix.
    assert from_trace.title.startswith(from_probe.title)
    assert from_probe.title == (
        "optimizer.step() of torch AdamW (foreach) makes the host wait for the GPU 1 time(s) "
        "per step (1 cudaStreamSynchronize)"
    )
    assert from_probe.fix == from_trace.fix
    # Clean twins: quiet on both sides.
    clean = training_trace(tmp_path / "clean.json")
    assert not [f for f in clean.findings if f.category == "optimizer"]
    assert (
        sync_in_step_finding(
            count_step_syncs(_adamw_step_events(with_syncs=False)),
            device_kind="cuda",
            running="adamw-foreach",
            running_label="x",
        )
        is None
    )


# --------------------------------------------------------------------------------------------
# 2 and 3 on a real run: the configured optimizer is slowed, the A/B finds the faster one


def _slowed(step: Callable[..., Any]) -> Callable[..., Any]:
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(PLANTED_DELAY_S)
        return step(*args, **kwargs)

    return slow


def _run(workload: Workload, record: RunRecord, candidates: tuple[Candidate, ...]) -> RunRecord:
    """The probe on the workload, settled into a copy of ``record`` as a run would save it."""
    ctx = ProbeContext(
        config=workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu"),
        record=record,
        workload=workload,
    )
    probe = OptimizerProbe(
        candidates=candidates, min_calls=5, max_calls=5, budget_s=0.0, profiled_calls=1
    )
    probe.numerics = False
    with one_torch_thread():  # its A/B times steps (see one_torch_thread)
        result = run_probe(probe, ctx)
    assert result.status == "ok", result.traceback
    saved = copy.deepcopy(record)
    saved.findings = list(result.findings)
    result.findings = []
    saved.probes = [result]
    settle(saved, specs())
    return saved


def _with_phase(record: RunRecord, share: float) -> RunRecord:
    """``record`` whose phase bar gives the optimizer ``share`` of the step: far below the step
    the planted delay makes when timed alone, as in the report that showed the bug."""
    shown = copy.deepcopy(record)
    shown.breakdown.seconds["optimizer"] = share * shown.timing.headline.median
    return shown


def test_a_slower_optimizer_quotes_the_phase_bar_and_proposes_a_change_it_lacks(
    tiny: tuple[Workload, RunRecord],
) -> None:
    workload, measured = tiny
    record = _with_phase(measured, 0.05)
    phase = record.breakdown.seconds["optimizer"]
    assert catalog.label("adamw-single") == "torch AdamW (for-loop)"
    foreach = tuple(c for c in CANDIDATES if c.key == "adamw-foreach")
    optimizer = workload.optimizer
    optimizer.step = _slowed(optimizer.step)  # type: ignore[method-assign]
    try:
        saved = _run(workload, record, foreach)
    finally:
        del optimizer.step
    finding = next(f for f in saved.findings if f.id == "optimizer.slower_than_alternative")
    # 2. The phase bar's number, written as the bar writes it; the step timed alone beside it.
    shown = format_seconds(phase, like=record.timing.headline.median)
    assert f"The optimizer phase takes {shown} per step" in finding.title
    assert "timed alone" in finding.title
    alone = finding.evidence["configured_step_ms_timed_alone"] * 1e-3
    assert alone >= PLANTED_DELAY_S
    assert format_seconds(alone) in finding.title
    assert finding.est_seconds_saved_per_it is not None
    assert finding.est_seconds_saved_per_it < phase
    assert not contradictions(saved, specs())
    # 3. The run already uses torch AdamW: the fix changes its implementation, never its kind.
    assert finding.fix.startswith("Keep torch AdamW and pass foreach=True")
    assert "--optimizer_type AdamW" not in finding.fix

    # The clean twin: the run steps with foreach, the alternative (the for-loop, slowed too) is
    # the slower one: no finding, the question answered ok.
    def slow_for_loop(params: list[torch.nn.Parameter], lr: float) -> Any:
        optimizer = torch.optim.AdamW(params, lr=lr, foreach=False)
        optimizer.step = _slowed(optimizer.step)  # type: ignore[method-assign]
        return optimizer

    workload.optimizer = torch.optim.AdamW(
        workload.lora_parameters(), lr=workload.config.learning_rate, foreach=True
    )
    try:
        twin = _run(workload, record, (Candidate("adamw-single", "for-loop", slow_for_loop),))
    finally:
        workload.optimizer = optimizer
    assert not [f for f in twin.findings if f.id == "optimizer.slower_than_alternative"]
    assert any(
        c.id == "optimizer.slower_than_alternative" and c.outcome == "ok" for c in twin.all_checks()
    )


# --------------------------------------------------------------------------------------------
# 3. A fix never proposes what the run already uses


def test_switching_fixes_never_name_the_running_optimizer() -> None:
    for running in catalog.LABELS:
        assert catalog.switch_fix(running, running) == ""
    for running in catalog.TORCH_ADAMW:
        for target in catalog.TORCH_ADAMW:
            if target != running:
                fix = catalog.switch_fix(running, target)
                assert fix.startswith("Keep torch AdamW and pass"), (running, target)
                assert "--optimizer_type AdamW" not in fix
    # A fused AdamW that syncs: the syncs come from elsewhere, not a reason to pass fused=True.
    assert "fused=True" not in catalog.sync_fix("adamw-fused")
    assert "foreach=True" not in catalog.sync_fix("adamw-foreach")
    assert "fused=True" in catalog.sync_fix("adamw8bit")


def test_a_rows_of_the_running_kind_is_never_the_faster_alternative() -> None:
    """An A/B row of the configured optimizer's own kind (a rerun of it) cannot be proposed."""
    slow = ABRow("torch AdamW (fused)", "adamw-fused", True, [0.040 + i * 1e-4 for i in range(5)])
    same = ABRow("torch AdamW (fused)", "adamw-fused", False, [0.010 + i * 1e-4 for i in range(5)])
    assert slower_than_alternative_rule([slow, same], s_per_it=0.2) is None
    other = ABRow("AdamW8bit", "adamw8bit", False, [0.010 + i * 1e-4 for i in range(5)])
    finding = slower_than_alternative_rule([slow, same, other], s_per_it=0.2)
    assert finding is not None and "AdamW8bit" in finding.fix


def test_a_broken_8bit_build_on_an_adamw_run_says_keep_adamw() -> None:
    pair = torch.load(PAIR, weights_only=True)
    broken = compare_updates(pair["update_8bit_perturbed"], pair["update_fp32"], pair["bound"])
    on_adamw = numerics_rule(broken, running="adamw-fused")
    assert on_adamw is not None and on_adamw.severity == "warn"
    assert on_adamw.fix.startswith("Keep torch AdamW (fused)")
    assert "--optimizer_type AdamW" not in on_adamw.fix
    on_8bit = numerics_rule(broken, running="adamw8bit")
    assert on_8bit is not None and on_8bit.severity == "critical"
    assert "fused=True" in on_8bit.fix
    clean = compare_updates(pair["update_8bit"], pair["update_fp32"], pair["bound"])
    assert numerics_rule(clean, running="adamw-fused") is None


def test_the_trace_rule_fix_does_not_propose_the_traced_optimizer(tmp_path: Path) -> None:
    traced = training_trace(tmp_path / "sync.json", sync_in_optimizer=True)
    finding = next(f for f in traced.findings if f.id == "optimizer.sync_in_step")
    # The trace steps torch AdamW with foreach kernels: the old fix said "or foreach=True".
    assert "foreach=True" not in finding.fix
    assert "torch AdamW (foreach) does not synchronise by itself" in finding.fix


# --------------------------------------------------------------------------------------------
# Size-dependent advice is judged on the real model's shapes


def test_the_8bit_threshold_is_judged_on_the_full_size_lora_tensors() -> None:
    """bitsandbytes keeps fp32 state for tensors below min_8bit_size. The tiny SD1.5's LoRA
    tensors are all below the default threshold (the finding would fire); the full-size preset's,
    built on the meta device, are all above it (no advice for the real model)."""
    from diagnose.probes.optimizer.inventory import fp32_state_share
    from diagnose.workload.models import lora_tensor_sizes

    tiny = lora_tensor_sizes("sd15", "tiny", 16)
    full = lora_tensor_sizes("sd15", "full", 16)
    threshold = catalog.BNB_DEFAULT_MIN_8BIT_SIZE
    assert fp32_state_share(tiny, threshold) >= catalog.FP32_SHARE_RAISED
    assert fp32_state_share(full, threshold) < catalog.FP32_SHARE_RAISED
    # A threshold above the real tensors keeps the real model's state in fp32: the finding holds.
    assert fp32_state_share(full, max(full) + 1) == 1.0
