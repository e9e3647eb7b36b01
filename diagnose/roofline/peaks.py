"""The vendor's dense peak for a GPU, by dtype: a small spec table and the lookup that finds a
device's row from what torch (or a trace) says about it.

No torch here: the trace analysis asks this of a trace's device, and reading a trace must not
import torch.

Every figure is DENSE (no 2:4 structured sparsity): vendor sheets print the sparse tensor figure
with an asterisk, and those were halved. The source of each row is in the comment above it and in
``SpecPeak.source``. A dtype a row lacks is one whose figure could not be confirmed (or that the
hardware does not compute natively); the lookup then answers None rather than a guess.

dtypes (the names torch uses, plus two):
- ``bfloat16``, ``float16``: the tensor/matrix-core rate with FP32 accumulation (what PyTorch's
  GEMMs use). GeForce cards run FP32 accumulation at half the FP16-accumulate rate NVIDIA prints
  first; their rows hold the FP32-accumulate figure.
- ``float32``: the rate an FP32 GEMM can reach without TF32: the vector (non-tensor) rate on
  NVIDIA, the FP32 matrix (MFMA) rate on AMD CDNA, whose rocBLAS/hipBLASLt SGEMM runs on the
  matrix cores at up to twice the vector rate (the comments give both). MFU holds the step's
  GEMM/conv/attention FLOPs against it, so a lower figure would let an fp32 run read above 100%.
- ``tf32``: FP32 matmul on NVIDIA tensor cores with ``allow_tf32`` (AMD MI300: XF32).
- ``float8``: FP8 (e4m3/e5m2) tensor/matrix rate.

Matching, in order:
1. The vendor comes from the device kind (cuda: NVIDIA, rocm: AMD); a CPU matches nothing.
2. Candidate rows are those whose name pattern fits the device name (normalised: lower case,
   punctuation to spaces), so "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3" (the SXM5 board),
   "AMD Instinct MI300X VF" (an SR-IOV function of the whole GPU) and "Radeon RX 7900 XTX" all
   name their card. A generic name ("AMD Radeon Graphics", "NVIDIA Graphics Device") names
   nothing: then every row of the vendor is a candidate, but only if the device's architecture,
   memory size and compute-unit count are all known (it is those that have to tell the card).
3. Candidates that the device's own numbers contradict are dropped: the architecture (sm_90,
   gfx942, or the "HIP compute 9.4" a ROCm trace records; not used when HSA_OVERRIDE_GFX_VERSION
   rewrote it), the memory size (from ``memory_bytes``, or a size written in the name such as
   "80GB"), and the SM/CU count (a MIG slice or a CPX partition has fewer, so it matches no row).
4. One candidate left: its row. Several (the name cannot tell the variants apart): the answer is
   given only where every candidate has the figure and they agree within 1% (e.g. an A100 40GB
   of unknown form factor: SXM4 and PCIe share 312 TFLOPS bf16 and 1555 GB/s); it is then the
   lowest of them, ``device`` names all of them and ``source`` says so. Where they disagree (an
   "NVIDIA H100" with no SM count: SXM5 989 vs PCIe 756 TFLOPS) the answer is None, never a
   guess. Bandwidth follows the same rule on its own: None where the candidates disagree on it.

A device torch shows as several (each GCD of an MI250/MI250X is its own device) gets the figures
of one GCD: those rows are the datasheet's package figures halved.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from diagnose.record import DeviceInfo
from diagnose.roofline.peak_table import TABLE, Card, Vendor

#: The dtypes the table knows, in the order reports list them.
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32", "tf32", "float8")

#: Spellings seen in torch, traces ("Input type" of an op) and users' configs.
_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "c10::bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "c10::half": "float16",
    "torch.float16": "float16",
    "torch.half": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "torch.float32": "float32",
    "torch.float": "float32",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "tensorfloat-32": "tf32",
    "xf32": "tf32",
    "fp8": "float8",
    "float8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "float8_e4m3fnuz": "float8",
    "float8_e5m2fnuz": "float8",
    "c10::float8_e4m3fn": "float8",
    "c10::float8_e5m2": "float8",
    "c10::float8_e4m3fnuz": "float8",
    "c10::float8_e5m2fnuz": "float8",
    "torch.float8_e4m3fn": "float8",
    "torch.float8_e5m2": "float8",
    "torch.float8_e4m3fnuz": "float8",
    "torch.float8_e5m2fnuz": "float8",
}

#: Candidates within this relative spread count as agreeing (MI210 181.0 vs half an MI250,
#: 181.05 TFLOPS: the same silicon at the same clock, rounded differently).
_AGREEMENT = 0.01

#: A device shows less memory than its nominal size (ECC, firmware reservations: an L4's 24 GB
#: shows as 22 GiB) and about the nominal size when that is in GiB (MI300X: 192 GiB). These bounds
#: keep every real card in and still tell 40 from 80 GB, 80 from 94 GB and 192 from 256 GB apart.
_MEMORY_LOW, _MEMORY_HIGH = 0.85, 1.02

#: Names that identify no card: AMD's marketing name for an unknown device ID, NVIDIA's for an
#: unreleased one, and the trace reader's placeholder when a trace has no device properties.
_GENERIC_NAME = re.compile(
    r"|((amd|nvidia) )?((radeon|radeon pro) )?graphics( device)?|unknown( (amd|nvidia))? gpu"
)


@dataclass(frozen=True)
class SpecPeak:
    """The vendor's dense peak of one device for one dtype."""

    #: The table's canonical name ("NVIDIA H100 SXM5"); several joined by " / " when the device
    #: could not be told apart from them and they agree on the figure.
    device: str
    #: Canonical dtype: "bfloat16", "float16", "float32", "tf32" or "float8".
    dtype: str
    #: Dense (no 2:4 sparsity) FLOP/s.
    flops_per_s: float
    #: Peak DRAM (HBM/GDDR) bandwidth in bytes/s; None where it is not confirmed or not agreed.
    memory_bytes_per_s: float | None
    #: Where the numbers come from (datasheet / whitepaper), short.
    source: str


def fastest_known_rate() -> float:
    """The fastest dense peak (FLOP/s, any dtype) of any device in the spec table: no step of
    any of them runs faster."""
    return max(rate for card in TABLE for rate in card.flops.values())


def known_devices() -> list[str]:
    """The canonical names of every card in the table."""
    return [card.name for card in TABLE]


def canonical_dtype(dtype: str) -> str | None:
    """The table's name for a dtype spelling ("bf16", "c10::BFloat16", "torch.bfloat16" ->
    "bfloat16"); None for a dtype the table does not know."""
    return _DTYPE_ALIASES.get(dtype.strip().lower())


def spec_peak(device: DeviceInfo, dtype: str) -> SpecPeak | None:
    """The vendor's dense peak of ``device`` for ``dtype``; None when the device is not in the
    table, cannot be told apart from cards with other figures, or lacks a confirmed figure for
    the dtype (see the module docstring for the matching rules)."""
    wanted = canonical_dtype(dtype)
    if wanted is None:
        return None
    candidates = _candidates(device)
    if not candidates:
        return None
    rates = [card.flops.get(wanted) for card in candidates]
    known = [r for r in rates if r is not None]
    if len(known) < len(rates) or not _agree(known):
        return None
    bandwidths = [card.memory_bytes_per_s for card in candidates]
    known_bandwidths = [b for b in bandwidths if b is not None]
    bandwidth = (
        min(known_bandwidths)
        if len(known_bandwidths) == len(bandwidths) and _agree(known_bandwidths)
        else None
    )
    if len(candidates) == 1:
        card = candidates[0]
        return SpecPeak(card.name, wanted, min(known), bandwidth, card.source)
    sources = list(dict.fromkeys(card.source for card in candidates))
    return SpecPeak(
        device=" / ".join(card.name for card in candidates),
        dtype=wanted,
        flops_per_s=min(known),
        memory_bytes_per_s=bandwidth,
        source=(
            f"the device fits {len(candidates)} cards that agree on this figure (the lowest is "
            f"given): " + "; ".join(sources)
        ),
    )


def _agree(values: list[float]) -> bool:
    return max(values) <= min(values) * (1 + _AGREEMENT)


def _normalise_name(name: str) -> str:
    """Lower case, trademark signs dropped, punctuation ("-", "/", "_") to single spaces."""
    text = name.lower()
    for mark in ("(tm)", "(r)", "™", "®"):
        text = text.replace(mark, "")
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())


def _vendor(device: DeviceInfo) -> Vendor | None:
    if device.kind == "cuda":
        return "nvidia"
    if device.kind == "rocm":
        return "amd"
    vendor = device.vendor.lower()
    if "nvidia" in vendor:
        return "nvidia"
    if "amd" in vendor or "advanced micro" in vendor:
        return "amd"
    return None


@dataclass(frozen=True)
class _Arch:
    """What the device says about its target: an exact one ("sm_90", "gfx942"), or only the HIP
    major.minor a ROCm trace records (9.4 covers gfx940/941/942)."""

    exact: str | None = None
    hip_compute: tuple[int, int] | None = None

    def admits(self, card_arch: str) -> bool:
        if self.exact is not None:
            return self.exact == card_arch
        if self.hip_compute is not None:
            return _gfx_compute(card_arch) == self.hip_compute
        return True


def _device_arch(device: DeviceInfo) -> _Arch | None:
    """The device's target, or None when it is unknown or was overridden."""
    if device.extra.get("hsa_override_gfx_version"):
        # The runtime then reports (and loads kernels for) another target than the silicon's.
        return None
    text = device.arch.strip().lower()
    nvidia = re.fullmatch(r"sm_?(\d+)[a-z]?", text)
    if nvidia:
        return _Arch(exact=f"sm_{nvidia.group(1)}")
    gfx = re.match(r"(gfx[0-9a-f]+)(?::|$)", text)
    if gfx:
        return _Arch(exact=gfx.group(1))
    hip = re.fullmatch(r"hip compute (\d+)\.(\d+)", text)
    if hip:
        return _Arch(hip_compute=(int(hip.group(1)), int(hip.group(2))))
    return None


def _gfx_compute(arch: str) -> tuple[int, int] | None:
    """gfx942 -> (9, 4), gfx90a -> (9, 0), gfx1100 -> (11, 0): the major.minor HIP reports (the
    last hex digit is the stepping)."""
    match = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", arch)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2), 16)


def _multiprocessors(device: DeviceInfo) -> int | None:
    # A trace records "multiprocessors" (numSms); the live inventory "multiprocessor_count".
    for key in ("multiprocessors", "multiprocessor_count"):
        value = device.extra.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _name_memory_gb(normalised_name: str) -> int | None:
    """A size written in the name: "nvidia a100 sxm4 80gb" -> 80."""
    match = re.search(r"\b(\d+) ?gb\b", normalised_name)
    return int(match.group(1)) if match else None


def _memory_fits(card: Card, memory_bytes: int) -> bool:
    visible_gib = memory_bytes / 2**30
    return any(_MEMORY_LOW * n <= visible_gib <= _MEMORY_HIGH * n for n in card.memory_gb)


def _candidates(device: DeviceInfo) -> list[Card]:
    """The rows the device could be, after its name and its own numbers had their say."""
    if device.kind == "cpu":
        return []
    vendor = _vendor(device)
    name = _normalise_name(device.name)
    arch = _device_arch(device)
    memory = device.memory_bytes if device.memory_bytes and device.memory_bytes > 0 else None
    multiprocessors = _multiprocessors(device)
    pool = [card for card in TABLE if vendor is None or card.vendor == vendor]
    if _GENERIC_NAME.fullmatch(name):
        # Nothing in the name: only the device's numbers can tell the card, so all of them must
        # be there (an arch alone would take any gfx1100 for a 7900 XTX).
        if vendor is None or arch is None or memory is None or multiprocessors is None:
            return []
        named = pool
    else:
        named = [card for card in pool if card.named_by(name)]
    name_memory = _name_memory_gb(name)
    fitting: list[Card] = []
    for card in named:
        if arch is not None and not arch.admits(card.arch):
            continue
        if memory is not None and not _memory_fits(card, memory):
            continue
        if name_memory is not None and name_memory not in card.memory_gb:
            continue
        if (
            multiprocessors is not None
            and card.multiprocessors
            and multiprocessors not in card.multiprocessors
        ):
            continue
        fitting.append(card)
    return fitting


def table_rows() -> list[tuple[str, str, Mapping[str, float], float | None, str]]:
    """(name, vendor, dtype -> FLOP/s, bandwidth, source) for every row: for tests and reports
    that list what the table knows."""
    return [
        (card.name, card.vendor, dict(card.flops), card.memory_bytes_per_s, card.source)
        for card in TABLE
    ]
