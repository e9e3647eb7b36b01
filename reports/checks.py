"""What was checked, as the report shows it: the checks found fine, those that could not be made
(a skipped or failed probe, a check a probe could not judge), and one row per probe with its
status, duration, findings and data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diagnose.errors import first_line
from diagnose.record import Finding, ProbeResult
from diagnose.units import format_seconds

from .key_values import KV, kv_rows

#: NotChecked.status of one check a probe that ran could not make.
NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class CheckedOk:
    probe: str
    text: str


@dataclass(frozen=True)
class NotChecked:
    probe: str
    #: "skipped" or "error" (the whole probe), or "not judged" (one check of a probe that ran).
    status: str
    reason: str
    traceback: str


@dataclass(frozen=True)
class ProbeRow:
    name: str
    status: str
    duration: str
    reason: str
    findings: int
    traceback: str
    data: tuple[KV, ...]


@dataclass(frozen=True)
class ChecksView:
    found_fine: tuple[CheckedOk, ...]
    could_not_check: tuple[NotChecked, ...]
    probes: tuple[ProbeRow, ...]
    #: Names of the probes that ran to completion (for the "no finding" state).
    ran: tuple[str, ...]
    #: "12 ok, 1 skipped, 1 error".
    status_counts: str


def build_checks(probes: Sequence[ProbeResult], findings: Sequence[Finding] = ()) -> ChecksView:
    # A saved record keeps its findings in RunRecord.findings, each naming its source probe.
    by_source: dict[str, int] = {}
    for finding in findings:
        # Trace rules name themselves "trace:<rule>"; they belong to the "trace" row.
        source = finding.source.split(":", 1)[0]
        by_source[source] = by_source.get(source, 0) + 1
    # Findings, "checked and found fine" and "could not be checked" are views of one check list.
    found_fine = tuple(CheckedOk(p.name, c.text) for p in probes for c in p.checks_with("ok"))
    could_not_check = tuple(
        NotChecked(
            probe=p.name,
            status=p.status,
            reason=first_line(p.reason, limit=None)
            or (
                "no reason recorded"
                if p.status == "skipped"
                else _last_line(p.traceback) or "no error recorded"
            ),
            traceback=p.traceback if p.status == "error" else "",
        )
        for p in probes
        if p.status != "ok"
    ) + tuple(
        NotChecked(
            probe=p.name, status=NOT_JUDGED, reason=first_line(c.text, limit=None), traceback=""
        )
        for p in probes
        for c in p.checks_with("not_judged")
    )
    rows = tuple(
        ProbeRow(
            name=p.name,
            status=p.status,
            duration=format_seconds(p.duration_seconds),
            reason=first_line(p.reason, limit=None),
            findings=len(p.findings) + by_source.get(p.name, 0),
            traceback=p.traceback,
            data=kv_rows(p.data) if p.data else (),
        )
        for p in probes
    )
    counts: dict[str, int] = {}
    for p in probes:
        counts[p.status] = counts.get(p.status, 0) + 1
    order = ["ok", "skipped", "error", *sorted(set(counts) - {"ok", "skipped", "error"})]
    status_counts = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    return ChecksView(
        found_fine=found_fine,
        could_not_check=could_not_check,
        probes=rows,
        ran=tuple(p.name for p in probes if p.status == "ok"),
        status_counts=status_counts or "no probe ran",
    )


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip() if text.strip() else ""


__all__ = ["NOT_JUDGED", "CheckedOk", "ChecksView", "NotChecked", "ProbeRow", "build_checks"]
