"""Upgrades of RunRecord documents written by older schema versions, one step per version.

Kept apart from :mod:`diagnose.record`: the data model says what a record is now; this says how
older ones become it. Pure functions of JSON-like dicts (nothing heavy is imported).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


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
