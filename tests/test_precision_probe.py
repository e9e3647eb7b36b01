"""The precision probe and the shared precision policy.

Real torch/diffusers/peft objects: the tiny SD1.5 LoRA workload (bf16-mixed, bf16-full, fp32) and
a hand-made tiny training loop, each with one planted fault and a clean twin. Timings are never
asserted on (the machine is shared); only structure, counts and the planted effects.
"""

from __future__ import annotations

import gc
import json
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
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
from diagnose.precision_policy import (
    claimed_vs_actual,
    deliberate_reason,
    is_compute_op,
    is_dtype_warning,
    judge,
    majority_dtype,
    normalize_dtype,
    op_base_name,
    op_kind,
    requested_low_dtype,
)
from diagnose.probes.base import Probe, ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_RAN_OUT
from diagnose.probes.precision.audit import AuditLog, OpGroup, Site, audit_step
from diagnose.probes.precision.findings import (
    bf16_not_native_rule,
    bf16_slower_rule,
    fp32_training_rule,
    upcast_rule,
)
from diagnose.probes.precision.probe import PrecisionProbe
from diagnose.probes.precision.replay import MIN_CALLS, BenchResult, bench_pair, replay_arguments
from diagnose.probes.precision.speed import HeadlineScale, SignatureBench, SpeedComparison
from diagnose.record import DeviceInfo, ProbeResult, RunRecord
from diagnose.record_io import record_from_dict
from diagnose.timing import PhaseTimer
from diagnose.trace.analysis import analyze_trace
from diagnose.workload import build_workload
from diagnose.workload.data import generate_images
from diagnose.workload.step import Workload
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
# The shared policy (pure)


def test_op_names_and_kinds_are_one_classification() -> None:
    for spelling in ("aten::addmm", "aten.addmm.default", "addmm.default", "addmm"):
        assert op_base_name(spelling) == "addmm"
        assert op_kind(spelling) == "matmul" and is_compute_op(spelling)
    assert op_kind("aten::convolution_backward") == "conv"
    assert op_kind("aten._scaled_dot_product_flash_attention_for_cpu.default") == "attention"
    for policy in ("aten::_softmax", "native_group_norm_backward", "mse_loss", "sum", "exp"):
        assert op_kind(policy) == "fp32_by_policy", policy
    for other in ("aten::add", "aten::mul", "view", "_to_copy"):
        assert op_kind(other) == "other", other


def test_dtypes_from_torch_and_from_traces() -> None:
    assert normalize_dtype("torch.bfloat16") == normalize_dtype("c10::BFloat16") == "bf16"
    assert normalize_dtype("float") == normalize_dtype("torch.float32") == "fp32"
    assert normalize_dtype("c10::complex<float>") == normalize_dtype("torch.complex64")
    assert normalize_dtype("long int") is None
    # _scaled_mm(fp8, fp8, fp32 scale, fp32 scale) is an fp8 op: ties go to the lower precision.
    assert majority_dtype(["fp8", "fp8", "fp32", "fp32"]) == "fp8"
    assert majority_dtype(["bf16", "bf16", "fp32"]) == "bf16"
    assert requested_low_dtype("bf16-full") == requested_low_dtype("bf16-mixed") == "bf16"
    assert requested_low_dtype("fp16") == "fp16" and requested_low_dtype("fp32") is None


def test_verdicts() -> None:
    assert judge("matmul", "fp32", "bf16", None) == "unexpected"
    assert judge("conv", "bf16", "bf16", None) == "low"
    assert judge("fp32_by_policy", "fp32", "bf16", None) == "by_policy"
    assert judge("other", "fp32", "bf16", None) == "other"
    assert judge("matmul", "fp32", None, None) == "other"  # an fp32 run judges nothing
    # The math attention path's bmm belongs to the attention call, not to this rule.
    assert judge("matmul", "fp32", "bf16", None, inside_attention=True) == "other"
    rope = deliberate_reason(dtype="complex64")
    assert rope and judge("other", "complex64", "bf16", rope) == "deliberate"
    assert deliberate_reason(dtype="fp32", module_path="model.rotary_emb")
    assert deliberate_reason(dtype="fp32", module_class="FluxPosEmbed")
    assert deliberate_reason(dtype="fp32", component_reason="VAE force_upcast")
    assert deliberate_reason(dtype="fp32", module_path="down_blocks.0.attentions.0.proj_in") is None


def test_claimed_vs_actual_sentence() -> None:
    text = claimed_vs_actual("bf16-mixed", {"bf16": 0.93, "fp32": 0.07}, ["mid_block.proj"])
    assert text.startswith("requested bf16-mixed → actual: 93% of GEMM/conv/attention time in bf16")
    assert "7% in fp32" in text and "mid_block.proj" in text
    assert claimed_vs_actual("", {"bf16": 1.0}).startswith("actual: 100%")


def test_dtype_warning_text_is_recognised() -> None:
    assert is_dtype_warning(
        "Mismatch dtype between input and weight: input dtype = float, weight dtype = "
        "c10::BFloat16, Cannot dispatch to fused implementation."
    )
    assert not is_dtype_warning("The default value of the antialias parameter will change")


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --------------------------------------------------------------------------------------------
# Device speed rules (pure: planted measurements)


def _comparison(
    base_s: float, low_s: float, low: str = "bf16", base: str = "fp32", audited_s: float = 0.01
) -> SpeedComparison:
    """One signature, 10 calls per step, timed 5 times in each dtype with a little spread."""
    row = SignatureBench(
        op="mm",
        shapes="[64, 320] [320, 320]",
        recorded_dtype=low,
        calls=10,
        base=BenchResult(base, [base_s * (1 + 0.01 * i) for i in range(5)]),
        low=BenchResult(low, [low_s * (1 + 0.01 * i) for i in range(5)]),
        audited_seconds=audited_s,
    )
    return SpeedComparison(base=base, low=low, rows=[row])


#: Audited seconds count as headline seconds one for one, in a run with 0.1 s of compute.
_SCALE = HeadlineScale(factor=1.0, compute_seconds=0.1, audited_seconds=0.1)


def test_bf16_slower_than_fp32_rule() -> None:
    finding = bf16_slower_rule("bf16-mixed", _comparison(1e-3, 2e-3), _SCALE)
    assert finding is not None and finding.id == BF16_SLOWER_ID
    assert finding.evidence["bf16_over_fp32_time"] == 2.0
    # Half of the measured signatures' 10 ms per iteration; the interval is sure of some of it.
    assert finding.est_seconds_saved_per_it == pytest.approx(0.005)
    assert 0 < finding.sure_seconds_saved_per_it <= finding.est_seconds_saved_per_it
    assert finding.saving_basis == "estimated" and "2.00x slower" in finding.title
    assert bf16_slower_rule("bf16-mixed", _comparison(2e-3, 1e-3), _SCALE) is None
    # Slower by the medians but within the spread (a busy machine): inconclusive, no finding.
    noisy = _comparison(1e-3, 2e-3)
    noisy.rows[0].base.samples = [0.5e-3, 1e-3, 3e-3, 2.2e-3, 0.7e-3]
    noisy.rows[0].low.samples = [1e-3, 2e-3, 2.5e-3, 0.6e-3, 2.1e-3]
    assert not noisy.clearly_slower and bf16_slower_rule("bf16-mixed", noisy, _SCALE) is None
    assert bf16_slower_rule("fp32", _comparison(1e-3, 2e-3), _SCALE) is None


def test_a_saving_is_never_more_than_the_compute_it_remeasured() -> None:
    """The 2.08 s/it on a 1.41 s/it run: bf16 80x slower, the audit's op times inflated."""
    # The audited signatures took 3 s, the audited compute phases 4 s; the headline run spends
    # 1 s per iteration in its compute phases, so they are a quarter of that.
    scale = HeadlineScale(factor=0.25, compute_seconds=1.0, audited_seconds=4.0)
    finding = bf16_slower_rule("bf16-mixed", _comparison(1e-3, 80e-3, audited_s=3.0), scale)
    assert finding is not None
    saving = finding.est_seconds_saved_per_it
    assert saving == pytest.approx(0.75 * (1 - 1 / 80))
    assert saving <= finding.evidence["measured_signatures_seconds_per_it"] <= 1.0
    assert "80.00x slower" in finding.title and "%" not in finding.title
    # However inflated the audit, never more than the run's compute phases.
    unscaled = HeadlineScale(factor=1.0, compute_seconds=1.0, audited_seconds=3.0)
    assert unscaled(3.0) == 1.0


def test_fp32_training_rule_needs_a_measured_gain() -> None:
    finding = fp32_training_rule("fp32", _cpu_info(), _comparison(3e-3, 1e-3), _SCALE)
    assert finding is not None and finding.id == FP32_TRAINING_ID
    assert finding.severity == "info" and finding.evidence["speedup"] == 3.0
    assert finding.est_seconds_saved_per_it == pytest.approx(0.01 * (1 - 1 / 3))
    assert "bf16" in finding.fix
    assert fp32_training_rule("fp32", _cpu_info(), _comparison(1e-3, 1.1e-3), _SCALE) is None
    assert fp32_training_rule("bf16-mixed", _cpu_info(), _comparison(3e-3, 1e-3), _SCALE) is None


def test_bf16_not_native_rule() -> None:
    rdna2 = DeviceInfo(kind="rocm", name="AMD Radeon RX 6800 XT", arch="gfx1030")
    fp16 = _comparison(2e-3, 1e-3, low="fp16", base="bf16")
    finding = bf16_not_native_rule("bf16-mixed", rdna2, False, fp16, _SCALE)
    assert finding is not None and finding.id == BF16_NOT_NATIVE_ID
    assert "gfx1030" in finding.title and "fp16" in finding.fix
    assert finding.est_seconds_saved_per_it == pytest.approx(0.005)
    assert bf16_not_native_rule("fp16", rdna2, False, fp16, _SCALE) is None
    rdna3 = DeviceInfo(kind="rocm", name="AMD Radeon RX 7900 XTX", arch="gfx1100")
    assert bf16_not_native_rule("bf16-mixed", rdna3, True, None, _SCALE) is None
    old_cpu = _cpu_info(["avx2", "fma"])
    finding = bf16_not_native_rule("bf16-full", old_cpu, False, None, _SCALE)
    assert finding is not None and "fp32" in finding.fix


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


def test_upcast_rule_ignores_policy_and_deliberate_groups() -> None:
    log = AuditLog(precision="bf16-mixed", requested_low="bf16")
    log.groups = [
        OpGroup(
            "mse_loss",
            "fp32_by_policy",
            "fp32",
            Site(),
            "forward",
            "mse_loss",
            True,
            "by_policy",
            "",
            "[4] [4]",
            calls=1,
            seconds=1e-3,
        ),
        OpGroup(
            "mul",
            "other",
            "complex64",
            Site("denoiser", "layers.0.attention"),
            "forward",
            "mul",
            False,
            "deliberate",
            "complex arithmetic",
            "[4]",
            calls=2,
            seconds=1e-3,
        ),
    ]
    assert upcast_rule(log, [], scale=_SCALE, saving_method="") is None


# --------------------------------------------------------------------------------------------
# The trace rule shares the classification (real GPU traces)


def test_trace_rule_on_real_gpu_traces(shared_traces: Path) -> None:
    for name in ("rocm/mi300x_resnet_ddp_bf16_train.json.gz", "cuda/h100_bert_small_infer.json.gz"):
        analysis = analyze_trace(shared_traces / name)
        assert UPCAST_ID not in {f.id for f in analysis.findings}, name
        line = next(line for line in ok_lines(analysis) if line.startswith("precision:"))
        assert "bf16" in line and "actual: 100% of GEMM/conv/attention time in bf16" in line
    minitoy = analyze_trace(shared_traces / "rocm/mi250_minitoy_train.json.gz")
    ids = {f.id for f in minitoy.findings}
    assert FP32_TRAINING_ID in ids and UPCAST_ID not in ids
    finding = next(f for f in minitoy.findings if f.id == FP32_TRAINING_ID)
    assert all(is_compute_op(row["op"]) for row in finding.evidence["ops"])
