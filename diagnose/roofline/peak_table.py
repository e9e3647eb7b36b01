"""The rows of the spec table: each card's dense FLOP/s per dtype, memory bandwidth, and what tells
it apart from its variants (name patterns, arch, memory sizes, SM/CU counts). The lookup and the
rules behind the figures (dense, FP32 accumulation, one GCD) are in :mod:`diagnose.roofline.peaks`.
Each row's source is in the comment above it and in its ``source``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Vendor = Literal["nvidia", "amd"]

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True, eq=False)
class Card:
    name: str
    vendor: Vendor
    #: "sm_90" or "gfx942": the target the card reports.
    arch: str
    #: Regex that must find the card in the normalised device name ...
    match: str
    #: ... and one that must not (another variant's marker: "pcie", "nvl", "ti").
    exclude: str | None
    #: Nominal memory sizes in GB (the variants that share every figure).
    memory_gb: tuple[int, ...]
    #: SMs (NVIDIA) or CUs (AMD) the device reports; empty where not used to tell variants.
    multiprocessors: tuple[int, ...]
    #: dtype -> dense FLOP/s.
    flops: Mapping[str, float]
    memory_bytes_per_s: float | None
    source: str
    _match: re.Pattern[str] = field(init=False, repr=False)
    _exclude: re.Pattern[str] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_match", re.compile(self.match))
        object.__setattr__(self, "_exclude", re.compile(self.exclude) if self.exclude else None)

    def named_by(self, normalised_name: str) -> bool:
        if not self._match.search(normalised_name):
            return False
        return self._exclude is None or not self._exclude.search(normalised_name)


def card(
    name: str,
    vendor: Vendor,
    arch: str,
    *,
    match: str,
    exclude: str | None = None,
    memory_gb: tuple[int, ...],
    multiprocessors: tuple[int, ...] = (),
    bf16: float | None = None,
    fp16: float | None = None,
    fp32: float | None = None,
    tf32: float | None = None,
    fp8: float | None = None,
    bandwidth_gb_s: float | None,
    source: str,
) -> Card:
    """A row, with the rates in TFLOPS and the bandwidth in GB/s as the sheets print them."""
    tflops = {"bfloat16": bf16, "float16": fp16, "float32": fp32, "tf32": tf32, "float8": fp8}
    return Card(
        name=name,
        vendor=vendor,
        arch=arch,
        match=match,
        exclude=exclude,
        memory_gb=memory_gb,
        multiprocessors=multiprocessors,
        flops={k: v * TERA for k, v in tflops.items() if v is not None},
        memory_bytes_per_s=bandwidth_gb_s * GIGA if bandwidth_gb_s is not None else None,
        source=source,
    )


_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (2021); tensor figures 'with sparsity' halved"
_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (2022); figures 'with sparsity' halved"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (2024); figures 'with sparsity' halved"
_V100_SHEET = "NVIDIA Tesla V100 GPU accelerator datasheet (2018): FP16 tensor, FP32 accumulate"
_MI200_SHEET = (
    "AMD Instinct MI200 series data sheet (2021): package (2 GCDs) figures halved, since torch "
    "sees each GCD as its own device"
)
_MI300_NOTE = "FP32 matrix (MFMA) equals the vector rate on CDNA 3"

TABLE: tuple[Card, ...] = (
    # ---------------------------------------------------------------- NVIDIA datacenter: Ampere
    # A100 datasheet (2021): BF16/FP16 312 | 624* TFLOPS, TF32 156 | 312*, FP32 19.5; bandwidth
    # 1,555 GB/s (40GB PCIe and SXM), 1,935 GB/s (80GB PCIe), 2,039 GB/s (80GB SXM). 108 SMs.
    card(
        "NVIDIA A100 SXM4 40GB",
        "nvidia",
        "sm_80",
        match=r"\ba100\b",
        exclude=r"\bpcie\b",
        memory_gb=(40,),
        multiprocessors=(108,),
        bf16=312,
        fp16=312,
        tf32=156,
        fp32=19.5,
        bandwidth_gb_s=1555,
        source=_A100_SHEET,
    ),
    card(
        "NVIDIA A100 SXM4 80GB",
        "nvidia",
        "sm_80",
        match=r"\ba100\b",
        exclude=r"\bpcie\b",
        memory_gb=(80,),
        multiprocessors=(108,),
        bf16=312,
        fp16=312,
        tf32=156,
        fp32=19.5,
        bandwidth_gb_s=2039,
        source=_A100_SHEET,
    ),
    card(
        "NVIDIA A100 PCIe 40GB",
        "nvidia",
        "sm_80",
        match=r"\ba100\b",
        exclude=r"\bsxm\d*\b",
        memory_gb=(40,),
        multiprocessors=(108,),
        bf16=312,
        fp16=312,
        tf32=156,
        fp32=19.5,
        bandwidth_gb_s=1555,
        source=_A100_SHEET,
    ),
    card(
        "NVIDIA A100 PCIe 80GB",
        "nvidia",
        "sm_80",
        match=r"\ba100\b",
        exclude=r"\bsxm\d*\b",
        memory_gb=(80,),
        multiprocessors=(108,),
        bf16=312,
        fp16=312,
        tf32=156,
        fp32=19.5,
        bandwidth_gb_s=1935,
        source=_A100_SHEET,
    ),
    # A10 datasheet (2021): BF16/FP16 125 | 250* TFLOPS, FP32 31.2, 600 GB/s, 72 SMs. Its TF32
    # figure (62.5) was not confirmed here. "A10G" (AWS) is another card: not matched.
    card(
        "NVIDIA A10",
        "nvidia",
        "sm_86",
        match=r"\ba10\b",
        memory_gb=(24,),
        multiprocessors=(72,),
        bf16=125,
        fp16=125,
        fp32=31.2,
        bandwidth_gb_s=600,
        source="NVIDIA A10 Tensor Core GPU datasheet (2021); figures 'with sparsity' halved",
    ),
    # ---------------------------------------------------------------- NVIDIA datacenter: Hopper
    # H100 datasheet (2022), SXM5: BF16/FP16 1,979*, FP8 3,958*, TF32 989*, FP32 67 TFLOPS,
    # 3.35 TB/s, 132 SMs. torch names it "NVIDIA H100 80GB HBM3" (the PCIe card has HBM2e).
    card(
        "NVIDIA H100 SXM5",
        "nvidia",
        "sm_90",
        match=r"\bh100\b",
        exclude=r"\b(pcie|nvl)\b",
        memory_gb=(80,),
        multiprocessors=(132,),
        bf16=989.5,
        fp16=989.5,
        tf32=494.5,
        fp32=67,
        fp8=1979,
        bandwidth_gb_s=3350,
        source=_H100_SHEET,
    ),
    # Same sheet, PCIe: BF16/FP16 1,513*, FP8 3,026*, TF32 756*, FP32 51, 2 TB/s, 114 SMs.
    card(
        "NVIDIA H100 PCIe",
        "nvidia",
        "sm_90",
        match=r"\bh100\b",
        exclude=r"\b(sxm\d*|nvl|hbm3)\b",
        memory_gb=(80,),
        multiprocessors=(114,),
        bf16=756.5,
        fp16=756.5,
        tf32=378,
        fp32=51,
        fp8=1513,
        bandwidth_gb_s=2000,
        source=_H100_SHEET,
    ),
    # H100 NVL (2023): 94 GB HBM3 at 3.9 TB/s, 132 SMs. Its tensor and FP32 figures were not
    # confirmed here: the row exists so that an NVL is never taken for an SXM5 (None instead).
    card(
        "NVIDIA H100 NVL",
        "nvidia",
        "sm_90",
        match=r"\bh100\b",
        exclude=r"\b(sxm\d*|pcie)\b",
        memory_gb=(94,),
        multiprocessors=(132,),
        bandwidth_gb_s=3900,
        source="NVIDIA H100 NVL product brief (2023): memory bandwidth only",
    ),
    # H200 datasheet (2024), SXM: the H100 SXM5 compute (BF16/FP16 1,979*, FP8 3,958*, TF32 989*,
    # FP32 67) with 141 GB HBM3e at 4.8 TB/s; torch names it "NVIDIA H200".
    card(
        "NVIDIA H200 SXM",
        "nvidia",
        "sm_90",
        match=r"\bh200\b",
        exclude=r"\bnvl\b",
        memory_gb=(141,),
        multiprocessors=(132,),
        bf16=989.5,
        fp16=989.5,
        tf32=494.5,
        fp32=67,
        fp8=1979,
        bandwidth_gb_s=4800,
        source=_H200_SHEET,
    ),
    # H200 NVL (same sheet): 4.8 TB/s; its lower-power compute figures were not confirmed here.
    card(
        "NVIDIA H200 NVL",
        "nvidia",
        "sm_90",
        match=r"\bh200\b.*\bnvl\b",
        memory_gb=(141,),
        multiprocessors=(132,),
        bandwidth_gb_s=4800,
        source=_H200_SHEET + ": memory bandwidth only",
    ),
    # ------------------------------------------------------------- NVIDIA datacenter: Blackwell
    # NVIDIA Blackwell datasheet (2025), HGX B200 column: FP16/BF16 4.5 PF*, FP8 9 PF*, TF32
    # 2.2 PF*, FP32 75 TFLOPS, 180 GB HBM3e at 7.7 TB/s; 148 SMs. (Earlier NVIDIA pages print
    # 80 TFLOPS FP32 and 8 TB/s; the later, lower sheet is the one used.)
    card(
        "NVIDIA B200",
        "nvidia",
        "sm_100",
        match=r"\bb200\b",
        memory_gb=(180, 192),
        multiprocessors=(148,),
        bf16=2250,
        fp16=2250,
        tf32=1100,
        fp32=75,
        fp8=4500,
        bandwidth_gb_s=7700,
        source="NVIDIA Blackwell datasheet, HGX B200 (2025); figures 'with sparsity' halved",
    ),
    # ----------------------------------------------------------- NVIDIA datacenter: Ada Lovelace
    # L40S datasheet (2023): BF16/FP16 362.05 | 733*, FP8 733 | 1,466*, TF32 183 | 366*, FP32
    # 91.6 TFLOPS, 864 GB/s, 142 SMs. (The L40 is half-rate on BF16: another card, not matched.)
    card(
        "NVIDIA L40S",
        "nvidia",
        "sm_89",
        match=r"\bl40s\b",
        memory_gb=(48,),
        multiprocessors=(142,),
        bf16=362.05,
        fp16=362.05,
        tf32=183,
        fp32=91.6,
        fp8=733,
        bandwidth_gb_s=864,
        source="NVIDIA L40S datasheet (2023); figures 'with sparsity' halved",
    ),
    # L4 datasheet (2023): BF16/FP16 242*, FP8 485*, TF32 120*, FP32 30.3 TFLOPS, 300 GB/s.
    card(
        "NVIDIA L4",
        "nvidia",
        "sm_89",
        match=r"\bl4\b",
        memory_gb=(24,),
        bf16=121,
        fp16=121,
        tf32=60,
        fp32=30.3,
        fp8=242.5,
        bandwidth_gb_s=300,
        source="NVIDIA L4 Tensor Core GPU datasheet (2023); figures 'with sparsity' halved",
    ),
    # ------------------------------------------------------------------ NVIDIA GeForce/workstation
    # GA102 whitepaper (2020), RTX 3090: FP16 tensor 142 | 284* with FP16 accumulate, 71 | 142*
    # with FP32 accumulate (GeForce halves it; PyTorch accumulates in FP32: 71 is used); BF16 71
    # (FP32 accumulate); FP32 35.6 TFLOPS; 936 GB/s; 82 SMs. TF32 not confirmed here.
    card(
        "NVIDIA GeForce RTX 3090",
        "nvidia",
        "sm_86",
        match=r"\brtx 3090\b",
        exclude=r"\bti\b",
        memory_gb=(24,),
        multiprocessors=(82,),
        bf16=71,
        fp16=71,
        fp32=35.6,
        bandwidth_gb_s=936,
        source=(
            "NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), RTX 3090: FP32-accumulate "
            "tensor rate (half the FP16-accumulate one on GeForce)"
        ),
    ),
    # Ada whitepaper (2022), RTX 4090: FP16/BF16 tensor with FP32 accumulate 165.2 | 330.4* (the
    # FP16-accumulate 330.3 is not what PyTorch uses), FP8 with FP32 accumulate 330.3 | 660.6*,
    # TF32 82.6, FP32 82.6 TFLOPS; 1,008 GB/s; 128 SMs. "RTX 4090 D" is a cut-down card.
    card(
        "NVIDIA GeForce RTX 4090",
        "nvidia",
        "sm_89",
        match=r"\brtx 4090\b",
        exclude=r"\b(d|laptop|mobile)\b",
        memory_gb=(24,),
        multiprocessors=(128,),
        bf16=165.2,
        fp16=165.2,
        tf32=82.6,
        fp32=82.6,
        fp8=330.3,
        bandwidth_gb_s=1008,
        source=(
            "NVIDIA Ada GPU Architecture whitepaper (2022), RTX 4090: FP32-accumulate tensor "
            "rate (half the FP16-accumulate one on GeForce)"
        ),
    ),
    # RTX Blackwell whitepaper / RTX 5090 specifications (2025): FP16 tensor 838 TFLOPS sparse
    # with FP16 accumulate -> 419 dense -> 209.5 with FP32 accumulate (GeForce halves it); FP32
    # 104.8 TFLOPS; 1,792 GB/s; 170 SMs. TF32 and FP8-with-FP32-accumulate not confirmed here.
    card(
        "NVIDIA GeForce RTX 5090",
        "nvidia",
        "sm_120",
        match=r"\brtx 5090\b",
        exclude=r"\b(d|laptop|mobile)\b",
        memory_gb=(32,),
        multiprocessors=(170,),
        bf16=209.5,
        fp16=209.5,
        fp32=104.8,
        bandwidth_gb_s=1792,
        source=(
            "NVIDIA RTX Blackwell GPU Architecture whitepaper (2025), RTX 5090: 838 sparse "
            "FP16-accumulate TFLOPS halved for density and again for FP32 accumulate on GeForce"
        ),
    ),
    # RTX 6000 Ada datasheet (2022): FP32 91.1 TFLOPS, 960 GB/s, 142 SMs. Its tensor figure
    # (1,457 TFLOPS, FP8 with sparsity) does not say which accumulate rate BF16 runs at on this
    # workstation card: the tensor dtypes were not confirmed here and are left out.
    card(
        "NVIDIA RTX 6000 Ada Generation",
        "nvidia",
        "sm_89",
        match=r"\brtx 6000 ada\b",
        memory_gb=(48,),
        multiprocessors=(142,),
        fp32=91.1,
        bandwidth_gb_s=960,
        source="NVIDIA RTX 6000 Ada Generation datasheet (2022): FP32 and bandwidth only",
    ),
    # ------------------------------------------------------------------- NVIDIA Volta / Turing
    # V100 datasheet (2018), "V100 for NVLink" (SXM2; also the DGX Station's "V100-DGXS" and the
    # DGX-2's SXM3, both NVLink boards per the DGX Station white paper, 2019): 125 TFLOPS FP16
    # tensor (FP32 accumulate), FP32 15.7, 900 GB/s, 80 SMs. No BF16 or TF32 in Volta.
    card(
        "NVIDIA Tesla V100 SXM2",
        "nvidia",
        "sm_70",
        match=r"\bv100\b",
        exclude=r"\b(pcie|fhhl)\b",
        memory_gb=(16, 32),
        multiprocessors=(80,),
        fp16=125,
        fp32=15.7,
        bandwidth_gb_s=900,
        source=_V100_SHEET,
    ),
    # Same sheet, "V100 for PCIe": 112 TFLOPS tensor, FP32 14, 900 GB/s. (V100S and the 150 W
    # FHHL board are other cards: not matched.)
    card(
        "NVIDIA Tesla V100 PCIe",
        "nvidia",
        "sm_70",
        match=r"\bv100\b",
        exclude=r"\b(sxm\d*|dgxs|fhhl)\b",
        memory_gb=(16, 32),
        multiprocessors=(80,),
        fp16=112,
        fp32=14,
        bandwidth_gb_s=900,
        source=_V100_SHEET,
    ),
    # T4 datasheet (2018): mixed precision (FP16/FP32) 65 TFLOPS, FP32 8.1, 320 GB/s, 40 SMs.
    # Turing has no BF16.
    card(
        "NVIDIA Tesla T4",
        "nvidia",
        "sm_75",
        match=r"\bt4\b",
        memory_gb=(16,),
        multiprocessors=(40,),
        fp16=65,
        fp32=8.1,
        bandwidth_gb_s=320,
        source="NVIDIA T4 Tensor Core GPU datasheet (2018): FP16 mixed precision",
    ),
    # ------------------------------------------------------------------------------ AMD CDNA 1
    # MI100 data sheet (2020): FP16 matrix 184.6, bfloat16 92.3 (half the FP16 rate on CDNA 1),
    # FP32 vector 23.1 (FP32 matrix 46.1) TFLOPS; 1.2288 TB/s; 120 CUs.
    card(
        "AMD Instinct MI100",
        "amd",
        "gfx908",
        match=r"\bmi100\b",
        memory_gb=(32,),
        multiprocessors=(120,),
        bf16=92.3,
        fp16=184.6,
        fp32=46.1,
        bandwidth_gb_s=1228.8,
        source="AMD Instinct MI100 data sheet (2020)",
    ),
    # ------------------------------------------------------------------------------ AMD CDNA 2
    # MI210 data sheet (2022): FP16/BF16 181.0, FP32 vector 22.6 (matrix 45.3) TFLOPS, 64 GB at
    # 1.6 TB/s, 104 CUs: one GCD, the same silicon and clock as half an MI250.
    card(
        "AMD Instinct MI210",
        "amd",
        "gfx90a",
        match=r"\bmi210\b",
        memory_gb=(64,),
        multiprocessors=(104,),
        bf16=181.0,
        fp16=181.0,
        fp32=45.3,
        bandwidth_gb_s=1638.4,
        source="AMD Instinct MI210 data sheet (2022)",
    ),
    # MI200 data sheet (2021), MI250: FP16/BF16 362.1, FP32 vector 45.3 (matrix 90.5) TFLOPS,
    # 128 GB at 3.2768 TB/s, 208 CUs, for 2 GCDs: halved per GCD. ROCm names MI250 and MI250X
    # alike ("AMD Instinct MI250X / MI250"): the CU count (104 vs 110) tells them apart.
    card(
        "AMD Instinct MI250 (one GCD)",
        "amd",
        "gfx90a",
        match=r"\bmi250\b",
        memory_gb=(64,),
        multiprocessors=(104,),
        bf16=181.05,
        fp16=181.05,
        fp32=45.25,
        bandwidth_gb_s=1638.4,
        source=_MI200_SHEET,
    ),
    # Same sheet, MI250X: FP16/BF16 383.0, FP32 vector 47.9 (matrix 95.7) TFLOPS, 3.2768 TB/s,
    # 220 CUs, for 2 GCDs: halved per GCD.
    card(
        "AMD Instinct MI250X (one GCD)",
        "amd",
        "gfx90a",
        match=r"\bmi250x\b",
        memory_gb=(64,),
        multiprocessors=(110,),
        bf16=191.5,
        fp16=191.5,
        fp32=47.85,
        bandwidth_gb_s=1638.4,
        source=_MI200_SHEET,
    ),
    # ------------------------------------------------------------------------------ AMD CDNA 3
    # MI300X data sheet (2023): FP16/BF16 1,307.4 (2,614.9 with sparsity), FP8 2,614.9, TF32
    # (XF32) 653.7, FP32 163.4 TFLOPS; 192 GB HBM3 at 5.3 TB/s; 304 CUs (SPX mode: a CPX
    # partition reports 38 and matches nothing). PyTorch on ROCm runs FP32 matmuls at the XF32
    # rate only when hipBLASLt's XF32 is enabled, which is not the default.
    card(
        "AMD Instinct MI300X",
        "amd",
        "gfx942",
        match=r"\bmi300x\b",
        memory_gb=(192,),
        multiprocessors=(304,),
        bf16=1307.4,
        fp16=1307.4,
        tf32=653.7,
        fp32=163.4,
        fp8=2614.9,
        bandwidth_gb_s=5300,
        source=f"AMD Instinct MI300X data sheet (2023); {_MI300_NOTE}",
    ),
    # MI325X data sheet (2024): the MI300X compute with 256 GB HBM3E at 6 TB/s.
    card(
        "AMD Instinct MI325X",
        "amd",
        "gfx942",
        match=r"\bmi325x\b",
        memory_gb=(256,),
        multiprocessors=(304,),
        bf16=1307.4,
        fp16=1307.4,
        tf32=653.7,
        fp32=163.4,
        fp8=2614.9,
        bandwidth_gb_s=6000,
        source=f"AMD Instinct MI325X data sheet (2024); {_MI300_NOTE}",
    ),
    # ------------------------------------------------------------------------------- AMD RDNA 3
    # Some ROCm releases count RDNA work-group processors (2 CUs) as multiprocessors: both counts
    # are accepted.
    # Radeon PRO W7900 specifications (2023): 96 CUs, 48 GB GDDR6 at 864 GB/s. Its FP32/FP16
    # figures were not confirmed here: the row tells a W7900 from a 7900 XTX (None for it).
    card(
        "AMD Radeon PRO W7900",
        "amd",
        "gfx1100",
        match=r"\bw7900\b",
        exclude=r"\b(ds|dual slot)\b",
        memory_gb=(48,),
        multiprocessors=(96, 48),
        bandwidth_gb_s=864,
        source="AMD Radeon PRO W7900 specifications (2023): memory bandwidth only",
    ),
    # Radeon RX 7900 XTX specifications (2022): FP16 122.8 and FP32 61.4 TFLOPS (dual-issue), 96
    # CUs, 960 GB/s. BF16: RDNA 3 WMMA runs BF16 at the FP16 rate, 512 FLOPs/clock/CU (AMD
    # GPUOpen, "How to accelerate AI applications on RDNA 3 using WMMA", 2023, and the RDNA 4
    # matrix-core guide's per-generation table, 2025).
    card(
        "AMD Radeon RX 7900 XTX",
        "amd",
        "gfx1100",
        match=r"\b7900 xtx\b",
        memory_gb=(24,),
        multiprocessors=(96, 48),
        bf16=122.8,
        fp16=122.8,
        fp32=61.4,
        bandwidth_gb_s=960,
        source=(
            "AMD Radeon RX 7900 XTX specifications (2022); BF16 WMMA at the FP16 rate per AMD "
            "GPUOpen RDNA 3 WMMA guide (2023)"
        ),
    ),
    # ------------------------------------------------------------------------------- AMD RDNA 4
    # Radeon RX 9070 XT specifications (2025): 64 CUs at 2,970 MHz boost, FP32 48.7 TFLOPS,
    # 16 GB at 640 GB/s. Matrix rates derived from AMD GPUOpen "Using the Matrix Cores of AMD
    # RDNA 4 architecture GPUs" (2025): dense FP16/BF16 1,024 and FP8 2,048 FLOPs/clock/CU, so
    # 194.6 and 389.3 TFLOPS (AMD prints 389/779 for them with sparsity).
    card(
        "AMD Radeon RX 9070 XT",
        "amd",
        "gfx1201",
        match=r"\b9070 xt\b",
        memory_gb=(16,),
        multiprocessors=(64, 32),
        bf16=194.6,
        fp16=194.6,
        fp32=48.7,
        fp8=389.3,
        bandwidth_gb_s=640,
        source=(
            "AMD Radeon RX 9070 XT specifications (2025); matrix rates from AMD GPUOpen RDNA 4 "
            "matrix-core guide (2025) x 64 CUs x 2.97 GHz"
        ),
    ),
)
