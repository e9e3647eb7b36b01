"""The trace corpus: broken, hostile and absurd profiler traces for ``diagnose trace`` (see
``fuzz_corpus.py`` for the classes of outcome)."""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz_corpus import (
    ANALYSED,
    AWS,
    BAD_VALUES,
    BOM,
    CLEANED_TRACE,
    DB_PASSWORD,
    EITHER,
    GHP,
    HF,
    LINEAR,
    MASKED,
    MISREAD,
    PASSWORD,
    REFUSED,
    Case,
    as_fifo,
    as_file,
    as_folder,
    as_gzip_file,
    edited,
    flipped,
    folder_with_fifo,
    gzip_bomb,
    json_bytes,
    nested,
    symlink,
    symlink_loop,
)

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
        add(Case(f"truncated plain at {cut}", as_file("t.json", real[:cut])))
    for _ in range(10):
        cut = rng.randrange(len(packed))
        add(Case(f"truncated gzip at {cut}", as_file("t.json.gz", packed[:cut])))
    for _ in range(25):
        flips = rng.randint(1, 8)
        add(Case(f"{flips} bytes flipped", as_file("t.json", flipped(real, rng, flips))))
    for source, label in ((real, "cpu"), (gpu, "gpu")):
        for field in _EVENT_FIELDS:
            for value in rng.sample(BAD_VALUES, 2):
                edited = json.loads(source)  # a fresh copy, faster than deepcopy
                target = rng.choice([e for e in edited["traceEvents"] if e.get("cat") in _KEPT])
                target[field] = value
                add(Case(f"{label} event {field}={value!r}", as_file("t.json", json_bytes(edited))))
        for field in _ARGS_FIELDS:
            value = rng.choice(BAD_VALUES)
            edited = json.loads(source)  # a fresh copy, faster than deepcopy
            with_args = [e for e in edited["traceEvents"] if isinstance(e.get("args"), dict)]
            rng.choice(with_args)["args"][field] = value
            add(Case(f"{label} args {field}={value!r}", as_file("t.json", json_bytes(edited))))
        for field in _TOP_FIELDS:
            value = rng.choice(BAD_VALUES)
            edited = dict(json.loads(source), **{field: value})
            add(Case(f"{label} top-level {field}={value!r}", as_file("t.json", json_bytes(edited))))
        # Impossible numbers on a share (or all) of the events of one kind.
        for value in (-1.0, -1e6, 1e308, 1e300, 18446744073709551616, -1e308):
            field = rng.choice(("ts", "dur"))
            share = rng.choice((0.1, 0.5, 1.0))
            edited = json.loads(source)  # a fresh copy, faster than deepcopy
            for event in edited["traceEvents"]:
                if event.get("cat") in _KEPT and rng.random() < share:
                    event[field] = value
            add(
                Case(
                    f"{label} {share:.0%} {field}={value!r}", as_file("t.json", json_bytes(edited))
                )
            )
    # Over one 4 MB chunk, so that the event array is cut and parsed a chunk at a time.
    doc = json.loads(real)
    doc["traceEvents"] *= 20
    streamed = json.dumps(doc).encode()
    for _ in range(4):
        cut = rng.randrange(len(streamed))
        add(Case(f"streamed, truncated at {cut}", as_file("t.json", streamed[:cut])))
    for _ in range(4):
        flips = rng.randint(1, 8)
        add(
            Case(
                f"streamed, {flips} bytes flipped", as_file("t.json", flipped(streamed, rng, flips))
            )
        )
    padding = b' ,"padding": "' + b"x" * (5 << 20) + b'"}'
    big = real.rstrip()[:-1] + padding  # over one 4 MB chunk: read streamed
    add(Case("BOM, small trace", as_file("t.json", BOM + real), ANALYSED))
    add(Case("BOM, gzip trace", as_gzip_file("t.json.gz", BOM + real), ANALYSED))
    add(Case("BOM, streamed trace", as_file("t.json", BOM + big), ANALYSED))
    add(Case("BOM only", as_file("t.json", BOM), REFUSED))
    add(Case("empty file", as_file("t.json", b""), REFUSED))
    add(Case("whitespace only", as_file("t.json", b" \n\t" * 1000), REFUSED))
    add(Case("5 MB of whitespace", as_file("t.json", b" " * (5 << 20)), REFUSED))
    add(
        Case(
            "5 MB without traceEvents",
            as_file("t.json", b'{"a": "' + b"y" * (5 << 20) + b'"}'),
            REFUSED,
        )
    )
    add(Case("nested 100,000 deep", as_file("t.json", nested(100_000)), REFUSED))
    add(
        Case(
            "traceEvents nested deep",
            as_file("t.json", b'{"traceEvents": ' + nested(100_000)),
            REFUSED,
        )
    )
    add(Case("event args nested deep", as_file("t.json", _deep_event(5000)), EITHER))
    add(
        Case(
            "streamed array never ends",
            as_file("t.json", b'{"traceEvents": [' + b"[" * (5 << 20)),
            REFUSED,
        )
    )
    add(
        Case(
            "streamed unclosed string",
            as_file("t.json", b'{"traceEvents": ["' + b"z" * (5 << 20)),
            REFUSED,
        )
    )
    add(Case("JSON null", as_file("t.json", b"null"), REFUSED))
    add(Case("JSON string", as_file("t.json", b'"trace"'), REFUSED))
    add(Case("list of numbers", as_file("t.json", b"[1, 2, 3]"), REFUSED))
    add(Case("traceEvents null", as_file("t.json", b'{"traceEvents": null}'), REFUSED))
    add(Case("traceEvents empty", as_file("t.json", b'{"traceEvents": []}'), REFUSED))
    add(Case("UTF-16", as_file("t.json", real.decode().encode("utf-16")), REFUSED))
    add(
        Case("latin-1 name", as_file("t.json", real.replace(b'"aten::', b'"\xe9aten::', 1)), EITHER)
    )
    add(Case("random bytes", as_file("t.json", rng.randbytes(4096)), REFUSED))
    add(Case("gzip of garbage", as_gzip_file("t.json.gz", rng.randbytes(4096)), REFUSED))
    add(Case("gzip of text", as_gzip_file("t.json.gz", b"not a trace at all\n" * 100), REFUSED))
    add(
        Case(
            "gzip header, garbage",
            as_file("t.json.gz", b"\x1f\x8b\x08\x00" + rng.randbytes(500)),
            REFUSED,
        )
    )
    add(Case("gzip magic only", as_file("t.json.gz", b"\x1f\x8b"), REFUSED))
    add(Case("gzip of gzip", as_gzip_file("t.json.gz", packed), REFUSED))
    add(Case("gzip, trailing garbage", as_file("t.json.gz", packed + b"garbage"), REFUSED))
    add(Case("gzip, flipped", as_file("t.json.gz", flipped(packed, rng, 3)), REFUSED))
    add(Case("bomb of spaces", gzip_bomb("t.json.gz", b"", b" ", 24), REFUSED))
    add(Case("bomb of zeros", gzip_bomb("t.json.gz", b"", b"\0", 24), REFUSED))
    add(Case("bomb of brackets", gzip_bomb("t.json.gz", b'{"traceEvents": [', b"[", 24), REFUSED))
    event = json.dumps(json.loads(real)["traceEvents"][-1]).encode() + b","
    add(Case("bomb of events", gzip_bomb("t.json.gz", b'{"traceEvents": [', event, 24), REFUSED))
    add(Case("bomb, no traceEvents", gzip_bomb("t.json.gz", b'{"a": "', b"a", 24), REFUSED))
    add(Case("directory", lambda folder: folder, REFUSED))
    add(Case("folder of bad traces", as_folder({"a.json": real[:100], "b.json": b"{}"}), REFUSED))
    add(Case("folder with a FIFO trace", folder_with_fifo("r0.json"), REFUSED))
    if hasattr(os, "mkfifo"):
        add(Case("FIFO", as_fifo("t.json"), REFUSED))
    add(Case("symlink loop", symlink_loop("t.json"), REFUSED))
    add(Case("dangling symlink", symlink("t.json", "/nonexistent/trace.json"), REFUSED))
    if Path("/dev/zero").exists():
        add(Case("symlink to /dev/zero", symlink("t.json", "/dev/zero"), REFUSED))
    return cases


def _deep_event(depth: int) -> bytes:
    head = b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1, "args": '
    return head + b'{"a": ' * depth + b"1" + b"}" * depth + b"}]}"


# --------------------------------------------------------------------------------------------
# Families with a definite class: impossible times, absurd shapes, long names, secrets


def _every(kind: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        for event in doc["traceEvents"]:
            if event.get("cat") == kind or (kind == "*" and event.get("cat") in _KEPT):
                event[field] = value

    return change


def _mm_dims(dims: Any) -> Callable[[dict[str, Any]], None]:
    """Every aten::mm (and addmm) records ``dims`` as its operands' shapes."""

    def change(doc: dict[str, Any]) -> None:
        for event in doc["traceEvents"]:
            if event.get("name") in ("aten::mm", "aten::addmm"):
                args = event.setdefault("args", {})
                bias = [[1]] if event["name"] == "aten::addmm" else []
                args["Input Dims"] = [*bias, *dims]
                args["Input type"] = ["float"] * (len(dims) + len(bias))

    return change


#: Units of names built to defeat one pattern each (kernel classes, redaction, op rules).
LONG_NAME_UNITS = {"one word": "a", "dashes": ".-a", "camel case": "aA", "open template": "x<"}


def _long_name(kind: str, unit: str) -> Callable[[dict[str, Any]], None]:
    """The first event of ``kind`` gets a 300 KB name made of ``unit``."""

    def change(doc: dict[str, Any]) -> None:
        event = next(e for e in doc["traceEvents"] if e.get("cat") == kind)
        event["name"] = unit * (300_000 // len(unit))

    return change


def _secret_names(doc: dict[str, Any]) -> None:
    """Tokens in op names, annotation names and args, as a user's record_function labels or a
    hand-edited trace may hold them."""
    hf, ghp, aws, password, db_password = HF, GHP, AWS, PASSWORD, DB_PASSWORD
    annotations = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
    for event in annotations[:2]:
        event["name"] = f"login {hf} {ghp}"
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    for event in ops[:5]:
        event["name"] = f"{event['name']} --password {password}"
        event.setdefault("args", {})["db"] = f"postgres://admin:{db_password}@db/x"
    doc["deviceProperties"] = [{"id": 0, "name": f"GPU {aws}"}]


def trace_families(real: bytes, gpu: bytes) -> list[Case]:
    """Traces whose outcome is known: impossible times, absurd shapes, long names, secrets."""
    cases: list[Case] = []
    add = cases.append
    for source, label in ((real, "cpu"), (gpu, "gpu")):
        kind = "kernel" if label == "gpu" else "cpu_op"
        # Negative times are left out with a note; NaN and Infinity are no JSON, and null is
        # no time (a trace holding them is refused, one line naming the file and the field).
        for value, expect in (
            (-1.0, CLEANED_TRACE),
            (-5000.0, CLEANED_TRACE),
            (None, REFUSED),
            (float("nan"), REFUSED),
            (float("inf"), REFUSED),
        ):
            add(
                Case(
                    f"{label}: every {kind} dur={value!r}",
                    as_file("t.json", edited(source, _every(kind, "dur", value))),
                    expect,
                )
            )
        add(
            Case(
                f"{label}: every {kind} ts=-1",
                as_file("t.json", edited(source, _every(kind, "ts", -1.0))),
                CLEANED_TRACE,
            )
        )
        add(
            Case(
                f"{label}: every event dur=-1",
                as_file("t.json", edited(source, _every("*", "dur", -1.0))),
                REFUSED,
            )
        )
        for dims in (
            [[65536, 65536], [65536, 65536]],
            [[2**62, 2**62], [2**62, 2**62]],
            [[2**31, 2**31], [2**31, 2**31]],
            [[-4, 8], [8, 4]],
        ):
            add(
                Case(
                    f"{label}: every mm of {dims[0]}",
                    as_file("t.json", edited(source, _mm_dims(dims))),
                    MISREAD,
                )
            )
        for name, unit in LONG_NAME_UNITS.items():
            add(
                Case(
                    f"{label}: 300 KB {kind} name ({name})",
                    as_file("t.json", edited(source, _long_name(kind, unit))),
                    LINEAR,
                )
            )
        add(
            Case(
                f"{label}: secrets in names and args",
                as_file("t.json", edited(source, _secret_names)),
                MASKED,
            )
        )
    return cases
