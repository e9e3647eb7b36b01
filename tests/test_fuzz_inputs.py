"""Fuzz the inputs: hundreds of broken traces and records through the real CLI, in-process.

Nothing is stored: the corpus is generated here, with a seeded ``random.Random``, from a small
trace captured by torch.profiler once per module and from real records (``fixtures/compare`` and
the record ``diagnose trace`` writes of the captured trace). Each case must end in exit 0 or a
documented code (3 for bad input; 6 for a compare that finds a regression), with no traceback
and at most one line on stderr (warnings count as lines), within a hard time bound, and leave
its input files byte-identical with nothing new beside them.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import io
import json
import os
import random
import signal
import stat
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.trace.stream import GZIP_LIMIT_ENV
from tests.conftest import FIXTURES

SEED = 20251201
#: Hard bound per case: a hang (a FIFO read, a quadratic scan) fails the case instead of the run.
CASE_SECONDS = 20.0
#: Bound on each whole corpus; the cases take about 0.05 s each on a 2-core machine.
CORPUS_SECONDS = 45.0
#: A gzip bomb need not be GBs to prove the cap: the cap is lowered to this for the corpus.
BOMB_CAP_MB = 8
BASELINE = FIXTURES / "compare" / "baseline.json"
SAME_CONFIG = FIXTURES / "compare" / "same_config.json"
GPU_TRACE = FIXTURES / "traces" / "gpu_synthetic_optimizer_sync.json.gz"
BOM = b"\xef\xbb\xbf"
ALLOWED = {
    "trace": {ExitCode.OK, ExitCode.BAD_INPUT},
    "report": {ExitCode.OK, ExitCode.BAD_INPUT},
    "compare": {ExitCode.OK, ExitCode.BAD_INPUT, ExitCode.REGRESSION},
}
#: Values of the wrong type or of impossible size, put where the schema wants something else.
BAD_VALUES: list[Any] = [
    None,
    True,
    "x",
    "",
    [],
    {},
    [[]],
    {"a": {"b": 1}},
    -1,
    0,
    -1e308,
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
    10**30,
    18446744073709551616,
]

Writer = Callable[[Path], Path]


@dataclass(frozen=True)
class Case:
    name: str
    write: Writer  # writes the input into an empty folder; returns the path to pass


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
# Writers


def _file(name: str, data: bytes) -> Writer:
    def write(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    return write


def _gzip_file(name: str, data: bytes) -> Writer:
    return _file(name, gzip.compress(data, compresslevel=1))


def _bomb(name: str, head: bytes, unit: bytes, megabytes: int) -> Writer:
    """A gzip file that expands to ``megabytes`` MB, compressed without holding them."""

    def write(folder: Path) -> Path:
        path = folder / name
        squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header
        block = unit * ((1 << 20) // len(unit))
        with path.open("wb") as out:
            out.write(squeeze.compress(head))
            for _ in range(megabytes):
                out.write(squeeze.compress(block))
            out.write(squeeze.flush())
        return path

    return write


def _fifo(name: str) -> Writer:
    def write(folder: Path) -> Path:
        path = folder / name
        os.mkfifo(path)
        return path

    return write


def _symlink_loop(name: str) -> Writer:
    def write(folder: Path) -> Path:
        (folder / name).symlink_to(folder / f"other-{name}")
        (folder / f"other-{name}").symlink_to(folder / name)
        return folder / name

    return write


def _symlink(name: str, target: str) -> Writer:
    def write(folder: Path) -> Path:
        (folder / name).symlink_to(target)
        return folder / name

    return write


def _folder(files: dict[str, bytes]) -> Writer:
    def write(folder: Path) -> Path:
        inner = folder / "run"
        inner.mkdir()
        for name, data in files.items():
            (inner / name).write_bytes(data)
        return inner

    return write


def _folder_with_fifo(name: str) -> Writer:
    def write(folder: Path) -> Path:
        inner = folder / "run"
        inner.mkdir()
        os.mkfifo(inner / name)
        return inner

    return write


def _dumps(doc: Any) -> bytes:
    """JSON with NaN/Infinity written as such (what a hand-edit or another tool may produce)."""
    return json.dumps(doc, allow_nan=True).encode()


#: What a flipped byte becomes, mostly: JSON's own syntax gets past the UTF-8 check and breaks
#: the structure in ways a random byte (usually not UTF-8 at all) does not.
_SYNTAX = b'{}[],:"\\-+.eE0123456789 tnfx'


def _flip(data: bytes, rng: random.Random, flips: int) -> bytes:
    out = bytearray(data)
    for _ in range(flips):
        byte = rng.choice(_SYNTAX) if rng.random() < 0.8 else rng.randrange(256)
        out[rng.randrange(len(out))] = byte
    return bytes(out)


def _deep(depth: int, opener: str = "[", closer: str = "]") -> bytes:
    return (opener * depth + closer * depth).encode()


# --------------------------------------------------------------------------------------------
# The trace corpus

_EVENT_FIELDS = ("name", "ts", "dur", "ph", "cat", "pid", "tid", "args")
_ARGS_FIELDS = (
    "External id",
    "correlation",
    "device",
    "stream",
    "Input type",
    "Input Dims",
)
_TOP_FIELDS = ("traceEvents", "deviceProperties", "distributedInfo", "schemaVersion")
_KEPT = {"cpu_op", "user_annotation", "kernel", "cuda_runtime", "gpu_memcpy", "python_function"}


def trace_corpus(real: bytes, gpu: bytes, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    packed = gzip.compress(real, compresslevel=6)
    for _ in range(25):
        cut = rng.randrange(len(real))
        add(Case(f"truncated plain at {cut}", _file("t.json", real[:cut])))
    for _ in range(10):
        cut = rng.randrange(len(packed))
        add(Case(f"truncated gzip at {cut}", _file("t.json.gz", packed[:cut])))
    for _ in range(25):
        flips = rng.randint(1, 8)
        add(Case(f"{flips} bytes flipped", _file("t.json", _flip(real, rng, flips))))
    for source, label in ((real, "cpu"), (gpu, "gpu")):
        for field in _EVENT_FIELDS:
            for value in rng.sample(BAD_VALUES, 2):
                edited = json.loads(source)  # a fresh copy, faster than deepcopy
                target = rng.choice([e for e in edited["traceEvents"] if e.get("cat") in _KEPT])
                target[field] = value
                add(Case(f"{label} event {field}={value!r}", _file("t.json", _dumps(edited))))
        for field in _ARGS_FIELDS:
            value = rng.choice(BAD_VALUES)
            edited = json.loads(source)  # a fresh copy, faster than deepcopy
            with_args = [e for e in edited["traceEvents"] if isinstance(e.get("args"), dict)]
            rng.choice(with_args)["args"][field] = value
            add(Case(f"{label} args {field}={value!r}", _file("t.json", _dumps(edited))))
        for field in _TOP_FIELDS:
            value = rng.choice(BAD_VALUES)
            edited = dict(json.loads(source), **{field: value})
            add(Case(f"{label} top-level {field}={value!r}", _file("t.json", _dumps(edited))))
        # Impossible numbers on a share (or all) of the events of one kind.
        for value in (-1.0, -1e6, 1e308, 1e300, 18446744073709551616, -1e308):
            field = rng.choice(("ts", "dur"))
            share = rng.choice((0.1, 0.5, 1.0))
            edited = json.loads(source)  # a fresh copy, faster than deepcopy
            for event in edited["traceEvents"]:
                if event.get("cat") in _KEPT and rng.random() < share:
                    event[field] = value
            add(Case(f"{label} {share:.0%} {field}={value!r}", _file("t.json", _dumps(edited))))
    # Over one 4 MB chunk, so that the event array is cut and parsed a chunk at a time.
    doc = json.loads(real)
    doc["traceEvents"] *= 20
    streamed = json.dumps(doc).encode()
    for _ in range(4):
        cut = rng.randrange(len(streamed))
        add(Case(f"streamed, truncated at {cut}", _file("t.json", streamed[:cut])))
    for _ in range(4):
        flips = rng.randint(1, 8)
        add(Case(f"streamed, {flips} bytes flipped", _file("t.json", _flip(streamed, rng, flips))))
    padding = b' ,"padding": "' + b"x" * (5 << 20) + b'"}'
    big = real.rstrip()[:-1] + padding  # over one 4 MB chunk: read streamed
    add(Case("BOM, small trace", _file("t.json", BOM + real)))
    add(Case("BOM, gzip trace", _gzip_file("t.json.gz", BOM + real)))
    add(Case("BOM, streamed trace", _file("t.json", BOM + big)))
    add(Case("BOM only", _file("t.json", BOM)))
    add(Case("empty file", _file("t.json", b"")))
    add(Case("whitespace only", _file("t.json", b" \n\t" * 1000)))
    add(Case("5 MB of whitespace", _file("t.json", b" " * (5 << 20))))
    add(Case("5 MB without traceEvents", _file("t.json", b'{"a": "' + b"y" * (5 << 20) + b'"}')))
    add(Case("nested 100,000 deep", _file("t.json", _deep(100_000))))
    add(Case("traceEvents nested deep", _file("t.json", b'{"traceEvents": ' + _deep(100_000))))
    add(Case("event args nested deep", _file("t.json", _deep_event(5000))))
    add(Case("streamed array never ends", _file("t.json", b'{"traceEvents": [' + b"[" * (5 << 20))))
    add(Case("streamed unclosed string", _file("t.json", b'{"traceEvents": ["' + b"z" * (5 << 20))))
    add(Case("JSON null", _file("t.json", b"null")))
    add(Case("JSON string", _file("t.json", b'"trace"')))
    add(Case("list of numbers", _file("t.json", b"[1, 2, 3]")))
    add(Case("traceEvents null", _file("t.json", b'{"traceEvents": null}')))
    add(Case("traceEvents empty", _file("t.json", b'{"traceEvents": []}')))
    add(Case("UTF-16", _file("t.json", real.decode().encode("utf-16"))))
    add(Case("latin-1 name", _file("t.json", real.replace(b'"aten::', b'"\xe9aten::', 1))))
    add(Case("random bytes", _file("t.json", rng.randbytes(4096))))
    add(Case("gzip of garbage", _gzip_file("t.json.gz", rng.randbytes(4096))))
    add(Case("gzip of text", _gzip_file("t.json.gz", b"not a trace at all\n" * 100)))
    add(Case("gzip header, garbage", _file("t.json.gz", b"\x1f\x8b\x08\x00" + rng.randbytes(500))))
    add(Case("gzip magic only", _file("t.json.gz", b"\x1f\x8b")))
    add(Case("gzip of gzip", _gzip_file("t.json.gz", packed)))
    add(Case("gzip, trailing garbage", _file("t.json.gz", packed + b"garbage")))
    add(Case("gzip, flipped", _file("t.json.gz", _flip(packed, rng, 3))))
    add(Case("bomb of spaces", _bomb("t.json.gz", b"", b" ", 24)))
    add(Case("bomb of zeros", _bomb("t.json.gz", b"", b"\0", 24)))
    add(Case("bomb of brackets", _bomb("t.json.gz", b'{"traceEvents": [', b"[", 24)))
    event = json.dumps(json.loads(real)["traceEvents"][-1]).encode() + b","
    add(Case("bomb of events", _bomb("t.json.gz", b'{"traceEvents": [', event, 24)))
    add(Case("bomb, no traceEvents", _bomb("t.json.gz", b'{"a": "', b"a", 24)))
    add(Case("directory", lambda folder: folder))
    add(Case("folder of bad traces", _folder({"a.json": real[:100], "b.json": b"{}"})))
    add(Case("folder with a FIFO trace", _folder_with_fifo("r0.json")))
    if hasattr(os, "mkfifo"):
        add(Case("FIFO", _fifo("t.json")))
    add(Case("symlink loop", _symlink_loop("t.json")))
    add(Case("dangling symlink", _symlink("t.json", "/nonexistent/trace.json")))
    if Path("/dev/zero").exists():
        add(Case("symlink to /dev/zero", _symlink("t.json", "/dev/zero")))
    return cases


def _deep_event(depth: int) -> bytes:
    head = b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1, "args": '
    return head + b'{"a": ' * depth + b"1" + b"}" * depth + b"}]}"


# --------------------------------------------------------------------------------------------
# The record corpus


def _paths(value: Any, prefix: tuple[Any, ...] = (), depth: int = 4) -> Iterator[tuple[Any, ...]]:
    """Paths (keys and list indexes) to the fields of a JSON document, ``depth`` levels deep."""
    if depth == 0:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key), depth - 1)
    elif isinstance(value, list) and value:
        yield (*prefix, 0)
        yield from _paths(value[0], (*prefix, 0), depth - 1)


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    edited = copy.deepcopy(doc)
    node = edited
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return edited


def _numbers(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _numbers(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _numbers(child, (*prefix, index))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix


#: The record's own objects (dataclasses), whose every field the corpus gives a bad value.
_TYPED_PARENTS: tuple[tuple[Any, ...], ...] = (
    (),
    ("timing",),
    ("timing", "samples", 0),
    ("timing", "unprofiled"),
    ("breakdown",),
    ("device",),
    ("model",),
    ("findings", 0),
    ("probes", 0),
    ("probes", 0, "checks", 0),
    ("top_ops", 0),
)


def _record_cases(raw: bytes, rng: random.Random) -> list[Case]:
    """Broken versions of the record ``raw``."""
    doc = json.loads(raw)
    cases: list[Case] = []

    def edit(path: tuple[Any, ...], value: Any, label: str = "") -> None:
        name = label or ".".join(map(str, path))
        cases.append(Case(f"{name}={value!r}", _file("r.json", _dumps(_set(doc, path, value)))))

    for _ in range(8):
        cut = rng.randrange(len(raw))
        cases.append(Case(f"truncated at {cut}", _file("r.json", raw[:cut])))
    for _ in range(8):
        flips = rng.randint(1, 6)
        cases.append(Case(f"{flips} bytes flipped", _file("r.json", _flip(raw, rng, flips))))
    # Every field of the record's own objects gets a value of a wrong type or size...
    for parent in _TYPED_PARENTS:
        node = doc
        for key in parent:
            present = isinstance(node, dict) and key in node
            present |= isinstance(node, list) and isinstance(key, int) and key < len(node)
            node = node[key] if present else None
        for key in node if isinstance(node, dict) else ():
            edit((*parent, key), rng.choice(BAD_VALUES))
    # ...and so do fields anywhere in it, and its numbers get impossible values.
    paths = list(_paths(doc))
    for path in rng.sample(paths, min(len(paths), 12)):
        edit(path, rng.choice(BAD_VALUES))
    numbers = list(_numbers(doc))
    for path in rng.sample(numbers, min(len(numbers), 10)):
        edit(path, rng.choice((1e308, -1e308, float("nan"), float("inf"), -1, 0, 10**30)))
    step_values: list[Any] = [-1.0, 0.0, float("nan"), float("inf"), 1e308, "1", None, True, [], {}]
    for value in step_values:
        edited = copy.deepcopy(doc)
        for sample in edited["timing"]["samples"]:
            sample["seconds"] = value
        cases.append(Case(f"every step {value!r}", _file("r.json", _dumps(edited))))
    edit(("timing", "samples", 0, "seconds"), -1.0, "first step")
    cases.append(Case("with BOM", _file("r.json", BOM + raw)))
    deep = dict(doc, config={"x": json.loads(_deep(200))})
    cases.append(Case("config nested 200 deep", _file("r.json", _dumps(deep))))
    latin = raw.decode().replace('"mode"', '"mod\u00e9"', 1).encode("latin-1", "replace")
    cases.append(Case("latin-1", _file("r.json", latin)))
    cases.append(Case("UTF-16", _file("r.json", raw.decode().encode("utf-16"))))
    return cases


def record_corpus(bases: dict[str, bytes], rng: random.Random) -> list[tuple[str, Case]]:
    """(base name, case): "run" cases go through report and compare, "trace" through report."""
    cases = [(base, case) for base, raw in bases.items() for case in _record_cases(raw, rng)]
    loose = [
        Case("nested 100,000 deep", _file("r.json", _deep(100_000))),
        Case(
            "objects nested 100,000 deep",
            _file("r.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ),
        Case("empty file", _file("r.json", b"")),
        Case("BOM only", _file("r.json", BOM)),
        Case("JSON list", _file("r.json", b"[]")),
        Case("JSON string", _file("r.json", b'"record"')),
        Case("JSON number", _file("r.json", b"3")),
        Case("JSON null", _file("r.json", b"null")),
        Case("empty object", _file("r.json", b"{}")),
        Case(
            "huge integer",
            _file("r.json", b'{"schema_version": ' + b"9" * 5000 + b', "mode": "run"}'),
        ),
        Case(
            "schema_version 10**30",
            _file("r.json", b'{"schema_version": 1000000000000000000000000000000, "mode": "run"}'),
        ),
        Case("random bytes", _file("r.json", rng.randbytes(2048))),
        Case("gzip of a record", _gzip_file("r.json", bases["run"])),
        Case("folder without record.json", lambda folder: folder),
        Case("folder with a FIFO record.json", _folder_with_fifo("record.json")),
        Case("symlink loop", _symlink_loop("r.json")),
        Case("dangling symlink", _symlink("r.json", "/nonexistent/record.json")),
    ]
    if hasattr(os, "mkfifo"):
        loose.append(Case("FIFO", _fifo("r.json")))
    if Path("/dev/zero").exists():
        loose.append(Case("symlink to /dev/zero", _symlink("r.json", "/dev/zero")))
    cases.extend(("run", case) for case in loose)
    return cases


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


def _run(
    command: str, argv: list[str], case: str, target: Path, guarded: list[Path]
) -> tuple[Outcome, list[str]]:
    before = {str(folder): _snapshot(folder) for folder in guarded}
    stdout, stderr = io.StringIO(), io.StringIO()
    started = time.perf_counter()
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
    seconds = time.perf_counter() - started
    err = stderr.getvalue()
    lines = [line for line in err.splitlines() if line.strip()]
    lines += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    outcome = Outcome(case, command, code, err, seconds)
    if code not in ALLOWED[command] and not problems:
        problems.append(f"exit {code}")
    if "Traceback" in err or "Traceback" in stdout.getvalue():
        problems.append("a traceback")
    if len(lines) > 1:
        problems.append(f"{len(lines)} lines on stderr")
    if code not in (0, -1, ExitCode.REGRESSION):
        if not err.startswith("diagnose: error: "):
            problems.append("no 'diagnose: error:' line")
        elif command != "compare" and target.name not in err:
            problems.append("the error does not name the file")
    after = {str(folder): _snapshot(folder) for folder in guarded}
    if after != before:
        problems.append("the input folder changed")
    return outcome, [f"{command} {case!r}: {p}; stderr: {lines[:3]}" for p in problems]


def _check_corpus(outcomes: list[Outcome], problems: list[str], started: float) -> None:
    total = time.perf_counter() - started
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(
        f"{len(outcomes)} runs in {total:.1f} s; slowest {slowest.seconds:.2f} s "
        f"({slowest.command} {slowest.case!r}); exit codes "
        f"{sorted({o.code for o in outcomes})}"
    )
    assert not problems, f"{len(problems)} failing cases:\n" + "\n".join(problems[:25])
    assert total < CORPUS_SECONDS, f"the corpus took {total:.1f} s"


def test_trace_corpus(tmp_path: Path, real_trace: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GZIP_LIMIT_ENV, str(BOMB_CAP_MB))
    gpu = gzip.decompress(GPU_TRACE.read_bytes())
    cases = trace_corpus(real_trace, gpu, random.Random(SEED))
    assert len(cases) >= 100
    (tmp_path / "out").mkdir()
    outcomes: list[Outcome] = []
    problems: list[str] = []
    started = time.perf_counter()
    for index, case in enumerate(cases):
        folder = tmp_path / "in" / f"{index:03d}"
        folder.mkdir(parents=True)
        target = case.write(folder)
        argv = ["trace", str(target), "--out", str(tmp_path / "out" / f"{index:03d}")]
        outcome, found = _run("trace", argv, case.name, target, [folder])
        outcomes.append(outcome)
        problems.extend(found)
    _check_corpus(outcomes, problems, started)
    # The corpus is not all refusals: the valid-but-odd traces (BOM, some impossible times)
    # were analysed.
    assert sum(o.code == 0 for o in outcomes) >= 5


def test_record_corpus(tmp_path: Path, trace_record: bytes) -> None:
    bases = {"run": SAME_CONFIG.read_bytes(), "trace": trace_record}
    cases = record_corpus(bases, random.Random(SEED + 1))
    assert len(cases) >= 100
    baseline_folder = tmp_path / "baseline"
    baseline_folder.mkdir()
    baseline = baseline_folder / "baseline.json"
    baseline.write_bytes(BASELINE.read_bytes())
    (tmp_path / "out").mkdir()
    outcomes: list[Outcome] = []
    problems: list[str] = []
    started = time.perf_counter()
    for index, (base, case) in enumerate(cases):
        folder = tmp_path / "in" / f"{index:03d}"
        folder.mkdir(parents=True)
        target = case.write(folder)
        guarded = [folder, baseline_folder]
        html = tmp_path / "out" / f"{index:03d}.html"
        runs = [("report", ["report", str(target), "--out", str(html)])]
        if base == "run":
            runs.append(("compare", ["compare", str(baseline), str(target)]))
        for command, argv in runs:
            outcome, found = _run(command, argv, f"{base} {case.name}", target, guarded)
            outcomes.append(outcome)
            problems.extend(found)
    _check_corpus(outcomes, problems, started)
    assert sum(o.code == 0 for o in outcomes) >= 5
