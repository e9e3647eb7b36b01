"""Read a Chrome/Kineto profiler trace (plain or gzip) into compact columnar tables.

Both trace schemas torch.profiler has written are read: the current one (``cpu_op``, ``kernel``,
``cuda_runtime``, ``cuda_driver``, ``gpu_memcpy``, ``gpu_memset``, ``user_annotation``) and the
2021 one (``Operator``, ``Kernel``, ``Runtime``, ``Memcpy``, ``Memset``). Categories the analysis
does not use (``python_function``, ``gpu_user_annotation``, flows, instant events, ...) and unknown
fields are skipped.

Memory: traces can be hundreds of MB. The raw event dicts never outlive one batch: a file is read
in chunks (``chunk_bytes``, see :mod:`diagnose.trace.stream`, which also bounds gzip expansion),
each chunk's complete events are parsed with orjson, copied into per-batch Python lists of plain
numbers, turned into numpy arrays, and dropped. Names are interned into one string table, so a
kernel name seen 10,000 times is stored once.

Impossible times (NaN or infinite, a negative duration or timestamp, an event lasting or lying
more than a day from the rest of the trace) are not analysed: such events are left out and
counted by reason in :attr:`ParsedTrace.excluded`.
"""

from __future__ import annotations

import gc
import gzip
import zlib
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.trace.stream import EventStream, ReadLimits, one_line, open_trace
from diagnose.trace.stream import kind as _kind

IntArray = npt.NDArray[np.int32]
LongArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: Bytes of JSON parsed per batch. The parsed dicts of one batch take about ten times this, so
#: peak memory is roughly the columnar tables plus ten chunks, whatever the file size.
CHUNK_BYTES = 4 << 20

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

#: Device activity kinds stored in :attr:`DeviceTable.kind`.
KERNEL, MEMCPY, MEMSET = 0, 1, 2

_EMPTY_ARGS: dict[str, Any] = {}


@dataclass(frozen=True)
class HostTable:
    """CPU-side ranges: operators (``cpu_op``) and record_function ranges (``user_annotation``)."""

    name: IntArray
    is_annotation: BoolArray
    ts: FloatArray  # microseconds since the trace's first event
    dur: FloatArray
    thread: IntArray  # index into ParsedTrace.threads
    ext_id: LongArray  # -1 when absent
    input_types: IntArray  # index into ParsedTrace.names ("float, c10::BFloat16, ..."), -1
    input_dims: IntArray  # index into ParsedTrace.names (JSON text of "Input Dims"), -1
    #: index into ParsedTrace.names (JSON text of "Concrete Inputs": the values of the op's int,
    #: bool and list arguments, recorded by torch >= 2.1 with record_shapes), -1
    concrete_inputs: IntArray
    #: the op's "flops" arg (torch.profiler with_flops, where the exporter writes it), NaN if none
    flops: FloatArray

    def __len__(self) -> int:
        return int(self.name.size)

    @property
    def end(self) -> FloatArray:
        return self.ts + self.dur


@dataclass(frozen=True)
class RuntimeTable:
    """CUDA/HIP runtime and driver API calls on the host."""

    name: IntArray
    ts: FloatArray
    dur: FloatArray
    thread: IntArray
    ext_id: LongArray
    correlation: LongArray

    def __len__(self) -> int:
        return int(self.name.size)


@dataclass(frozen=True)
class DeviceTable:
    """Work on the accelerator: kernels, memcpys, memsets."""

    kind: npt.NDArray[np.int8]  # KERNEL, MEMCPY or MEMSET
    name: IntArray
    ts: FloatArray
    dur: FloatArray
    device: IntArray  # index into ParsedTrace.devices
    stream: IntArray  # index into ParsedTrace.streams
    correlation: LongArray
    ext_id: LongArray

    def __len__(self) -> int:
        return int(self.name.size)


@dataclass(frozen=True)
class ModuleTable:
    """``nn.Module: <Class>_<n>`` ranges (python_function events of with_stack/with_modules)."""

    name: IntArray
    ts: FloatArray
    dur: FloatArray
    thread: IntArray  # index into ParsedTrace.threads, as for the host ops

    def __len__(self) -> int:
        return int(self.name.size)


#: The prefix torch gives the python_function event of a module's forward.
MODULE_PREFIX = "nn.Module: "


@dataclass
class ParsedTrace:
    """A trace in columnar form; ``names`` is the string table that all ``name`` columns index."""

    path: str
    names: list[str]
    host: HostTable
    runtime: RuntimeTable
    device: DeviceTable
    #: (pid, tid) of each thread index, as written in the trace.
    threads: list[tuple[Any, Any]]
    thread_names: dict[int, str]
    #: Raw device ids (``args.device`` or the pid of the device row) of each device index.
    devices: list[Any]
    streams: list[Any]
    #: Top-level JSON fields other than traceEvents (versions, deviceProperties, distributedInfo).
    top_level: dict[str, Any]
    #: "process_labels"/"process_name" metadata per pid (e.g. "GPU 0", "CPU").
    process_labels: dict[Any, str]
    #: Absolute timestamp (microseconds) that the ``ts`` columns are relative to.
    base_us: float
    event_count: int
    #: True when the file was read in more than one chunk.
    streamed: bool = False
    #: Events per table ("host", "runtime", "device", "total"), and per reason for leaving an event
    #: out ("excluded: negative duration", ...; only reasons that occurred).
    counts: dict[str, int] = field(default_factory=dict)
    #: Events left out because their times are impossible, by reason (see EXCLUSION_REASONS).
    excluded: dict[str, int] = field(default_factory=dict)
    #: Module forward ranges; empty unless the trace was captured with with_stack/with_modules.
    modules: ModuleTable = field(default_factory=lambda: ModuleTable(**_concat([], _MODULE_FIELDS)))

    def name_of(self, index: int) -> str:
        return self.names[index] if index >= 0 else ""


def read_trace(
    path: Path, *, chunk_bytes: int = CHUNK_BYTES, limits: ReadLimits | None = None
) -> ParsedTrace:
    """Read ``path`` (``.json`` or gzip, detected by content) into a :class:`ParsedTrace`.

    Raises ``DiagnoseError(BAD_INPUT)`` with a one-line message naming the file for anything that
    is not a readable profiler trace, including a gzip file that expands past ``limits``
    (default: :meth:`ReadLimits.from_env`).
    """
    label = str(path)
    if not path.exists():
        raise DiagnoseError(f"{label}: no such file", ExitCode.BAD_INPUT)
    if path.is_dir():
        raise DiagnoseError(f"{label}: is a directory, not a trace file", ExitCode.BAD_INPUT)
    limits = limits if limits is not None else ReadLimits.from_env()
    builder = _Builder(label)
    # orjson builds millions of dicts and lists; the cyclic GC would scan them over and over while
    # they are alive (3x slower) although they hold no cycles. Pause it while reading.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        opened, compressed = open_trace(path)
        with opened as stream:
            events_stream = EventStream(
                stream,
                max(chunk_bytes, 1 << 10),
                label,
                compressed=compressed,
                limits=limits,
            )
            for batch in events_stream.batches():
                builder.add(batch)
                del batch  # free this batch's dicts before the next one is parsed
            top_level = events_stream.top_level
            streamed = events_stream.streamed
    except DiagnoseError:
        raise
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DiagnoseError(
            f"{label}: truncated or corrupt gzip data ({one_line(exc)})", ExitCode.BAD_INPUT
        ) from None
    except OSError as exc:
        raise DiagnoseError(f"{label}: cannot read: {one_line(exc)}", ExitCode.BAD_INPUT) from None
    finally:
        if gc_was_enabled:
            gc.enable()
    return builder.finish(top_level, streamed)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Builder:
    """Accumulates batches of event dicts into numpy chunks; ``finish`` builds the tables."""

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
        self._meta: list[tuple[str, Any, Any, str]] = []
        self._host: list[dict[str, npt.NDArray[Any]]] = []
        self._runtime: list[dict[str, npt.NDArray[Any]]] = []
        self._device: list[dict[str, npt.NDArray[Any]]] = []
        self._modules: list[tuple[int, float, float, int]] = []
        self._seen = 0

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
        try:
            self._add(events)
        except (TypeError, AttributeError, ValueError, KeyError, OverflowError):
            raise DiagnoseError(
                f"{self._label}: {_first_bad_event(events, self._seen)}", ExitCode.BAD_INPUT
            ) from None
        self._seen += len(events)

    def _add(self, events: list[Any]) -> None:
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
        if host_rows:
            name, ann, ts, dur, thread_col, ext_col, types, dims, concrete_col, flops_col = zip(
                *host_rows, strict=True
            )
            self._host.append(
                {
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
            )
        if runtime_rows:
            name, ts, dur, thread_col, ext_col, corr = zip(*runtime_rows, strict=True)
            self._runtime.append(
                {
                    "name": _ints(name, "i"),
                    "ts": _floats(ts),
                    "dur": _floats(dur),
                    "thread": _ints(thread_col, "i"),
                    "ext_id": _ints(ext_col, "q"),
                    "correlation": _ints(corr, "q"),
                }
            )
        if device_rows:
            kind, name, ts, dur, dev_col, stream_col, corr, ext_col = zip(*device_rows, strict=True)
            self._device.append(
                {
                    "kind": np.array(kind, dtype=np.int8),
                    "name": _ints(name, "i"),
                    "ts": _floats(ts),
                    "dur": _floats(dur),
                    "device": _ints(dev_col, "i"),
                    "stream": _ints(stream_col, "i"),
                    "correlation": _ints(corr, "q"),
                    "ext_id": _ints(ext_col, "q"),
                }
            )

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

    # -- tables

    def finish(self, top_level: dict[str, Any], streamed: bool) -> ParsedTrace:
        if self._seen == 0:
            raise DiagnoseError(f"{self._label}: the trace has no events", ExitCode.BAD_INPUT)
        host = _concat(self._host, _HOST_FIELDS)
        runtime = _concat(self._runtime, _RUNTIME_FIELDS)
        device = _concat(self._device, _DEVICE_FIELDS)
        self._host = self._runtime = self._device = []
        modules = _concat(
            [
                {
                    "name": _ints((m[0] for m in self._modules), "i"),
                    "ts": _floats(m[1] for m in self._modules),
                    "dur": _floats(m[2] for m in self._modules),
                    "thread": _ints((m[3] for m in self._modules), "i"),
                }
            ]
            if self._modules
            else [],
            _MODULE_FIELDS,
        )
        self._modules = []
        had_events = bool(host["name"].size or runtime["name"].size or device["name"].size)
        excluded = _drop_impossible((host, runtime, device, modules))
        if not (host["name"].size or runtime["name"].size or device["name"].size):
            if had_events:
                raise DiagnoseError(
                    f"{self._label}: no profiler event has a possible time "
                    f"(left out: {describe_exclusions(excluded)})",
                    ExitCode.BAD_INPUT,
                )
            raise DiagnoseError(
                f"{self._label}: the trace has no profiler events "
                "(no cpu_op, user_annotation, kernel, memcpy or runtime events)",
                ExitCode.BAD_INPUT,
            )
        base = float(min(float(np.min(t["ts"])) for t in (host, runtime, device) if t["ts"].size))
        tables = []
        for columns in (host, runtime, device, modules):
            columns["ts"] = columns["ts"] - base
            ts = columns["ts"]
            if ts.size and not bool(np.all(ts[1:] >= ts[:-1])):
                order = np.argsort(ts, kind="stable")
                for key in columns:
                    columns[key] = columns[key][order]
            tables.append(columns)
        thread_names: dict[int, str] = {}
        process_labels: dict[Any, str] = {}
        for kind, pid, tid, value in self._meta:
            if kind == "thread_name":
                index = self._thread_ids.get((pid, tid))
                if index is None and isinstance(tid, str) and tid.isdigit():
                    index = self._thread_ids.get((pid, int(tid)))
                if index is not None:
                    thread_names[index] = value
            elif kind == "process_labels" or pid not in process_labels:
                process_labels[pid] = value
        return ParsedTrace(
            path=self._label,
            names=self._names,
            host=HostTable(**tables[0]),
            runtime=RuntimeTable(**tables[1]),
            device=DeviceTable(**tables[2]),
            threads=self._threads,
            thread_names=thread_names,
            devices=self._devices,
            streams=self._streams,
            top_level=top_level,
            process_labels=process_labels,
            base_us=base,
            event_count=self._seen,
            streamed=streamed,
            modules=ModuleTable(**tables[3]),
            counts={
                "host": int(tables[0]["name"].size),
                "runtime": int(tables[1]["name"].size),
                "device": int(tables[2]["name"].size),
                "total": self._seen,
                # Mirrored here because the counts travel into the record's trace metadata.
                **{f"{EXCLUDED_PREFIX}{reason}": n for reason, n in excluded.items()},
            },
            excluded=excluded,
        )


#: Why an event's times are impossible, tested in this order (an event counts under the first).
NON_FINITE = "non-finite time"
NEGATIVE_DURATION = "negative duration"
NEGATIVE_TIMESTAMP = "negative timestamp"
OUTSIDE_SPAN = "time outside the trace span"
EXCLUSION_REASONS = (NON_FINITE, NEGATIVE_DURATION, NEGATIVE_TIMESTAMP, OUTSIDE_SPAN)
#: Prefix of the per-reason keys in :attr:`ParsedTrace.counts`.
EXCLUDED_PREFIX = "excluded: "
#: No profiler trace spans a day (a minute of a GPU trace is hundreds of MB): an event lasting
#: longer, or starting further than this from the median event, is a corrupt value such as 1e308,
#: which would otherwise overflow every sum it enters. Microseconds.
_MAX_SPAN_US = 86_400e6


def _drop_impossible(tables: tuple[dict[str, Any], ...]) -> dict[str, int]:
    """Remove, in place, the events of ``tables`` whose ts/dur are impossible; count them by
    reason (only reasons that occurred)."""
    codes: list[npt.NDArray[np.int8]] = []
    for columns in tables:
        ts, dur = columns["ts"], columns["dur"]
        code = np.zeros(ts.size, dtype=np.int8)
        code[~(np.isfinite(ts) & np.isfinite(dur))] = 1 + EXCLUSION_REASONS.index(NON_FINITE)
        code[(code == 0) & (dur < 0)] = 1 + EXCLUSION_REASONS.index(NEGATIVE_DURATION)
        code[(code == 0) & (ts < 0)] = 1 + EXCLUSION_REASONS.index(NEGATIVE_TIMESTAMP)
        codes.append(code)
    starts = np.concatenate([c["ts"][code == 0] for c, code in zip(tables, codes, strict=True)])
    if starts.size:
        # The median start is the trace's centre whatever a few corrupt events say.
        centre = float(np.median(starts))
        for columns, code in zip(tables, codes, strict=True):
            far = (np.abs(columns["ts"] - centre) > _MAX_SPAN_US) | (columns["dur"] > _MAX_SPAN_US)
            code[(code == 0) & far] = 1 + EXCLUSION_REASONS.index(OUTSIDE_SPAN)
    excluded: dict[str, int] = {}
    for index, reason in enumerate(EXCLUSION_REASONS, start=1):
        count = sum(int(np.count_nonzero(code == index)) for code in codes)
        if count:
            excluded[reason] = count
    if excluded:
        for columns, code in zip(tables, codes, strict=True):
            keep = code == 0
            for key in columns:
                columns[key] = columns[key][keep]
    return excluded


def describe_exclusions(excluded: Mapping[str, int]) -> str:
    """``{"negative duration": 3, ...}`` as "3 negative duration, ..." (reasons in test order)."""
    return ", ".join(f"{excluded[r]:,} {r}" for r in EXCLUSION_REASONS if excluded.get(r))


def exclusion_note(counts: Mapping[str, Any]) -> str | None:
    """One line for the reader about the events left out, from :attr:`ParsedTrace.counts` (or the
    trace metadata's copy of it in a record); None when none were."""
    excluded = {
        key.removeprefix(EXCLUDED_PREFIX): value
        for key, value in counts.items()
        if key.startswith(EXCLUDED_PREFIX) and isinstance(value, int)
    }
    total = sum(excluded.values())
    if not total:
        return None
    return (
        f"{total:,} trace event{'s' if total != 1 else ''} with impossible times left out of the "
        f"analysis ({describe_exclusions(excluded)})."
    )


_HOST_FIELDS: dict[str, Any] = {
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
_RUNTIME_FIELDS: dict[str, Any] = {
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "thread": np.int32,
    "ext_id": np.int64,
    "correlation": np.int64,
}
_MODULE_FIELDS: dict[str, Any] = {
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "thread": np.int32,
}
_DEVICE_FIELDS: dict[str, Any] = {
    "kind": np.int8,
    "name": np.int32,
    "ts": np.float64,
    "dur": np.float64,
    "device": np.int32,
    "stream": np.int32,
    "correlation": np.int64,
    "ext_id": np.int64,
}


def _concat(chunks: list[dict[str, npt.NDArray[Any]]], fields: dict[str, Any]) -> dict[str, Any]:
    if not chunks:
        return {key: np.empty(0, dtype=dtype) for key, dtype in fields.items()}
    return {key: np.concatenate([c[key] for c in chunks]) for key in fields}


def _floats(values: Iterable[float]) -> FloatArray:
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
