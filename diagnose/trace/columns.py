"""Profiler events into columns: the hot loop of trace reading, and the merge of columns built
in two processes.

:class:`ColumnBuilder` turns each batch of parsed event dicts into numpy columns (one
:class:`ChunkColumns` per batch). Names (and the texts of input types and shapes), threads,
devices and streams are interned into tables in the order they are first seen, and each chunk
remembers how many of each its builder knew before it. That is what lets :func:`merge` rebuild,
from chunks that two builders took turns at, the very tables one builder reading every chunk in
order would have made: the same ids, the same rows in the same order.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.trace.stream import kind as _kind

# Category codes. Values 1-2 are host ranges, 3 runtime/driver calls, 4-6 device activities.
_OP, _ANNOTATION, _RUNTIME, _KERNEL, _MEMCPY, _MEMSET = 1, 2, 3, 4, 5, 6
_CATEGORIES: dict[Any, int] = {
    "cpu_op": _OP,
    "Operator": _OP,
    "operator": _OP,
    "user_annotation": _ANNOTATION,
    "cuda_runtime": _RUNTIME,
    "cuda_driver": _RUNTIME,
    "Runtime": _RUNTIME,
    "runtime": _RUNTIME,
    "hip_runtime": _RUNTIME,
    "kernel": _KERNEL,
    "Kernel": _KERNEL,
    "gpu_memcpy": _MEMCPY,
    "Memcpy": _MEMCPY,
    "gpu_memset": _MEMSET,
    "Memset": _MEMSET,
}

#: Device activity kinds stored in the device table's ``kind`` column.
KERNEL, MEMCPY, MEMSET = 0, 1, 2

_EMPTY_ARGS: dict[str, Any] = {}

#: The prefix torch gives the python_function event of a module's forward.
MODULE_PREFIX = "nn.Module: "

#: One table's columns for one chunk (None: the chunk had no event of that table).
Columns = dict[str, npt.NDArray[Any]] | None
#: A module range: name id, ts, dur, thread id.
ModuleRow = tuple[int, float, float, int]
#: A metadata event kept: kind ("thread_name", ...), pid, tid, value.
#: (kind, pid, tid, value): thread and process names (a str), or the profiler's own window
#: (kind "profiler_window", value (ts, dur) of its "Trace" event).
MetaRow = tuple[str, Any, Any, Any]


@dataclass
class ChunkColumns:
    """One batch of events as columns."""

    host: Columns
    runtime: Columns
    device: Columns
    modules: list[ModuleRow]
    meta: list[MetaRow]
    #: How many names, threads, devices and streams the builder knew before this chunk: the ids
    #: from there on were first seen in it.
    known_before: tuple[int, int, int, int]
    events: int


@dataclass
class BuiltColumns:
    """A builder's tables and chunks (what a worker process sends back)."""

    names: list[str]
    threads: list[tuple[Any, Any]]
    devices: list[Any]
    streams: list[Any]
    chunks: list[ChunkColumns]
    events: int

    def tables(self) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        return self.names, self.threads, self.devices, self.streams

    def concatenated(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The host, runtime, device and module columns of all chunks, in chunk order."""
        chunks = self.chunks
        modules = [row for chunk in chunks for row in chunk.modules]
        module_columns = {
            "name": _ints((m[0] for m in modules), "i"),
            "ts": _floats(m[1] for m in modules),
            "dur": _floats(m[2] for m in modules),
            "thread": _ints((m[3] for m in modules), "i"),
        }
        return (
            _concat([c.host for c in chunks if c.host is not None], HOST_FIELDS),
            _concat([c.runtime for c in chunks if c.runtime is not None], RUNTIME_FIELDS),
            _concat([c.device for c in chunks if c.device is not None], DEVICE_FIELDS),
            module_columns,
        )

    def meta(self) -> list[MetaRow]:
        return [row for chunk in self.chunks for row in chunk.meta]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ColumnBuilder:
    """Turns batches of event dicts into columns, one :class:`ChunkColumns` per batch; names,
    threads, devices and streams are interned in the order they are first seen."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._name_ids: dict[str, int] = {}
        self._names: list[str] = []
        self._thread_ids: dict[tuple[Any, Any], int] = {}
        self._threads: list[tuple[Any, Any]] = []
        self._device_ids: dict[Any, int] = {}
        self._devices: list[Any] = []
        self._stream_ids: dict[Any, int] = {}
        self._streams: list[Any] = []
        self._list_ids: dict[tuple[Any, ...], int] = {}
        self._dims_ids: dict[bytes, int] = {}
        self._meta: list[MetaRow] = []
        self._modules: list[tuple[int, float, float, int]] = []
        self._chunks: list[ChunkColumns] = []
        self._seen = 0

    def built(self) -> BuiltColumns:
        """What was added so far (shared, not copied)."""
        return BuiltColumns(
            self._names, self._threads, self._devices, self._streams, self._chunks, self._seen
        )

    # -- interning (only on first sight; the hot loop does dict.get)

    def _intern(self, text: Any) -> int:
        if not isinstance(text, str):
            raise TypeError("name")
        index = len(self._names)
        self._names.append(text)
        self._name_ids[text] = index
        return index

    def _thread(self, key: tuple[Any, Any]) -> int:
        index = len(self._threads)
        self._threads.append(key)
        self._thread_ids[key] = index
        return index

    def _types(self, values: Any) -> int:
        if type(values) is not list:
            return -1
        key = tuple(values)
        index = self._list_ids.get(key)
        if index is None:
            text = ", ".join(v if isinstance(v, str) else str(v) for v in values)
            index = self._name_ids.get(text)
            if index is None:
                index = self._intern(text)
            self._list_ids[key] = index
        return index

    def _dims(self, values: Any) -> int:
        if type(values) is not list:
            return -1
        key = orjson.dumps(values)
        index = self._dims_ids.get(key)
        if index is None:
            text = key.decode()
            index = self._name_ids.get(text)
            if index is None:
                index = self._intern(text)
            self._dims_ids[key] = index
        return index

    def _small_id(self, table: dict[Any, int], values: list[Any], key: Any) -> int:
        index = table.get(key)
        if index is None:
            index = len(values)
            values.append(key)
            table[key] = index
        return index

    # -- the hot loop

    def add(self, events: list[Any]) -> None:
        firsts = (len(self._names), len(self._threads), len(self._devices), len(self._streams))
        self._modules, self._meta = [], []
        try:
            host, runtime, device = self._add(events)
        except (TypeError, AttributeError, ValueError, KeyError, OverflowError):
            raise DiagnoseError(
                f"{self._label}: {_first_bad_event(events, self._seen)}", ExitCode.BAD_INPUT
            ) from None
        self._seen += len(events)
        self._chunks.append(
            ChunkColumns(host, runtime, device, self._modules, self._meta, firsts, len(events))
        )

    def _add(self, events: list[Any]) -> tuple[Columns, Columns, Columns]:
        # One tuple per kept event, transposed into columns at the end of the batch: fewer
        # Python-level calls per event than appending to eight column lists.
        categories = _CATEGORIES.get
        name_ids = self._name_ids.get
        thread_ids = self._thread_ids.get
        device_ids = self._device_ids.get
        stream_ids = self._stream_ids.get
        list_ids = self._list_ids.get
        dims_ids = self._dims_ids.get
        dumps = orjson.dumps
        host_rows: list[tuple[Any, ...]] = []
        runtime_rows: list[tuple[Any, ...]] = []
        device_rows: list[tuple[Any, ...]] = []
        add_host, add_runtime, add_device = (
            host_rows.append,
            runtime_rows.append,
            device_rows.append,
        )
        empty = _EMPTY_ARGS
        nan = float("nan")
        for event in events:
            cat = event.get("cat")
            code = categories(cat)
            if code is None:
                if cat is None and event.get("ph") == "M":
                    self._metadata(event)
                elif cat == "python_function":
                    self._module(event)
                elif cat == "Trace":
                    self._profiler_window(event)
                continue
            if event.get("ph") != "X":
                continue
            name = event["name"]
            nid = name_ids(name)
            if nid is None:
                nid = self._intern(name)
            args = event.get("args")
            if args is None:
                args = empty
            ext = args.get("External id")
            if ext is None:
                ext = args.get("external id", -1)
            if code >= _KERNEL:
                dev = args.get("device")
                if dev is None:
                    dev = event.get("pid")
                dev_id = device_ids(dev)
                if dev_id is None:
                    dev_id = self._small_id(self._device_ids, self._devices, dev)
                stream = args.get("stream")
                if stream is None:
                    stream = event.get("tid")
                stream_id = stream_ids(stream)
                if stream_id is None:
                    stream_id = self._small_id(self._stream_ids, self._streams, stream)
                add_device(
                    (
                        code - _KERNEL,
                        nid,
                        event["ts"],
                        event.get("dur", 0),
                        dev_id,
                        stream_id,
                        args.get("correlation", -1),
                        ext,
                    )
                )
                continue
            key = (event.get("pid"), event.get("tid"))
            thread = thread_ids(key)
            if thread is None:
                thread = self._thread(key)
            if code == _RUNTIME:
                add_runtime(
                    (
                        nid,
                        event["ts"],
                        event.get("dur", 0),
                        thread,
                        ext,
                        args.get("correlation", -1),
                    )
                )
                continue
            input_types = args.get("Input type")
            flops = args.get("flops")
            if type(flops) is not int and type(flops) is not float:
                flops = nan
            if input_types is None:
                types_id = dims_id = concrete_id = -1
            else:
                # Cache hits inline; the methods intern first sightings. Non-lists: ignored.
                types_id = dims_id = concrete_id = -1
                if type(input_types) is list:
                    cached = list_ids(tuple(input_types))
                    types_id = self._types(input_types) if cached is None else cached
                dims = args.get("Input Dims")
                if type(dims) is list:
                    cached = dims_ids(dumps(dims))
                    dims_id = self._dims(dims) if cached is None else cached
                concrete = args.get("Concrete Inputs")
                if type(concrete) is list:
                    cached = dims_ids(dumps(concrete))
                    concrete_id = self._dims(concrete) if cached is None else cached
            add_host(
                (
                    nid,
                    code == _ANNOTATION,
                    event["ts"],
                    event.get("dur", 0),
                    thread,
                    ext,
                    types_id,
                    dims_id,
                    concrete_id,
                    flops,
                )
            )
        host = runtime = device = None
        if host_rows:
            name, ann, ts, dur, thread_col, ext_col, types, dims, concrete_col, flops_col = zip(
                *host_rows, strict=True
            )
            host = {
                "name": _ints(name, "i"),
                "is_annotation": np.array(ann, dtype=bool),
                "ts": _floats(ts),
                "dur": _floats(dur),
                "thread": _ints(thread_col, "i"),
                "ext_id": _ints(ext_col, "q"),
                "input_types": _ints(types, "i"),
                "input_dims": _ints(dims, "i"),
                "concrete_inputs": _ints(concrete_col, "i"),
                "flops": _floats(flops_col),
            }
        if runtime_rows:
            name, ts, dur, thread_col, ext_col, corr = zip(*runtime_rows, strict=True)
            runtime = {
                "name": _ints(name, "i"),
                "ts": _floats(ts),
                "dur": _floats(dur),
                "thread": _ints(thread_col, "i"),
                "ext_id": _ints(ext_col, "q"),
                "correlation": _ints(corr, "q"),
            }
        if device_rows:
            kind, name, ts, dur, dev_col, stream_col, corr, ext_col = zip(*device_rows, strict=True)
            device = {
                "kind": np.array(kind, dtype=np.int8),
                "name": _ints(name, "i"),
                "ts": _floats(ts),
                "dur": _floats(dur),
                "device": _ints(dev_col, "i"),
                "stream": _ints(stream_col, "i"),
                "correlation": _ints(corr, "q"),
                "ext_id": _ints(ext_col, "q"),
            }
        return host, runtime, device

    def _module(self, event: dict[str, Any]) -> None:
        name = event.get("name")
        if not (isinstance(name, str) and name.startswith(MODULE_PREFIX)) or event.get("ph") != "X":
            return
        ts: Any = event.get("ts")
        dur: Any = event.get("dur", 0)
        key = (event.get("pid"), event.get("tid"))
        # Module ranges only enrich the analysis: a malformed one is skipped, never fatal.
        if not (_is_number(ts) and _is_number(dur)):
            return
        if isinstance(key[0], (list, dict)) or isinstance(key[1], (list, dict)):
            return
        nid = self._name_ids.get(name)
        if nid is None:
            nid = self._intern(name)
        thread = self._thread_ids.get(key)
        if thread is None:
            thread = self._thread(key)
        self._modules.append((nid, float(ts), float(dur), thread))

    def _profiler_window(self, event: dict[str, Any]) -> None:
        """The span torch.profiler recorded in ("PyTorch Profiler (0)"): ranges still open when it
        stopped end after it."""
        ts, dur = event.get("ts"), event.get("dur")
        if isinstance(ts, (int, float)) and isinstance(dur, (int, float)) and dur >= 0:
            self._meta.append(("profiler_window", None, None, (float(ts), float(dur))))

    def _metadata(self, event: dict[str, Any]) -> None:
        kind = event.get("name")
        if kind not in ("thread_name", "process_name", "process_labels"):
            return
        args = event.get("args")
        if not isinstance(args, dict):
            return
        value = args.get("name", args.get("labels"))
        if isinstance(value, str):
            self._meta.append((kind, event.get("pid"), event.get("tid"), value))


# -- merging -------------------------------------------------------------------------------------


class _Table:
    """A merged table of names (or threads, devices, streams) and the ids given out."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.ids: dict[Any, int] = {}

    def take(self, values: Sequence[Any], renumbered: list[int]) -> None:
        """Give merged ids to the values of one side from ``len(renumbered)`` on."""
        for value in values[len(renumbered) :]:
            index = self.ids.get(value)
            if index is None:
                index = len(self.values)
                self.values.append(value)
                self.ids[value] = index
            renumbered.append(index)


def _renumber(column: npt.NDArray[Any], ids: list[int]) -> npt.NDArray[Any]:
    # The lookup ends with -1, so an id of -1 ("none") stays -1.
    lookup = np.array([*ids, -1], dtype=column.dtype)
    return np.take(lookup, column)


def merge(order: Sequence[tuple[BuiltColumns, int]]) -> BuiltColumns:
    """The columns of chunks that several builders read, as one builder reading them in ``order``
    would have made them. Each item names a builder's columns and one of its chunks; each
    builder's chunks must come in its own order."""
    tables = (_Table(), _Table(), _Table(), _Table())
    # Per side: merged id of each of its ids, for names, threads, devices, streams.
    sides: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
    chunks: list[ChunkColumns] = []
    for built, index in order:
        ids = sides.setdefault(id(built), ([], [], [], []))
        chunk = built.chunks[index]
        after = (
            built.chunks[index + 1].known_before
            if index + 1 < len(built.chunks)
            else tuple(len(t) for t in built.tables())
        )
        before = tuple(len(t.values) for t in tables)
        for table, values, renumbered, seen, end in zip(
            tables, built.tables(), ids, chunk.known_before, after, strict=True
        ):
            if len(renumbered) != seen:
                raise ValueError("a builder's chunks were merged out of their order")
            table.take(values[:end], renumbered)
        names, threads, devices, streams = ids
        host, runtime, device = chunk.host, chunk.runtime, chunk.device
        if host is not None:
            host = dict(host)
            for key in ("name", "input_types", "input_dims", "concrete_inputs"):
                host[key] = _renumber(host[key], names)
            host["thread"] = _renumber(host["thread"], threads)
        if runtime is not None:
            runtime = dict(runtime)
            runtime["name"] = _renumber(runtime["name"], names)
            runtime["thread"] = _renumber(runtime["thread"], threads)
        if device is not None:
            device = dict(device)
            device["name"] = _renumber(device["name"], names)
            device["device"] = _renumber(device["device"], devices)
            device["stream"] = _renumber(device["stream"], streams)
        modules = [(names[n], ts, dur, threads[t]) for n, ts, dur, t in chunk.modules]
        known = (before[0], before[1], before[2], before[3])
        chunks.append(ChunkColumns(host, runtime, device, modules, chunk.meta, known, chunk.events))
    merged = [t.values for t in tables]
    events = sum(c.events for c in chunks)
    return BuiltColumns(merged[0], merged[1], merged[2], merged[3], chunks, events)


# -- columns -------------------------------------------------------------------------------------


HOST_FIELDS: dict[str, Any] = {
    "name": np.int32,
    "is_annotation": np.bool_,
    "ts": np.float64,
    "dur": np.float64,
    "thread": np.int32,
    "ext_id": np.int64,
    "input_types": np.int32,
    "input_dims": np.int32,
    "concrete_inputs": np.int32,
    "flops": np.float64,
}
RUNTIME_FIELDS: dict[str, Any] = {
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "thread": np.int32,
    "ext_id": np.int64,
    "correlation": np.int64,
}
MODULE_FIELDS: dict[str, Any] = {
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "thread": np.int32,
}
DEVICE_FIELDS: dict[str, Any] = {
    "kind": np.int8,
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "device": np.int32,
    "stream": np.int32,
    "correlation": np.int64,
    "ext_id": np.int64,
}


def empty_columns(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: np.empty(0, dtype=dtype) for key, dtype in fields.items()}


def _concat(chunks: list[dict[str, npt.NDArray[Any]]], fields: dict[str, Any]) -> dict[str, Any]:
    if not chunks:
        return {key: np.empty(0, dtype=dtype) for key, dtype in fields.items()}
    return {key: np.concatenate([c[key] for c in chunks]) for key in fields}


def _floats(values: Iterable[float]) -> npt.NDArray[np.float64]:
    # array("d") rejects strings, None and containers (TypeError), unlike np.array(dtype=float).
    return np.frombuffer(array("d", values), dtype=np.float64)


def _ints(values: Iterable[int], code: str) -> npt.NDArray[Any]:
    dtype = np.int32 if code == "i" else np.int64
    return np.frombuffer(array(code, values), dtype=dtype)


def _first_bad_event(events: Any, offset: int) -> str:
    """A one-line description of the first event whose fields have the wrong types."""
    if not isinstance(events, list):
        return f"traceEvents is a {_kind(events)}, not a list"
    for position, event in enumerate(events):
        where = f"event {offset + position}"
        if not isinstance(event, dict):
            return f"{where} is a {_kind(event)}, not an object"
        cat = event.get("cat")
        if isinstance(cat, (list, dict)):
            return f"{where}: field 'cat' is a {_kind(cat)}, expected a string"
        code = _CATEGORIES.get(cat)
        if code is None or event.get("ph") != "X":
            continue
        if "name" not in event:
            return f"{where}: no 'name' field"
        if not isinstance(event["name"], str):
            return f"{where}: field 'name' is a {_kind(event['name'])}, expected a string"
        for key in ("ts", "dur"):
            if key not in event:
                if key == "ts":
                    return f"{where}: no 'ts' field"
                continue
            value = event[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{where}: field '{key}' is a {_kind(value)}, expected a number"
        for key in ("pid", "tid"):
            value = event.get(key)
            if isinstance(value, (list, dict)):
                return f"{where}: field '{key}' is a {_kind(value)}, expected a number or string"
        args = event.get("args")
        if args is not None and not isinstance(args, dict):
            return f"{where}: field 'args' is a {_kind(args)}, expected an object"
        for key in ("External id", "external id", "correlation"):
            value = (args or {}).get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                return f"{where}: args field '{key}' is a {_kind(value)}, expected an integer"
            if value is not None and not -(1 << 63) <= value < 1 << 63:
                return f"{where}: args field '{key}' is {value}, beyond a 64-bit integer"
        types = (args or {}).get("Input type")
        if isinstance(types, list) and any(isinstance(v, (list, dict)) for v in types):
            return f"{where}: args field 'Input type' holds a list or object, expected strings"
        for key in ("device", "stream"):
            value = (args or {}).get(key)
            if isinstance(value, (list, dict)):
                return f"{where}: args field '{key}' is a {_kind(value)}, expected a number"
    return "events with fields of the wrong types"
