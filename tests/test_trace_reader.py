"""The trace reader: schemas, gzip, chunked (streaming) reading, one-line errors on bad input."""

from __future__ import annotations

import gzip
import json
import re
import tracemalloc
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diagnose.cli import main
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.trace import stream
from diagnose.trace.columns import KERNEL, MEMCPY
from diagnose.trace.reader import (
    CHUNK_BYTES,
    EXCLUDED_PREFIX,
    NEGATIVE_DURATION,
    NEGATIVE_TIMESTAMP,
    NON_FINITE,
    OUTSIDE_SPAN,
    _drop_impossible,
    exclusion_note,
    read_trace,
)
from diagnose.trace.stream import GZIP_LIMIT_ENV, ReadLimits
from tests.conftest import FIXTURES

GPU_TRACE = FIXTURES / "traces" / "gpu_synthetic_optimizer_sync.json.gz"


def _event(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": 1,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _small_trace(n_steps: int = 3) -> dict[str, Any]:
    """A hand-built current-schema trace: steps, ops, a launch and its kernel, flows, metadata."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
    ]
    t = 1_000_000.0
    corr = 100
    for step in range(n_steps):
        events.append(
            _event(f"ProfilerStep#{step}", "user_annotation", t, 1000, **{"External id": 1})
        )
        events.append(
            _event(
                "aten::mm",
                "cpu_op",
                t + 10,
                100,
                **{
                    "External id": 10 + step,
                    "Input type": ["c10::BFloat16", "c10::BFloat16"],
                    "Input Dims": [[4, 8], [8, 4]],
                },
            )
        )
        events.append(
            _event(
                "cudaLaunchKernel",
                "cuda_runtime",
                t + 20,
                5,
                **{"External id": 10 + step, "correlation": corr},
            )
        )
        events.append(
            {"ph": "s", "id": corr, "pid": 1, "tid": 1, "ts": t + 20, "cat": "ac2g", "name": "ac2g"}
        )
        kernel = _event(
            "Cijk_Alik_Bljk_BBS_gemm",
            "kernel",
            t + 30,
            50,
            device=0,
            stream=7,
            correlation=corr,
            **{"External id": 10 + step},
        )
        kernel["pid"], kernel["tid"] = 0, 7
        events.append(kernel)
        events.append(
            _event(
                "Memcpy HtoD (Pageable -> Device)",
                "gpu_memcpy",
                t + 90,
                3,
                device=0,
                stream=7,
                correlation=corr + 1,
            )
        )
        events.append(
            {
                "ph": "i",
                "name": "[memory]",
                "pid": 1,
                "tid": 1,
                "ts": t + 50,
                "s": "t",
                "args": {"Bytes": 4},
            }
        )
        events.append(_event("python.py(1): f", "python_function", t, 500))
        t += 1000
        corr += 2
    return {
        "schemaVersion": 1,
        "deviceProperties": [
            {
                "id": 0,
                "name": "AMD Instinct MI300X",
                "totalGlobalMem": 1 << 30,
                "computeMajor": 9,
                "computeMinor": 4,
            }
        ],
        "roctracer_version": 4.1,
        "traceEvents": events,
        "traceName": "x.json",
        "displayTimeUnit": "ms",
    }


def test_reads_current_schema_and_skips_what_it_does_not_use(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_small_trace()))
    trace = read_trace(path)
    assert len(trace.host) == 6  # 3 steps + 3 ops; python_function and instants skipped
    assert len(trace.runtime) == 3
    assert len(trace.device) == 6
    assert set(trace.device.kind.tolist()) == {KERNEL, MEMCPY}
    assert trace.top_level["roctracer_version"] == 4.1
    assert trace.top_level["traceName"] == "x.json"
    assert "traceEvents" not in trace.top_level
    assert trace.thread_names == {0: "main"}
    assert trace.host.ts.min() == 0.0  # timestamps are relative to the first event
    mm = [i for i in range(len(trace.host)) if trace.names[trace.host.name[i]] == "aten::mm"]
    assert trace.names[trace.host.input_types[mm[0]]] == "c10::BFloat16, c10::BFloat16"
    assert json.loads(trace.names[trace.host.input_dims[mm[0]]]) == [[4, 8], [8, 4]]


def test_gzip_is_detected_by_content(tmp_path: Path) -> None:
    path = tmp_path / "trace.bin"  # no .gz suffix on purpose
    path.write_bytes(gzip.compress(json.dumps(_small_trace()).encode()))
    assert len(read_trace(path).device) == 6


def test_bare_event_array_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_small_trace()["traceEvents"]))
    assert len(read_trace(path).host) == 6


@pytest.mark.parametrize("indent", [None, 1])
def test_chunked_reading_equals_whole_reading(tmp_path: Path, indent: int | None) -> None:
    """Force many tiny chunks: events (with nested lists of objects in args and a '}, {' inside a
    string) must come out identical, and fields after traceEvents must still be read."""
    doc = _small_trace(n_steps=60)
    doc["traceEvents"][3]["args"]["weird"] = [{"a": "}, {"}, {"b": [1, {"c": '\\"}'}]}]
    doc["traceEvents"][5]["name"] = 'say "}, {" please'
    doc["deviceProperties"] *= 3
    # Put deviceProperties after the events, as some exporters do.
    ordered = {k: v for k, v in doc.items() if k != "deviceProperties"}
    ordered["deviceProperties"] = doc["deviceProperties"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(ordered, indent=indent))
    whole = read_trace(path)
    chunked = read_trace(path, chunk_bytes=1024)
    assert chunked.streamed and not whole.streamed
    for table in ("host", "runtime", "device"):
        a, b = getattr(whole, table), getattr(chunked, table)
        for column in a.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
    assert [whole.names[i] for i in whole.host.name] == [
        chunked.names[i] for i in chunked.host.name
    ]
    assert chunked.top_level["deviceProperties"] == doc["deviceProperties"]
    assert chunked.top_level["traceName"] == "x.json"


def test_chunked_reading_of_a_real_trace(shared_traces: Path) -> None:
    path = shared_traces / "rocm" / "mi300x_bert_small_infer.json.gz"
    whole = read_trace(path)
    chunked = read_trace(path, chunk_bytes=64 << 10)
    assert chunked.streamed
    np.testing.assert_array_equal(whole.device.ts, chunked.device.ts)
    np.testing.assert_array_equal(whole.host.dur, chunked.host.dur)
    assert whole.top_level == chunked.top_level


def _write_gzip_truncated(path: Path) -> None:
    data = gzip.compress(json.dumps(_small_trace(40)).encode())
    path.write_bytes(data[: len(data) // 2])


BAD_INPUTS: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated gzip": (lambda p: _write_gzip_truncated(p), "gzip"),
    "invalid JSON": (lambda p: p.write_text('{"traceEvents": [ {"ph": "X",'), "invalid JSON"),
    "no traceEvents": (lambda p: p.write_text('{"schemaVersion": 1}'), "no traceEvents"),
    "traceEvents not a list": (lambda p: p.write_text('{"traceEvents": {"a": 1}}'), "not a list"),
    "ts is a string": (
        lambda p: p.write_text(
            json.dumps(
                {
                    "traceEvents": [
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": "aten::mm",
                            "ts": "12",
                            "dur": 3,
                            "pid": 1,
                            "tid": 1,
                        }
                    ]
                }
            )
        ),
        "'ts'",
    ),
    "name is a number": (
        lambda p: p.write_text(
            json.dumps(
                {
                    "traceEvents": [
                        {
                            "ph": "X",
                            "cat": "kernel",
                            "name": 5,
                            "ts": 1,
                            "dur": 3,
                            "pid": 0,
                            "tid": 7,
                        }
                    ]
                }
            )
        ),
        "'name'",
    ),
    "args is a list": (
        lambda p: p.write_text(
            json.dumps(
                {
                    "traceEvents": [
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": "a",
                            "ts": 1,
                            "dur": 3,
                            "pid": 1,
                            "tid": 1,
                            "args": [1],
                        }
                    ]
                }
            )
        ),
        "'args'",
    ),
    "event is not an object": (lambda p: p.write_text('{"traceEvents": [1, 2]}'), "event 0"),
    "empty traceEvents": (lambda p: p.write_text('{"traceEvents": []}'), "no events"),
    "only unknown events": (
        lambda p: p.write_text(
            '{"traceEvents": [{"ph": "X", "cat": "mine", "name": "a", "ts": 1, "dur": 2}]}'
        ),
        "no profiler events",
    ),
    "empty file": (lambda p: p.write_bytes(b""), "empty"),
    "JSON scalar": (lambda p: p.write_text("3"), "top level"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_bad_input_error(tmp_path: Path, case: str) -> None:
    write, expected = BAD_INPUTS[case]
    path = tmp_path / "bad.json"
    write(path)
    with pytest.raises(DiagnoseError) as info:
        read_trace(path)
    message = str(info.value)
    assert info.value.code == ExitCode.BAD_INPUT
    assert "\n" not in message
    assert message.startswith(str(path))
    assert expected in message


@pytest.mark.parametrize("case", ["invalid JSON", "ts is a string", "truncated gzip"])
def test_bad_input_in_chunked_mode(tmp_path: Path, case: str) -> None:
    """The streaming path reports the same kind of error."""
    path = tmp_path / "bad.json"
    if case == "invalid JSON":
        text = json.dumps(_small_trace(60))
        path.write_text(text[: len(text) - 200])
    elif case == "ts is a string":
        doc = _small_trace(60)
        last_op = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"][-1]
        last_op["ts"] = "late"
        path.write_text(json.dumps(doc))
    else:
        _write_gzip_truncated(path)
    with pytest.raises(DiagnoseError) as info:
        read_trace(path, chunk_bytes=1024)
    assert info.value.code == ExitCode.BAD_INPUT
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_gz_name_on_what_is_neither_gzip_nor_json_says_so(tmp_path: Path) -> None:
    """Random bytes named .json.gz: the error says it is not the gzip its name promises (a JSON
    parser's complaint about its first bytes did not); plain JSON under that name, with a byte
    order mark and leading blanks, is still read."""
    garbage = tmp_path / "trace.json.gz"
    garbage.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DiagnoseError) as info:
        read_trace(garbage)
    assert info.value.code == ExitCode.BAD_INPUT
    assert (
        str(info.value)
        == f"{garbage}: not a gzip file, though its name ends in .gz, and not JSON either"
    )
    plain = tmp_path / "plain.json.gz"
    plain.write_bytes(b"\xef\xbb\xbf \n" + json.dumps(_small_trace()).encode())
    assert len(read_trace(plain).device) == 6


def test_missing_file_and_directory(tmp_path: Path) -> None:
    for path, expected in ((tmp_path / "nope.json", "no such file"), (tmp_path, "directory")):
        with pytest.raises(DiagnoseError) as info:
            read_trace(path)
        assert info.value.code == ExitCode.BAD_INPUT
        assert str(path) in str(info.value) and expected in str(info.value)


# --------------------------------------------------------------------------------------------
# Bounded reading: gzip expansion, the search for traceEvents, one event; byte-order marks


def _bomb(path: Path, megabytes: int, unit: bytes = b" ") -> Path:
    """A gzip file that expands ~1000x to ``megabytes`` MB of ``unit``."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: with a gzip header
    block = unit * ((1 << 20) // len(unit))
    with path.open("wb") as out:
        for _ in range(megabytes):
            out.write(squeeze.compress(block))
        out.write(squeeze.flush())
    return path


def test_a_gzip_bomb_is_refused_by_its_ratio(tmp_path: Path) -> None:
    limits = ReadLimits(ratio_floor_bytes=1 << 20)
    bomb = _bomb(tmp_path / "bomb.json.gz", 32)
    with pytest.raises(DiagnoseError) as info:
        read_trace(bomb, limits=limits)
    assert info.value.code == ExitCode.BAD_INPUT
    assert str(bomb) in info.value.message and "gzip bomb" in info.value.message
    assert "\n" not in info.value.message
    # Its twin: a trace of the same size that compresses like a real one (~25x) is read.
    twin = tmp_path / "twin.json.gz"
    twin.write_bytes(gzip.compress(json.dumps(_small_trace(1000)).encode()))
    assert len(read_trace(twin, limits=limits).device) == 2000


def test_a_gzip_trace_beyond_the_absolute_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_small_trace(2000)).encode()))  # 2.4 MB inside
    with pytest.raises(DiagnoseError) as info:
        read_trace(path, limits=ReadLimits(max_gzip_bytes=1 << 20))
    assert "expands past 1 MB" in info.value.message and GZIP_LIMIT_ENV in info.value.message
    assert len(read_trace(path, limits=ReadLimits(max_gzip_bytes=4 << 20)).device) == 4000


def test_the_gzip_cap_can_be_set_by_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_small_trace(2000)).encode()))
    monkeypatch.setenv(GZIP_LIMIT_ENV, "1")
    with pytest.raises(DiagnoseError, match="expands past 1 MB"):
        read_trace(path)
    monkeypatch.setenv(GZIP_LIMIT_ENV, "3")
    assert len(read_trace(path).device) == 4000
    monkeypatch.setenv(GZIP_LIMIT_ENV, "lots")
    with pytest.raises(DiagnoseError) as info:
        read_trace(path)
    assert info.value.code == ExitCode.USAGE and GZIP_LIMIT_ENV in info.value.message


@pytest.mark.parametrize("unit", [b" ", b"["])
def test_memory_stays_bounded_while_a_gzip_bomb_is_refused(tmp_path: Path, unit: bytes) -> None:
    """The decompressed bytes are counted as they are read: a 64 MB bomb of blanks or brackets
    (what no cut of the event stream can parse, so it is buffered) costs about the cap (8 MB
    here), not 64 MB. (A bomb of valid events is refused at the cap too, see the fuzz corpus;
    its memory is the event tables'.)"""
    bomb = _bomb(tmp_path / "bomb.json.gz", 64, unit)
    tracemalloc.start()
    try:
        with pytest.raises(DiagnoseError, match="expands past 8 MB"):
            read_trace(bomb, chunk_bytes=1 << 20, limits=ReadLimits(max_gzip_bytes=8 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"peak {peak / 2**20:.0f} MB"


class _CountingKey:
    """Stands in for the traceEvents key pattern; counts the bytes each search scans."""

    def __init__(self) -> None:
        self.scanned = 0
        self._key = stream._TRACE_EVENTS_KEY

    def search(self, buf: bytearray, pos: int = 0) -> re.Match[bytes] | None:
        self.scanned += len(buf) - pos
        return self._key.search(buf, pos)


def test_a_file_without_trace_events_is_refused_at_a_bound_without_rescanning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notes.json"
    path.write_bytes(b'{"notes": [' + b'"a line of text", ' * 200_000 + b'"end"]}')  # 3.4 MB
    counter = _CountingKey()
    monkeypatch.setattr(stream, "_TRACE_EVENTS_KEY", counter)
    with pytest.raises(DiagnoseError) as info:
        read_trace(path, chunk_bytes=16 << 10, limits=ReadLimits(max_header_bytes=1 << 20))
    assert "not a profiler trace: no traceEvents in the first 1 MB" in info.value.message
    # Each byte is searched about once (the overlap adds 4 KB a chunk), not once per chunk.
    assert counter.scanned < 2 * (1 << 20), counter.scanned
    # The twin: the key cut in two by a chunk boundary, after a long header, is found.
    doc = _small_trace(60)
    header = b'{"pad": "' + b"p" * ((16 << 10) - 20) + b'", "traceEvents": ['
    text = header + json.dumps(doc["traceEvents"]).encode()[1:] + b"}"
    twin = tmp_path / "twin.json"
    twin.write_bytes(text)
    trace = read_trace(twin, chunk_bytes=16 << 10)
    assert trace.streamed and len(trace.host) == 120 and counter.scanned < 3 * (1 << 20)


def test_a_corrupt_streamed_trace_stops_at_the_event_bound(tmp_path: Path) -> None:
    """A broken event early in a big file: no cut parses, so the reader looks further, but not
    through the whole file."""
    text = json.dumps(_small_trace(2000))
    broken = text.replace('"ph": "X"', '"ph": X', 1)  # not JSON from the first event on
    path = tmp_path / "broken.json"
    path.write_text(broken)
    with pytest.raises(DiagnoseError) as info:
        read_trace(path, chunk_bytes=16 << 10, limits=ReadLimits(max_event_bytes=256 << 10))
    assert "invalid JSON" in info.value.message and str(path) in info.value.message
    path.write_text(text)  # the twin, intact, reads
    assert len(read_trace(path, chunk_bytes=16 << 10).host) == 4000


@pytest.mark.parametrize("chunk", [CHUNK_BYTES, 1024])
def test_a_byte_order_mark_is_accepted_whole_or_streamed(tmp_path: Path, chunk: int) -> None:
    text = json.dumps(_small_trace(60)).encode()
    plain, marked = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_bytes(text)
    marked.write_bytes(b"\xef\xbb\xbf" + text)
    a, b = read_trace(plain, chunk_bytes=chunk), read_trace(marked, chunk_bytes=chunk)
    assert a.streamed == b.streamed == (chunk == 1024)
    np.testing.assert_array_equal(a.device.ts, b.device.ts)
    assert a.top_level == b.top_level
    bare = tmp_path / "bare.json"  # the bare event array too
    bare.write_bytes(b"\xef\xbb\xbf" + json.dumps(_small_trace(60)["traceEvents"]).encode())
    assert len(read_trace(bare, chunk_bytes=chunk).host) == 120


# --------------------------------------------------------------------------------------------
# Impossible times


def test_impossible_times_are_left_out_and_counted(tmp_path: Path) -> None:
    doc = _small_trace(10)
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    kernels[0]["dur"] = -999_980.0  # "-999.98 ms" of kernel time per step, before
    kernels[1]["dur"] = 1e308  # inf and overflow warnings, before
    kernels[2]["ts"] = 1e300
    ops[0]["ts"] = -5.0
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    trace = read_trace(path)
    assert trace.excluded == {
        NEGATIVE_DURATION: 1,
        NEGATIVE_TIMESTAMP: 1,
        OUTSIDE_SPAN: 2,
    }
    assert trace.counts[f"{EXCLUDED_PREFIX}{OUTSIDE_SPAN}"] == 2
    assert len(trace.device) == 20 - 3 and len(trace.host) == 20 - 1
    for table in (trace.host, trace.device, trace.runtime):
        assert np.all(np.isfinite(table.ts)) and np.all(table.dur >= 0)
        assert float(np.max(table.ts + table.dur)) < 20_000  # the 10 steps' 10 ms
    note = exclusion_note(trace.counts)
    assert note == (
        "4 trace events with impossible times left out of the analysis "
        "(1 negative duration, 1 negative timestamp, 2 time outside the trace span)."
    )
    # The clean twin: nothing left out, nothing said, the same events read.
    path.write_text(json.dumps(_small_trace(10)))
    clean = read_trace(path)
    assert clean.excluded == {} and exclusion_note(clean.counts) is None
    assert len(clean.device) == 20 and set(clean.counts) == {"host", "runtime", "device", "total"}


def test_non_finite_times_are_left_out() -> None:
    """orjson refuses NaN and Infinity, so no file yields them; the check stands for any other
    source of events."""
    tables = (
        {"ts": np.array([0.0, np.nan, 5.0]), "dur": np.array([1.0, 1.0, np.inf])},
        {"ts": np.array([2.0]), "dur": np.array([-1.0])},
    )
    assert _drop_impossible(tables) == {NON_FINITE: 2, NEGATIVE_DURATION: 1}
    assert tables[0]["ts"].tolist() == [0.0] and tables[1]["ts"].size == 0


def test_a_trace_of_only_impossible_times_is_a_clear_error(tmp_path: Path) -> None:
    doc = _small_trace(3)
    for event in doc["traceEvents"]:
        if "dur" in event:
            event["dur"] = -1
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DiagnoseError) as info:
        read_trace(path)
    assert info.value.code == ExitCode.BAD_INPUT
    assert info.value.message == (
        f"{path}: no profiler event has a possible time (left out: 15 negative duration)"
    )


def test_the_trace_command_says_what_was_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU trace with negative kernel durations: analysed without them, without numpy
    warnings, and the report and the terminal say how many were left out."""
    doc = json.loads(gzip.decompress(GPU_TRACE.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    for kernel in kernels[::3]:
        kernel["dur"] = -1e6
    kernels[1]["dur"] = 1e308
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow warning fails the test
        assert main(["trace", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    line = (
        f"{len(kernels[::3]) + 1} trace events with impossible times left out of the analysis "
        f"({len(kernels[::3])} negative duration, 1 time outside the trace span)."
    )
    assert f"note: {line}" in out
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert line in record["notes"]
    assert all(f.get("est_seconds_saved_per_it") or 0 >= 0 for f in record["findings"])
    assert all(v >= 0 for v in record["breakdown"]["seconds"].values())
    # The clean twin says nothing.
    assert main(["trace", str(GPU_TRACE), "--out", str(tmp_path / "clean")]) == 0
    assert "impossible" not in capsys.readouterr().out
