"""A trace read by two processes gives the very tables one process gives, or the same error.

The shared real traces and generated ones (many threads, devices, streams, shapes, modules and
metadata spread over the file, so that ids first seen by the worker must be renumbered) are read
both ways, in small pieces so that both processes take many of them.
"""

from __future__ import annotations

import dataclasses
import gzip
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from diagnose.errors import DiagnoseError
from diagnose.trace import parallel_read, stream
from diagnose.trace.reader import ParsedTrace, read_ahead, read_trace
from tests.conftest import SHARED_TRACES

PIECE = 32 << 10


def _differences(a: ParsedTrace, b: ParsedTrace) -> list[str]:
    """The fields (tables: columns) in which two reads differ, but for who read which piece."""
    differ = []
    for field in dataclasses.fields(a):
        if field.name == "pieces_read":
            continue
        x, y = getattr(a, field.name), getattr(b, field.name)
        if dataclasses.is_dataclass(x):
            for column in dataclasses.fields(x):
                u, v = getattr(x, column.name), getattr(y, column.name)
                if u.dtype != v.dtype or not np.array_equal(u, v, equal_nan=u.dtype.kind == "f"):
                    differ.append(f"{field.name}.{column.name}")
        elif x != y:
            differ.append(field.name)
    return differ


def _varied_events(n: int, bad_at: int | None = None) -> list[dict[str, Any]]:
    """Ops on several threads, kernels on several devices and streams, shapes, modules and
    thread names, with names first seen all along the file; op number ``bad_at`` has a duration
    that is no number."""
    events: list[dict[str, Any]] = []
    for i in range(n):
        ts = 1_000_000.0 + 10 * i
        thread = (i % 3, f"t{(i // 7) % 5}")
        events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": f"aten::op{i % 97}_{i // 500}",
                "pid": thread[0],
                "tid": thread[1],
                "ts": ts,
                "dur": "slow" if i == bad_at else 5,
                "args": {
                    "External id": i,
                    "Input type": ["float", f"c10::BFloat16_{i % 11}"],
                    "Input Dims": [[i % 13, 8], [8, 4]],
                    **({"Concrete Inputs": ["", str(i % 5)]} if i % 2 else {}),
                },
            }
        )
        if i % 4 == 0:
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": f"kernel_{i % 31}_{i // 900}",
                    "pid": i % 2,
                    "tid": 7 + i % 3,
                    "ts": ts + 2,
                    "dur": 3,
                    "args": {"device": (i // 1000) % 3, "stream": 7 + (i // 300) % 4},
                }
            )
        if i % 9 == 0:
            events.append(
                {
                    "ph": "X",
                    "cat": "python_function",
                    "name": f"nn.Module: Block_{i % 17}",
                    "pid": thread[0],
                    "tid": thread[1],
                    "ts": ts,
                    "dur": 6,
                }
            )
        if i % 250 == 0:
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": thread[0],
                    "tid": thread[1],
                    "args": {"name": f"thread {i}"},
                }
            )
    return events


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    text = orjson.dumps({"schemaVersion": 1, "traceEvents": events, "traceName": path.name})
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text, compresslevel=1))
    else:
        path.write_bytes(text)
    return path


def _read_both(path: Path) -> tuple[ParsedTrace, ParsedTrace]:
    one = read_trace(path, chunk_bytes=PIECE, parallel=False)
    two = read_trace(path, chunk_bytes=PIECE, parallel=True)
    return one, two


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_two_processes_make_the_tables_one_process_makes(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"varied{suffix}", _varied_events(6000))
    one, two = _read_both(path)
    assert one.pieces_read == (sum(two.pieces_read),) and len(two.pieces_read) == 2
    assert sum(two.pieces_read) > 20
    assert _differences(one, two) == []
    assert len(two.names) > 500 and len(two.threads) == 15 and len(two.devices) == 3
    assert len(two.thread_names) == 15 and len(two.modules) > 0
    assert not multiprocessing.active_children()  # the worker is gone


def test_the_shared_gpu_traces_read_the_same_by_two_processes() -> None:
    traces = sorted(SHARED_TRACES.glob("*/*.json.gz"))
    if not traces:
        pytest.skip("no shared GPU traces")
    two_read = 0
    for path in traces:
        one, two = _read_both(path)
        assert _differences(one, two) == [], path.name
        two_read += len(two.pieces_read) == 2
    # The small traces fit one piece and are read in one process; the others by two.
    assert two_read >= len(traces) // 2


def _errors_both_ways(path: Path) -> list[str]:
    """The one-line errors of reading ``path`` in one process, then in two."""
    errors = []
    for parallel in (False, True):
        with pytest.raises(DiagnoseError) as caught:
            read_trace(path, chunk_bytes=PIECE, parallel=parallel)
        errors.append(caught.value.message)
    return errors


def test_a_read_started_ahead_makes_the_same_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `diagnose trace` does: the second process starts, this one imports, then reads along.
    monkeypatch.setattr(parallel_read, "MIN_PARALLEL_BYTES", 0)
    path = _write(tmp_path / "varied.json.gz", _varied_events(6000))
    ahead = read_ahead(path, chunk_bytes=PIECE)
    if ahead is None:
        pytest.skip("no second process here (one core, or no fork)")
    two = read_trace(path, chunk_bytes=PIECE, ahead=ahead)
    assert len(two.pieces_read) == 2 and sum(two.pieces_read) > 20
    assert _differences(read_trace(path, chunk_bytes=PIECE, parallel=False), two) == []
    assert not multiprocessing.active_children()
    # Started on another file, or never used: stopped, and the trace read all the same.
    other = read_ahead(_write(tmp_path / "other.json", _varied_events(6000)), chunk_bytes=PIECE)
    assert other is not None
    assert len(read_trace(path, chunk_bytes=PIECE, ahead=other).host) == len(two.host)
    unused = read_ahead(path, chunk_bytes=PIECE)
    assert unused is not None
    unused.stop()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("where", [100, 5900])
def test_a_bad_event_gives_the_one_process_error(tmp_path: Path, where: int) -> None:
    path = _write(tmp_path / "bad.json", _varied_events(6000, bad_at=where))
    errors = _errors_both_ways(path)
    assert errors[0] == errors[1] and "field 'dur' is a string" in errors[0]


def test_truncated_gzip_gives_the_one_process_error(tmp_path: Path) -> None:
    whole = _write(tmp_path / "whole.json.gz", _varied_events(6000)).read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(whole[: len(whole) * 2 // 3])
    errors = _errors_both_ways(path)
    assert errors[0] == errors[1] and "truncated or corrupt gzip data" in errors[0]


def test_the_standard_inflater_reads_what_isal_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "varied.json.gz", _varied_events(3000))
    first = read_trace(path, chunk_bytes=PIECE, parallel=False)
    monkeypatch.setattr(stream, "_isal_gzip", None)
    assert _differences(first, read_trace(path, chunk_bytes=PIECE, parallel=False)) == []


def test_a_second_process_only_where_it_pays(tmp_path: Path) -> None:
    small = _write(tmp_path / "small.json", _varied_events(300))
    assert not parallel_read.worth_a_second_process(small, 4 << 20)
    # A gzip file is judged by the size it inflates to, read from its trailer.
    big = tmp_path / "big.json.gz"
    big.write_bytes(gzip.compress(b" " * (parallel_read.MIN_PARALLEL_BYTES + 1)))
    assert parallel_read._decompressed_size(big) == parallel_read.MIN_PARALLEL_BYTES + 1
    # Forking is only safe with no other thread (a thread an earlier test left running, a
    # library's pool): the verdict then stays in one process.
    assert parallel_read.worth_a_second_process(big, 4 << 20) == (
        sys.platform.startswith("linux")
        and parallel_read._usable_cores() >= 2
        and threading.active_count() == 1
    )


def test_diagnose_trace_imports_neither_torch_nor_matplotlib(tmp_path: Path) -> None:
    # Their imports would cost a `diagnose trace` more than reading a 60 MB trace does.
    trace = _write(tmp_path / "varied.json", _varied_events(500))
    code = (
        "import sys\n"
        "from diagnose.cli import main\n"
        f"code = main(['trace', {str(trace)!r}, '--out', {str(tmp_path / 'out')!r}])\n"
        "heavy = sorted(m for m in ('torch', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy, code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert "HEAVY [] 0" in done.stdout, done.stdout + done.stderr
