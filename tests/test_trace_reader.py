"""The trace reader: schemas, gzip, chunked (streaming) reading, one-line errors on bad input."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.trace.reader import KERNEL, MEMCPY, read_trace


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


def test_missing_file_and_directory(tmp_path: Path) -> None:
    for path, expected in ((tmp_path / "nope.json", "no such file"), (tmp_path, "directory")):
        with pytest.raises(DiagnoseError) as info:
            read_trace(path)
        assert info.value.code == ExitCode.BAD_INPUT
        assert str(path) in str(info.value) and expected in str(info.value)
