"""The precision probe on real steps.

Real torch/diffusers/peft objects: the tiny SD1.5 LoRA workload (bf16-mixed, bf16-full, fp32) and
a hand-made tiny training loop, each with one planted fault and a clean twin. Timings are never
asserted on (the machine is shared); only structure, counts and the planted effects. The shared
precision policy and the rules on planted inputs are ``test_precision_rules.py``.
"""

from __future__ import annotations

import gc
import json
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from diagnose.catalogs.precision_catalog import (
    BF16_NOT_NATIVE_ID,
    BF16_SLOWER_ID,
    DTYPE_MISMATCH_ID,
    FP32_TRAINING_ID,
    FP32_WEIGHTS_ID,
    UPCAST_ID,
)
from diagnose.config import RunConfig
from diagnose.probes.base import Probe, ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_RAN_OUT
from diagnose.probes.precision.audit import audit_step
from diagnose.probes.precision.probe import PrecisionProbe
from diagnose.probes.precision.replay import MIN_CALLS, bench_pair, replay_arguments
from diagnose.record import DeviceInfo, ProbeResult, RunRecord
from diagnose.record_io import record_from_dict
from diagnose.timing import PhaseTimer
from diagnose.workload import build_workload
from diagnose.workload.step import Workload
from diagnose.workload.synthetic_images import generate_images
from tests.conftest import ok_lines
from tests.factories import timed_record

CPU = torch.device("cpu")
#: The attention projection the planted-fault tests wrap.
TARGET = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


def _fast_probe() -> PrecisionProbe:
    """Few benchmark calls: these tests check what the probe reports, not the timings."""
    return PrecisionProbe(
        bench_signatures=2, upcast_bench_signatures=2, bench_repeats=3, bench_budget_s=0.01
    )


def _record(seconds: float = 0.1) -> RunRecord:
    return timed_record([seconds] * 3)


def _cpu_info(isa: list[str] | None = None) -> DeviceInfo:
    return DeviceInfo(
        kind="cpu",
        name="test CPU",
        arch="x86_64",
        extra={"isa": isa if isa is not None else ["avx2", "avx512f", "avx512_bf16"]},
    )


def _ctx(workload: Any, config: RunConfig, info: DeviceInfo | None = None) -> ProbeContext:
    return ProbeContext(
        config=config,
        device=CPU,
        device_info=info or _cpu_info(),
        record=_record(),
        workload=workload,
    )


def _run_probe(
    probe: PrecisionProbe, ctx: ProbeContext, budgets: dict[str, float] | None = None
) -> ProbeResult:
    """The probe without a time budget unless one is planted: what it reports is under test, and
    on a busy machine its budget would leave the benchmarks untimed."""
    return run_probe(probe, ctx, budgets={} if budgets is None else budgets)


def _ids(result: ProbeResult) -> set[str]:
    return {f.id for f in result.findings}


# --------------------------------------------------------------------------------------------
# A hand-made tiny loop: policy-only fp32 stays quiet, a dtype mismatch warning is caught


class TinyNet(torch.nn.Module):
    """Linear, LayerNorm, softmax attention and an RMSNorm whose weight dtype may mismatch."""

    def __init__(self, mismatch: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 16)
        dtype = torch.bfloat16 if mismatch else torch.float32
        self.rms_weight = torch.nn.Parameter(torch.ones(16, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        weights = torch.softmax(h @ h.transpose(-1, -2), dim=-1)
        # An fp32 activation with a bf16 weight: torch cannot use its fused RMSNorm.
        h = F.rms_norm((weights @ h).float(), (16,), self.rms_weight)
        out: torch.Tensor = self.out(h)
        return out


class TinyLoop:
    """The workload interface the probe uses, around TinyNet (bf16 autocast on the CPU)."""

    def __init__(self, mismatch: bool = False) -> None:
        torch.manual_seed(0)
        self.denoiser = TinyNet(mismatch)
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.lora_parameters())
        self.scaler = None

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def batches(self) -> Iterator[torch.Tensor]:
        while True:
            yield torch.randn(2, 8, 16)

    def step(self, batch: torch.Tensor, timer: PhaseTimer) -> float:
        with timer.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(self.denoiser(batch).float(), torch.zeros(2, 8, 16))
        with timer.phase("backward"):
            loss.backward()  # type: ignore[no-untyped-call]
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _tiny_config(precision: str = "bf16-mixed") -> RunConfig:
    return RunConfig(preset="sd15", size="tiny", precision=precision)  # type: ignore[arg-type]


def test_policy_fp32_alone_raises_no_warn_finding() -> None:
    loop = TinyLoop(mismatch=False)
    result = _run_probe(_fast_probe(), _ctx(loop, _tiny_config()))
    assert result.status == "ok", result.traceback
    verdicts = result.data["verdicts"]
    assert verdicts["by_policy"]["calls"] >= 3  # layer_norm, softmax, mse_loss (+ backward)
    assert verdicts["low"]["calls"] >= 4  # the linears and matmuls, lowered by autocast
    assert "unexpected" not in verdicts
    judged = {f.id for f in result.findings if f.severity != "info"}
    assert not judged - {BF16_SLOWER_ID}  # speed is a device fact, not a policy op
    assert UPCAST_ID not in _ids(result) and DTYPE_MISMATCH_ID not in _ids(result)
    assert any("no dtype-mismatch" in line for line in ok_lines(result))
    # Backward ops are attributed to the module whose forward call made them.
    backward = [r for r in result.data["ops"] if r["phase"] == "backward" and r["kind"] != "other"]
    assert any(r["module"] == "out" and r["function"] == "linear" for r in backward)


def test_fused_kernel_dtype_warning_is_found() -> None:
    loop = TinyLoop(mismatch=True)
    result = _run_probe(_fast_probe(), _ctx(loop, _tiny_config()))
    assert result.status == "ok", result.traceback
    finding = next(f for f in result.findings if f.id == DTYPE_MISMATCH_ID)
    assert finding.severity == "warn"
    first = finding.evidence["warnings"][0]
    assert first["function"] == "rms_norm" and first["module"] == "(denoiser root)"
    assert first["count"] == 1 and "Cannot dispatch to fused" in first["message"]
    # torch raises it once per process; the audit counts it on every run anyway.
    again = _run_probe(_fast_probe(), _ctx(loop, _tiny_config()))
    assert DTYPE_MISMATCH_ID in _ids(again)


def test_audit_restores_the_loop_and_warning_state() -> None:
    loop = TinyLoop()
    loop.step(next(loop.batches()), PhaseTimer(lambda: None))
    params = [p.detach().clone() for p in loop.lora_parameters()]
    state = {k: v.clone() for k, v in loop.optimizer.state[loop.lora_parameters()[0]].items()}
    optimizer = loop.optimizer
    warn_always = torch.is_warn_always_enabled()
    log = audit_step(loop, precision="bf16-mixed", requested_low="bf16", device=CPU)
    assert log.ops > 20 and log.groups
    assert loop.optimizer is optimizer and torch.is_warn_always_enabled() == warn_always
    assert all(torch.equal(a, b) for a, b in zip(params, loop.lora_parameters(), strict=True))
    assert all(p.grad is None for p in loop.lora_parameters())
    now = loop.optimizer.state[loop.lora_parameters()[0]]
    assert all(torch.equal(v, now[k]) for k, v in state.items())
    # No hook is left on the model.
    for module in loop.denoiser.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_replay_keeps_shapes_and_strides_and_changes_only_the_compute_dtype() -> None:
    loop = TinyLoop()
    log = audit_step(loop, precision="bf16-mixed", requested_low="bf16", device=CPU)
    spec = max(log.replays.values(), key=lambda s: s.calls)
    args, _ = replay_arguments(spec, torch.float32)
    recorded = [t for t in args if isinstance(t, torch.Tensor)]
    assert recorded and all(t.dtype == torch.float32 for t in recorded if t.is_floating_point())
    fp32, bf16 = bench_pair(spec, torch.float32, torch.bfloat16, lambda: None, repeats=1)
    assert not fp32.error and not bf16.error
    # Interleaved, one of each per round, and never fewer than the U test needs.
    assert len(fp32.samples) == len(bf16.samples) == MIN_CALLS
    # Past the probe's deadline no round is added to the fewest, however long its own budget.
    spent = time.perf_counter()
    fp32, bf16 = bench_pair(
        spec,
        torch.float32,
        torch.bfloat16,
        lambda: None,
        repeats=40,
        budget_s=3600.0,
        deadline=spent,
    )
    assert len(fp32.samples) == len(bf16.samples) == MIN_CALLS
    _, broken = bench_pair(spec, torch.float32, torch.bool, lambda: None)  # no bool matmul
    assert broken.error and not broken.samples


def test_spent_benchmark_budget_leaves_speed_unjudged() -> None:
    probe = PrecisionProbe(bench_signatures=2, total_bench_budget_s=0.0)
    result = _run_probe(probe, _ctx(TinyLoop(), _tiny_config()))
    assert result.status == "ok", result.traceback
    comparison = result.data["speed_comparison"]
    assert comparison["speedup"] is None
    assert all("budget" in row["error"] for row in comparison["signatures"])
    assert not _ids(result) & {BF16_SLOWER_ID, FP32_TRAINING_ID}


def test_without_a_workload_the_probe_is_skipped() -> None:
    probe = PrecisionProbe()
    assert isinstance(probe, Probe) and probe.name == "precision"
    result = _run_probe(probe, _ctx(None, _tiny_config()))
    assert result.status == "skipped" and "trace" in result.reason


def test_bf16_not_native_fires_from_the_probe_on_a_cpu_without_bf16() -> None:
    from diagnose.device import bf16_native

    old_cpu = _cpu_info(["avx2", "fma"])
    assert bf16_native(old_cpu) is False
    result = _run_probe(_fast_probe(), _ctx(TinyLoop(), _tiny_config(), old_cpu))
    # One cause, one finding: its own finding, or (when the probe measured bf16 clearly slower,
    # which a loaded machine can make sure or not) the slowdown finding carries it, and the
    # check says where it went.
    folded = [f for f in result.findings if f.id == BF16_SLOWER_ID]
    if folded:
        assert BF16_NOT_NATIVE_ID not in _ids(result)
        note = next(c for c in result.checks if c.id == BF16_NOT_NATIVE_ID)
        assert note.outcome == "ok" and BF16_SLOWER_ID in note.text
    else:
        assert BF16_NOT_NATIVE_ID in _ids(result)
    clean = _run_probe(_fast_probe(), _ctx(TinyLoop(), _tiny_config(), _cpu_info()))
    assert BF16_NOT_NATIVE_ID not in _ids(clean)


# --------------------------------------------------------------------------------------------
# The real tiny SD1.5 LoRA step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Workload]]:
    """Tiny SD1.5 LoRA workloads by precision, each stepped once (optimizer state exists)."""
    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=2, seed=1, size=(72, 64))
    built: dict[str, Workload] = {}

    def get(precision: str) -> Workload:
        if precision not in built:
            config = RunConfig(
                preset="sd15",
                size="tiny",
                resolution=[64],
                data_dir=str(folder),
                precision=precision,  # type: ignore[arg-type]
            )
            workload = build_workload(config, CPU)
            workload.step(next(workload.batches()), PhaseTimer(lambda: None))
            built[precision] = workload
        return built[precision]

    try:
        yield get
    finally:
        for workload in built.values():
            workload.close()
        built.clear()
        # Collect the models' reference cycles now: left to a later automatic collection, the
        # pause lands in whichever test runs next (a timing-sensitive trace test, say).
        gc.collect()


def _snapshot(workload: Workload) -> dict[str, Any]:
    params = workload.lora_parameters()
    return {
        "params": [p.detach().clone() for p in params],
        "state": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for s in (workload.optimizer.state[p] for p in params)
        ],
        "generator": workload.noise_generator.get_state(),
        "optimizer": workload.optimizer,
    }


def _assert_unchanged(before: dict[str, Any], workload: Workload) -> None:
    after = _snapshot(workload)
    assert after["optimizer"] is before["optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert all(p.grad is None for p in workload.lora_parameters())
    assert torch.equal(before["generator"], after["generator"])
    for saved, now in zip(before["state"], after["state"], strict=True):
        assert saved.keys() == now.keys()
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, now[key])


def test_clean_bf16_step_has_no_upcast(tiny: Callable[[str], Workload]) -> None:
    workload = tiny("bf16-mixed")
    before = _snapshot(workload)
    result = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    _assert_unchanged(before, workload)
    assert result.status == "ok", result.traceback
    assert not _ids(result) & {UPCAST_ID, DTYPE_MISMATCH_ID, FP32_WEIGHTS_ID, BF16_NOT_NATIVE_ID}
    line = next(line for line in ok_lines(result) if "→ actual" in line)
    assert line.startswith("precision: requested bf16-mixed → actual: 100% of GEMM")
    data = result.data
    assert data["compute_share_by_dtype"] == {"bf16": 1.0}
    assert data["verdicts"]["low"]["calls"] > 100 and "unexpected" not in data["verdicts"]
    rows = data["ops"]
    assert {"op", "dtype", "module", "calls", "seconds", "verdict"} <= set(rows[0])
    components = data["compute_seconds_by_component"]
    assert {"denoiser", "vae", "text_encoder"} <= set(components)
    assert all(set(by_dtype) == {"bf16"} for by_dtype in components.values())
    comparison = data["speed_comparison"]
    assert comparison["base"] == "fp32" and comparison["low"] == "bf16"
    assert comparison["signatures"] and comparison["speedup"] is not None
    # Everything the probe reports survives the record's JSON round trip.
    record = _record()
    record.probes, record.findings = [result], list(result.findings)
    loaded = record_from_dict(json.loads(record.to_json()))
    assert loaded.probes[0].data["claimed_vs_actual"] == data["claimed_vs_actual"]


def test_past_its_time_budget_no_pair_is_timed_and_the_speed_answer_says_why(
    tiny: Callable[[str], Workload],
) -> None:
    """The probe's time budget planted spent: no signature is timed in either dtype, and the
    speed question stays open naming the budget (its twin within the budget, above, times them)."""
    workload = tiny("bf16-mixed")
    result = _run_probe(_fast_probe(), _ctx(workload, workload.config), budgets={"precision": 0.0})
    assert result.status == "ok", result.traceback
    rows = result.data["speed_comparison"]["signatures"]
    assert rows and all(BUDGET_RAN_OUT in row["error"] for row in rows)
    assert result.data["speed_comparison"]["speedup"] is None
    (answer,) = [c for c in result.checks if c.id == BF16_SLOWER_ID]
    assert answer.outcome == "not_judged" and BUDGET_RAN_OUT in answer.text


def test_autocast_disabled_projection_is_found(tiny: Callable[[str], Workload]) -> None:
    workload = tiny("bf16-mixed")
    module = workload.denoiser.get_submodule(TARGET)

    def upcast(self: Any, x: torch.Tensor) -> torch.Tensor:
        # What a model does when it guards a block against autocast and computes in fp32.
        with torch.autocast(device_type="cpu", enabled=False):
            weight = self.base_layer.weight.float()
            return F.linear(x.float(), weight).to(x.dtype)

    module.forward = types.MethodType(upcast, module)
    try:
        result = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    finally:
        del module.forward
    assert result.status == "ok", result.traceback
    finding = next(f for f in result.findings if f.id == UPCAST_ID)
    assert TARGET in finding.title and "autocast is disabled" in finding.title
    top = finding.evidence["modules"][0]
    assert top["module"] == TARGET and top["autocast"] == "disabled"
    assert top["forward_calls"] == 1 and top["backward_calls"] == 1  # grad of the input
    assert top["ops"] == ["mm"] and top["called_via"] == ["linear"]
    assert top["seconds_per_step"] > 0 and top["shapes"] == "[16, 32] [32, 32]"
    assert finding.evidence["fp32_calls_per_step"] == 2
    assert finding.saving_basis == "estimated" and finding.est_seconds_saved_per_it is not None
    assert "bf16" in finding.evidence["saving_method"]
    actual = finding.evidence["claimed_vs_actual"]
    assert actual.startswith("requested bf16-mixed → actual:") and "fp32" in actual
    assert TARGET in actual and result.data["claimed_vs_actual"] == actual


def test_float_under_autocast_is_lowered_not_flagged(tiny: Callable[[str], Workload]) -> None:
    """``x.float() @ w.float().T`` directly under autocast is re-cast to bf16: no fault."""
    workload = tiny("bf16-mixed")
    module = workload.denoiser.get_submodule(TARGET)

    def floats(self: Any, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x.float() @ self.base_layer.weight.float().T
        return out

    module.forward = types.MethodType(floats, module)
    try:
        result = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    finally:
        del module.forward
    assert result.status == "ok", result.traceback
    assert UPCAST_ID not in _ids(result)
    assert result.data["compute_share_by_dtype"] == {"bf16": 1.0}


def test_fp32_lora_weights_in_bf16_full(tiny: Callable[[str], Workload]) -> None:
    workload = tiny("bf16-full")
    clean = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    assert clean.status == "ok", clean.traceback
    assert not _ids(clean) & {FP32_WEIGHTS_ID, UPCAST_ID}
    assert any("every weight is bf16" in line for line in ok_lines(clean))

    lora = [p for n, p in workload.denoiser.named_parameters() if n.startswith(TARGET + ".lora_")]
    assert len(lora) == 2
    for param in lora:
        param.data = param.data.float()  # a trainer that left this adapter in fp32
    try:
        result = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    finally:
        for param in lora:
            param.data = param.data.to(torch.bfloat16)
    assert result.status == "ok", result.traceback
    weights = next(f for f in result.findings if f.id == FP32_WEIGHTS_ID)
    assert weights.evidence["lora_tensors"] == 2 and weights.evidence["base_tensors"] == 0
    modules = {row["module"] for row in weights.evidence["modules"]}
    assert modules == {f"{TARGET}.lora_A.default", f"{TARGET}.lora_B.default"}
    assert weights.evidence["modules_computing_in_fp32"]
    # peft casts the input to the fp32 LoRA weight, so these matmuls run in fp32.
    upcast = next(f for f in result.findings if f.id == UPCAST_ID)
    sites = {row["module"]: row for row in upcast.evidence["modules"]}
    assert set(sites) == modules
    assert all(row["cause"] == "its weights are fp32" for row in sites.values())


def test_fp32_run_skips_the_audit_but_reports_bf16_speed(
    tiny: Callable[[str], Workload],
) -> None:
    workload = tiny("fp32")
    result = _run_probe(_fast_probe(), _ctx(workload, workload.config))
    assert result.status == "ok", result.traceback
    assert UPCAST_ID not in _ids(result)
    assert any("asked for fp32" in line and "skipped" in line for line in ok_lines(result))
    comparison = result.data["speed_comparison"]
    assert comparison["low"] == "bf16" and comparison["speedup"] is not None
    # Whichever way the measurement goes on this machine, the fact is reported once.
    training = [f for f in result.findings if f.id == FP32_TRAINING_ID]
    lines = [line for line in ok_lines(result) if "than fp32 here" in line]
    assert "than fp32 here" in result.data["speed_summary"]
    assert len(training) + len(lines) == 1
    if training:
        assert training[0].severity == "info" and training[0].evidence["speedup"] >= 1.25
