"""Which devices compute bf16 natively: per vendor, from the architecture name alone.

No torch here: the trace analysis asks this of a trace's device (an fp32 trace on a GPU without
native bf16 gets fp16 advice), and reading a trace must not import torch.
"""

from __future__ import annotations

import re

from diagnose.record import DeviceInfo


def amd_bf16_native(gfx: str) -> bool | None:
    """Whether an AMD gfx target computes bf16 natively (matrix/dot instructions), None if unknown.

    Sources: LLVM AMDGPUUsage processor table and the per-generation ISA manuals.
    - gfx908 (MI100, CDNA1): bf16 MFMA (v_mfma_f32_*bf16) at half its fp16 rate: native.
    - gfx90a (MI200, CDNA2) added full-rate bf16 MFMA (the "_1k" forms); gfx94x (MI300) and
      gfx95x (MI350) keep them.
    - gfx900/902/904/906/909/90c (Vega, MI50/60, Radeon VII, Vega APUs): no bf16 instructions;
      torch emulates bf16 through fp32.
    - gfx10xx (RDNA1/2): dot instructions for fp16/int8 only, no bf16.
    - gfx11xx (RDNA3/3.5): WMMA with bf16 inputs (V_WMMA_F32_16X16X16_BF16) and v_dot2_f32_bf16.
    - gfx12xx (RDNA4): WMMA bf16.
    """
    name = gfx.strip().lower().split(":", 1)[0]
    generic = re.fullmatch(r"gfx(\d+)(?:-(\d+))?-generic", name)
    if generic:  # code-object "generic" targets: gfx9-generic, gfx9-4-generic, gfx11-generic...
        major = int(generic.group(1))
        if major == 9:
            return generic.group(2) in ("4", "5")
        return amd_bf16_native(f"gfx{major}00") if major >= 10 else False
    match = re.fullmatch(r"gfx([0-9a-f]+)", name)
    if not match:
        return None
    digits = match.group(1)
    if len(digits) == 3:
        major_text, rest = digits[0], digits[1:]
    elif len(digits) == 4:
        major_text, rest = digits[:2], digits[2:]
    else:
        return None
    if not major_text.isdigit():
        return None
    major = int(major_text)
    if major <= 8:
        return False
    if major == 9:
        return rest in ("08", "0a") or rest[0] in ("4", "5")
    if major == 10:
        return False
    if major in (11, 12):
        return True
    return None


def nvidia_bf16_native(arch: str) -> bool | None:
    """bf16 tensor cores arrived with Ampere (sm_80); Turing/Volta (sm_75/sm_70) emulate bf16."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch.strip().lower())
    if not match:
        return None
    major = int(match.group(1)) // 10
    return major >= 8


def cpu_bf16_native(isa: list[str] | None) -> bool | None:
    """x86: AVX512-BF16 or AMX-BF16 (oneDNN uses them for bf16 GEMMs); aarch64: the BF16 extension
    (BFMMLA/BFDOT). Without them torch converts bf16 to fp32 and back around every op."""
    if isa is None:
        return None
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(isa))


def bf16_native(info: DeviceInfo) -> bool | None:
    """Whether the device computes bf16 natively; None when it cannot be told.

    Do not use ``torch.cuda.is_bf16_supported()`` for this: it returns True on every HIP build
    whatever the GPU.
    """
    if info.kind == "cuda":
        return nvidia_bf16_native(info.arch)
    if info.kind == "rocm":
        return amd_bf16_native(info.arch)
    if info.kind == "cpu":
        isa = info.extra.get("isa")
        return cpu_bf16_native(list(isa)) if isinstance(isa, (list, tuple)) else None
    return None
