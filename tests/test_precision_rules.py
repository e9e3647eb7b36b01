"""The precision rules on planted inputs: the shared precision policy (the op classification,
dtypes, verdicts), the device speed rules on planted measurements, and the trace rule that shares
the classification, on real GPU traces. The probe on a hand-made loop and on the real tiny
workload is ``test_precision_probe.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose.catalogs.precision_catalog import (
    BF16_NOT_NATIVE_ID,
    BF16_SLOWER_ID,
    FP32_TRAINING_ID,
    UPCAST_ID,
)
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
from diagnose.probes.precision.audit import AuditLog, OpGroup, Site
from diagnose.probes.precision.findings import (
    bf16_not_native_rule,
    bf16_slower_rule,
    fp32_training_rule,
    upcast_rule,
)
from diagnose.probes.precision.replay import BenchResult
from diagnose.probes.precision.speed import HeadlineScale, SignatureBench, SpeedComparison
from diagnose.record import DeviceInfo
from diagnose.trace.analysis import analyze_trace
from tests.conftest import ok_lines
from tests.test_precision_probe import _cpu_info

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
