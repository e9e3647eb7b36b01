"""Kernel classes from names of both vendors' libraries, and the interval arithmetic under the
breakdown."""

from __future__ import annotations

import numpy as np
import pytest

from diagnose.trace.columns import MEMCPY, MEMSET
from diagnose.trace.intervals import complement, intersect, subtract, union, window
from diagnose.trace.kernel_classes import KERNEL_CLASSES, classify_kernel

NAMES = {
    # GEMM: cuBLAS / cuBLASLt / CUTLASS / Tensile / hipBLASLt / CK
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn": "gemm",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn>()": "gemm",
    "Cijk_Ailk_Bljk_BBS_BH_MT128x128x32_MI32x32x8x1_SN_GRVW8": "gemm",
    "Custom_Cijk_Alik_Bljk_HHS_BH_MT256x256x64": "gemm",
    "ck::kernel_gemm_xdl_cshuffle_v3<...>": "gemm",
    "splitKreduce_kernel<float, float, float, float>(cublasSplitKParams<float>)": "gemm",
    # Convolution: cuDNN / MIOpen / CK
    "sm80_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tile128x128": "conv",
    "cudnn_infer_ampere_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1": "conv",
    "void cudnn::cnn::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>()": "conv",
    "naive_conv_fwd_nchw_half_double_half": "conv",
    "igemm_fwd_gtcx35_nhwc_bf16_bx0_ex1_bt128x128x32_wt32x32x8_ws1x1_wr2x2": "conv",
    "miopenSp3AsmConv_v30_3_1_gfx11_fp16_stride1": "conv",
    # Fused attention: FlashAttention, AOTriton, CK, xFormers, cuDNN SDPA, mem-efficient
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>()": "attention_fused",
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention_fused",
    "attn_fwd": "attention_fused",
    "bwd_kernel_dk_dv": "attention_fused",
    "ck_tile::FmhaFwdKernel<ck_tile::BlockFmhaPipelineQRKSVSAsync>": "attention_fused",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention_fused",
    "void attention_kernel_batched_impl<AttentionKernel<cutlass::bfloat16_t>>()": "attention_fused",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention_fused",
    # Others
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>()": "norm",
    "MIOpenBatchNormFwdTrainSpatial": "norm",
    "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>()": "norm",
    "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>()": "elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4, 64>()": "elementwise",
    "SubTensorOpWithScalar1d": "elementwise",
    "void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>()": "reduction",
    "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, float, 7, false>()": "softmax",
    "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>()": "optimizer",
    "void kOptimizer32bit2State<float, 4, 4096, 8>(float*, float*)": "optimizer",
    "triton_poi_fused_add_mul_silu_0": "triton",
    "triton_red_fused__softmax_1": "triton",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "rcclGenericKernel<1, false>": "communication",
    "some_vendor_kernel_we_have_never_seen": "other",
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_kernel_class(name: str) -> None:
    assert classify_kernel(name) == NAMES[name]


def test_lambda_is_not_an_optimizer() -> None:
    # "{lambda()#1}" appears in most at::native kernel names; it must not read as "lamb".
    name = (
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<{lambda()#1}>>()"
    )
    assert classify_kernel(name) == "elementwise"


def test_copies_by_kind() -> None:
    assert classify_kernel("Memcpy HtoD (Pageable -> Device)", MEMCPY) == "memcpy"
    assert classify_kernel("Memset (Device)", MEMSET) == "memset"
    assert set(NAMES.values()) | {"memcpy", "memset"} <= set(KERNEL_CLASSES)


def test_interval_arithmetic() -> None:
    a = union([0, 5, 2, 20], [3, 8, 4, 30])  # [0,4) [5,8) [20,30)
    np.testing.assert_array_equal(a.starts, [0, 5, 20])
    np.testing.assert_array_equal(a.ends, [4, 8, 30])
    assert a.total == 17
    b = union([3, 25], [6, 40])
    assert intersect(a, b).total == (4 - 3) + (6 - 5) + (30 - 25)
    assert subtract(a, b).total == a.total - intersect(a, b).total
    gaps = complement(a, -5, 35)
    assert gaps.total == 40 - 17
    assert a.clip(2, 22).total == 2 + 3 + 2
    np.testing.assert_array_equal(a.contains(np.array([0.0, 4.0, 7.9, 19.0])), [1, 0, 1, 0])
    assert intersect(window(0, 1), window(1, 2)).total == 0
