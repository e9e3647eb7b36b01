"""Reading a large trace with two processes: both inflate and cut, each parses what it claims.

Parsing JSON and copying events into columns hold Python's lock, so threads cannot share that
work: a second process can. A forked worker opens the same file, and both processes inflate it
and cut the events array into the same pieces without parsing them
(:meth:`EventStream.raw_batches`; cutting is a small part of the cost, and inflating twice costs
less than handing pieces over, which would tie the two processes' pace together). A shared
counter hands out the pieces: a process arriving at a piece that nobody has claimed claims and
parses it, so whichever process is free takes the next piece. At the end the worker sends its
columns back and :func:`diagnose.trace.columns.merge` puts the chunks in file order: the tables
are the very ones one process reading the file would make.

Anything unusual (a piece that does not parse, a bad event, a worker that dies, a file too small
to cut) returns None, and the caller reads the file in one process, which gives the one-line
error that file deserves. So this path changes how fast a trace is read, never what is read.

Forking is used only where it is safe and cheap: on Linux, from a process with no other threads
(a forked child gets only the thread that forked), not inside a daemonic worker, with two usable
cores, for files several chunks long.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson

from diagnose.trace.columns import BuiltColumns, ColumnBuilder, merge
from diagnose.trace.stream import EventStream, ReadLimits, open_trace

#: Below this many (decompressed) bytes the second process costs more than it saves.
MIN_PARALLEL_BYTES = 24 << 20
_DONE, _FAILED = b"d", b"f"

#: What a read gives: the columns, the top-level fields, whether the file was read in chunks, and
#: how many pieces each process parsed.
ReadColumns = tuple[BuiltColumns, dict[str, Any], bool, tuple[int, ...]]


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _decompressed_size(path: Path) -> int:
    """The file's size once inflated: gzip's trailer holds it (modulo 4 GB, so a size smaller
    than the compressed one means it wrapped: large)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return size
        f.seek(-4, os.SEEK_END)
        stored = int.from_bytes(f.read(4), "little")
    return stored if stored >= size else 1 << 32


def worth_a_second_process(path: Path, chunk_bytes: int) -> bool:
    """Whether reading ``path`` with a forked worker is both safe here and likely faster."""
    if not sys.platform.startswith("linux") or _usable_cores() < 2:
        return False
    if threading.active_count() > 1 or multiprocessing.current_process().daemon:
        return False
    try:
        size = _decompressed_size(path)
    except OSError:
        return False
    return size >= max(MIN_PARALLEL_BYTES, 4 * chunk_bytes)


def read_in_two_processes(
    path: Path, label: str, chunk_bytes: int, limits: ReadLimits
) -> ReadColumns | None:
    """The file's columns, read by this process and a forked worker; None when it could not be
    read this way (the caller then reads it in one process)."""
    second = SecondReader.start(path, chunk_bytes, limits)
    return second.finish(label) if second is not None else None


@dataclass
class SecondReader:
    """A forked worker reading the pieces of a trace it claims, from the moment it starts: a
    command starts one before it imports the analysis, and :meth:`finish` reads along."""

    path: Path
    chunk_bytes: int
    limits: ReadLimits
    _claimed: Any  # the shared count of pieces handed out
    _worker: Any
    _connection: Connection

    @classmethod
    def start(cls, path: Path, chunk_bytes: int, limits: ReadLimits) -> SecondReader | None:
        """A worker reading ``path``, or None where one cannot be started."""
        try:
            context = multiprocessing.get_context("fork")
            claimed = context.Value("q", 0)  # pieces handed out so far; they form a prefix
            ours, theirs = context.Pipe(duplex=False)
            reading = (path, str(path), chunk_bytes, limits, claimed)
            worker = context.Process(target=_work, args=(theirs, *reading), daemon=True)
            worker.start()
        except (OSError, ValueError, RuntimeError):
            return None
        theirs.close()
        return cls(path, chunk_bytes, limits, claimed, worker, ours)

    def finish(self, label: str) -> ReadColumns | None:
        """Read the pieces still free in this process, and merge in the worker's; None when the
        file could not be read this way (the caller then reads it in one process)."""
        try:
            reading = (self.path, label, self.chunk_bytes, self.limits, self._claimed)
            local, mine, top_level, streamed = _read_claimed(*reading)
            message = self._connection.recv_bytes()
            if message[:1] != _DONE:
                return None
            built, its = pickle.loads(memoryview(message)[1:])
            order = {index: (local, n) for n, index in enumerate(mine)}
            order.update({index: (built, n) for n, index in enumerate(its)})
            if sorted(order) != list(range(len(order))):
                return None  # not expected: a piece nobody read
            merged = merge([order[index] for index in range(len(order))])
            return merged, top_level, streamed, (len(mine), len(its))
        except Exception:  # a cut that does not parse, a bad event, a dead worker, a corrupt file
            return None  # ... the one-process read says what, properly
        finally:
            self.stop()

    def stop(self) -> None:
        """End the worker (a no-op once it has ended)."""
        self._connection.close()
        if self._worker.is_alive():
            self._worker.kill()
        self._worker.join()


def _read_claimed(
    path: Path, label: str, chunk_bytes: int, limits: ReadLimits, claimed: Any
) -> tuple[BuiltColumns, list[int], dict[str, Any], bool]:
    """Cut the whole file; parse the pieces this process is first to claim."""
    builder = ColumnBuilder(label)
    mine: list[int] = []
    opened, compressed = open_trace(path)
    with opened as stream:
        events = EventStream(stream, chunk_bytes, label, compressed=compressed, limits=limits)
        for index, piece in enumerate(events.raw_batches()):
            with claimed.get_lock():
                free = claimed.value <= index
                if free:
                    claimed.value = index + 1
            if free:
                builder.add(orjson.loads(piece))
                mine.append(index)
            del piece
    return builder.built(), mine, events.top_level, events.streamed


def _work(connection: Connection, *reading: Any) -> None:  # pragma: no cover - in the worker
    """The worker: read what it claims, send back its columns and their piece numbers."""
    gc.disable()  # as the one-process read does: the parsed events hold no cycles
    try:
        built, mine, _, _ = _read_claimed(*reading)
        connection.send_bytes(_DONE + pickle.dumps((built, mine), pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # any failure: the parent reads the file itself
        with contextlib.suppress(OSError, ValueError):
            connection.send_bytes(_FAILED + f"{type(exc).__name__}: {exc}".encode()[:500])
    finally:
        connection.close()
        os._exit(0)  # no atexit handlers or buffers of the parent's to run twice


__all__ = [
    "MIN_PARALLEL_BYTES",
    "ReadColumns",
    "SecondReader",
    "read_in_two_processes",
    "worth_a_second_process",
]
