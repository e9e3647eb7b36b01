"""The stress corpus through the real CLI, in-process: hundreds of broken, hostile and absurd
traces and records, output targets that are no files, and commands that never train.

The corpus is generated (``tests/fuzz_corpus.py``, ``fuzz_traces.py``, ``fuzz_records.py``), each
case with the class of outcome it must end in (refused, analysed, cleaned, masked, misread,
linear, ...). Every case, whatever its class, must end in an allowed exit code with no traceback,
at most one line on stderr (warnings count), within a hard time bound, and leave its inputs
byte-identical with nothing new beside them; an exit-0 case states no share above 100% and
writes no MFU above 100%. Every command of
the CLI is either fed by a corpus here or listed with the reason it reads no input, so a new
command fails :func:`test_every_command_is_in_the_corpus` until it is given one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import random
import signal
import stat
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.trace.stream import GZIP_LIMIT_ENV
from tests.conftest import shares
from tests.fuzz_corpus import (
    BASELINE,
    BOMB_CAP_MB,
    CASE_SECONDS,
    CLASSES,
    CORPUS_SECONDS,
    GPU_TRACE,
    SAME_CONFIG,
    SECRET_PARTS,
    SEED,
    Case,
    special_file,
)
from tests.fuzz_records import record_corpus, record_families
from tests.fuzz_traces import trace_corpus, trace_families

# --------------------------------------------------------------------------------------------
# Real inputs, made once per module


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small real trace: torch.profiler around 3 steps of a tiny MLP training loop."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
    ) as prof:
        for _ in range(4):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.step()
    path = tmp_path_factory.mktemp("real_trace") / "trace.json"
    prof.export_chrome_trace(str(path))
    return path.read_bytes()


@pytest.fixture(scope="module")
def trace_record(tmp_path_factory: pytest.TempPathFactory, real_trace: bytes) -> bytes:
    """The record ``diagnose trace`` writes of the real trace."""
    folder = tmp_path_factory.mktemp("trace_record")
    (folder / "trace.json").write_bytes(real_trace)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["trace", str(folder / "trace.json"), "--out", str(folder / "out")]) == 0
    return (folder / "out" / "record.json").read_bytes()


# --------------------------------------------------------------------------------------------
# Running a case


class _CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that the CLI's own handlers do not catch it."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _CaseTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _snapshot(folder: Path) -> dict[str, str]:
    """Each entry under ``folder`` (not following links, never opening FIFOs) and its content."""
    seen: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        name = str(path.relative_to(folder))
        if stat.S_ISLNK(mode):
            seen[name] = f"link {os.readlink(path)}"
        elif stat.S_ISREG(mode):
            seen[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            seen[name] = f"mode {stat.S_IFMT(mode):o}"
    return seen


@dataclass
class Outcome:
    case: str
    command: str
    code: int
    stderr: str
    seconds: float
    #: The class the case had to end in.
    expected: str


def _utilisation_problems(record_path: Path) -> list[str]:
    """An MFU or a FLOP class's share of its peak above 100% in a written record."""
    if not record_path.is_file():
        return []
    u = json.loads(record_path.read_text()).get("utilisation") or {}
    found = [
        f"{basis} MFU {peak['mfu']:.3g}"
        for basis in ("spec", "measured")
        if (peak := u.get(basis)) and peak.get("mfu") is not None and peak["mfu"] > 1
    ]
    found += [
        f"{c['op_class']} share {c['share_of_peak']:.3g}"
        for c in u.get("classes") or []
        if c.get("op_class") != "memory" and (c.get("share_of_peak") or 0) > 1
    ]
    return found


def _run(
    command: str,
    argv: list[str],
    case: Case,
    target: Path,
    guarded: list[Path],
    outputs: list[Path],
) -> tuple[Outcome, list[str]]:
    """Run one case in-process and check it against its class and the rules every case keeps."""
    expect = case.expect
    before = {str(folder): _snapshot(folder) for folder in guarded}
    stdout, stderr = io.StringIO(), io.StringIO()
    started, cpu_started = time.perf_counter(), time.process_time()
    code = -1
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with (
                contextlib.redirect_stdout(stdout),
                contextlib.redirect_stderr(stderr),
                _deadline(CASE_SECONDS),
            ):
                code = main(argv)
        except _CaseTimeout:
            problems.append(f"still running after {CASE_SECONDS:.0f} s")
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    err, out = stderr.getvalue(), stdout.getvalue()
    lines = [line for line in err.splitlines() if line.strip()]
    lines += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    outcome = Outcome(case.name, command, code, err, seconds, expect.name)
    allowed = set(expect.codes)
    if command == "compare":
        allowed = set(expect.gate) if expect.gate is not None else allowed
        if ExitCode.OK in allowed:
            allowed |= {ExitCode.REGRESSION, ExitCode.INCONCLUSIVE}
    if code not in allowed and not problems:
        problems.append(f"exit {code}, expected {expect.name} {sorted(allowed)}")
    if "Traceback" in err or "Traceback" in out:
        problems.append("a traceback")
    if len(lines) > 1:
        problems.append(f"{len(lines)} lines on stderr")
    if code not in (0, -1, ExitCode.REGRESSION, ExitCode.INCONCLUSIVE):
        if not err.startswith("diagnose: error: "):
            problems.append("no 'diagnose: error:' line")
        elif command != "compare" and target.name not in err:
            problems.append("the error does not name the file")
    if expect.cpu_seconds is not None and cpu > expect.cpu_seconds:
        problems.append(f"{cpu:.1f} s of CPU, over {expect.cpu_seconds:g} s")
    texts = [out, err, *(p.read_text(errors="replace") for p in outputs if p.is_file())]
    leaked = sorted({s for s in expect.never for text in texts if s in text})
    if leaked:
        problems.append(f"secrets in the outputs: {leaked}")
    if code == ExitCode.OK and command in ("trace", "report"):
        above = [p for text in texts for p in shares(text) if p > 100]
        if above:
            problems.append(f"shares above 100%: {sorted(above)[-3:]}")
        if expect.says and expect.says not in out + err:
            problems.append(f"no note saying {expect.says!r}")
        written = [p for p in outputs if p.suffix == ".json"]  # the record a trace wrote
        problems += _utilisation_problems(written[0]) if written else []
    after = {str(folder): _snapshot(folder) for folder in guarded}
    if after != before:
        problems.append("the input folder changed")
    return outcome, [f"{command} {case.name!r}: {p}; stderr: {lines[:3]}" for p in problems]


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children: what the corpus costs, which a busy
    machine does not stretch as it stretches wall time."""
    return sum(os.times()[:4])


def _check_corpus(outcomes: list[Outcome], problems: list[str], started: float) -> None:
    """``started``: :func:`_cpu_seconds` before the first case."""
    total = _cpu_seconds() - started
    slowest = max(outcomes, key=lambda o: o.seconds)
    by_class: dict[str, int] = {}
    for o in outcomes:
        by_class[o.expected] = by_class.get(o.expected, 0) + 1
    print(
        f"{len(outcomes)} runs in {total:.1f} s of CPU; slowest {slowest.seconds:.2f} s "
        f"({slowest.command} {slowest.case!r}); exit codes "
        f"{sorted({o.code for o in outcomes})}; classes {by_class}"
    )
    assert not problems, f"{len(problems)} failing cases:\n" + "\n".join(problems[:25])
    assert total < CORPUS_SECONDS, f"the corpus took {total:.1f} s of CPU"


def test_trace_corpus(tmp_path: Path, real_trace: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GZIP_LIMIT_ENV, str(BOMB_CAP_MB))
    gpu = gzip.decompress(GPU_TRACE.read_bytes())
    cases = trace_corpus(real_trace, gpu, random.Random(SEED)) + trace_families(real_trace, gpu)
    assert len(cases) >= 100
    (tmp_path / "out").mkdir()
    outcomes: list[Outcome] = []
    problems: list[str] = []
    started = _cpu_seconds()
    for index, case in enumerate(cases):
        folder = tmp_path / "in" / f"{index:03d}"
        folder.mkdir(parents=True)
        target = case.write(folder)
        out = tmp_path / "out" / f"{index:03d}"
        argv = ["trace", str(target), "--out", str(out)]
        written = [out / "record.json", out / "report.html"]
        outcome, found = _run("trace", argv, case, target, [folder], written)
        outcomes.append(outcome)
        problems.extend(found)
    _check_corpus(outcomes, problems, started)
    # Every class the families stand for was met, and the corpus is not all refusals.
    assert {o.expected for o in outcomes} >= {c.name for c in CLASSES}
    assert sum(o.code == 0 for o in outcomes) >= 30


def test_record_corpus(tmp_path: Path, trace_record: bytes) -> None:
    bases = {"run": SAME_CONFIG.read_bytes(), "trace": trace_record}
    cases = record_corpus(bases, random.Random(SEED + 1)) + record_families(bases)
    assert len(cases) >= 100
    baseline_folder = tmp_path / "baseline"
    baseline_folder.mkdir()
    baseline = baseline_folder / "baseline.json"
    baseline.write_bytes(BASELINE.read_bytes())
    (tmp_path / "out").mkdir()
    outcomes: list[Outcome] = []
    problems: list[str] = []
    started = _cpu_seconds()
    for index, (base, case) in enumerate(cases):
        folder = tmp_path / "in" / f"{index:03d}"
        folder.mkdir(parents=True)
        target = case.write(folder)
        guarded = [folder, baseline_folder]
        out = tmp_path / "out" / f"{index:03d}"
        html = out.with_suffix(".html")
        runs = [("report", ["report", str(target), "--out", str(html)], [html])]
        if base == "run":
            gate = [out.with_suffix(s) for s in (".compare.html", ".md", ".xml")]
            options = ["--html", str(gate[0]), "--markdown", str(gate[1]), "--junit", str(gate[2])]
            runs.append(("compare", ["compare", str(baseline), str(target), *options], gate))
        for command, argv, written in runs:
            named = Case(f"{base} {case.name}", case.write, case.expect)
            outcome, found = _run(command, argv, named, target, guarded, written)
            outcomes.append(outcome)
            problems.extend(found)
    _check_corpus(outcomes, problems, started)
    assert {o.expected for o in outcomes} >= {"refused", "cleaned", "masked", "misread"}
    assert sum(o.code == 0 for o in outcomes) >= 30


# --------------------------------------------------------------------------------------------
# Outputs that are not files, and commands that never get to their input


#: (command line with {out} for the target and {record}/{trace} for a real input, expected exit)
OUTPUT_CASES: list[tuple[str, list[str], int]] = [
    ("report -o", ["report", "{record}", "-o", "{out}"], ExitCode.USAGE),
    ("report -o --force", ["report", "{record}", "-o", "{out}", "--force"], ExitCode.USAGE),
    ("compare --html", ["compare", "{record}", "{record}", "--html", "{out}"], ExitCode.USAGE),
    ("compare --junit", ["compare", "{record}", "{record}", "--junit", "{out}"], ExitCode.USAGE),
    ("compare --markdown", ["compare", "{record}", "{record}", "--markdown", "{out}"], 2),
    ("triton --json", ["triton", "--json", "{out}", "--force"], ExitCode.USAGE),
    ("trace --out", ["trace", "{trace}", "--out", "{out}"], ExitCode.OUTPUT_EXISTS),
    ("run --out", ["run", "--out", "{out}"], ExitCode.OUTPUT_EXISTS),
    ("sweep --out", ["sweep", "--rank", "4,8", "--out", "{out}"], ExitCode.OUTPUT_EXISTS),
]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and sockets")
@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_outputs_that_are_not_files(
    tmp_path: Path, trace_record: bytes, real_trace: bytes, kind: str
) -> None:
    """Class "output refused": an output path that is a FIFO, a socket or a device node is
    refused (``--force`` or not) before any work, and is left as it was."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "record.json").write_bytes(trace_record)
    (inputs / "trace.json").write_bytes(real_trace)
    problems = []
    for label, template, expected in OUTPUT_CASES:
        folder = tmp_path / label.replace(" ", "_")
        folder.mkdir()
        target = special_file(folder, kind)
        if target is None:
            pytest.skip("this user cannot make a device node")
        fill = {"{out}": str(target), "{record}": str(inputs / "record.json")}
        fill["{trace}"] = str(inputs / "trace.json")
        argv = [fill.get(a, a) for a in template]
        case = Case(f"{label} to a {kind}", lambda f: f)
        before = _snapshot(folder)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
        if code != expected:
            problems.append(f"{case.name}: exit {code}, expected {int(expected)}: {err.getvalue()}")
        if not err.getvalue().startswith("diagnose: error:") or err.getvalue().count("\n") != 1:
            problems.append(f"{case.name}: not one error line: {err.getvalue()!r}")
        if _snapshot(folder) != before:
            problems.append(f"{case.name}: the target or its folder changed")
    assert not problems, "\n".join(problems)


def _profile_cases(folder: Path) -> list[tuple[str, list[str], int]]:
    python = sys.executable
    return [
        ("no such command", ["/nonexistent/train"], ExitCode.BAD_INPUT),
        ("exits 0 without a step", [python, "-c", "pass"], ExitCode.BAD_INPUT),
        ("exits 7 without a step", [python, "-c", "import sys; sys.exit(7)"], 7),
        (
            "secrets, no step",
            [python, "-c", "pass", "--password", SECRET_PARTS[3], "--token", SECRET_PARTS[0]],
            ExitCode.BAD_INPUT,
        ),
    ]


def test_profile_of_commands_that_never_step(tmp_path: Path, capfd: Any) -> None:
    """Class "refused": a command that cannot start or steps no optimizer writes nothing, exits
    with its own code (3 for 0), says why in one line of diagnose's and names no secret."""
    problems = []
    for index, (label, command, expected) in enumerate(_profile_cases(tmp_path)):
        out = tmp_path / f"out{index}"
        capfd.readouterr()
        code = main(["profile", "--out", str(out), "--no-stacks", "--", *command])
        printed = capfd.readouterr()
        ours = [line for line in printed.err.splitlines() if line.startswith("diagnose:")]
        if code != expected:
            problems.append(f"{label}: exit {code}, expected {int(expected)}: {ours}")
        if out.exists():
            problems.append(f"{label}: wrote {sorted(p.name for p in out.iterdir())}")
        if "Traceback" in printed.err or len(ours) > 2:  # the "profiling ..." line and one more
            problems.append(f"{label}: {ours}")
        leaked = [s for s in SECRET_PARTS if s in printed.err + printed.out]
        if leaked:
            problems.append(f"{label}: printed {leaked}")
    assert not problems, "\n".join(problems)


def test_sweep_refuses_before_any_run(tmp_path: Path) -> None:
    """Class "refused": a sweep whose folder or options cannot work stops before its first point,
    in one line."""
    resumable = tmp_path / "resumable"
    (resumable / "points").mkdir(parents=True)
    os.mkfifo(resumable / "sweep.json")
    cases: list[tuple[list[str], int]] = [
        (["--data", str(tmp_path / "missing")], ExitCode.BAD_INPUT),
        (["--timeout", "0"], ExitCode.USAGE),
        (["--out", str(resumable)], ExitCode.USAGE),
        # Values no `diagnose run` takes: refused as it refuses them, not run and failed.
        (["--resolution", "0"], ExitCode.USAGE),
        (["--batch", "-1"], ExitCode.USAGE),
        (["--resolution", "512,100"], ExitCode.USAGE),
    ]
    for extra, expected in cases:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["sweep", "--rank", "4,8", "--out", str(tmp_path / "s"), *extra])
        assert code == expected, (extra, err.getvalue())
        assert err.getvalue().startswith("diagnose: error:") and err.getvalue().count("\n") == 1
        assert not (tmp_path / "s").exists(), extra  # before the first point
    assert stat.S_ISFIFO((resumable / "sweep.json").lstat().st_mode)


# --------------------------------------------------------------------------------------------
# Every command is covered

#: Each command of the CLI and the tests of this module that feed it bad input, or why it reads
#: none. A command added to the CLI fails the test below until it is given its place here.
FED: dict[str, str] = {
    "trace": "test_trace_corpus, test_outputs_that_are_not_files",
    "report": "test_record_corpus, test_outputs_that_are_not_files",
    "compare": "test_record_corpus, test_outputs_that_are_not_files",
    "profile": "test_profile_of_commands_that_never_step (trainers that fork, die by SIGKILL or "
    "write into --out: tests/test_profile_robustness.py; secrets: tests/test_redaction_exits.py)",
    "sweep": "test_sweep_refuses_before_any_run, test_outputs_that_are_not_files",
    "run": "test_outputs_that_are_not_files (signals: tests/test_signals.py)",
    "triton": "test_outputs_that_are_not_files",
    "env": "reads no input and writes no file: prints the inventory, redacted",
    "presets": "reads no input and writes no file: prints a table of presets",
}


def test_every_command_is_in_the_corpus() -> None:
    from diagnose.cli import all_commands

    assert {c.name for c in all_commands()} == set(FED)
