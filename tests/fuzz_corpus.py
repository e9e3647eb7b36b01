"""The stress corpus: bad, hostile and absurd inputs for every command that reads one, generated
(nothing is stored) with a seeded ``random.Random`` from a small real trace, real records and the
project's fixtures. This module holds what the corpora share (the classes of outcome, the case,
the writers); ``fuzz_traces.py`` and ``fuzz_records.py`` make the cases.

Each case belongs to a family and says the class of outcome it must end in (:class:`Expect`):
refused, analysed, either (a random cut or flip may land anywhere), cleaned (impossible numbers
left out with a note), masked (planted secrets in no output), misread (absurd shapes: no MFU or
share above 100%), linear (an input built to defeat a pattern, read in bounded time). The checks
every case gets, whatever its class, are in ``tests/test_fuzz_inputs.py``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import socket
import stat
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnose.errors import ExitCode
from tests.conftest import FIXTURES

SEED = 20251201
#: Hard bound per case: a hang (a FIFO read, a quadratic scan) fails the case instead of the run.
CASE_SECONDS = 20.0
#: Bound on the CPU time of each whole corpus; the cases take about 0.05 s each on a 2-core
#: machine.
CORPUS_SECONDS = 45.0
#: A gzip bomb need not be GBs to prove the cap: the cap is lowered to this for the corpus.
BOMB_CAP_MB = 8
BASELINE = FIXTURES / "compare" / "baseline.json"
SAME_CONFIG = FIXTURES / "compare" / "same_config.json"
GPU_TRACE = FIXTURES / "traces" / "gpu_synthetic_optimizer_sync.json.gz"
BOM = b"\xef\xbb\xbf"
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

#: Secrets planted in records and traces (split so that no scanner reads them as real ones).
HF, GHP, AWS = (
    "hf_" + "Pq7Rs8Tu9Vw0Xy1Za2Bc3De4Fg5Hi6",
    "ghp_" + "Jk7Lm8No9Pq0Rs1Tu2Vw3Xy4Za5",
    "AKIA" + "QWERTYUIOPASDFGH",
)
PASSWORD, DB_PASSWORD = "Sup3rS3cretPw2", "Sup3rS3cretPw3"
#: What must be absent from every output: each secret less the public prefix a mask keeps
#: ("hf_***").
SECRET_PARTS = (HF[3:], GHP[4:], AWS[4:], PASSWORD, DB_PASSWORD)


@dataclass(frozen=True)
class Expect:
    """The class of outcome a family's cases must end in (the reliability section of
    docs/exit-codes.md lists them)."""

    name: str
    #: Exit codes allowed (``diagnose compare`` may also say 6, a regression, where 0 is).
    codes: frozenset[int]
    #: Text diagnose must print about what it did (the note on what was left out), "" for none.
    says: str = ""
    #: Texts in no output file and no printed line (planted secrets).
    never: tuple[str, ...] = ()
    #: CPU seconds a case may take (a linear read of an input built against one pattern).
    cpu_seconds: float | None = None
    #: Exit codes of ``diagnose compare`` where they differ from :attr:`codes` (a record left
    #: with no step is cleaned for the report and refused by the gate: nothing to compare).
    gate: frozenset[int] | None = None


OK, BAD = int(ExitCode.OK), int(ExitCode.BAD_INPUT)
REFUSED = Expect("refused", frozenset({BAD}))
ANALYSED = Expect("analysed", frozenset({OK}))
EITHER = Expect("refused or analysed", frozenset({OK, BAD}))
CLEANED_TRACE = Expect("cleaned", frozenset({OK}), says="left out of the analysis")
CLEANED_RECORD = Expect("cleaned", frozenset({OK}), says="Left out when the record was read")
#: Every step left out: the report says "not measured", the gate has nothing to compare.
NO_STEP_LEFT = dataclasses.replace(CLEANED_RECORD, gate=frozenset({BAD}))
#: Masked whatever the verdict: a planted device name also makes two records incomparable.
MASKED = Expect("masked", frozenset({OK}), never=SECRET_PARTS, gate=frozenset({OK, BAD, 6}))
MISREAD = Expect("misread", frozenset({OK}))
#: The issue's bound for a trace with a 300 KB kernel name: read in under 5 s.
LINEAR = Expect("linear", frozenset({OK}), cpu_seconds=5.0)
CLASSES = (REFUSED, ANALYSED, EITHER, CLEANED_TRACE, MASKED, MISREAD, LINEAR)


@dataclass(frozen=True)
class Case:
    name: str
    write: Writer  # writes the input into an empty folder; returns the path to pass
    expect: Expect = EITHER


# --------------------------------------------------------------------------------------------
# Writers


def as_file(name: str, data: bytes) -> Writer:
    def write(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    return write


def as_gzip_file(name: str, data: bytes) -> Writer:
    return as_file(name, gzip.compress(data, compresslevel=1))


def gzip_bomb(name: str, head: bytes, unit: bytes, megabytes: int) -> Writer:
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


def as_fifo(name: str) -> Writer:
    def write(folder: Path) -> Path:
        path = folder / name
        os.mkfifo(path)
        return path

    return write


def symlink_loop(name: str) -> Writer:
    def write(folder: Path) -> Path:
        (folder / name).symlink_to(folder / f"other-{name}")
        (folder / f"other-{name}").symlink_to(folder / name)
        return folder / name

    return write


def symlink(name: str, target: str) -> Writer:
    def write(folder: Path) -> Path:
        (folder / name).symlink_to(target)
        return folder / name

    return write


def as_folder(files: dict[str, bytes]) -> Writer:
    def write(folder: Path) -> Path:
        inner = folder / "run"
        inner.mkdir()
        for name, data in files.items():
            (inner / name).write_bytes(data)
        return inner

    return write


def folder_with_fifo(name: str) -> Writer:
    def write(folder: Path) -> Path:
        inner = folder / "run"
        inner.mkdir()
        os.mkfifo(inner / name)
        return inner

    return write


def json_bytes(doc: Any) -> bytes:
    """JSON with NaN/Infinity written as such (what a hand-edit or another tool may produce)."""
    return json.dumps(doc, allow_nan=True).encode()


#: What a flipped byte becomes, mostly: JSON's own syntax gets past the UTF-8 check and breaks
#: the structure in ways a random byte (usually not UTF-8 at all) does not.
_SYNTAX = b'{}[],:"\\-+.eE0123456789 tnfx'


def flipped(data: bytes, rng: random.Random, flips: int) -> bytes:
    out = bytearray(data)
    for _ in range(flips):
        byte = rng.choice(_SYNTAX) if rng.random() < 0.8 else rng.randrange(256)
        out[rng.randrange(len(out))] = byte
    return bytes(out)


def nested(depth: int, opener: str = "[", closer: str = "]") -> bytes:
    return (opener * depth + closer * depth).encode()


def edited(source: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    doc = json.loads(source)
    change(doc)
    return json_bytes(doc)


def special_file(folder: Path, kind: str) -> Path | None:
    """A FIFO, a socket or a device node ("fifo", "socket", "device") at a new path in
    ``folder``, where an output could be asked for; None where this user may not make a device
    node (a node like /dev/null's, 1:3)."""
    path = folder / f"{kind}.out"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()  # the socket file stays
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            return None
    return path
