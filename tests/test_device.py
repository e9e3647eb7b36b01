"""Device selection and description.

The CPU branch runs for real here. The GPU branches cannot; their pure helpers are tested on
``torch.cuda.get_device_properties`` values users posted in public issues (cited per case).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import pytest
import torch

from diagnose.device import (
    GpuProperties,
    amd_bf16_native,
    bf16_native,
    cpu_bf16_native,
    describe_device,
    dnn_label,
    format_pci_bus_id,
    gpu_info,
    is_integrated_gpu,
    nvidia_arch,
    nvidia_bf16_native,
    parse_cpuinfo,
    parse_gcn_arch,
    parse_nvidia_proc_version,
    runtime_label,
    select_device,
)
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.quiet import capture_output
from diagnose.record import DeviceInfo

needs_cpu_only_torch = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the behaviour without a GPU"
)

# --- select_device --------------------------------------------------------------------------------


@needs_cpu_only_torch
def test_auto_is_cpu_without_a_gpu() -> None:
    assert select_device("auto") == torch.device("cpu")
    assert select_device() == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cpu", " CPU ", "cpu:0"])
def test_cpu_spellings(spec: str) -> None:
    assert select_device(spec) == torch.device("cpu")


@needs_cpu_only_torch
@pytest.mark.parametrize("spec", ["cuda", "cuda:1", "rocm", "hip:0"])
def test_missing_gpu_is_unsupported_with_one_line_naming_what_is_there(spec: str) -> None:
    with pytest.raises(DiagnoseError) as caught:
        select_device(spec)
    assert caught.value.code == ExitCode.UNSUPPORTED
    message = caught.value.message
    assert "\n" not in message
    assert repr(spec) in message
    assert message.endswith("available: cpu")


@pytest.mark.parametrize("spec", ["bogus", "cuda:x", "cuda:-1", "", "auto:1", "cpu:1", "cuda:0:1"])
def test_malformed_spec_is_usage(spec: str) -> None:
    with pytest.raises(DiagnoseError) as caught:
        select_device(spec)
    assert caught.value.code == ExitCode.USAGE
    assert "\n" not in caught.value.message
    assert "cuda:N" in caught.value.message or "'cpu'" in caught.value.message


def test_other_torch_device_types_are_unsupported() -> None:
    with pytest.raises(DiagnoseError) as caught:
        select_device("mps")
    assert caught.value.code == ExitCode.UNSUPPORTED
    assert "available: cpu" in caught.value.message


# --- describe_device(cpu) -------------------------------------------------------------------------


def test_describe_cpu_is_complete() -> None:
    info = describe_device(torch.device("cpu"))
    assert info.kind == "cpu"
    assert info.torch_device == "cpu"
    assert info.name
    assert info.arch == platform.machine()
    assert info.memory_bytes is not None and info.memory_bytes > 0
    assert info.runtime == "" and info.driver == ""
    extra = info.extra
    assert extra["logical_cores"] == os.cpu_count()
    assert extra["physical_cores"] is None or extra["physical_cores"] >= 1
    assert extra["torch_threads"] == torch.get_num_threads()
    assert extra["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if sys.platform.startswith("linux"):
        assert isinstance(extra["isa"], list)
        assert extra["isa"] == sorted(extra["isa"])
        assert extra["bf16_native"] == cpu_bf16_native(extra["isa"])
        assert info.vendor


# --- pure GPU helpers on recorded values ---------------------------------------------------------


def test_parse_gcn_arch() -> None:
    assert parse_gcn_arch("gfx1100:sramecc-:xnack-") == ("gfx1100", ["sramecc-", "xnack-"])
    assert parse_gcn_arch("gfx942:sramecc+:xnack-") == ("gfx942", ["sramecc+", "xnack-"])
    assert parse_gcn_arch("gfx1030") == ("gfx1030", [])


def test_capability_and_runtime_labels() -> None:
    assert nvidia_arch(9, 0) == "sm_90"
    assert nvidia_arch(7, 5) == "sm_75"
    assert nvidia_arch(12, 0) == "sm_120"
    assert runtime_label(None, "6.4.43482-0f2d60242") == "HIP 6.4.43482"
    assert runtime_label(None, "6.3.42131-fa1d09cbd") == "HIP 6.3.42131"
    assert runtime_label("12.8", None) == "CUDA 12.8"
    assert runtime_label(None, None) == ""


def test_dnn_labels() -> None:
    assert dnn_label(90100, hip=False) == "cuDNN 9.1.0"
    assert dnn_label(91002, hip=False) == "cuDNN 9.10.2"
    assert dnn_label(8906, hip=False) == "cuDNN 8.9.6"
    assert dnn_label(3004000, hip=True) == "MIOpen 3.4.0"  # major*1e6 + minor*1e3 + patch
    assert dnn_label(None, hip=False) == ""


@pytest.mark.parametrize(
    ("gfx", "native"),
    [
        ("gfx1030", False),  # RDNA2 (RX 6800/6900)
        ("gfx1010", False),  # RDNA1
        ("gfx1100", True),  # RDNA3 WMMA bf16 (RX 7900 XTX)
        ("gfx1151", True),  # RDNA3.5 (Strix Halo)
        ("gfx1201", True),  # RDNA4 (RX 9070 XT)
        ("gfx906", False),  # Vega 20 (MI50, Radeon VII)
        ("gfx908", True),  # MI100 bf16 MFMA
        ("gfx90a", True),  # MI200
        ("gfx942", True),  # MI300
        ("gfx950", True),  # MI350
        ("gfx90c", False),  # Vega APU
        ("gfx803", False),
        ("gfx11-generic", True),
        ("gfx9-4-generic", True),
        ("gfx9-generic", False),
        ("gfx1100:sramecc-:xnack-", True),
        ("banana", None),
    ],
)
def test_amd_bf16_native(gfx: str, native: bool | None) -> None:
    assert amd_bf16_native(gfx) is native


@pytest.mark.parametrize(
    ("arch", "native"),
    [("sm_75", False), ("sm_70", False), ("sm_80", True), ("sm_86", True), ("sm_90", True),
     ("sm_120", True), ("sm_90a", True), ("gfx1100", None)],
)  # fmt: skip
def test_nvidia_bf16_native(arch: str, native: bool | None) -> None:
    assert nvidia_bf16_native(arch) is native


#: RX 7900 XTX under torch 2.9.0.dev20250713+rocm6.4 (a user's report):
#: _CudaDeviceProperties(name='Radeon RX 7900 XTX', major=11, minor=0, gcnArchName='gfx1100',
#: total_memory=24560MB, multi_processor_count=48, ..., L2_cache_size=6MB)
RX_7900_XTX = GpuProperties(
    name="Radeon RX 7900 XTX",
    major=11,
    minor=0,
    total_memory=24560 * 2**20,
    multi_processor_count=48,
    gcn_arch_name="gfx1100",
    l2_cache_bytes=6 * 2**20,
    hip_version="6.4.43482-0f2d60242",
    dnn_version=3004000,
    torch_bf16_supported=True,
)
#: MI300X under torch 2.6 (ROCm/ROCm issue 4203): gcnArchName='gfx942:sramecc+:xnack-',
#: total_memory=196592MB, multi_processor_count=304.
MI300X = GpuProperties(
    name="AMD Instinct MI300X",
    major=9,
    minor=4,
    total_memory=196592 * 2**20,
    multi_processor_count=304,
    gcn_arch_name="gfx942:sramecc+:xnack-",
    hip_version="6.2.41133-dd7f95766",
    torch_bf16_supported=True,
)
#: H100 under torch 2.7.0 / CUDA 12.8: major=9, minor=0, total_memory=81089MB,
#: multi_processor_count=132, L2_cache_size=50MB.
H100 = GpuProperties(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    total_memory=81089 * 2**20,
    multi_processor_count=132,
    l2_cache_bytes=50 * 2**20,
    cuda_version="12.8",
    dnn_version=90701,
    torch_bf16_supported=True,
)


def test_gpu_info_amd_rdna3() -> None:
    info = gpu_info(RX_7900_XTX, driver="6.10.5")
    assert (info.kind, info.vendor, info.arch) == ("rocm", "AMD", "gfx1100")
    assert info.name == "Radeon RX 7900 XTX"
    assert info.runtime == "HIP 6.4.43482"
    assert info.memory_bytes == 24560 * 2**20
    assert info.driver == "6.10.5"
    assert info.torch_device == "cuda:0"
    assert info.extra["dnn"] == "MIOpen 3.4.0"
    assert info.extra["multiprocessor_count"] == 48
    assert info.extra["bf16_native"] is True


def test_gpu_info_amd_features_go_to_extra() -> None:
    info = gpu_info(MI300X)
    assert info.arch == "gfx942"
    assert info.extra["gcn_arch_features"] == ["sramecc+", "xnack-"]
    assert info.extra["gcn_arch_name"] == "gfx942:sramecc+:xnack-"
    assert info.extra["bf16_native"] is True


def test_gpu_info_nvidia() -> None:
    info = gpu_info(H100)
    assert (info.kind, info.vendor, info.arch) == ("cuda", "NVIDIA", "sm_90")
    assert info.runtime == "CUDA 12.8"
    assert info.extra["compute_capability"] == "9.0"
    assert info.extra["dnn"] == "cuDNN 9.7.1"
    assert info.extra["bf16_native"] is True


def test_hip_bf16_claim_is_not_trusted() -> None:
    """torch.cuda.is_bf16_supported() says True on every HIP build; RDNA2 has no bf16 compute."""
    rdna2 = GpuProperties(
        name="AMD Radeon RX 6800",
        major=10,
        minor=3,
        gcn_arch_name="gfx1030",
        hip_version="6.2.41133-dd7f95766",
        torch_bf16_supported=True,
    )
    info = gpu_info(rdna2)
    assert info.extra["torch_is_bf16_supported"] is True
    assert info.extra["bf16_native"] is False


def test_turing_is_not_bf16_native() -> None:
    t4 = GpuProperties(name="Tesla T4", major=7, minor=5, cuda_version="12.4")
    assert gpu_info(t4).extra["bf16_native"] is False


def test_bf16_native_on_device_infos() -> None:
    assert bf16_native(DeviceInfo(kind="cuda", arch="sm_80")) is True
    assert bf16_native(DeviceInfo(kind="cuda", arch="sm_75")) is False
    assert bf16_native(DeviceInfo(kind="rocm", arch="gfx1030")) is False
    assert bf16_native(DeviceInfo(kind="rocm", arch="gfx1100")) is True
    assert bf16_native(DeviceInfo(kind="cpu", extra={"isa": ["avx2", "avx512f"]})) is False
    assert bf16_native(DeviceInfo(kind="cpu", extra={"isa": ["amx_bf16", "amx_tile"]})) is True
    assert bf16_native(DeviceInfo(kind="cpu", extra={"isa": None})) is None
    assert bf16_native(DeviceInfo(kind="unknown")) is None


# --- /proc/cpuinfo parsing ------------------------------------------------------------------------

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 \
amx_tile amx_int8 avx512_fp16

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
sve asimdfhm sve2 svebf16 i8mm bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 0
"""


def test_parse_cpuinfo_x86() -> None:
    facts = parse_cpuinfo(X86_CPUINFO)
    assert facts.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts.vendor == "Intel"
    assert facts.flags_known
    assert {"amx_bf16", "avx512_bf16", "avx2"} <= facts.flags
    assert cpu_bf16_native(sorted(facts.flags)) is True


def test_parse_cpuinfo_aarch64() -> None:
    facts = parse_cpuinfo(ARM_CPUINFO)
    assert facts.vendor == "ARM"
    assert facts.model == "ARM Neoverse V2"
    assert {"sve2", "bf16", "i8mm"} <= facts.flags


def test_parse_cpuinfo_without_flags_is_unknown() -> None:
    facts = parse_cpuinfo("processor : 0\n")
    assert not facts.flags_known


# --- capture_output -------------------------------------------------------------------------------


def test_capture_output_catches_python_fd_and_c_level_writes(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with capture_output() as captured:
        print("from print")
        sys.stderr.write("from sys.stderr\n")
        os.write(1, b"from fd 1\n")
        os.write(2, b"from fd 2\n")
        if sys.platform != "win32":  # buffered in C stdio until fflush
            ctypes.CDLL(None).printf(b"from C printf\n")
    expected = ["from print", "from sys.stderr", "from fd 1", "from fd 2"]
    if sys.platform != "win32":
        expected.append("from C printf")
    for text in expected:
        assert text in captured.text
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    print("after")
    assert capfd.readouterr().out == "after\n"


def test_capture_output_restores_on_error(capfd: pytest.CaptureFixture[str]) -> None:
    stdout = sys.stdout
    with pytest.raises(KeyError), capture_output() as captured:
        print("before the error")
        raise KeyError("gfx")
    assert sys.stdout is stdout
    assert "before the error" in captured.text
    assert capfd.readouterr().out == ""


# --- integrated GPUs, PCI addresses, driver version files ----------------------------------------


def test_integrated_and_pci_bus_id_go_to_extra() -> None:
    #: A Ryzen 7 7840HS laptop's 780M under a ROCm build: gcnArchName='gfx1103', is_integrated=1.
    apu = GpuProperties(
        name="AMD Radeon 780M",
        gcn_arch_name="gfx1103",
        hip_version="6.4.43482",
        is_integrated=True,
        pci_bus_id=format_pci_bus_id(0, 0xC4, 0),
    )
    info = gpu_info(apu)
    assert info.extra["is_integrated"] is True
    assert info.extra["pci_bus_id"] == "0000:c4:00.0"
    assert is_integrated_gpu(info) is True
    discrete = gpu_info(RX_7900_XTX)
    assert "is_integrated" not in discrete.extra  # torch did not say
    assert is_integrated_gpu(discrete) is False  # gfx1100 is no APU target
    assert is_integrated_gpu(DeviceInfo(kind="rocm", arch="gfx1151")) is True
    assert is_integrated_gpu(DeviceInfo(kind="cuda", arch="sm_89")) is None
    assert is_integrated_gpu(DeviceInfo(kind="cuda", extra={"is_integrated": False})) is False


def test_format_pci_bus_id() -> None:
    assert format_pci_bus_id(0, 1, 0) == "0000:01:00.0"
    assert format_pci_bus_id(None, 0x3D, 0x1F) == "0000:3d:1f.0"
    assert format_pci_bus_id(0, None, 0) == ""


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024",
         "550.54.14"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.07  Release Build",
         "570.133.07"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  575.51.03  Release Build",
         "575.51.03"),
        ("", ""),
    ],
)  # fmt: skip
def test_parse_nvidia_proc_version(text: str, version: str) -> None:
    assert parse_nvidia_proc_version(text) == version
