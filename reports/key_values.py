"""Key/value trees as the report shows them: a record's free-form mappings (a finding's evidence,
the inventory, the config, a probe's data) as rows of nested tables, sorted and cut to a readable
length, every value formatted to text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diagnose.units import format_value

#: Nested key/value trees deeper than this are shown flattened to one text cell.
_MAX_KV_DEPTH = 6
#: Lists longer than this are cut, with a note of how many were left out.
_MAX_LIST_ITEMS = 50


@dataclass(frozen=True)
class KV:
    """One row of a key/value table: a text value, or nested rows."""

    key: str
    text: str = ""
    children: tuple[KV, ...] = ()
    #: A list of flat records (e.g. per-step rows, an A/B table) shown as one table:
    #: ``columns`` are the keys in first-seen order, ``cells`` one formatted row per record.
    columns: tuple[str, ...] = ()
    cells: tuple[tuple[str, ...], ...] = ()


def kv_rows(value: Any, *, depth: int = 0) -> tuple[KV, ...]:
    """Rows for a mapping (keys sorted, so the output is deterministic) or a list (indexed)."""
    if isinstance(value, Mapping):
        items: list[tuple[str, Any]] = sorted(((str(k), v) for k, v in value.items()))
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value[:_MAX_LIST_ITEMS])]
        if len(value) > _MAX_LIST_ITEMS:
            items.append(("…", f"{len(value) - _MAX_LIST_ITEMS} more not shown"))
    else:
        return (KV(key="", text=format_value(value)),)
    return tuple(_kv_row(key, item, depth) for key, item in items)


def _is_record_list(value: Sequence[Any]) -> bool:
    """A list of mappings whose values are all scalars or short scalar lists: a table."""
    return all(isinstance(item, Mapping) for item in value) and all(
        not isinstance(v, Mapping)
        and not (
            isinstance(v, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple)) for x in v)
        )
        for item in value
        for v in item.values()
    )


def _records_row(key: str, records: Sequence[Mapping[str, Any]]) -> KV:
    columns: dict[str, None] = {}
    for record in records:
        columns.update((str(k), None) for k in record)
    shown = records[:_MAX_LIST_ITEMS]

    def cell(record: Mapping[str, Any], column: str) -> str:
        if column not in record:
            return ""
        value = record[column]
        if isinstance(value, (list, tuple)):
            return ", ".join(format_value(v) for v in value)
        return format_value(value)

    cells = tuple(tuple(cell(r, c) for c in columns) for r in shown)
    if len(records) > _MAX_LIST_ITEMS:
        cells += (
            (f"… {len(records) - _MAX_LIST_ITEMS} more not shown",) + ("",) * (len(columns) - 1),
        )
    return KV(key=key, columns=tuple(columns), cells=cells)


def _kv_row(key: str, value: Any, depth: int) -> KV:
    if isinstance(value, (Mapping, list, tuple)):
        if not value:
            return KV(key=key, text="(empty)")
        if isinstance(value, (list, tuple)) and all(
            not isinstance(v, (Mapping, list, tuple)) for v in value
        ):
            shown = [format_value(v) for v in value[:_MAX_LIST_ITEMS]]
            if len(value) > _MAX_LIST_ITEMS:
                shown.append(f"… {len(value) - _MAX_LIST_ITEMS} more")
            return KV(key=key, text=", ".join(shown))
        if depth >= _MAX_KV_DEPTH:
            return KV(key=key, text=format_value(value))
        if isinstance(value, (list, tuple)) and _is_record_list(value):
            return _records_row(key, value)
        return KV(key=key, children=kv_rows(value, depth=depth + 1))
    return KV(key=key, text=format_value(value))


__all__ = ["KV", "kv_rows"]
