"""The attention classification the probe and the trace rule share (``diagnose.attention_paths``):
ops and kernels by path and provider, and the trace rule that uses it on real traces.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose import attention_paths as ap
from diagnose.catalogs import attention_catalog as ac
from diagnose.trace.analysis import analyze_trace
from diagnose.trace.kernel_classes import classify_kernel

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize(
    ("name", "path", "provider"),
    [
        ("aten::_scaled_dot_product_attention_math", ap.MATH, "torch SDPA"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", ap.FLASH, "torch SDPA (CPU)"),
        ("aten::_scaled_dot_product_flash_attention", ap.FLASH, "torch SDPA"),
        ("aten::_scaled_dot_product_efficient_attention", ap.EFFICIENT, "torch SDPA"),
        ("aten::_scaled_dot_product_cudnn_attention", ap.CUDNN, "torch SDPA"),
        ("xformers::efficient_attention_forward_cutlass", ap.EFFICIENT, "xFormers"),
        ("xformers_flash::flash_fwd", ap.FLASH, "xFormers"),
        ("flash_attn::_flash_attn_forward", ap.FLASH, "flash-attn"),
    ],
)
def test_attention_ops(name: str, path: str, provider: str) -> None:
    kind = ap.classify_op(name)
    assert kind is not None and (kind.path, kind.provider) == (path, provider)


def test_non_attention_ops() -> None:
    for name in ("aten::scaled_dot_product_attention", "aten::bmm", "aten::softmax", "aten::mm"):
        assert ap.classify_op(name) is None


@pytest.mark.parametrize(
    ("kernel", "label"),
    [
        (
            "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64>>()",
            "FlashAttention (torch SDPA)",
        ),
        ("attn_fwd", "AOTriton"),
        ("bwd_kernel_dk_dv", "AOTriton"),
        ("ck_tile::FmhaFwdKernel<ck_tile::BlockFmhaPipelineQRKSVSAsync>", "Composable Kernel fmha"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "CUTLASS fmha (memory-efficient)"),
        (
            "void attention_kernel_batched_impl<AttentionKernel<cutlass::bfloat16_t>>()",
            "CUTLASS fmha (memory-efficient)",
        ),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "cuDNN SDPA"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>()", "FlashAttention"),
    ],
)
def test_kernel_families_agree_with_the_kernel_classes(kernel: str, label: str) -> None:
    family = ap.kernel_family(kernel)
    assert family is not None and family.label == label
    assert classify_kernel(kernel) == "attention_fused"


def test_kernels_that_are_no_fused_attention() -> None:
    for kernel in (
        "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, float, 7, false>()",
        "Cijk_Ailk_Bljk_BBS_BH_MT128x128x32_MI32x32x8x1_SN_GRVW8",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas",
    ):
        assert ap.kernel_family(kernel) is None


def test_trace_rule_finds_math_in_the_cpu_fixture() -> None:
    a = analyze_trace(FIXTURES / "traces" / "cpu_train_loop_math_attention.json.gz")
    finding = next(f for f in a.findings if f.id == ac.MATH_ID)
    assert any("_scaled_dot_product_attention_math" in op for op in finding.evidence["ops"])
    assert "--sdpa" in finding.fix
    clean = analyze_trace(FIXTURES / "traces" / "cpu_train_loop.json.gz")
    assert not {f.id for f in clean.findings} & {ac.MATH_ID, ac.MANUAL_ID}


def test_trace_rule_recognises_fused_gpu_kernels(shared_traces: Path) -> None:
    for name, family in (
        ("cuda/h100_bert_small_infer.json.gz", "FlashAttention (torch SDPA)"),
        ("rocm/mi300x_bert_small_infer.json.gz", "AOTriton"),
    ):
        a = analyze_trace(shared_traces / name)
        assert not {f.id for f in a.findings} & {ac.MATH_ID, ac.MANUAL_ID}
        (path,) = a.rule_data["attention"]["paths"]
        assert path["path"] == ap.FLASH and path["calls_per_step"] == 4
        assert path["kernel_families"] == [family]
