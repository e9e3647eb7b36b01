"""The CLI end to end: real runs of the tiny workload on the CPU, exit codes, re-rendering."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.config import RunConfig
from diagnose.errors import ExitCode
from diagnose.output import prepare_out_dir
from diagnose.probes.base import ProbeContext
from diagnose.record import ProbeResult
from diagnose.record_io import load_record
from diagnose.run import execute_run
from diagnose.torch_compat import sdpa_takes_enable_gqa
from tests.conftest import FIXTURES, QUICK

#: Every probe, for tests whose subject is not what the probes find.
PROBES = ("environment", "precision", "attention", "dataloader", "optimizer", "triton")


class _ExternalRefs(HTMLParser):
    """Collects every attribute value that could make a browser fetch something."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if (
                name in {"src", "href", "srcset", "action", "poster", "data", "xlink:href"}
                and value
            ):
                self.refs.append(value)


def assert_offline_html(path: Path) -> str:
    html = path.read_text(encoding="utf-8")
    parser = _ExternalRefs()
    parser.feed(html)
    outside = [r for r in parser.refs if not r.startswith(("#", "data:"))]
    assert not outside, f"the report references outside files: {outside}"
    assert "http://" not in html and "https://" not in html
    assert "@import" not in html and "url(http" not in html
    return html


def test_run_writes_record_report_and_trace(default_run: Path) -> None:
    assert {p.name for p in default_run.iterdir()} == {
        "record.json",
        "report.html",
        "trace.json.gz",
    }
    record = load_record(default_run / "record.json")
    assert record.mode == "run"
    assert record.device.kind == "cpu"
    assert record.config["preset"] == "sd15" and record.config["size"] == "tiny"
    assert record.model.trainable_parameters > 0
    assert record.model.parameters > record.model.trainable_parameters
    assert record.timing.unprofiled.n == 3 and record.timing.profiled.n == 1
    assert record.timing.unprofiled.median > 0
    assert record.timing.peak_rss_bytes
    phases = set(record.breakdown.seconds)
    assert {"data_wait", "h2d", "encode", "forward", "backward", "optimizer"} <= phases
    assert record.trace_path == "trace.json.gz"
    assert record.command.startswith("diagnose run")
    assert record.inventory  # versions of torch, diffusers, ... are recorded
    assert record.top_ops, "top operators come from the trace"
    with gzip.open(default_run / "trace.json.gz", "rt") as handle:
        names = {e.get("name") for e in json.load(handle)["traceEvents"]}
    assert any(str(n).startswith("ProfilerStep#") for n in names)
    assert "diagnose::forward" in names
    # Where the command's own time went: every stage, each probe that ran, and the timed steps
    # at least as long as the steps they timed.
    wall = record.wall_seconds
    for stage in ("inventory", "build", "warm-up steps", "timed steps", "profiled steps"):
        assert wall[stage] > 0, stage
    ran = {p.name for p in record.probes if p.status == "ok"} - {"trace"}
    assert ran and {f"probe {name}" for name in ran} <= set(wall)
    assert "probe trace" not in wall  # the trace rules are the trace analysis, counted once
    plain = sum(s.seconds for s in record.timing.samples if not s.profiled)
    assert wall["timed steps"] >= plain
    # The step's counted FLOPs against the peak measured here (a CPU has no vendor spec).
    u = record.utilisation
    assert u is not None and u.flops_per_step > 0 and not u.lower_bound and u.spec is None
    assert u.measured is not None and min(u.measured.flops_per_s.values()) > 0
    assert u.measured.mfu is not None and 0 < u.measured.mfu <= 1
    assert u.step_seconds == record.timing.unprofiled.median
    assert all(0 < c.share_of_peak <= 1 for c in u.classes if c.share_of_peak is not None)


STARTED_LATE = """
import time
import psutil
from diagnose.cli import main
from diagnose.entry import seconds_since_entry

main(["presets"], entered=__import__("diagnose").IMPORTED_AT)
age = time.time() - psutil.Process().create_time()
print(age, seconds_since_entry())
"""


def test_start_up_is_timed_from_the_commands_entry_not_the_processes_creation(
    tmp_path: Path,
) -> None:
    """`bash -c 'sleep 2 && exec diagnose ...'`: the process bash made is two seconds old when
    diagnose starts in it; none of them is diagnose's start-up."""
    script = tmp_path / "late.py"
    script.write_text(STARTED_LATE)
    done = subprocess.run(
        ["bash", "-c", 'sleep 2 && exec "$0" "$1"', sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    age, start_up = map(float, done.stdout.split()[-2:])
    # The process's age holds the sleep; the start-up only what came after it (the creation
    # time is counted in clock ticks: a hundredth of a second).
    assert age >= 2.0
    assert start_up <= age - 2.0 + 0.02


def test_report_is_self_contained_and_states_the_number(default_run: Path) -> None:
    html = assert_offline_html(default_run / "report.html")
    record = load_record(default_run)
    assert "/it" in html  # "s/it" or "ms/it"
    assert "SD 1.5" in html
    assert record.command in html  # the command that reproduces the run
    assert "model FLOPs utilisation (MFU)" in html and 'id="utilisation"' in html


def test_report_command_rerenders_a_saved_record(default_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(default_run, copy)
    (copy / "trace.json.gz").unlink()  # re-rendering needs only the record
    original = (copy / "report.html").read_bytes()
    # The run's own report is derived output: rendered again in place, the same bytes when
    # nothing changed, and the same bytes again to another file.
    assert main(["report", str(copy)]) == 0
    assert (copy / "report.html").read_bytes() == original
    again = tmp_path / "again.html"
    assert main(["report", str(copy / "record.json"), "-o", str(again)]) == 0
    assert again.read_bytes() == original
    assert_offline_html(again)
    # An existing -o FILE, and a file of the user's by the report's name, need --force.
    assert main(["report", str(copy), "-o", str(again)]) == ExitCode.OUTPUT_EXISTS
    (copy / "report.html").write_text("<html>my own notes</html>")
    assert main(["report", str(copy)]) == ExitCode.OUTPUT_EXISTS
    assert (copy / "report.html").read_text() == "<html>my own notes</html>"
    assert main(["report", str(copy), "--force"]) == 0
    assert (copy / "report.html").read_bytes() == original


def test_a_traces_report_renders_again_to_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    assert (
        main(["trace", str(FIXTURES / "traces" / "cpu_train_loop.json.gz"), "--out", str(out)]) == 0
    )
    original = (out / "report.html").read_bytes()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").read_bytes() == original


def test_report_of_the_oldest_record_fixture(tmp_path: Path) -> None:
    out = tmp_path / "old.html"
    assert main(["report", str(FIXTURES / "records" / "v1_minimal.json"), "-o", str(out)]) == 0
    html = assert_offline_html(out)
    assert "Attention fell back to the math path" in html
    assert "RX 7900 XTX" in html


def test_existing_output_folder_is_not_overwritten(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    assert main(["run", "--out", str(out), *QUICK]) == ExitCode.OUTPUT_EXISTS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["run", "--precision", "fp8"], ExitCode.USAGE, "--precision"),
        (["run", "--steps", "0"], ExitCode.USAGE, "--steps"),
        (["run", "--resolution", "abc"], ExitCode.USAGE, "--resolution"),
        (["run", "--resolution", "100"], ExitCode.USAGE, "multiple of 8"),
        (["run", "--skip", "no-such-probe"], ExitCode.USAGE, "no such probe"),
        (["run", "--device", "cuda"], ExitCode.UNSUPPORTED, "cuda"),
        (["run", "--model", "/no/such/folder"], ExitCode.BAD_INPUT, "--model"),
        (["run", "--data", "/no/such/folder"], ExitCode.BAD_INPUT, "--data"),
        (["run", "--preset", "flux", "--size", "full"], ExitCode.UNSUPPORTED, "--force"),
        (["report", "/no/such/record.json"], ExitCode.BAD_INPUT, "no such file"),
        (["bogus-command"], ExitCode.USAGE, "invalid choice"),
    ],
)
def test_bad_input_gives_one_line_and_the_documented_code(
    tmp_path: Path, capsys: Any, argv: list[str], code: ExitCode, needle: str
) -> None:
    if argv[0] == "run":
        argv = [*argv, "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == code
    captured = capsys.readouterr()
    assert captured.err.startswith("diagnose: error:")
    assert captured.err.count("\n") == 1, captured.err
    assert needle in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists(), "a refused run must leave no output folder"


def test_model_folder_that_is_not_a_model(tmp_path: Path, capsys: Any) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    argv = ["run", "--model", str(folder), "--out", str(tmp_path / "out"), *QUICK]
    assert main(argv) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder) in err


def test_empty_data_folder_is_bad_input(tmp_path: Path, capsys: Any) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    argv = ["run", "--data", str(folder), "--out", str(tmp_path / "out"), *QUICK]
    assert main(argv) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err.count("\n") == 1
    assert list(folder.iterdir()) == []


class _BrokenProbe:
    name = "broken"
    description = "raises on purpose"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        raise ValueError("<script>alert('probe')</script> went wrong")


def test_a_probe_that_raises_still_leaves_a_report(tmp_path: Path) -> None:
    out = prepare_out_dir(tmp_path / "run", force=False)
    config = RunConfig(steps=2, warmup=0, profiled_steps=1)
    outputs = execute_run(config, out, probes=[_BrokenProbe()])
    [broken] = [p for p in outputs.record.probes if p.name == "broken"]
    assert broken.status == "error"
    assert "went wrong" in broken.reason
    html = assert_offline_html(outputs.report_path)
    assert "went wrong" in html
    assert "<script>alert('probe')</script>" not in html  # escaped, not injected
    assert load_record(out).probes[-1].traceback


@pytest.mark.parametrize(
    ("where", "said"),
    [
        (
            "diagnose.run.measure",
            "the training step ran out of GPU memory: CUDA out of memory. Tried to allocate "
            "8.00 GiB: lower the batch or resolution, or train with --grad-checkpointing",
        ),
        (
            # What the build makes on the device beyond the weights checked before, or memory
            # another process holds.
            "diagnose.workload.build_workload",
            "building the model ran out of GPU memory: CUDA out of memory. Tried to allocate "
            "8.00 GiB: lower the batch or resolution, or free the GPU of other processes",
        ),
    ],
)
def test_running_out_of_gpu_memory_ends_with_one_line_and_exit_5(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
    said: str,
) -> None:
    """torch's out-of-memory error (CUDA's and HIP's are the same class), in the steps or while
    the model is built, is not an internal error: the run cannot be done on this device, said in
    one line with what to lower."""
    import torch

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore")

    monkeypatch.setattr(where, out_of_memory)
    code = main(["run", "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "run")])
    assert code == ExitCode.UNSUPPORTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"diagnose: error: {said}"


def test_run_with_the_network_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing is downloaded: every network connection attempt fails the test.

    Local (AF_UNIX) sockets stay allowed: DataLoader workers and multiprocessing talk over them.
    Under torch 2.4 Z-Image's attention (diffusers') cannot run: that is said in one line.
    """
    attempts: list[object] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError("network access is blocked in this test")

    def guarded(original: Any) -> Any:
        def call(sock: socket.socket, address: Any) -> Any:
            if sock.family == socket.AF_UNIX:
                return original(sock, address)
            return refuse(sock, address)

        return call

    monkeypatch.setattr(socket.socket, "connect", guarded(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(connect_ex))
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    out = tmp_path / "offline"
    argv = ["run", "--out", str(out), "--preset", "zimage", "--precision", "fp32", *QUICK]
    if not sdpa_takes_enable_gqa():
        assert main(argv) == ExitCode.UNSUPPORTED
        assert "ZImageTransformer2DModel cannot train under torch" in capsys.readouterr().err
        assert attempts == []
        return
    assert main(argv) == 0
    assert attempts == []
    assert (out / "report.html").is_file()


@pytest.mark.parametrize("entry", [["diagnose"], [sys.executable, "-m", "diagnose"]])
def test_entry_points(entry: list[str]) -> None:
    if entry[0] == "diagnose" and shutil.which("diagnose") is None:
        pytest.skip("the console script is not installed")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([*entry, "--version"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.startswith("diagnose ")
    done = subprocess.run([*entry, "run", "--batch", "x"], capture_output=True, text=True, env=env)
    assert done.returncode == ExitCode.USAGE
    assert "Traceback" not in done.stderr


def test_run_with_a_baseline_gates_and_keeps_the_measurement(
    default_run: Path, tmp_path: Path, capsys: Any
) -> None:
    """--baseline compares after saving: a baseline of the same config gates (0 or 6, with JUnit);
    one from another device is refused (3) and the new record is still there."""
    same = tmp_path / "same"
    junit = tmp_path / "gate.xml"
    # A second baseline (--baseline repeats): the default run's record, as if run a minute later.
    earlier = load_record(default_run)
    earlier.created = "2026-11-30T10:00:00+00:00"
    second = tmp_path / "second.json"
    second.write_text(earlier.to_json(), encoding="utf-8")
    # The gate is the subject here, not the probes: they are off (the step is the same config).
    no_probes = [arg for name in PROBES for arg in ("--skip", name)]
    argv = ["run", "--out", str(same), *QUICK, *no_probes, "--baseline", str(default_run)]
    code = main([*argv, "--baseline", str(second), "--junit", str(junit)])
    assert code in (ExitCode.OK, ExitCode.REGRESSION, ExitCode.INCONCLUSIVE)
    assert junit.is_file() and "<testsuite" in junit.read_text()
    assert 'name="baseline 2"' in junit.read_text()
    assert (same / "record.json").is_file()

    other = tmp_path / "other"
    old = FIXTURES / "records" / "v1_minimal.json"  # recorded on an RX 7900 XTX
    capsys.readouterr()
    argv = ["run", "--out", str(other), *QUICK, *no_probes, "--baseline", str(old)]
    assert main(argv) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err.startswith("diagnose: error:")
    assert load_record(other).mode == "run"
    page = (other / "report.html").read_text(encoding="utf-8")
    assert "not compared" in page and "device" in page  # the report says why, too


def test_a_gate_output_over_the_baseline_is_refused_before_the_run(tmp_path: Path) -> None:
    baseline = FIXTURES / "compare" / "baseline.json"
    copy = tmp_path / "baseline.json"
    copy.write_bytes(baseline.read_bytes())
    out = tmp_path / "out"
    argv = ["run", "--out", str(out), *QUICK, "--baseline", str(copy), "--junit", str(copy)]
    assert main([*argv, "--force"]) == ExitCode.USAGE
    assert copy.read_bytes() == baseline.read_bytes() and not out.exists()
    # The record of an earlier run in the --out folder would be overwritten by this run.
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "record.json").write_bytes(baseline.read_bytes())
    argv = ["run", "--out", str(earlier), *QUICK, "--baseline", str(earlier), "--force"]
    assert main(argv) == ExitCode.USAGE
    assert (earlier / "record.json").read_bytes() == baseline.read_bytes()


def test_a_bad_baseline_fails_before_the_run(tmp_path: Path) -> None:
    argv = ["run", "--out", str(tmp_path / "out"), *QUICK, "--baseline", str(tmp_path / "nope")]
    assert main(argv) == ExitCode.BAD_INPUT
    assert not (tmp_path / "out").exists()


SKIP_ALL = [f"--skip={name}" for name in ("attention", "dataloader", "optimizer", "precision")]


def test_library_chatter_stays_off_the_terminal_unless_verbose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    """Planted: building the workload prints from native code (straight to descriptor 2, as a
    C extension does), prints from Python with a token in it, and warns. Without --verbose none
    of it reaches the terminal, and one line says how much was kept back; with --verbose it is
    shown with the token masked."""
    import warnings

    import diagnose.workload as workload_module

    token = "hf_" + "q" * 34
    real_build = workload_module.build_workload

    def noisy_build(*args: Any, **kwargs: Any) -> Any:
        os.write(2, b"Failed to load CPU gemm_4bit_forward from kernels-community\n")
        print(f"fetching https://hub.example/x?token={token}")
        warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
        return real_build(*args, **kwargs)

    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(workload_module, "build_workload", noisy_build)
    argv = ["run", *QUICK, *SKIP_ALL]
    assert main([*argv, "--out", str(tmp_path / "quiet")]) == 0
    out, err = capfd.readouterr()
    assert "gemm_4bit" not in out + err and "deprecation" not in out + err
    kept_back = "libraries printed or warned 3 lines during the run (--verbose shows them)"
    assert kept_back in out, out[-600:]

    assert main([*argv, "--out", str(tmp_path / "loud"), "--verbose"]) == 0
    out, err = capfd.readouterr()
    assert "gemm_4bit_forward" in err and "FutureWarning: a library's deprecation" in err
    assert token not in out + err and "fetching https://hub.example" in err
    assert "--verbose shows them" not in out


def test_the_quick_exit_keeps_the_exit_code_and_runs_the_exit_handlers(tmp_path: Path) -> None:
    """With torch loaded, the command leaves without the interpreter's slow teardown; the exit
    code stays, buffered output is flushed and exit handlers (temporary folders, worker
    processes) still run. The clean twin: without torch loaded, the normal exit is taken."""
    marker = tmp_path / "handler-ran"
    script = (
        "import atexit, sys\n"
        "{imports}\n"
        "from diagnose.cli import _finish\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'a').write('ran\\n'))\n"
        "print('last line', end='')\n"
        "sys.exit(_finish(3))\n"
    )
    for imports in ("import torch", ""):
        marker.unlink(missing_ok=True)
        result = subprocess.run(
            [sys.executable, "-c", script.format(imports=imports)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 3, result.stderr
        assert result.stdout == "last line"
        assert marker.read_text() == "ran\n"
