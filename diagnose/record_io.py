"""Reading a record file: its checks, the upgrades of older schema versions, building the record.

:func:`load_record` reads every record (``diagnose report``, ``compare``,
``run --baseline``, sweeps) through here, so a hand-edited, truncated or hostile file ends in one
:class:`DiagnoseError` line (exit 3), never a traceback, a hang or unbounded memory:

* :func:`read_record_document`: only a regular file (a FIFO or ``/dev/zero`` would block or never
  end), at most :data:`MAX_RECORD_BYTES`, UTF-8 with or without a byte-order mark, JSON nested at
  most :data:`MAX_DEPTH` deep (Python's parser would raise RecursionError on 100,000 levels, and
  everything that walks a record recursively would later), integers within 64 bits.
* the record is redacted (:func:`diagnose.redact.redact_record`) as diagnose redacts what it
  writes itself, so no re-rendering shows a secret a record from elsewhere holds;
* :func:`screen_steps`: impossible step times (zero, negative, NaN, infinite, longer than a
  day) are left out of the document before the record is built, so no summary is "-1.00 s/it"
  and no sum overflows; :func:`validate_record` says so in a counted note, and requires every
  other number to be finite and plausible and the maps of seconds to hold numbers.

:func:`load_record` is the whole of it; :func:`record_from_dict` builds a record from a document
(:data:`MIGRATIONS` upgrades one written by an older schema version, one step per version). Saving
is :meth:`diagnose.record.RunRecord.save`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_type_hints

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import SCHEMA_VERSION, RankStat, RunRecord
from diagnose.redact import redact_record

#: Real records are KB to a few MB (a trace record lists kernels and rules' tables).
MAX_RECORD_BYTES = 256 << 20
#: Real records nest about ten levels (record > probes > data > rules > tables > rows).
MAX_DEPTH = 100
#: No training step lasts a day; a larger time is a corrupt value (1e308 overflows every sum).
MAX_STEP_SECONDS = 86_400.0
#: The largest magnitude of any other number: far beyond any byte count, second or ratio a record
#: holds, far below where a sum of thousands of them overflows a float.
MAX_MAGNITUDE = 1e18
_INT_LIMIT = 1 << 63
#: The notes :func:`validate_record` adds start with this (the report command shows them).
LEFT_OUT = "Left out when the record was read: "


def load_record(path: Path) -> RunRecord:
    """Read, build and check the record at ``path``, a file or a run folder.

    Every problem is one DiagnoseError line naming the file (exit 3).
    """
    path, data = read_record_document(path)
    left_out = screen_steps(data)
    try:
        record = record_from_dict(data)
        validate_record(record, left_out)
    except DiagnoseError as exc:
        raise DiagnoseError(f"{path}: {exc.message}", exc.code) from None
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        # The schema migrations walk the raw document before any type is checked.
        raise _fail(path, f"malformed record: {' '.join(str(exc).split())}") from None
    # A record may come from another machine, an older diagnose or a hand edit: whatever renders
    # it (report, compare, a gated run) gets it redacted, as diagnose writes its own.
    return redact_record(record, redact_paths=False)


def _fail(path: Path, problem: str) -> DiagnoseError:
    return DiagnoseError(f"{path}: {problem}", ExitCode.BAD_INPUT)


def read_record_document(path: Path) -> tuple[Path, Any]:
    """The JSON document of the record at ``path`` (a file, or a run folder's ``record.json``),
    and the file's path. Raises DiagnoseError(BAD_INPUT) naming the file."""
    if path.is_dir():
        path = path / "record.json"
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as exc:  # a symlink loop (ELOOP), a permission error
        raise _fail(path, f"cannot read: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _fail(path, "not a regular file (a record is a JSON file)")
    if info.st_size > MAX_RECORD_BYTES:
        raise _fail(path, f"{info.st_size:,} bytes, more than any record; not a diagnose record")
    try:
        # O_NONBLOCK: if the file was swapped for a FIFO after the check, open does not wait.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or type(exc).__name__}") from None
    if len(raw) > MAX_RECORD_BYTES:
        raise _fail(path, "more bytes than any record; not a diagnose record")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors) is accepted
    except UnicodeDecodeError as exc:
        raise _fail(path, f"not UTF-8 text (byte {exc.start}); not a diagnose record") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise _fail(
            path, f"JSON nested more than {MAX_DEPTH} deep; not a diagnose record"
        ) from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"invalid JSON: {' '.join(str(exc).split())}") from None
    except ValueError:  # Python refuses to convert integers of more than 4,300 digits
        raise _fail(path, "a number with thousands of digits; not a diagnose record") from None
    problem = _shape_problem(data)
    if problem:
        raise _fail(path, f"malformed record: {problem}")
    return path, data


def _shape_problem(data: Any) -> str | None:
    """Why ``data`` cannot be a record whatever its fields: too deep, or an integer that no
    float holds. Iterative, so that no depth of nesting can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                return f"JSON nested more than {MAX_DEPTH} deep"
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _INT_LIMIT:
            return f"the integer {str(value)[:20]}... is out of range"
    return None


def screen_steps(data: Any) -> dict[str, int]:
    """Remove, in place, the step samples of a record document whose ``seconds`` is a number (or
    null, a NaN) that no step can take; return how many by reason. Samples of the wrong type are
    left for the record's own type checks to refuse."""
    timing = data.get("timing") if isinstance(data, dict) else None
    if not isinstance(timing, dict) or not isinstance(timing.get("samples"), list):
        return {}
    samples: list[Any] = timing["samples"]
    reasons: dict[str, int] = {}
    kept = []
    for sample in samples:
        if not isinstance(sample, dict):
            kept.append(sample)  # refused by the type checks, with their message
            continue
        seconds = sample.get("seconds", 0.0)  # a step without a time is no timed step
        if seconds is None:
            seconds = math.nan  # how a record writes a NaN
        problem = None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
            problem = _step_problem(float(seconds))
        if problem is None:
            kept.append(sample)
        else:
            reasons[problem] = reasons.get(problem, 0) + 1
    timing["samples"] = kept
    return reasons


def validate_record(record: RunRecord, left_out: Mapping[str, int] | None = None) -> None:
    """Check the values of a record built from a screened document; note what was left out.

    Raises DiagnoseError (the caller adds the file name) for a value that is wrong rather than
    merely impossible to time: a map of seconds holding a non-number, an infinite or absurd
    number anywhere.
    """
    _check_numbers(record)
    for index, sample in enumerate(record.timing.samples):
        _check_map(sample.phases, f"timing.samples[{index}].phases")
    _check_map(record.breakdown.seconds, "breakdown.seconds")
    _check_map(record.breakdown.device_seconds_by_kernel_class, "breakdown.device_seconds")
    _check_map(record.breakdown.kernel_seconds_summed_by_class, "breakdown.kernel_seconds_summed")
    _check_map(record.wall_seconds, "wall_seconds")
    for index, rank in enumerate(record.ranks):
        _check_rank(rank, f"ranks[{index}]")
    dropped = drop_impossible_values(record)
    if dropped:
        shown = "; ".join(dropped[:_NAMED_AT_MOST])
        more = len(dropped) - _NAMED_AT_MOST
        record.notes.append(
            f"{LEFT_OUT}{len(dropped)} number{'s' if len(dropped) != 1 else ''} no run can have: "
            f"{shown}{f'; and {more} more' if more > 0 else ''}."
        )
    if left_out:
        left = sum(left_out.values())
        kept = len(record.timing.samples)
        tally = ", ".join(f"{n} {reason}" for reason, n in left_out.items())
        record.notes.append(
            f"{LEFT_OUT}{left} step sample{'s' if left != 1 else ''} with an impossible time "
            f"({tally}); {kept} valid step{'s' if kept != 1 else ''} remain."
        )


#: Fields a note names one by one; the rest are counted.
_NAMED_AT_MOST = 4
#: Words of a key that make its number a share of something: a fraction in [0, 1].
_SHARE_WORDS = frozenset({"share", "shares", "fraction", "fractions", "mfu"})
#: Counts that are at least one (a job of no rank, a step of no micro-batch does not exist).
_AT_LEAST_ONE = frozenset({"world_size", "micro_batches_per_step"})
#: Summaries recomputed from the samples when a record is built: never read from the file.
_DERIVED = frozenset({"unprofiled", "profiled"})


def drop_impossible_values(record: RunRecord) -> list[str]:
    """Remove, in place, the numbers of a built record that no run can have, and say where each
    was (field and why): a saving below zero or above the step, a share outside [0, 1], a
    negative duration, a negative count. A dropped saving becomes None ("not quantified"), a
    dropped duration NaN or None ("not measured"), a map entry or a list element goes, a count
    takes its default. Numbers of the right kind are never touched."""
    dropped: list[str] = []
    step = record.timing.per_iteration if record.timing.headline.n else math.nan
    # Without a step time a saving is bounded by the longest step there is.
    bound = step if math.isfinite(step) and step > 0 else MAX_STEP_SECONDS
    for index, finding in enumerate(record.findings):
        for name in (
            "est_seconds_saved_per_it",
            "sure_seconds_saved_per_it",
            "high_seconds_saved_per_it",
        ):
            value = getattr(finding, name)
            if value is None or math.isnan(value):
                continue
            why = "below zero" if value < 0 else "more than the step" if value > bound else ""
            if why:
                setattr(finding, name, None)
                dropped.append(f"findings[{index}].{name} of {finding.id or 'a finding'} ({why})")
        _drop_shares(finding.evidence, f"findings[{index}].evidence", dropped)
    for index, probe in enumerate(record.probes):
        _drop_shares(probe.data, f"probes[{index}].data", dropped)
    utilisation = record.utilisation
    if utilisation is not None and not utilisation.misread and (why := utilisation.above_peak()):
        # A count no device could run in the step: said to be a misread, as diagnose says it.
        utilisation.mark_misread(why)
        dropped.append("utilisation.spec/measured.mfu (above the peak: a misread count)")
    _drop_typed(record, "", dropped)
    return dropped


def _is_share(key: object) -> bool:
    return isinstance(key, str) and not _SHARE_WORDS.isdisjoint(key.lower().split("_"))


def _is_fraction(value: object) -> bool:
    return (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or math.isnan(value)
        or 0.0 <= value <= 1.0
    )


def _drop_shares(data: Any, where: str, dropped: list[str]) -> None:
    """Shares (keys named ``*_share``, ``share_of_*``, ``*_fraction*``, ``mfu``) outside [0, 1]
    anywhere in free-form data (a finding's evidence, a probe's data). A share-named key may hold
    a number, or a list or map of numbers (``{"bf16": 0.7, ...}``), each a share; what lies
    deeper (rows of a table) is judged by its own keys."""
    stack: list[tuple[Any, str, bool]] = [(data, where, False)]
    while stack:
        node, at, share = stack.pop()
        if isinstance(node, dict):
            for key in list(node):
                value, here = node[key], f"{at}[{key!r}]"
                if (share or _is_share(key)) and not _is_fraction(value):
                    del node[key]
                    dropped.append(f"{here} (a share outside 0-1)")
                elif isinstance(value, (dict, list)):
                    stack.append((value, here, _is_share(key) and not share))
        elif isinstance(node, list):
            kept = []
            for index, value in enumerate(node):
                if share and not _is_fraction(value):
                    dropped.append(f"{at}[{index}] (a share outside 0-1)")
                    continue
                kept.append(value)
                if isinstance(value, (dict, list)):
                    stack.append((value, f"{at}[{index}]", False))
            node[:] = kept


def _is_duration(name: str) -> bool:
    return "seconds" in name or name.endswith("_s")


def _drop_typed(item: Any, at: str, dropped: list[str]) -> None:
    """The record's own fields, by what their names say they hold: durations (``*seconds*``,
    ``*_s``) are at least zero, shares at most one, counts (int fields) at least zero."""
    for f in dataclasses.fields(item):
        value, here = getattr(item, f.name), f"{at}.{f.name}".lstrip(".")
        if f.name in _DERIVED or f.name in ("evidence", "data"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _drop_typed(value, here, dropped)
        elif isinstance(value, list):
            for index, element in enumerate(value):
                if dataclasses.is_dataclass(element) and not isinstance(element, type):
                    _drop_typed(element, f"{here}[{index}]", dropped)
            if _is_duration(f.name) and any(_negative(v) for v in value):
                dropped.append(f"{here} (a negative duration)")
                value[:] = [v for v in value if not _negative(v)]
        elif isinstance(value, dict) and _is_duration(f.name):
            for key in [k for k, v in value.items() if _negative(v)]:
                del value[key]
                dropped.append(f"{here}[{key!r}] (a negative duration)")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        elif isinstance(value, int) and value < (1 if f.name in _AT_LEAST_ONE else 0):
            setattr(item, f.name, default)
            dropped.append(f"{here} (a count below {1 if f.name in _AT_LEAST_ONE else 0})")
        elif isinstance(value, float) and _is_duration(f.name) and value < 0:
            setattr(item, f.name, math.nan if default is not None else None)
            dropped.append(f"{here} (a negative duration)")
        elif isinstance(value, float) and _is_share(f.name) and not _is_fraction(value):
            setattr(item, f.name, math.nan if default is not None else None)
            dropped.append(f"{here} (a share outside 0-1)")


def _negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def left_out_notes(record: RunRecord) -> list[str]:
    """The notes :func:`validate_record` added (what was left out, for the terminal)."""
    return [note for note in record.notes if note.startswith(LEFT_OUT)]


def is_valid_step_time(seconds: object) -> bool:
    """Whether ``seconds`` is a time a training step can take: the one rule for the loader here
    and the gate (which also sees records built in memory, never loaded)."""
    return (
        isinstance(seconds, (int, float))
        and not isinstance(seconds, bool)
        and _step_problem(float(seconds)) is None
    )


def _step_problem(seconds: float) -> str | None:
    if not math.isfinite(seconds):
        return "not a finite number"
    if seconds <= 0:
        return "zero or negative"
    if seconds > MAX_STEP_SECONDS:
        return "longer than a day"
    return None


def _check_rank(rank: RankStat, where: str) -> None:
    for key in ("phases", "comm_by_kind"):
        _check_map(getattr(rank, key), f"{where}.{key}")
    for index, seconds in enumerate(rank.step_seconds):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise DiagnoseError(f"malformed record: {where}.step_seconds[{index}] is not a number")


def _check_map(values: Mapping[str, Any], where: str) -> None:
    """A map of name -> seconds (phases, kernel classes): numbers, finite when given."""
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DiagnoseError(
                f"malformed record: {where}[{key!r}] is {type(value).__name__}, expected seconds"
            )
        if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise DiagnoseError(f"malformed record: {where}[{key!r}] is {value!r}")


def _check_numbers(record: RunRecord) -> None:
    """Every number of the record: no infinity anywhere (a record writes none: JSON has no
    Infinity), and no float field of its dataclasses beyond :data:`MAX_MAGNITUDE`. NaN is how a
    record says "not measured" (null), so it passes; step times are screened apart."""
    stack: list[tuple[Any, str, bool]] = [(record, "", True)]
    while stack:
        item, at, typed = stack.pop()
        if isinstance(item, float):
            if math.isinf(item) or (typed and abs(item) > MAX_MAGNITUDE):
                raise DiagnoseError(f"malformed record: {at.lstrip('.')} is {item!r}")
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for field in dataclasses.fields(item):
                stack.append((getattr(item, field.name), f"{at}.{field.name}", True))
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]", typed) for i, child in enumerate(item))
        elif isinstance(item, dict):
            stack.extend((child, f"{at}[{key!r}]", False) for key, child in item.items())


# --------------------------------------------------------------------------------------------
# Upgrades of documents written by older schema versions, one step per version


def _checks_from_lines(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept a probe's checks as bare lines (``checked_ok``, ``not_judged``, and before
    those ``data["not_judged"]``) and its findings only in the record's list: each becomes a
    check, the lines with an id made from the probe's name."""
    upgraded = dict(data, schema_version=2)
    probes = [dict(p) for p in data.get("probes") or [] if isinstance(p, Mapping)]
    by_name = {p.get("name", ""): p for p in probes}
    for probe in probes:
        name = str(probe.get("name", ""))
        old_data = probe.get("data")
        old_data = dict(old_data) if isinstance(old_data, Mapping) else {}
        lines: list[tuple[str, Any]] = [("ok", line) for line in probe.pop("checked_ok", []) or []]
        lines += [("not_judged", line) for line in probe.pop("not_judged", []) or []]
        lines += [("not_judged", line) for line in old_data.pop("not_judged", []) or []]
        probe["data"] = old_data
        checks = list(probe.get("checks") or [])
        for outcome, line in lines:
            checks.append(
                {
                    "id": f"{name}.check_{len(checks) + 1}",
                    "outcome": outcome,
                    "text": str(line),
                    "source": name,
                }
            )
        probe["checks"] = checks
    for finding in data.get("findings") or []:
        if not isinstance(finding, Mapping):
            continue
        source = str(finding.get("source", "")).split(":", 1)[0]
        owner = by_name.get(source)
        if owner is None:
            owner = {"name": source or "record", "status": "ok", "checks": []}
            probes.append(owner)
            by_name[owner["name"]] = owner
        owner["checks"].append(
            {
                "id": finding.get("id", ""),
                "outcome": "finding",
                "text": finding.get("title", ""),
                "source": finding.get("source", ""),
            }
        )
    upgraded["probes"] = probes
    return upgraded


def _kernel_time_counted_once(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 kept summed kernel durations per class in ``device_seconds_by_kernel_class``
    (overlapping streams both counted); version 3 counts each instant once there and keeps the
    sums in ``kernel_seconds_summed_by_class``. An old record's sums move to their new name; the
    counted-once times cannot be made from them and stay unknown."""
    upgraded = dict(data, schema_version=3)
    breakdown = data.get("breakdown")
    if isinstance(breakdown, Mapping):
        moved = dict(breakdown)
        moved["kernel_seconds_summed_by_class"] = moved.pop("device_seconds_by_kernel_class", {})
        upgraded["breakdown"] = moved
    return upgraded


#: schema_version -> function that upgrades a document of that version to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _checks_from_lines,
    2: _kernel_time_counted_once,
}


# --------------------------------------------------------------------------------------------
# Building the record


def record_from_dict(data: Mapping[str, Any]) -> RunRecord:
    """The record a JSON document describes, upgraded from an older schema version; fields it
    lacks take their defaults, unknown fields are ignored."""
    if not isinstance(data, Mapping):
        raise DiagnoseError("not a diagnose record: the JSON top level is not an object")
    if "schema_version" not in data or "mode" not in data:
        raise DiagnoseError("not a diagnose record: no schema_version/mode field")
    version = data["schema_version"]
    if not isinstance(version, int):
        raise DiagnoseError(f"not a diagnose record: schema_version is {version!r}")
    if version > SCHEMA_VERSION:
        raise DiagnoseError(
            f"record schema version {version} is newer than this diagnose "
            f"(reads up to {SCHEMA_VERSION}); upgrade diagnose"
        )
    upgraded = dict(data)
    while upgraded["schema_version"] < SCHEMA_VERSION:
        step = MIGRATIONS.get(upgraded["schema_version"])
        if step is None:
            raise DiagnoseError(
                f"record schema version {upgraded['schema_version']} is not supported"
            )
        upgraded = step(upgraded)
    try:
        record = _from_dict(RunRecord, upgraded)
    except (TypeError, ValueError) as exc:
        raise DiagnoseError(f"malformed record: {exc}") from None
    record.timing.summarize()
    return record


_T = TypeVar("_T")


def _from_dict(cls: type[_T], data: Any) -> _T:
    """Build dataclass ``cls`` from ``data``: unknown keys ignored, missing keys defaulted."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__} must be an object, got {type(data).__name__}")
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{cls.__name__}.{f.name}")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = getattr(hint, "__origin__", None)
    args = get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value)  # type: ignore[arg-type]
    if origin is list:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise TypeError(f"{where} must be a list")
        return [_convert(args[0], v, where) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{where} must be an object")
        return dict(value)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where} is {value!r}, expected one of {', '.join(map(str, args))}")
        return value
    if args and type(None) in args:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where) if len(inner) == 1 else value
    if hint is float:
        if value is None:  # a NaN written as null
            return math.nan
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} must be an integer")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a string")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be true or false")
        return value
    return value
