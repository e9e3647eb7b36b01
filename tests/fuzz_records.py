"""The record corpus: broken, hostile and absurd records for ``diagnose report`` and ``diagnose
compare`` (see ``fuzz_corpus.py`` for the classes of outcome)."""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.fuzz_corpus import (
    ANALYSED,
    AWS,
    BAD_VALUES,
    BOM,
    CLEANED_RECORD,
    DB_PASSWORD,
    EITHER,
    GHP,
    HF,
    MASKED,
    MISREAD,
    NO_STEP_LEFT,
    PASSWORD,
    REFUSED,
    Case,
    Expect,
    as_fifo,
    as_file,
    as_gzip_file,
    edited,
    flipped,
    folder_with_fifo,
    json_bytes,
    nested,
    symlink,
    symlink_loop,
)

# --------------------------------------------------------------------------------------------
# The record corpus


def _paths(value: Any, prefix: tuple[Any, ...] = (), depth: int = 4) -> Iterator[tuple[Any, ...]]:
    """Paths (keys and list indexes) to the fields of a JSON document, ``depth`` levels deep."""
    if depth == 0:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key), depth - 1)
    elif isinstance(value, list) and value:
        yield (*prefix, 0)
        yield from _paths(value[0], (*prefix, 0), depth - 1)


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    edited = copy.deepcopy(doc)
    node = edited
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return edited


def _numbers(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _numbers(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _numbers(child, (*prefix, index))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix


#: The record's own objects (dataclasses), whose every field the corpus gives a bad value.
_TYPED_PARENTS: tuple[tuple[Any, ...], ...] = (
    (),
    ("timing",),
    ("timing", "samples", 0),
    ("timing", "unprofiled"),
    ("breakdown",),
    ("device",),
    ("model",),
    ("findings", 0),
    ("probes", 0),
    ("probes", 0, "checks", 0),
    ("top_ops", 0),
)


def _record_cases(raw: bytes, rng: random.Random) -> list[Case]:
    """Broken versions of the record ``raw``."""
    doc = json.loads(raw)
    cases: list[Case] = []

    def edit(path: tuple[Any, ...], value: Any, label: str = "", expect: Expect = EITHER) -> None:
        name = label or ".".join(map(str, path))
        written = as_file("r.json", json_bytes(_set(doc, path, value)))
        cases.append(Case(f"{name}={value!r}", written, expect))

    for _ in range(8):
        cut = rng.randrange(len(raw))
        cases.append(Case(f"truncated at {cut}", as_file("r.json", raw[:cut]), REFUSED))
    for _ in range(8):
        flips = rng.randint(1, 6)
        cases.append(Case(f"{flips} bytes flipped", as_file("r.json", flipped(raw, rng, flips))))
    # Every field of the record's own objects gets a value of a wrong type or size...
    for parent in _TYPED_PARENTS:
        node = doc
        for key in parent:
            present = isinstance(node, dict) and key in node
            present |= isinstance(node, list) and isinstance(key, int) and key < len(node)
            node = node[key] if present else None
        for key in node if isinstance(node, dict) else ():
            edit((*parent, key), rng.choice(BAD_VALUES))
    # ...and so do fields anywhere in it, and its numbers get impossible values.
    paths = list(_paths(doc))
    for path in rng.sample(paths, min(len(paths), 12)):
        edit(path, rng.choice(BAD_VALUES))
    numbers = list(_numbers(doc))
    for path in rng.sample(numbers, min(len(numbers), 10)):
        edit(path, rng.choice((1e308, -1e308, float("nan"), float("inf"), -1, 0, 10**30)))
    step_values: list[Any] = [-1.0, 0.0, float("nan"), float("inf"), 1e308, "1", None, True, [], {}]
    for value in step_values:
        edited = copy.deepcopy(doc)
        for sample in edited["timing"]["samples"]:
            sample["seconds"] = value
        # A number (or null, a NaN) no step can take is left out; another type is refused.
        number = value is None or (isinstance(value, float))
        expect = NO_STEP_LEFT if number else REFUSED
        cases.append(Case(f"every step {value!r}", as_file("r.json", json_bytes(edited)), expect))
    edit(("timing", "samples", 0, "seconds"), -1.0, "first step", CLEANED_RECORD)
    cases.append(Case("with BOM", as_file("r.json", BOM + raw), ANALYSED))
    deep = dict(doc, config={"x": json.loads(nested(200))})
    cases.append(Case("config nested 200 deep", as_file("r.json", json_bytes(deep)), REFUSED))
    latin = raw.decode().replace('"mode"', '"mod\u00e9"', 1).encode("latin-1", "replace")
    cases.append(Case("latin-1", as_file("r.json", latin), REFUSED))
    cases.append(Case("UTF-16", as_file("r.json", raw.decode().encode("utf-16")), REFUSED))
    return cases


def record_corpus(bases: dict[str, bytes], rng: random.Random) -> list[tuple[str, Case]]:
    """(base name, case): "run" cases go through report and compare, "trace" through report."""
    cases = [(base, case) for base, raw in bases.items() for case in _record_cases(raw, rng)]
    loose = [
        Case("nested 100,000 deep", as_file("r.json", nested(100_000)), REFUSED),
        Case(
            "objects nested 100,000 deep",
            as_file("r.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
            REFUSED,
        ),
        Case("empty file", as_file("r.json", b""), REFUSED),
        Case("BOM only", as_file("r.json", BOM), REFUSED),
        Case("JSON list", as_file("r.json", b"[]"), REFUSED),
        Case("JSON string", as_file("r.json", b'"record"'), REFUSED),
        Case("JSON number", as_file("r.json", b"3"), REFUSED),
        Case("JSON null", as_file("r.json", b"null"), REFUSED),
        Case("empty object", as_file("r.json", b"{}"), REFUSED),
        Case(
            "huge integer",
            as_file("r.json", b'{"schema_version": ' + b"9" * 5000 + b', "mode": "run"}'),
            REFUSED,
        ),
        Case(
            "schema_version 10**30",
            as_file(
                "r.json", b'{"schema_version": 1000000000000000000000000000000, "mode": "run"}'
            ),
            REFUSED,
        ),
        Case("random bytes", as_file("r.json", rng.randbytes(2048)), REFUSED),
        Case("gzip of a record", as_gzip_file("r.json", bases["run"]), REFUSED),
        Case("folder without record.json", lambda folder: folder, REFUSED),
        Case("folder with a FIFO record.json", folder_with_fifo("record.json"), REFUSED),
        Case("symlink loop", symlink_loop("r.json"), REFUSED),
        Case("dangling symlink", symlink("r.json", "/nonexistent/record.json"), REFUSED),
    ]
    if hasattr(os, "mkfifo"):
        loose.append(Case("FIFO", as_fifo("r.json"), REFUSED))
    if Path("/dev/zero").exists():
        loose.append(Case("symlink to /dev/zero", symlink("r.json", "/dev/zero"), REFUSED))
    cases.extend(("run", case) for case in loose)
    return cases


def _plant(change: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def apply(raw: bytes) -> bytes:
        return edited(raw, change)

    return apply


def plant_secrets(doc: dict[str, Any]) -> None:
    """A record from elsewhere holding secrets where people have them."""
    hf, ghp, aws, password, db_password = HF, GHP, AWS, PASSWORD, DB_PASSWORD
    doc["command"] = f"python train.py --hub_token {hf} --password {password}"
    doc["notes"] = [*doc.get("notes", []), f"pushed with {ghp}"]
    doc["device"]["name"] = f"GPU {aws}"
    doc["probes"].append(
        {
            "name": "leaky",
            "status": "error",
            "reason": f"cannot reach postgres://admin:{db_password}@db/x",
            "traceback": f'  File "train.py"\n    login("{hf}")\nConnectionError: {ghp}\n',
            "data": {"command": ["python", "train.py", "--password", password]},
        }
    )


def _first_finding(**values: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        if doc["findings"]:
            doc["findings"][0].update(values)
        else:
            doc["findings"] = [{"id": "x.y", "title": "planted", **values}]

    return change


def _set_in(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
        node[path[-1]] = value

    return change


#: Numbers no run can have, each in a record that is otherwise whole.
IMPOSSIBLE_NUMBERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "a saving of 1e9 s": _first_finding(est_seconds_saved_per_it=1e9),
    "a saving of -0.5 s": _first_finding(est_seconds_saved_per_it=-0.5),
    "a sure saving above the step": _first_finding(sure_seconds_saved_per_it=1e4),
    "a share of 6.1": _first_finding(evidence={"data_wait_share_of_step": 6.1}),
    "a negative share": _first_finding(evidence={"share": -0.2}),
    "a host load share of 6.1": _set_in(("timing", "host_load"), {"competing_share": 6.1}),
    "a negative phase": _set_in(("breakdown", "seconds", "forward"), -0.036),
    "a negative probe duration": _set_in(("probes", 0, "duration_seconds"), -3.0),
    "a negative parameter count": _set_in(("model", "parameters"), -5),
    "a negative first batch": _set_in(("timing", "first_batch_seconds"), -1.0),
}


#: A record's utilisation as an older diagnose (or a hand edit) may hold it: 9 PFLOP a step in
#: a 72 ms step of an H200, 9 s at its peak: an MFU of 12,600%.
MFU_ABOVE_PEAK: dict[str, Any] = {
    "flops_per_step": 9e15,
    "basis": "trace shapes",
    "flops_by_dtype": {"bfloat16": 9e15},
    "step_seconds": 0.072,
    "achieved_flops_per_s": 1.25e17,
    "spec": {
        "basis": "spec",
        "flops_per_s": {"bfloat16": 9.9e14},
        "device": "NVIDIA H200 SXM",
        "seconds_at_peak": 9.09,
        "mfu": 126.0,
    },
    "classes": [{"op_class": "gemm", "work_per_step": 9e15, "share_of_peak": 126.0}],
}


def record_families(bases: dict[str, bytes]) -> list[tuple[str, Case]]:
    """Records whose outcome is known: impossible numbers (cleaned), an MFU above the peak
    (misread), secrets (masked)."""
    cases: list[tuple[str, Case]] = []
    for base, raw in bases.items():
        for name, change in IMPOSSIBLE_NUMBERS.items():
            written = as_file("r.json", edited(raw, change))
            cases.append((base, Case(f"{name}", written, CLEANED_RECORD)))
        above = edited(raw, _set_in(("utilisation",), MFU_ABOVE_PEAK))
        cases.append((base, Case("an MFU of 12,600%", as_file("r.json", above), MISREAD)))
        cases.append((base, Case("secrets", as_file("r.json", edited(raw, plant_secrets)), MASKED)))
    return cases
