"""Chunked reading of a Chrome/Kineto trace's JSON: the ``traceEvents`` array in batches.

:func:`open_trace` opens a plain or gzip file (detected by content); :class:`EventStream` yields
the events a chunk at a time, so the raw dicts of a multi-GB trace never exist all at once.

Every input is bounded (:class:`ReadLimits`): a gzip file may not expand past a ratio of its
compressed size nor past an absolute size (a gzip bomb would otherwise fill memory before any
JSON is seen); the text before ``"traceEvents": [`` and any single event may not grow past a
few tens of MB (a file that is no trace, or a corrupt one, would otherwise be buffered whole).

Gzip is inflated by ISA-L (``pip install isal``, the ``fast`` extra) when it is installed, about
half again as fast as zlib on a trace; the standard library's gzip otherwise.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import re
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import orjson

from diagnose.errors import DiagnoseError, ExitCode

#: Exceptions that mean gzip data is truncated or corrupt.
CORRUPT_GZIP: tuple[type[Exception], ...] = (EOFError, gzip.BadGzipFile, zlib.error)
try:  # an optional, faster inflater with the same file API
    from isal import igzip as _isal_gzip
    from isal.igzip_lib import IsalError

    CORRUPT_GZIP = (*CORRUPT_GZIP, cast(type[Exception], IsalError))
except ImportError:  # pragma: no cover - depends on the environment
    _isal_gzip = None  # type: ignore[assignment]


def _open_gzip(path: Path) -> io.BufferedIOBase:
    if _isal_gzip is not None:
        return cast(io.BufferedIOBase, _isal_gzip.open(path, "rb"))  # type: ignore[no-untyped-call]
    return gzip.open(path, "rb")


_MB = 1 << 20
#: Environment variable that raises (or lowers) :attr:`ReadLimits.max_gzip_bytes`, in MB.
GZIP_LIMIT_ENV = "DIAGNOSE_GZIP_LIMIT_MB"
_BOM = b"\xef\xbb\xbf"
_ARRAY_ENDS = "array ends"
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
# The key search resumes this far before the end of what was already searched, so a key cut by
# a chunk boundary is still found without rescanning the whole buffer after every chunk.
_KEY_OVERLAP = 4096
_WHITESPACE = re.compile(rb"[ \t\r\n]*")
#: Bytes the bracket scan takes at a time (its memory is about 30 times this).
_SCAN_BLOCK = 1 << 20
# A "}" then "," then "{": the usual boundary between two events of the traceEvents array. It can
# also occur inside an event (a list of objects in args), so every split is verified by parsing.
_EVENT_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_STRUCTURE = np.zeros(256, dtype=np.int8)
_STRUCTURE[ord("{")] = _STRUCTURE[ord("[")] = 1
_STRUCTURE[ord("}")] = _STRUCTURE[ord("]")] = -1


@dataclass(frozen=True)
class ReadLimits:
    """How far a trace may grow while it is read before it is refused as not a trace.

    The defaults leave wide room for real traces: the real Kineto traces this project tests
    against compress 7-30x and the largest benchmarked trace is 1 GB, while a gzip bomb expands
    about 1000x and a file that is no trace has no ``traceEvents`` near its start.
    """

    #: Decompressed bytes per compressed byte past which a gzip file is a bomb, not a trace:
    #: over three times the most compressible real trace seen (30x), a tenth of a bomb's.
    max_gzip_ratio: float = 100.0
    #: The ratio is only judged past this many decompressed bytes: a small file can compress
    #: far better than a big one (a header and a few repeated events) and costs nothing anyway.
    ratio_floor_bytes: int = 64 * _MB
    #: Decompressed bytes no gzip trace may exceed, whatever its ratio (4 GB: four times the
    #: largest trace benchmarked; ``DIAGNOSE_GZIP_LIMIT_MB`` changes it).
    max_gzip_bytes: int = 4096 * _MB
    #: Bytes searched for ``"traceEvents": [`` before the file is refused as not a trace, and
    #: the most read after the array's end (real traces have KBs of fields around it).
    max_header_bytes: int = 64 * _MB
    #: The largest single event. Profilers write events of a few KB: when no cut of this many
    #: bytes parses, the file is corrupt, and the buffer must not grow on to its end.
    max_event_bytes: int = 8 * _MB

    @classmethod
    def from_env(cls) -> ReadLimits:
        """The defaults, with ``DIAGNOSE_GZIP_LIMIT_MB`` applied when it is set."""
        text = os.environ.get(GZIP_LIMIT_ENV, "").strip()
        if not text:
            return cls()
        try:
            megabytes = float(text)
        except ValueError:
            megabytes = math.nan
        if not (math.isfinite(megabytes) and megabytes > 0):
            raise DiagnoseError(
                f"{GZIP_LIMIT_ENV}={text!r}: expected a positive number of MB", ExitCode.USAGE
            )
        cap = max(1, int(megabytes * _MB))
        # A lowered cap also lowers the ratio's floor, so that the ratio is judged as early.
        return cls(max_gzip_bytes=cap, ratio_floor_bytes=min(cap, cls.ratio_floor_bytes))


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (file paths and errno texts can hold newlines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def kind(value: Any) -> str:
    """The JSON kind of ``value`` for an error message: object, list, string, number..."""
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def open_trace(path: Path) -> tuple[io.BufferedIOBase, int | None]:
    """The file's decompressed byte stream, and its compressed size when it is gzip."""
    with path.open("rb") as probe:
        head = probe.read(64)
    if head[:2] == b"\x1f\x8b":
        return _open_gzip(path), path.stat().st_size
    start = head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
    if path.suffix == ".gz" and start and start not in (b"{", b"["):
        # Neither what its name says nor JSON: a JSON parser's complaint about its first bytes
        # would not say that.
        raise DiagnoseError(
            f"{path}: not a gzip file, though its name ends in .gz, and not JSON either",
            ExitCode.BAD_INPUT,
        )
    return path.open("rb"), None


def _mb(size: float) -> str:
    return f"{size / _MB:,.0f} MB" if size >= _MB else f"{size / _MB:.2g} MB"


class CannotSplit(Exception):
    """The file is not one that :meth:`EventStream.raw_batches` can cut without parsing (it fits
    one chunk, or its array could not be cut): read it with :meth:`EventStream.batches`."""


class EventStream:
    """Yields the traceEvents array in batches of parsed events, reading ``chunk`` bytes at a time.

    Small files (one chunk) are parsed whole. Larger ones: the text before ``"traceEvents": [`` is
    parsed as the header object; then each chunk is cut at the last event boundary, the complete
    events before it are parsed, and the rest is carried over to the next chunk. The end of the
    array and the fields after it are found with an exact (string-aware) bracket scan.

    ``compressed`` is the gzip file's size (None for a plain file): the decompressed bytes are
    counted against ``limits`` as they are read, so a bomb stops within one chunk of its cap.
    """

    def __init__(
        self,
        stream: io.BufferedIOBase,
        chunk: int,
        label: str,
        *,
        compressed: int | None = None,
        limits: ReadLimits | None = None,
    ) -> None:
        self._stream = stream
        self._chunk = chunk
        self._label = label
        self._eof = False
        self._limits = limits or ReadLimits()
        self._compressed = compressed
        self._total = 0
        self.top_level: dict[str, Any] = {}
        self.chunks_read = 0
        self.streamed = False
        #: Yield the array's text in pieces instead of parsed events (see raw_batches).
        self._raw = False

    def _read(self) -> bytes:
        """Up to one chunk; shorter only at the end of the stream."""
        parts: list[bytes] = []
        wanted = self._chunk
        while wanted > 0:
            data = self._stream.read(wanted)
            if not data:
                self._eof = True
                break
            parts.append(data)
            wanted -= len(data)
            self._total += len(data)
            if self._compressed is not None:
                self._check_expansion()
        self.chunks_read += 1
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def _check_expansion(self) -> None:
        limits, total = self._limits, self._total
        compressed = max(self._compressed or 0, 1)
        if total > limits.max_gzip_bytes:
            raise self._fail(
                f"gzip data expands past {_mb(limits.max_gzip_bytes)}, the most a trace may "
                f"(set {GZIP_LIMIT_ENV} to read a larger one)"
            )
        if total > limits.ratio_floor_bytes and total > limits.max_gzip_ratio * compressed:
            raise self._fail(
                f"gzip data expands more than {limits.max_gzip_ratio:.0f}x (past {_mb(total)} "
                f"from {_mb(compressed)}): a gzip bomb, not a profiler trace "
                "(real traces compress 10-30x)"
            )

    def _fail(self, problem: str) -> DiagnoseError:
        return DiagnoseError(f"{self._label}: {problem}", ExitCode.BAD_INPUT)

    def _loads(self, data: bytes | bytearray | memoryview) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise self._fail(f"invalid JSON: {one_line(exc)}") from None

    def raw_batches(self) -> Iterator[bytes]:
        """The traceEvents array in pieces of JSON text, each an array of whole events ("[...]"),
        cut where an event likely ends and not parsed here: a piece that fails to parse means the
        cut was wrong (or the JSON is), and the file must be read again with :meth:`batches`.
        Raises :class:`CannotSplit` for a file of one chunk, or one no cut is found in."""
        self._raw = True
        return self._batches()

    def batches(self) -> Iterator[list[Any]]:
        """The traceEvents array in batches of parsed events."""
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        first = self._read()
        # A UTF-8 byte-order mark (Windows editors write one) is dropped here, once, so that small
        # and streamed files treat it alike.
        if first.startswith(_BOM):
            first = first[len(_BOM) :]
        if not first and self._eof:
            raise self._fail("empty file")
        buf = bytearray(first)
        more = b"" if self._eof else self._read()
        if not more:
            if self._raw:
                raise CannotSplit("one chunk")
            yield self._whole_document(buf)
            return
        buf += more
        yield from self._streamed(buf)

    def _whole_document(self, buf: bytearray) -> list[Any]:
        data = self._loads(buf)
        del buf[:]
        if isinstance(data, list):  # Chrome's "JSON Array Format": the events alone
            return data
        if not isinstance(data, dict):
            raise self._fail(f"not a profiler trace: the JSON top level is a {kind(data)}")
        if "traceEvents" not in data:
            raise self._fail("not a profiler trace: no traceEvents field")
        events = data.pop("traceEvents")
        if not isinstance(events, list):
            raise self._fail(f"not a profiler trace: traceEvents is a {kind(events)}, not a list")
        self.top_level = data
        return events

    def _read_all(self, buf: bytearray, limit: int, problem: str) -> None:
        """Read to the end into ``buf``; refused with ``problem`` past ``limit`` bytes."""
        while not self._eof:
            if len(buf) > limit:
                raise self._fail(problem)
            buf += self._read()

    def _streamed(self, buf: bytearray) -> Iterator[Any]:
        self.streamed = True
        blank = _WHITESPACE.match(buf)  # a regex, not a byte loop: the file may be MBs of blanks
        start = blank.end() if blank else 0
        limit = self._limits.max_header_bytes
        absent = f"not a profiler trace: no traceEvents in the first {_mb(limit)}"
        if start < len(buf) and buf[start] == ord("["):
            del buf[:start]  # bare array of events
        else:
            match = _TRACE_EVENTS_KEY.search(buf)
            while match is None and not self._eof:
                if len(buf) > limit:
                    raise self._fail(absent)
                # Only the new bytes (and a key cut by the chunk boundary) need searching.
                searched = max(0, len(buf) - _KEY_OVERLAP)
                buf += self._read()
                match = _TRACE_EVENTS_KEY.search(buf, searched)
            header = _parse_header(bytes(buf[: match.start()])) if match is not None else None
            if match is None or header is None:
                if self._raw:
                    raise CannotSplit("no traceEvents array after a header")
                # No plain '"traceEvents": [' after a parseable header: parse the whole document,
                # which also yields the precise error for files that are no trace at all.
                self._read_all(buf, limit, absent)
                yield self._whole_document(buf)
                return
            self.top_level = header
            del buf[: match.end() - 1]  # buf now starts with the array's "["
        yield from self._array_batches(buf)

    def _array_batches(self, buf: bytearray) -> Iterator[Any]:
        """Parse the events of the array that ``buf`` starts with; then the fields after it."""
        limit = self._chunk
        while True:
            while not self._eof and len(buf) < 2 * limit:
                buf += self._read()
            if self._eof:
                yield from self._finish(buf)
                return
            if self._raw:
                yield self._cut(buf, limit)
                continue
            split = self._split(buf, limit)
            if split is _ARRAY_ENDS:
                # The fields after the array are in this buffer: read the rest and finish.
                self._read_all(
                    buf,
                    self._limits.max_header_bytes,
                    "invalid JSON: more than "
                    f"{_mb(self._limits.max_header_bytes)} after the traceEvents array",
                )
                yield from self._finish(buf)
                return
            if split is None:
                # No complete event yet: an event larger than a chunk, or corrupt JSON that no
                # cut parses. Look further, but not without bound.
                if limit >= self._limits.max_event_bytes:
                    raise self._fail(
                        f"invalid JSON: no complete event in {_mb(limit)} (a corrupt trace?)"
                    )
                limit = min(2 * limit, self._limits.max_event_bytes)
                continue
            limit = self._chunk
            assert not isinstance(split, str)
            next_start, events = split
            yield events
            del events, split
            del buf[: next_start - 1]
            buf[0] = ord("[")  # the byte before the next "{" is "," or whitespace

    def _split(self, buf: bytearray, limit: int) -> tuple[int, list[Any]] | str | None:
        """Parse the complete events in about the first ``limit`` bytes of ``buf``.

        Returns (index of the next event's "{", the parsed events); ``_ARRAY_ENDS`` when the
        array ends inside the buffer; None when no event ends within it.
        """
        limit = min(len(buf), limit)
        window = 1 << 16
        candidates: list[re.Match[bytes]] = []
        while not candidates and window < limit * 4:
            candidates = list(_EVENT_BOUNDARY.finditer(buf, max(1, limit - window), limit))
            window *= 4
        for match in reversed(candidates[-3:]):
            events = self._try_events(buf, match.start())
            if events is not None:
                return match.end() - 1, events
        # The cheap cut failed (objects nested in args, or the array ends in this buffer): scan.
        end, element_ends = scan_brackets(buf)
        if end >= 0:
            return _ARRAY_ENDS
        for brace in reversed(element_ends):
            nxt = buf.find(b"{", brace + 1)
            if nxt < 0:
                continue
            events = self._try_events(buf, brace)
            if events is not None:
                return nxt, events
        return None

    def _cut(self, buf: bytearray, limit: int) -> bytes:
        """The events before the last likely boundary in about the first ``limit`` bytes of
        ``buf``, as an array's text; ``buf`` then starts with the array's "[" again."""
        window = 1 << 16
        while window < limit * 4:
            found = deque(_EVENT_BOUNDARY.finditer(buf, max(1, limit - window), limit), maxlen=1)
            if found:
                last = found[0]
                piece = bytearray(memoryview(buf)[: last.start() + 2])
                piece[-1] = ord("]")
                del buf[: last.end() - 2]
                buf[0] = ord("[")  # the byte before the next "{" is "," or whitespace
                return bytes(piece)
            window *= 4
        raise CannotSplit(f"no event boundary in {_mb(limit)}")

    def _try_events(self, buf: bytearray, brace: int) -> list[Any] | None:
        saved = buf[brace + 1]
        buf[brace + 1] = ord("]")
        try:
            with memoryview(buf) as view:
                parsed = orjson.loads(view[: brace + 2])
        except orjson.JSONDecodeError:
            parsed = None
        buf[brace + 1] = saved
        return parsed if isinstance(parsed, list) else None

    def _finish(self, buf: bytearray) -> Iterator[Any]:
        end, _ = scan_brackets(buf)
        if end < 0:
            raise self._fail("invalid JSON: the traceEvents array never ends (truncated file?)")
        if self._raw:
            events: Any = bytes(memoryview(buf)[: end + 1])
        else:
            with memoryview(buf) as view:
                events = self._loads(view[: end + 1])
        tail = bytes(buf[end + 1 :]).strip()
        del buf[:]
        yield events
        if tail.startswith(b","):
            rest = self._loads(b"{" + tail[1:])
            if isinstance(rest, dict):
                self.top_level.update(rest)
        elif tail not in (b"}", b""):
            raise self._fail("invalid JSON: unexpected text after the traceEvents array")


def _parse_header(text: bytes) -> dict[str, Any] | None:
    """The top-level fields written before traceEvents, or None if the text is not such a prefix."""
    body = text.strip()
    if not body.startswith(b"{"):
        return None
    if body.endswith(b","):
        body = body[:-1]
    try:
        parsed = orjson.loads(body + b"}")
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def scan_brackets(buf: bytearray) -> tuple[int, list[int]]:
    """Scan ``buf``, which starts with the traceEvents array's "[", for brackets outside strings.

    Returns the index of the bracket that closes the array (-1 if none), and the indexes of the
    last two "}" before it that close an element of the array (depth 1).

    The scan goes a block at a time, carrying the depth and whether a string is open, so that
    its memory is a few times the block whatever the buffer holds: per-bracket arrays over a
    buffer of nothing but brackets would take 20 bytes a byte.
    """
    data = np.frombuffer(buf, dtype=np.uint8)
    depth, in_string = 0, 0
    ends: list[int] = []
    for start in range(0, data.size, _SCAN_BLOCK):
        block = data[start : start + _SCAN_BLOCK]
        quotes = _unescaped_quotes(data, np.flatnonzero(block == ord('"')) + start)
        deltas = _STRUCTURE[block]
        positions = np.flatnonzero(deltas)
        if quotes.size or in_string:
            # Inside a string: an odd number of quotes (with the state carried in) before it.
            inside = (np.searchsorted(quotes, positions + start) + in_string) & 1
            positions = positions[inside == 0]
        levels = depth + np.cumsum(deltas[positions], dtype=np.int64)
        closed = np.flatnonzero(levels == 0)
        last = int(closed[0]) if closed.size else positions.size
        element_ends = (levels[:last] == 1) & (block[positions[:last]] == ord("}"))
        ends = (ends + (positions[:last][element_ends][-2:] + start).tolist())[-2:]
        if closed.size:
            return int(positions[closed[0]]) + start, ends
        depth = int(levels[-1]) if levels.size else depth
        in_string ^= quotes.size & 1
    return -1, ends


def _unescaped_quotes(
    data: npt.NDArray[np.uint8], quotes: npt.NDArray[np.intp]
) -> npt.NDArray[np.intp]:
    """``quotes`` (indexes into ``data``) without those escaped by an odd run of backslashes."""
    candidates = quotes[(quotes > 0) & (data[np.maximum(quotes - 1, 0)] == ord("\\"))]
    if not candidates.size:
        return quotes
    escaped = []
    for q in candidates.tolist():
        run = 0
        while q - run - 1 >= 0 and data[q - run - 1] == ord("\\"):
            run += 1
        if run % 2:
            escaped.append(q)
    if not escaped:
        return quotes
    return np.setdiff1d(quotes, np.asarray(escaped, dtype=quotes.dtype), assume_unique=True)
