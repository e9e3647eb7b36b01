"""The probe runner isolates probes: errors, missing packages, wrong devices never crash a run."""

from __future__ import annotations

import torch

from diagnose.config import RunConfig
from diagnose.probes.base import Probe, ProbeContext, ProbeSkipped, run_probes
from diagnose.probes.budgets import GPU_BUDGET_S, GPU_RUN_S
from diagnose.probes.registry import REGISTRY
from diagnose.record import DeviceInfo, Finding, ProbeResult, new_record


class _Probe:
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()
    description = "test probe"

    def __init__(self, name: str, behaviour: str) -> None:
        self.name = name
        self.behaviour = behaviour

    def run(self, ctx: ProbeContext) -> ProbeResult:
        if self.behaviour == "raise":
            raise RuntimeError("the probe broke\nsecond line")
        if self.behaviour == "skip":
            raise ProbeSkipped("nothing to judge on this device")
        if self.behaviour == "flip-flags":
            torch.backends.cuda.enable_math_sdp(False)
            torch.backends.cuda.enable_flash_sdp(False)
            torch.set_grad_enabled(False)
            result = ProbeResult()
            result.add_ok("test.flags", "flags flipped")
            return result
        if self.behaviour == "wrong-type":
            return "not a result"  # type: ignore[return-value]
        if self.behaviour == "exit":
            raise SystemExit(3)
        return ProbeResult(findings=[Finding(id="test.found", title="found")])


def _ctx(kind: str = "cpu") -> ProbeContext:
    return ProbeContext(
        config=RunConfig(),
        device=torch.device("cpu"),
        device_info=DeviceInfo(kind=kind),
        record=new_record("run"),
    )


def test_each_probe_is_isolated() -> None:
    probes = [
        _Probe("raises", "raise"),
        _Probe("skips", "skip"),
        _Probe("wrong", "wrong-type"),
        _Probe("exits", "exit"),
        _Probe("fine", "ok"),
    ]
    results = {r.name: r for r in run_probes(probes, _ctx())}
    assert results["raises"].status == "error"
    assert results["raises"].reason == "RuntimeError: the probe broke"
    assert "Traceback" in results["raises"].traceback
    assert "the probe broke" in results["raises"].traceback
    assert results["skips"].status == "skipped"
    assert results["skips"].reason == "nothing to judge on this device"
    assert results["wrong"].status == "error"
    assert "not a ProbeResult" in results["wrong"].reason
    assert results["exits"].status == "error"
    assert results["fine"].status == "ok"
    assert results["fine"].findings[0].source == "fine"
    assert all(r.duration_seconds >= 0 for r in results.values())


def test_missing_package_and_wrong_device_are_skipped() -> None:
    needs_pkg = _Probe("needs-pkg", "ok")
    needs_pkg.requires_packages = ("a_package_that_is_not_installed_anywhere",)
    needs_gpu = _Probe("needs-gpu", "ok")
    needs_gpu.device_kinds = ("cuda", "rocm")
    results = run_probes([needs_pkg, needs_gpu, _Probe("off", "ok")], _ctx(), skip=["off"])
    assert [r.status for r in results] == ["skipped", "skipped", "skipped"]
    assert "a_package_that_is_not_installed_anywhere" in results[0].reason
    assert "cuda or rocm" in results[1].reason and "cpu" in results[1].reason
    assert results[2].reason == "turned off with --skip"


def test_torch_switches_flipped_by_a_probe_are_restored() -> None:
    before = (
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.is_grad_enabled(),
    )
    [result] = run_probes([_Probe("flipper", "flip-flags")], _ctx())
    assert result.status == "ok"
    after = (
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.is_grad_enabled(),
    )
    assert after == before


def test_registered_probes_satisfy_the_protocol() -> None:
    names = [p.name for p in REGISTRY]
    assert len(names) == len(set(names))
    for probe in REGISTRY:
        assert isinstance(probe, Probe)
        assert probe.description


def test_a_probe_past_its_time_budget_says_so_and_its_twin_within_does_not() -> None:
    environment = next(p for p in REGISTRY if p.name == "environment")
    ctx = _ctx()
    over = run_probes([environment], ctx, budgets={"environment": 0.0})[0]
    within = run_probes([environment], ctx, budgets={"environment": 3600.0})[0]
    assert over.status == within.status == "ok"
    [check] = [c for c in over.checks if c.id == "environment.time_budget"]
    assert check.outcome == "not_judged"
    assert "ran out of its time budget" in check.text and "of 0 s" in check.text
    assert not [c for c in within.checks if c.id.endswith(".time_budget")]
    # What the probe measured stands: the same checks apart from the budget's.
    assert {c.id for c in over.checks} - {check.id} == {c.id for c in within.checks}


def test_the_probe_sees_its_budget_and_the_context_forgets_it_after() -> None:
    seen: list[float | None] = []

    class Watch(_Probe):
        def run(self, ctx: ProbeContext) -> ProbeResult:
            seen.append(ctx.seconds_left())
            return ProbeResult()

    ctx = _ctx("cuda")
    run_probes([Watch("environment", "ok"), Watch("own", "ok")], ctx)
    assert seen[0] is not None and 0 < seen[0] <= GPU_BUDGET_S["environment"]
    assert seen[1] is None  # a probe without a budget (a user's own) runs without one
    assert ctx.deadline is None


def test_the_default_gpu_run_probes_fit_the_run_budget() -> None:
    default_run = [p.name for p in REGISTRY if p.name != "quantization"]
    assert set(default_run) <= set(GPU_BUDGET_S)
    assert sum(GPU_BUDGET_S[name] for name in default_run) <= GPU_RUN_S
