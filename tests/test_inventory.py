"""The machine inventory: complete, JSON-serialisable, quiet, fast, and free of secrets.

Planted faults use small real packages written to a temporary folder (a noisy one, a broken one,
one that crashes or hangs the interpreter) and stand-ins for pynvml/amdsmi that behave as the
real ones do on a machine without the driver (neither library can be exercised here for real).
The GPU hardware the inventory sees without torch is ``test_inventory_gpu.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.cli import main
from diagnose.inventory import (
    ENV_NAMES,
    PACKAGE_STATUSES,
    PACKAGES,
    PackageSpec,
    collect_env,
    collect_inventory,
    collect_packages,
    collect_telemetry,
    parse_os_release,
)
from diagnose.redact import MASK

TOP_LEVEL_KEYS = {
    "collect_seconds",
    "cpu",
    "env",
    "gpu",
    "inventory_version",
    "memory",
    "os",
    "packages",
    "python",
    "sdpa",
    "telemetry",
    "torch",
}


def _assert_sorted(obj: Any, where: str = "") -> None:
    if isinstance(obj, dict):
        assert list(obj) == sorted(obj), f"keys not sorted at {where or 'top'}"
        for key, value in obj.items():
            _assert_sorted(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _assert_sorted(value, f"{where}[{i}]")


ModuleWriter = Callable[[str, str], None]


@pytest.fixture
def fake_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleWriter]:
    """Write real modules into a folder on sys.path (and PYTHONPATH, for child interpreters)."""
    written: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


# --- the real inventory of this machine -----------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children."""
    return sum(os.times()[:4])


def _own_seconds(inventory: dict[str, Any]) -> float:
    """Seconds collect_inventory spent on its own, i.e. not importing the packages it checks."""
    imports = sum(
        entry["import_seconds"] or 0.0
        for entry in inventory["packages"].values()
        if entry["checked"] == "this process"
    )
    return float(inventory["collect_seconds"]) - imports


def test_inventory_of_this_machine(capfd: pytest.CaptureFixture[str]) -> None:
    inventory = collect_inventory("cpu")
    out, err = capfd.readouterr()
    assert out == "" and err == "", "collect_inventory printed something"
    # A first call imports diffusers, peft, bitsandbytes... (seconds, paid once per process and
    # needed by the run anyway); the inventory itself must stay cheap.
    # What the inventory costs on its own, its packages imported: CPU time (its own process's and
    # its children's), which a busy machine does not stretch as it stretches wall time.
    spent = _cpu_seconds()
    again = collect_inventory("cpu")
    assert _cpu_seconds() - spent < 0.5
    assert set(again) == set(inventory)

    text = json.dumps(inventory, allow_nan=False)
    assert json.loads(text) == inventory
    _assert_sorted(inventory)
    assert set(inventory) == TOP_LEVEL_KEYS

    assert inventory["os"]["system"] == platform.system()
    assert inventory["python"]["version"] == platform.python_version()
    assert inventory["cpu"]["model"]
    assert inventory["cpu"]["logical_cores"] == os.cpu_count()
    assert inventory["memory"]["total_bytes"] > 0
    assert inventory["torch"]["version"] == torch.__version__
    assert inventory["torch"]["num_threads"] == torch.get_num_threads()
    for key in ("flash_enabled", "mem_efficient_enabled", "math_enabled"):
        assert isinstance(inventory["sdpa"][key], bool)

    bnb = inventory["packages"]["bitsandbytes"]
    assert bnb["version"] == importlib.metadata.version("bitsandbytes")
    assert bnb["installed"] and bnb["imports"] and bnb["status"] == "ok"
    assert set(inventory["packages"]) == {spec.name for spec in PACKAGES}
    for spec in PACKAGES:
        entry = inventory["packages"][spec.name]
        assert entry["status"] in PACKAGE_STATUSES
        installed = [d for d in spec.distributions if _dist_version(d) is not None]
        if installed:
            assert entry["installed"] is True
            assert entry["version"] == _dist_version(installed[0])
            assert entry["imports"] is not None
        else:
            assert entry["status"] == "not installed" or entry["version"] is not None
    for name in ("diffusers", "peft", "transformers"):  # what the workload needs
        assert inventory["packages"][name]["status"] == "ok"

    telemetry = inventory["telemetry"]
    if not torch.cuda.is_available():
        assert telemetry["available"] is False
        assert telemetry["reason"]
        assert telemetry["backend"] is None

    if len(platform.node()) >= 6:  # a short name ("vm") also occurs inside ordinary words
        assert platform.node() not in text


def test_fresh_interpreter_prints_nothing_and_is_fast(tmp_path: Path) -> None:
    """Cold start, as `diagnose env` runs: every package is imported for the first time.

    Measured on the 2-core CI box: 3.8-5.2 s, of which all but ~10 ms is the packages' own
    import time (torch._dynamo/_inductor pulled in by diffusers and bitsandbytes). The bound on
    the CPU time it took only guards against a runaway; the inventory's own share of its wall
    time is checked tightly (a busy machine stretches both alike).
    """
    result_path = tmp_path / "inventory.json"
    script = (
        "import json, sys, time\n"
        "from diagnose.inventory import collect_inventory\n"
        "import os\n"
        "started, spent = time.perf_counter(), sum(os.times()[:4])\n"
        "inventory = collect_inventory()\n"
        "seconds = time.perf_counter() - started\n"
        "cpu = sum(os.times()[:4]) - spent\n"
        "open(sys.argv[1], 'w').write(\n"
        "    json.dumps({'seconds': seconds, 'cpu': cpu, 'inventory': inventory})\n"
        ")\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(result_path)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang's bound only: a busy machine may take minutes to import torch
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    result = json.loads(result_path.read_text())
    assert result["cpu"] < 30.0
    assert _own_seconds(result["inventory"]) < 0.1 * result["seconds"]
    packages = result["inventory"]["packages"]
    assert packages["bitsandbytes"]["checked"] == "this process"


# --- secrets --------------------------------------------------------------------------------------

HF_TOKEN = "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNm0123456789"
API_KEY = "sk-live-4f9a8b7c6d5e4f3a2b1c"
PROXY_PASSWORD = "pr0xyPassw0rd"


def test_inventory_contains_no_secret(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("MY_API_KEY", API_KEY)
    monkeypatch.setenv("HTTP_PROXY", f"http://user:{PROXY_PASSWORD}@proxy.example:3128")
    # Secret-named variables under the prefixes the inventory records:
    monkeypatch.setenv("PYTORCH_HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("TRITON_API_KEY", API_KEY)
    monkeypatch.setenv("TORCHINDUCTOR_REMOTE_CACHE_PASSWORD", "cache-password-1")
    # A recorded variable whose value holds credentials:
    monkeypatch.setenv("TRITON_CACHE_URL", f"https://bob:{PROXY_PASSWORD}@cache.example/x")
    monkeypatch.setenv("PYTORCH_TUNABLEOP_ENABLED", "1")

    inventory = collect_inventory("cpu")
    text = json.dumps(inventory)
    for secret in (HF_TOKEN, API_KEY, PROXY_PASSWORD, "cache-password-1", "user:"):
        assert secret not in text
    env = inventory["env"]
    for name in ("HF_TOKEN", "MY_API_KEY", "PYTORCH_HF_TOKEN", "TRITON_API_KEY"):
        assert name not in env
    assert "TORCHINDUCTOR_REMOTE_CACHE_PASSWORD" not in env
    assert env["TRITON_CACHE_URL"] == f"https://{MASK}@cache.example/x"
    assert env["PYTORCH_TUNABLEOP_ENABLED"] == "1"
    assert capfd.readouterr() == ("", "")


def test_redact_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    home = os.path.expanduser("~")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(home, ".cache", "inductor"))
    plain = json.dumps(collect_inventory())
    assert home in plain
    redacted = collect_inventory(redact_paths=True)
    assert home not in json.dumps(redacted)
    assert redacted["env"]["TORCHINDUCTOR_CACHE_DIR"] == "~/.cache/inductor"


def test_printed_secrets_are_redacted(fake_modules: ModuleWriter) -> None:
    fake_modules("diag_fake_leaky", f"print('logged in as {HF_TOKEN}')\n")
    inventory = collect_inventory(
        packages=(PackageSpec("leaky", "diag_fake_leaky", ("diag-fake-leaky",)),)
    )
    printed = inventory["packages"]["leaky"]["printed"]
    assert HF_TOKEN not in printed
    assert printed == f"logged in as hf_{MASK}"


# --- planted faults: packages ---------------------------------------------------------------------


def test_noisy_import_is_captured_not_leaked(
    fake_modules: ModuleWriter, capfd: pytest.CaptureFixture[str]
) -> None:
    fake_modules(
        "diag_fake_noisy",
        """
        import os, sys, warnings
        __version__ = "1.2.3"
        print("Failed to load CPU gemm_4bit_forward from kernels-community")
        os.write(2, b"WARNING[XFORMERS]: xFormers can't load C++/CUDA extensions\\n")
        warnings.warn("built for another torch", UserWarning)
        """,
    )
    entries = collect_packages((PackageSpec("noisy", "diag_fake_noisy", ("diag-fake-noisy",)),))
    entry = entries["noisy"]
    assert entry["status"] == "ok" and entry["imports"] is True
    assert entry["version"] == "1.2.3"  # no distribution metadata: from __version__
    assert entry["distribution"] is None
    assert "gemm_4bit_forward" in entry["printed"]
    assert "xFormers can't load" in entry["printed"]
    assert "UserWarning: built for another torch" in entry["printed"]
    assert capfd.readouterr() == ("", "")


def test_clean_import_has_nothing_printed(fake_modules: ModuleWriter) -> None:
    fake_modules("diag_fake_clean", "__version__ = '0.1'\n")
    entry = collect_packages((PackageSpec("clean", "diag_fake_clean", ("diag-fake-clean",)),))[
        "clean"
    ]
    assert (entry["status"], entry["error"], entry["printed"]) == ("ok", "", "")


def test_broken_import_keeps_the_error_verbatim_on_one_line(fake_modules: ModuleWriter) -> None:
    fake_modules(
        "diag_fake_broken",
        """
        raise ImportError(
            "libcudart.so.12: cannot open shared object file:\\n  No such file or directory"
        )
        """,
    )
    entry = collect_packages((PackageSpec("broken", "diag_fake_broken", ("diag-fake-broken",)),))[
        "broken"
    ]
    assert entry["status"] == "import failed"
    assert entry["imports"] is False and entry["installed"] is True
    assert entry["error"] == (
        "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory"
    )


def test_missing_package_is_not_installed() -> None:
    entry = collect_packages((PackageSpec("ghost", "diag_fake_ghost_missing", ("nope-nope",)),))[
        "ghost"
    ]
    assert entry["status"] == "not installed"
    assert entry["installed"] is False and entry["imports"] is None and entry["version"] is None


def test_isolated_import_that_crashes_the_interpreter(fake_modules: ModuleWriter) -> None:
    fake_modules("diag_fake_crash", "import os\nprint('loading kernels', flush=True)\nos.abort()\n")
    spec = PackageSpec("crash", "diag_fake_crash", ("diag-fake-crash",), isolated=True)
    entry = collect_packages((spec,))["crash"]
    assert entry["status"] == "crashed"
    assert entry["imports"] is False
    assert "SIGABRT" in entry["error"]
    assert "loading kernels" in entry["printed"]


def test_isolated_import_that_hangs_times_out(fake_modules: ModuleWriter) -> None:
    fake_modules("diag_fake_hang", "import time\ntime.sleep(60)\n")
    spec = PackageSpec("hang", "diag_fake_hang", ("diag-fake-hang",), isolated=True)
    started = time.monotonic()
    entry = collect_packages((spec,), isolated_timeout_s=1.0)["hang"]
    assert time.monotonic() - started < 10
    assert entry["status"] == "timed out"
    assert "took longer than 1 s" in entry["error"]


def test_isolated_import_that_works(fake_modules: ModuleWriter) -> None:
    fake_modules("diag_fake_iso", "__version__ = '0.0.29'\nprint('xformers banner')\n")
    fake_modules("diag_fake_iso_ops", "import diag_fake_iso\n")
    spec = PackageSpec(
        "iso",
        "diag_fake_iso",
        ("diag-fake-iso",),
        isolated=True,
        also_import=("diag_fake_iso_ops",),
    )
    entry = collect_packages((spec,))["iso"]
    assert (entry["status"], entry["imports"], entry["version"]) == ("ok", True, "0.0.29")
    assert entry["printed"] == "xformers banner"
    assert entry["checked"] == "child process"
    assert "diag_fake_iso" not in sys.modules  # it never ran in this process


def test_isolated_import_failure(fake_modules: ModuleWriter) -> None:
    fake_modules(
        "diag_fake_iso_bad", "raise OSError('undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    spec = PackageSpec("isobad", "diag_fake_iso_bad", ("diag-fake-iso-bad",), isolated=True)
    entry = collect_packages((spec,))["isobad"]
    assert entry["status"] == "import failed"
    assert entry["error"] == "OSError: undefined symbol: _ZN3c104cuda9SetDeviceEi"


# --- planted faults: telemetry --------------------------------------------------------------------


def test_telemetry_amdsmi_without_driver(
    fake_modules: ModuleWriter, capfd: pytest.CaptureFixture[str]
) -> None:
    # amdsmi without the amdgpu driver prints to stdout and raises KeyError while importing.
    fake_modules(
        "amdsmi",
        """
        print("Unable to find amdgpu driver")
        raise KeyError("amdgpu")
        """,
    )
    fake_modules(
        "pynvml",
        """
        class NVMLError_LibraryNotFound(Exception):
            pass
        def nvmlInit():
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        """,
    )
    telemetry = collect_telemetry(prefer="rocm")
    assert telemetry["available"] is False and telemetry["backend"] is None
    assert telemetry["details"]["amdsmi"] == "KeyError: 'amdgpu'"
    assert "NVML Shared Library Not Found" in telemetry["details"]["nvml"]
    assert telemetry["reason"].startswith("amdsmi: KeyError")  # the preferred one first
    assert "Unable to find amdgpu driver" in telemetry["printed"]
    assert capfd.readouterr() == ("", "")


def test_telemetry_available(fake_modules: ModuleWriter) -> None:
    fake_modules(
        "pynvml",
        """
        def nvmlInit():
            pass
        def nvmlShutdown():
            pass
        def nvmlDeviceGetCount():
            return 1
        """,
    )
    telemetry = collect_telemetry(prefer="cuda")
    assert telemetry["available"] is True
    assert telemetry["backend"] == "nvml"
    assert telemetry["reason"] == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_telemetry_here_is_unavailable_with_a_reason() -> None:
    telemetry = collect_telemetry()
    assert telemetry["available"] is False
    assert "nvml:" in telemetry["reason"] and "amdsmi:" in telemetry["reason"]


# --- pure parts -----------------------------------------------------------------------------------


def test_collect_env_keeps_performance_variables_only() -> None:
    environ = {
        "HIP_VISIBLE_DEVICES": "0",
        "HSA_OVERRIDE_GFX_VERSION": "11.0.0",
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1",
        "MIOPEN_FIND_MODE": "FAST",
        "PYTORCH_TUNABLEOP_ENABLED": "1",
        "PYTORCH_TUNABLEOP_FILENAME": "tunableop.csv",
        "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT": "10000",
        "CUDA_LAUNCH_BLOCKING": "1",
        "NVIDIA_TF32_OVERRIDE": "0",
        "OMP_NUM_THREADS": "4",
        "DIFFUSERS_ATTN_BACKEND": "flash",
        "HF_HUB_OFFLINE": "1",
        "HOME": "/home/alice",
        "PATH": "/usr/bin",
        "HF_TOKEN": HF_TOKEN,
        "TRITON_API_KEY": API_KEY,
        # set by torch itself when torch._inductor is imported, not by the user:
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "torchinductor_alice"),
    }
    env = collect_env(environ)
    assert list(env) == sorted(env)
    dropped = {"HOME", "PATH", "HF_TOKEN", "TRITON_API_KEY", "TORCHINDUCTOR_CACHE_DIR"}
    assert set(env) == set(environ) - dropped
    assert collect_env({"TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"}) == {
        "TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"
    }
    assert "NVIDIA_TF32_OVERRIDE" in ENV_NAMES


def test_parse_os_release() -> None:
    text = 'PRETTY_NAME="Ubuntu 24.04.2 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\n# c\n'
    assert parse_os_release(text) == {
        "PRETTY_NAME": "Ubuntu 24.04.2 LTS",
        "NAME": "Ubuntu",
        "VERSION_ID": "24.04",
        "ID": "ubuntu",
    }


# --- diagnose env ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_diagnose_env_on_this_machine(
    fake_modules: ModuleWriter, capfd: pytest.CaptureFixture[str]
) -> None:
    """`diagnose env` here: exit 0, stdout is one JSON document (a library that prints on import
    must not corrupt it), the inventory is complete, telemetry is unavailable with a reason."""
    fake_modules(
        "amdsmi",
        """
        import os
        print("Unable to find amdgpu driver")
        os.write(1, b"amdsmi native init failed\\n")
        raise KeyError("amdgpu")
        """,
    )
    sys.modules.pop("amdsmi", None)
    assert main(["env"]) == 0
    out, err = capfd.readouterr()
    assert err == ""
    document = json.loads(out)
    assert {"device", "inventory"} <= set(document)
    assert document["device"]["kind"] == "cpu"
    inventory = document["inventory"]
    assert set(inventory) == TOP_LEVEL_KEYS
    for section, keys in {
        "os": {"system", "release", "kernel_version", "distro"},
        "cpu": {"model", "logical_cores", "physical_cores", "usable_cores", "isa"},
        "memory": {"total_bytes"},
        "python": {"version", "implementation"},
        "torch": {"version", "cuda", "hip", "cudnn", "cuda_available", "arch_list", "flags"},
        "sdpa": {"flash_enabled", "mem_efficient_enabled", "math_enabled", "cudnn_enabled"},
        "gpu": {"pci", "drivers", "cuda_driver_api", "kfd_nodes", "torch_devices"},
    }.items():
        assert keys <= set(inventory[section]), section
    for name in (
        "diffusers",
        "peft",
        "bitsandbytes",
        "triton",
        "xformers",
        "flash_attn",
        "accelerate",
        "transformers",
    ):
        assert inventory["packages"][name]["status"] in PACKAGE_STATUSES
    telemetry = inventory["telemetry"]
    assert telemetry["available"] is False
    assert "amdsmi: KeyError: 'amdgpu'" in telemetry["reason"]
    assert "nvml:" in telemetry["reason"]
    assert "Unable to find amdgpu driver" in telemetry["printed"]


def test_torch_compile_is_deferred_to_the_first_call_while_packages_import() -> None:
    from diagnose.inventory.packages import torch_compile_deferred

    real = torch.compile

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with torch_compile_deferred():
        lazy = torch.compile(double, backend="eager")
        decorated = torch.compile(backend="eager")(double)
        module = torch.compile(torch.nn.Identity(), backend="eager")
    assert torch.compile is real
    # A function gets a plain wrapper until it is called; a module its compiled type at once.
    assert lazy.__wrapped__ is double and decorated.__wrapped__ is double  # type: ignore[attr-defined]
    assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
    x = torch.arange(4.0)
    assert torch.equal(lazy(x), x * 2) and torch.equal(decorated(x), x * 2)
