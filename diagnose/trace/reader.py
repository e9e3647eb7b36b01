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
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.trace.columns import (
    MODULE_FIELDS,
    BuiltColumns,
    ColumnBuilder,
    empty_columns,
)
from diagnose.trace.parallel_read import (
    ReadColumns,
    SecondReader,
    read_in_two_processes,
    worth_a_second_process,
)
from diagnose.trace.stream import CORRUPT_GZIP, EventStream, ReadLimits, one_line, open_trace

IntArray = npt.NDArray[np.int32]
LongArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: Bytes of JSON parsed per batch. The parsed dicts of one batch take about ten times this, so
#: peak memory is roughly the columnar tables plus ten chunks, whatever the file size.
CHUNK_BYTES = 4 << 20


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
    #: When torch.profiler stopped (relative, as ``ts``), from its own "Trace" event; None when
    #: the trace has none. A range still open then ends after it.
    profiler_stop_us: float | None
    event_count: int
    #: True when the file was read in more than one chunk.
    streamed: bool = False
    #: Events per table ("host", "runtime", "device", "total"), and per reason for leaving an event
    #: out ("excluded: negative duration", ...; only reasons that occurred).
    counts: dict[str, int] = field(default_factory=dict)
    #: Events left out because their times are impossible, by reason (see EXCLUSION_REASONS).
    excluded: dict[str, int] = field(default_factory=dict)
    #: Pieces of the file each process parsed: one number when one process read it, two when a
    #: second process shared the work (see diagnose.trace.parallel_read).
    pieces_read: tuple[int, ...] = ()
    #: Module forward ranges; empty unless the trace was captured with with_stack/with_modules.
    modules: ModuleTable = field(
        default_factory=lambda: ModuleTable(**empty_columns(MODULE_FIELDS))
    )

    def name_of(self, index: int) -> str:
        return self.names[index] if index >= 0 else ""


def read_trace(
    path: Path,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    limits: ReadLimits | None = None,
    parallel: bool | None = None,
    ahead: SecondReader | None = None,
) -> ParsedTrace:
    """Read ``path`` (``.json`` or gzip, detected by content) into a :class:`ParsedTrace`.

    Raises ``DiagnoseError(BAD_INPUT)`` with a one-line message naming the file for anything that
    is not a readable profiler trace, including a gzip file that expands past ``limits``
    (default: :meth:`ReadLimits.from_env`).

    ``parallel``: read with a second process (see :mod:`diagnose.trace.parallel_read`); None
    decides by the file's size and this machine. The tables are the same either way. ``ahead``:
    the second process :func:`read_ahead` started on this file.
    """
    label = str(path)
    if not path.exists():
        raise DiagnoseError(f"{label}: no such file", ExitCode.BAD_INPUT)
    if path.is_dir():
        raise DiagnoseError(f"{label}: is a directory, not a trace file", ExitCode.BAD_INPUT)
    limits = limits if limits is not None else ReadLimits.from_env()
    chunk_bytes = max(chunk_bytes, 1 << 10)
    # orjson builds millions of dicts and lists; the cyclic GC would scan them over and over while
    # they are alive (3x slower) although they hold no cycles. Pause it while reading.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        read = None
        if ahead is not None and (ahead.path, ahead.chunk_bytes) == (path, chunk_bytes):
            read = ahead.finish(label)
        elif ahead is not None:
            ahead.stop()  # started on another file or chunk size: not ours to use
        if read is None and (
            parallel
            or (parallel is None and ahead is None and worth_a_second_process(path, chunk_bytes))
        ):
            read = read_in_two_processes(path, label, chunk_bytes, limits)
        if read is None:
            read = _read_in_this_process(path, label, chunk_bytes, limits)
    finally:
        if gc_was_enabled:
            gc.enable()
    built, top_level, streamed, pieces_read = read
    return _tables(built, label, top_level, streamed, pieces_read)


def read_ahead(path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> SecondReader | None:
    """Start a second process reading ``path`` now, where that pays, for ``read_trace(path,
    ahead=...)`` to read along and merge: a command imports the analysis meanwhile. The caller
    calls ``stop()`` on it if it does not read the trace after all."""
    path = Path(path)
    if not path.is_file() or not worth_a_second_process(path, chunk_bytes):
        return None
    return SecondReader.start(path, chunk_bytes, ReadLimits.from_env())


def _read_in_this_process(
    path: Path, label: str, chunk_bytes: int, limits: ReadLimits
) -> ReadColumns:
    builder = ColumnBuilder(label)
    try:
        opened, compressed = open_trace(path)
        with opened as stream:
            events_stream = EventStream(
                stream, chunk_bytes, label, compressed=compressed, limits=limits
            )
            for batch in events_stream.batches():
                builder.add(batch)
                del batch  # free this batch's dicts before the next one is parsed
    except DiagnoseError:
        raise
    except CORRUPT_GZIP as exc:
        raise DiagnoseError(
            f"{label}: truncated or corrupt gzip data ({one_line(exc)})", ExitCode.BAD_INPUT
        ) from None
    except OSError as exc:
        raise DiagnoseError(f"{label}: cannot read: {one_line(exc)}", ExitCode.BAD_INPUT) from None
    built = builder.built()
    return built, events_stream.top_level, events_stream.streamed, (len(built.chunks),)


def _tables(
    built: BuiltColumns,
    label: str,
    top_level: dict[str, Any],
    streamed: bool,
    pieces_read: tuple[int, ...],
) -> ParsedTrace:
    """The trace's tables from its columns: impossible times left out, rows in time order."""
    if built.events == 0:
        raise DiagnoseError(f"{label}: the trace has no events", ExitCode.BAD_INPUT)
    host, runtime, device, modules = built.concatenated()
    meta = built.meta()
    built.chunks = []  # the chunks' columns are no longer needed
    had_events = bool(host["name"].size or runtime["name"].size or device["name"].size)
    excluded = _drop_impossible((host, runtime, device, modules))
    if not (host["name"].size or runtime["name"].size or device["name"].size):
        if had_events:
            raise DiagnoseError(
                f"{label}: no profiler event has a possible time "
                f"(left out: {describe_exclusions(excluded)})",
                ExitCode.BAD_INPUT,
            )
        raise DiagnoseError(
            f"{label}: the trace has no profiler events "
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
    thread_ids = {key: index for index, key in enumerate(built.threads)}
    profiler_stop: float | None = None
    for kind, pid, tid, value in meta:
        if kind == "profiler_window":
            start, duration = value
            profiler_stop = max(profiler_stop or -math.inf, start + duration - base)
        elif kind == "thread_name":
            index = thread_ids.get((pid, tid))
            if index is None and isinstance(tid, str) and tid.isdigit():
                index = thread_ids.get((pid, int(tid)))
            if index is not None:
                thread_names[index] = str(value)
        elif kind == "process_labels" or pid not in process_labels:
            process_labels[pid] = str(value)
    return ParsedTrace(
        path=label,
        names=built.names,
        host=HostTable(**tables[0]),
        runtime=RuntimeTable(**tables[1]),
        device=DeviceTable(**tables[2]),
        threads=built.threads,
        thread_names=thread_names,
        devices=built.devices,
        streams=built.streams,
        top_level=top_level,
        process_labels=process_labels,
        base_us=base,
        profiler_stop_us=profiler_stop,
        event_count=built.events,
        streamed=streamed,
        pieces_read=pieces_read,
        modules=ModuleTable(**tables[3]),
        counts={
            "host": int(tables[0]["name"].size),
            "runtime": int(tables[1]["name"].size),
            "device": int(tables[2]["name"].size),
            "total": built.events,
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
