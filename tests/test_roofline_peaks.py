"""The vendor spec table (diagnose.roofline.peaks): the table's own sanity, the lookup from the
names torch and the traces report, the documented rule for names that cannot tell variants apart,
and the devices of the real traces under ../shared/gpu-traces (skipped when that is absent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diagnose.record import DeviceInfo
from diagnose.roofline.peaks import (
    DTYPES,
    SpecPeak,
    canonical_dtype,
    known_devices,
    spec_peak,
    table_rows,
)

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-traces"

GIB = 2**30
T = 1e12
TENSOR_DTYPES = ("bfloat16", "float16", "tf32", "float8")


def cuda(name: str, **fields: Any) -> DeviceInfo:
    return DeviceInfo(kind="cuda", vendor="NVIDIA", name=name, **fields)


def rocm(name: str, **fields: Any) -> DeviceInfo:
    return DeviceInfo(kind="rocm", vendor="AMD", name=name, **fields)


def peak(device: DeviceInfo, dtype: str = "bf16") -> SpecPeak:
    found = spec_peak(device, dtype)
    assert found is not None, f"{device.name!r} ({dtype}) found no peak"
    return found


# ------------------------------------------------------------------------------------ the table


def test_every_row_is_sane() -> None:
    rows = table_rows()
    names = [name for name, *_ in rows]
    assert len(names) == len(set(names)), "duplicate canonical names"
    assert names == known_devices()
    for name, vendor, flops, bandwidth, source in rows:
        assert vendor in ("nvidia", "amd"), name
        assert source.strip(), f"{name} has no source"
        assert set(flops) <= set(DTYPES), name
        for dtype, value in flops.items():
            assert 1 * T <= value <= 10_000 * T, f"{name} {dtype}: {value:g} FLOP/s"
        if bandwidth is not None:
            assert 100e9 <= bandwidth <= 10e12, f"{name}: {bandwidth:g} B/s"
        fp32 = flops.get("float32")
        for dtype in TENSOR_DTYPES:
            if fp32 is not None and dtype in flops:
                # Tensor/matrix cores are never slower than the vector FP32 units.
                assert flops[dtype] >= fp32, f"{name}: {dtype} below fp32"
        if "float8" in flops and "bfloat16" in flops:
            assert flops["float8"] >= flops["bfloat16"], name


def test_rows_with_tensor_figures_have_bandwidth() -> None:
    for name, _, flops, bandwidth, _ in table_rows():
        if set(flops) & set(TENSOR_DTYPES):
            assert bandwidth is not None, name


@pytest.mark.parametrize(
    "card",
    [
        "NVIDIA A100 SXM4 40GB",
        "NVIDIA A100 SXM4 80GB",
        "NVIDIA A100 PCIe 40GB",
        "NVIDIA A100 PCIe 80GB",
        "NVIDIA H100 SXM5",
        "NVIDIA H100 PCIe",
        "NVIDIA H100 NVL",
        "NVIDIA H200 SXM",
        "NVIDIA B200",
        "NVIDIA L40S",
        "NVIDIA L4",
        "NVIDIA A10",
        "NVIDIA GeForce RTX 3090",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA GeForce RTX 5090",
        "NVIDIA RTX 6000 Ada Generation",
        "NVIDIA Tesla V100 SXM2",
        "NVIDIA Tesla V100 PCIe",
        "NVIDIA Tesla T4",
        "AMD Instinct MI100",
        "AMD Instinct MI210",
        "AMD Instinct MI250X (one GCD)",
        "AMD Instinct MI300X",
        "AMD Instinct MI325X",
        "AMD Radeon PRO W7900",
        "AMD Radeon RX 7900 XTX",
        "AMD Radeon RX 9070 XT",
    ],
)
def test_the_cards_the_users_have_are_known(card: str) -> None:
    assert card in known_devices()


def test_dense_figures_not_sparse() -> None:
    # The sheets print 1,979 (H100 SXM5) and 624 (A100) TFLOPS bf16 "with sparsity".
    assert peak(cuda("NVIDIA H100 80GB HBM3")).flops_per_s == pytest.approx(989.5 * T)
    assert peak(cuda("NVIDIA A100-SXM4-80GB")).flops_per_s == pytest.approx(312 * T)
    assert peak(cuda("NVIDIA H100 80GB HBM3"), "fp8").flops_per_s == pytest.approx(1979 * T)


def test_geforce_uses_the_fp32_accumulate_rate() -> None:
    # NVIDIA prints 330.3 (4090) and 142 (3090) TFLOPS with FP16 accumulate; PyTorch accumulates
    # in FP32, which GeForce runs at half that.
    assert peak(cuda("NVIDIA GeForce RTX 4090")).flops_per_s == pytest.approx(165.2 * T)
    assert peak(cuda("NVIDIA GeForce RTX 3090"), "fp16").flops_per_s == pytest.approx(71 * T)
    assert peak(cuda("NVIDIA GeForce RTX 5090")).flops_per_s == pytest.approx(209.5 * T)


def test_float32_is_the_rate_an_fp32_gemm_can_reach() -> None:
    # NVIDIA without TF32: the CUDA cores' vector rate; TF32 is its own dtype.
    assert peak(cuda("NVIDIA H100 80GB HBM3"), "fp32").flops_per_s == pytest.approx(67 * T)
    assert peak(cuda("NVIDIA H100 80GB HBM3"), "tf32").flops_per_s == pytest.approx(494.5 * T)
    # MI210: FP32 vector 22.6, FP32 matrix 45.3 TFLOPS; rocBLAS SGEMM runs on the matrix cores,
    # so the vector rate would let an fp32 GEMM read above 100% of the peak.
    assert peak(rocm("AMD Instinct MI210"), "fp32").flops_per_s == pytest.approx(45.3 * T)


# ------------------------------------------------------------------- names as torch reports them


@pytest.mark.parametrize(
    ("device", "card", "bf16_tflops"),
    [
        (cuda("NVIDIA H100 80GB HBM3"), "NVIDIA H100 SXM5", 989.5),
        (cuda("NVIDIA H100 PCIe"), "NVIDIA H100 PCIe", 756.5),
        (cuda("NVIDIA A100-SXM4-80GB"), "NVIDIA A100 SXM4 80GB", 312),
        (cuda("NVIDIA A100-SXM4-40GB"), "NVIDIA A100 SXM4 40GB", 312),
        (cuda("NVIDIA A100-PCIE-40GB"), "NVIDIA A100 PCIe 40GB", 312),
        (cuda("NVIDIA A100 80GB PCIe"), "NVIDIA A100 PCIe 80GB", 312),
        (cuda("NVIDIA H200"), "NVIDIA H200 SXM", 989.5),
        (cuda("NVIDIA B200"), "NVIDIA B200", 2250),
        (cuda("NVIDIA L40S"), "NVIDIA L40S", 362.05),
        (cuda("NVIDIA L4"), "NVIDIA L4", 121),
        (cuda("NVIDIA A10"), "NVIDIA A10", 125),
        (cuda("NVIDIA GeForce RTX 3090"), "NVIDIA GeForce RTX 3090", 71),
        (cuda("NVIDIA GeForce RTX 4090"), "NVIDIA GeForce RTX 4090", 165.2),
        (cuda("NVIDIA GeForce RTX 5090"), "NVIDIA GeForce RTX 5090", 209.5),
        (rocm("AMD Instinct MI100"), "AMD Instinct MI100", 92.3),
        (rocm("AMD Instinct MI210"), "AMD Instinct MI210", 181.0),
        (rocm("AMD Instinct MI300X"), "AMD Instinct MI300X", 1307.4),
        (rocm("AMD Instinct MI300X VF"), "AMD Instinct MI300X", 1307.4),
        (rocm("AMD Instinct MI325X"), "AMD Instinct MI325X", 1307.4),
        (rocm("AMD Radeon RX 7900 XTX"), "AMD Radeon RX 7900 XTX", 122.8),
        (rocm("Radeon RX 7900 XTX"), "AMD Radeon RX 7900 XTX", 122.8),
        (rocm("AMD Radeon™ RX 7900 XTX"), "AMD Radeon RX 7900 XTX", 122.8),
        (rocm("AMD Radeon RX 9070 XT"), "AMD Radeon RX 9070 XT", 194.6),
    ],
    ids=lambda value: value.name if isinstance(value, DeviceInfo) else None,
)
def test_a_torch_name_finds_its_card(device: DeviceInfo, card: str, bf16_tflops: float) -> None:
    found = peak(device)
    assert found.device == card
    assert found.dtype == "bfloat16"
    assert found.flops_per_s == pytest.approx(bf16_tflops * T)
    assert found.source


@pytest.mark.parametrize(
    ("device", "card", "fp16_tflops"),
    [
        (cuda("Tesla V100-SXM2-16GB"), "NVIDIA Tesla V100 SXM2", 125),
        (cuda("Tesla V100-SXM2-32GB"), "NVIDIA Tesla V100 SXM2", 125),
        (cuda("Tesla V100-DGXS-32GB"), "NVIDIA Tesla V100 SXM2", 125),
        (cuda("Tesla V100-PCIE-16GB"), "NVIDIA Tesla V100 PCIe", 112),
        (cuda("Tesla T4"), "NVIDIA Tesla T4", 65),
    ],
    ids=lambda value: value.name if isinstance(value, DeviceInfo) else None,
)
def test_cards_without_bf16_answer_fp16_only(
    device: DeviceInfo, card: str, fp16_tflops: float
) -> None:
    found = peak(device, "fp16")
    assert found.device == card
    assert found.flops_per_s == pytest.approx(fp16_tflops * T)
    # Volta and Turing have no bf16 tensor cores (torch emulates bf16 there): no figure.
    assert spec_peak(device, "bf16") is None


@pytest.mark.parametrize(
    "device",
    [
        cuda("NVIDIA GeForce RTX 4090 D"),  # cut-down export card
        cuda("NVIDIA GeForce RTX 4090 Laptop GPU"),
        cuda("NVIDIA GeForce RTX 3090 Ti"),
        cuda("NVIDIA GeForce RTX 4080"),
        cuda("NVIDIA L40"),  # half the L40S's bf16 rate
        cuda("NVIDIA A10G"),  # AWS variant, other clocks
        cuda("NVIDIA A100X"),
        cuda("NVIDIA H800"),
        cuda("NVIDIA GH200 480GB"),
        cuda("Tesla V100S-PCIE-32GB"),
        cuda("Tesla V100-FHHL-16GB"),
        cuda("Quadro RTX 6000"),  # Turing, not the Ada card
        cuda("NVIDIA RTX PRO 6000 Blackwell Workstation Edition"),
        rocm("AMD Radeon RX 7900 XT"),
        rocm("AMD Radeon RX 9070"),
        rocm("AMD Instinct MI300A"),
    ],
    ids=lambda device: device.name,
)
def test_other_cards_find_nothing(device: DeviceInfo) -> None:
    assert spec_peak(device, "bf16") is None
    assert spec_peak(device, "fp32") is None


def test_rows_without_a_confirmed_figure_answer_none() -> None:
    # These rows tell their card from a sibling, but their tensor figures are not confirmed.
    assert spec_peak(cuda("NVIDIA H100 NVL"), "bf16") is None
    assert spec_peak(cuda("NVIDIA H200 NVL"), "bf16") is None
    assert spec_peak(rocm("AMD Radeon PRO W7900"), "bf16") is None
    assert spec_peak(cuda("NVIDIA RTX 6000 Ada Generation"), "bf16") is None
    found = peak(cuda("NVIDIA RTX 6000 Ada Generation"), "fp32")
    assert found.flops_per_s == pytest.approx(91.1 * T)
    assert found.memory_bytes_per_s == pytest.approx(960e9)


# ---------------------------------------------------------- names that cannot tell the variant


def test_bare_h100_needs_its_sm_count() -> None:
    bare = cuda("NVIDIA H100", arch="sm_90", memory_bytes=85_018_279_936)
    assert spec_peak(bare, "bf16") is None  # SXM5 989.5 vs PCIe 756.5: no guess
    sxm = cuda("NVIDIA H100", arch="sm_90", memory_bytes=85_018_279_936)
    sxm.extra["multiprocessor_count"] = 132
    assert peak(sxm).device == "NVIDIA H100 SXM5"
    pcie = cuda("NVIDIA H100", arch="sm_90", memory_bytes=85_018_279_936)
    pcie.extra["multiprocessor_count"] = 114
    assert peak(pcie).device == "NVIDIA H100 PCIe"
    nvl = cuda("NVIDIA H100", arch="sm_90", memory_bytes=99_857_989_632)
    nvl.extra["multiprocessor_count"] = 132
    assert spec_peak(nvl, "bf16") is None  # an NVL, whose figures are not in the table


def test_agreeing_candidates_give_the_figure_and_name_them_all() -> None:
    # "PG509-200" is a board number: SXM4 or PCIe cannot be read from it, but every 40 GB A100
    # has 312 TFLOPS bf16 and 1,555 GB/s.
    device = cuda("NVIDIA A100-PG509-200", arch="sm_80", memory_bytes=42_297_524_224)
    device.extra["multiprocessors"] = 108
    found = peak(device)
    assert found.flops_per_s == pytest.approx(312 * T)
    assert found.memory_bytes_per_s == pytest.approx(1555e9)
    assert "NVIDIA A100 SXM4 40GB" in found.device
    assert "NVIDIA A100 PCIe 40GB" in found.device
    assert "agree" in found.source


def test_bandwidth_is_dropped_where_candidates_disagree_on_it() -> None:
    # Every A100 has 312 TFLOPS bf16, but without a memory size 1,555 / 1,935 / 2,039 GB/s remain.
    found = peak(cuda("NVIDIA A100"))
    assert found.flops_per_s == pytest.approx(312 * T)
    assert found.memory_bytes_per_s is None


def test_mi250x_and_mi250_share_a_name_and_split_on_cus() -> None:
    name = "AMD Instinct MI250X / MI250"
    assert spec_peak(rocm(name, arch="gfx90a"), "bf16") is None  # 191.5 vs 181.05 per GCD
    mi250x = rocm(name, arch="gfx90a", memory_bytes=64 * GIB)
    mi250x.extra["multiprocessors"] = 110
    assert peak(mi250x).device == "AMD Instinct MI250X (one GCD)"
    assert peak(mi250x).flops_per_s == pytest.approx(191.5 * T)
    mi250 = rocm(name, arch="gfx90a", memory_bytes=64 * GIB)
    mi250.extra["multiprocessors"] = 104
    assert peak(mi250).device == "AMD Instinct MI250 (one GCD)"


def test_generic_amd_name_needs_arch_memory_and_cus() -> None:
    assert spec_peak(rocm("AMD Radeon Graphics"), "bf16") is None
    assert spec_peak(rocm("AMD Radeon Graphics", arch="gfx1100"), "bf16") is None
    no_cus = rocm("AMD Radeon Graphics", arch="gfx1100", memory_bytes=24 * GIB)
    assert spec_peak(no_cus, "bf16") is None


@pytest.mark.parametrize(
    ("arch", "memory_gib", "cus", "card"),
    [
        ("gfx1100", 24, 96, "AMD Radeon RX 7900 XTX"),
        ("gfx1100", 24, 48, "AMD Radeon RX 7900 XTX"),  # counted in work-group processors
        ("gfx942:sramecc+:xnack-", 192, 304, "AMD Instinct MI300X"),
        ("gfx942", 256, 304, "AMD Instinct MI325X"),
        ("gfx1201", 16, 64, "AMD Radeon RX 9070 XT"),
        ("HIP compute 9.4", 192, 304, "AMD Instinct MI300X"),
    ],
)
def test_generic_amd_name_resolved_by_the_device_numbers(
    arch: str, memory_gib: int, cus: int, card: str
) -> None:
    device = rocm("AMD Radeon Graphics", arch=arch, memory_bytes=memory_gib * GIB)
    device.extra["multiprocessor_count"] = cus
    assert peak(device).device == card


@pytest.mark.parametrize(
    ("arch", "memory_gib", "cus"),
    [
        ("gfx1100", 48, 96),  # a W7900: its figures are not in the table
        ("gfx1100", 20, 84),  # a 7900 XT: not in the table
        ("gfx1201", 16, 56),  # a 9070 (non-XT)
        ("gfx942", 128, 228),  # an MI300A
        ("gfx1103", 16, 12),  # an APU
    ],
)
def test_generic_amd_name_of_a_card_not_in_the_table(arch: str, memory_gib: int, cus: int) -> None:
    device = rocm("AMD Radeon Graphics", arch=arch, memory_bytes=memory_gib * GIB)
    device.extra["multiprocessor_count"] = cus
    assert spec_peak(device, "bf16") is None


def test_generic_gfx90a_of_mi210_size_is_mi210_or_half_an_mi250() -> None:
    # 104 CUs and 64 GB at 1.7 GHz: an MI210 and one GCD of an MI250 are the same silicon.
    device = rocm("AMD Radeon Graphics", arch="HIP compute 9.0", memory_bytes=68_702_699_520)
    device.extra["multiprocessors"] = 104
    found = peak(device)
    assert found.device == "AMD Instinct MI210 / AMD Instinct MI250 (one GCD)"
    assert found.flops_per_s == pytest.approx(181.0 * T)
    assert found.memory_bytes_per_s == pytest.approx(1638.4e9)


# ---------------------------------------------------------- the device's numbers contradict


def test_a_mig_slice_or_cpx_partition_matches_nothing() -> None:
    mig = cuda("NVIDIA H100 80GB HBM3 MIG 1g.10gb", arch="sm_90", memory_bytes=10 * GIB)
    mig.extra["multiprocessors"] = 16
    assert spec_peak(mig, "bf16") is None
    cpx = rocm("AMD Instinct MI300X", arch="gfx942", memory_bytes=48 * GIB)
    cpx.extra["multiprocessor_count"] = 38
    assert spec_peak(cpx, "bf16") is None


def test_an_arch_that_contradicts_the_name_matches_nothing() -> None:
    assert spec_peak(cuda("NVIDIA GeForce RTX 4090", arch="sm_86"), "bf16") is None
    assert spec_peak(rocm("AMD Instinct MI300X", arch="gfx90a"), "bf16") is None
    assert spec_peak(rocm("AMD Instinct MI300X", arch="HIP compute 9.0"), "bf16") is None
    assert peak(cuda("NVIDIA GeForce RTX 4090", arch="sm_89")).device == "NVIDIA GeForce RTX 4090"
    assert peak(rocm("AMD Instinct MI300X", arch="HIP compute 9.4")).device == (
        "AMD Instinct MI300X"
    )


def test_memory_that_contradicts_the_name_matches_nothing() -> None:
    assert spec_peak(cuda("NVIDIA GeForce RTX 4090", memory_bytes=48 * GIB), "bf16") is None
    assert spec_peak(cuda("NVIDIA A100-SXM4-80GB", memory_bytes=40 * GIB), "bf16") is None
    real = cuda("NVIDIA GeForce RTX 4090", memory_bytes=25_386_352_640)
    assert peak(real).device == "NVIDIA GeForce RTX 4090"


def test_an_overridden_gfx_target_is_not_evidence() -> None:
    # HSA_OVERRIDE_GFX_VERSION=10.3.0 makes the runtime report gfx1030 on this 7900 XTX.
    named = rocm("AMD Radeon RX 7900 XTX", arch="gfx1030", memory_bytes=24 * GIB)
    named.extra["hsa_override_gfx_version"] = "10.3.0"
    assert peak(named).device == "AMD Radeon RX 7900 XTX"
    generic = rocm("AMD Radeon Graphics", arch="gfx1100", memory_bytes=24 * GIB)
    generic.extra["hsa_override_gfx_version"] = "11.0.0"
    generic.extra["multiprocessor_count"] = 96
    assert spec_peak(generic, "bf16") is None


# ------------------------------------------------------------------------ no device, no dtype


def test_cpu_and_unknown_devices_find_nothing() -> None:
    assert spec_peak(DeviceInfo(kind="cpu", name="CPU", arch="x86_64"), "fp32") is None
    assert spec_peak(DeviceInfo(kind="cpu", name="NVIDIA H100 80GB HBM3"), "bf16") is None
    assert spec_peak(DeviceInfo(), "bf16") is None
    assert spec_peak(DeviceInfo(kind="unknown", name="unknown GPU"), "bf16") is None
    assert spec_peak(cuda("NVIDIA Graphics Device"), "bf16") is None


def test_vendor_must_match() -> None:
    assert spec_peak(rocm("NVIDIA H100 80GB HBM3"), "bf16") is None
    assert spec_peak(cuda("AMD Instinct MI300X"), "bf16") is None
    unknown_kind = DeviceInfo(kind="unknown", vendor="", name="NVIDIA H100 80GB HBM3")
    assert peak(unknown_kind).device == "NVIDIA H100 SXM5"


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp64", "", "bfloat", "c10::Float"])
def test_unknown_dtype_finds_nothing(dtype: str) -> None:
    assert canonical_dtype(dtype) is None
    assert spec_peak(cuda("NVIDIA H100 80GB HBM3"), dtype) is None


@pytest.mark.parametrize(
    ("alias", "dtype"),
    [
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("c10::BFloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("float16", "float16"),
        ("c10::Half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("float32", "float32"),
        (" Float32 ", "float32"),
        ("tf32", "tf32"),
        ("fp8", "float8"),
        ("float8_e4m3fn", "float8"),
        ("c10::Float8_e5m2", "float8"),
    ],
)
def test_dtype_aliases(alias: str, dtype: str) -> None:
    assert canonical_dtype(alias) == dtype
    assert peak(cuda("NVIDIA H100 80GB HBM3"), alias).dtype == dtype


def test_every_canonical_dtype_is_its_own_alias() -> None:
    for dtype in DTYPES:
        assert canonical_dtype(dtype) == dtype


# -------------------------------------------------------------------------- the real traces

#: trace -> (card(s) it must resolve to, dtype asked, dense TFLOPS); None: no peak (CPU only).
EXPECTED_PEAKS: dict[str, tuple[str, str, float] | None] = {
    # "NVIDIA A100-PG509-200", 40 GB: SXM4 or PCIe cannot be told, and both have these figures.
    "cuda/a100_alexnet_train.json.gz": ("NVIDIA A100 SXM4 40GB", "bf16", 312),
    "cuda/a100_triton_example.json.gz": ("NVIDIA A100 SXM4 40GB", "bf16", 312),
    "cuda/h100_bert_small_infer.json.gz": ("NVIDIA H100 SXM5", "bf16", 989.5),
    "cuda/v100_resnet50_num_workers_0.json.gz": ("NVIDIA Tesla V100 SXM2", "fp16", 125),
    "cuda/v100_resnet50_num_workers_4.json.gz": ("NVIDIA Tesla V100 SXM2", "fp16", 125),
    "edge/cpu_only.json.gz": None,
    "edge/mi210_gpu_only.json.gz": ("AMD Instinct MI210", "bf16", 181.0),
    # "AMD Radeon Graphics", HIP compute 9.0, 104 CUs, 64 GB: one GCD of the MI250 this trace
    # came from, indistinguishable from (and equal to) an MI210.
    "rocm/mi250_minitoy_train.json.gz": ("AMD Instinct MI250 (one GCD)", "bf16", 181.0),
    "rocm/mi300x_bert_small_infer.json.gz": ("AMD Instinct MI300X", "bf16", 1307.4),
    "rocm/mi300x_normalization_train.json.gz": ("AMD Instinct MI300X", "bf16", 1307.4),
    "rocm/mi300x_resnet_ddp_bf16_train.json.gz": ("AMD Instinct MI300X", "bf16", 1307.4),
    "rocm/mi300x_torch_compile_triton.json.gz": ("AMD Instinct MI300X", "bf16", 1307.4),
}


@pytest.fixture(scope="module")
def traces() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"real GPU traces not present at {SHARED}")
    return SHARED


def trace_device(path: Path) -> DeviceInfo:
    from diagnose.trace.device import detect_device
    from diagnose.trace.reader import read_trace

    return detect_device(read_trace(path)).info


@pytest.mark.parametrize("name", sorted(EXPECTED_PEAKS))
def test_real_trace_device_resolves_to_its_card(traces: Path, name: str) -> None:
    path = traces / name
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    device = trace_device(path)
    expected = EXPECTED_PEAKS[name]
    if expected is None:
        assert all(spec_peak(device, dtype) is None for dtype in DTYPES)
        return
    card, dtype, tflops = expected
    found = peak(device, dtype)
    assert card in found.device.split(" / "), found.device
    assert found.flops_per_s == pytest.approx(tflops * T)
    assert found.memory_bytes_per_s is not None
