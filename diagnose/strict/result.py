"""The strict logs of a run's processes, read back into the record: one ``strict`` result whose
checks answer ``precision.strict_violation`` and ``attention.strict_violation`` (a finding, fine,
or not judged and why), with every violation, the accepted ones and the allow-list in its data.
Torch-free."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from diagnose.catalogs.strict_catalog import (
    CHECK_IDS,
    no_claim_text,
    ok_text,
    stopped_text,
    strict_finding,
)
from diagnose.record import ProbeResult, RunRecord
from diagnose.strict.options import StrictOptions
from diagnose.strict.violations import LOG_PREFIX, LOG_SUFFIX, StrictLog, Violation

#: The name of the result in the record.
STRICT_PROBE = "strict"


def read_logs(folder: Path) -> list[StrictLog]:
    """The logs the processes wrote into ``folder`` (unreadable ones are skipped)."""
    logs: list[StrictLog] = []
    for path in sorted(folder.glob(f"{LOG_PREFIX}*{LOG_SUFFIX}")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            logs.append(StrictLog.from_dict(data))
    return logs


def violation_count(logs: Sequence[StrictLog]) -> int:
    """Distinct violations (not accepted by ``--strict-allow``) over all processes."""
    return len(_merged([v for log in logs for v in log.violations]))


def _merged(violations: Sequence[Violation]) -> list[Violation]:
    """One entry per (check, module, op) over the processes, counts summed, most calls first."""
    merged: dict[tuple[str, str, str], Violation] = {}
    for violation in violations:
        entry = merged.get(violation.key)
        if entry is None:
            merged[violation.key] = Violation.from_dict(violation.to_dict())
        else:
            entry.count += violation.count
            entry.first_step = min(entry.first_step, violation.first_step)
    return sorted(merged.values(), key=lambda v: (-v.count, v.module, v.op))


def _claim_text(logs: Sequence[StrictLog]) -> str:
    claim = next((log.claim for log in logs if log.claim is not None), None)
    return f"{claim.dtype}, claimed by {claim.by}" if claim is not None else ""


def strict_result(options: StrictOptions, logs: Sequence[StrictLog]) -> ProbeResult:
    """The ``strict`` result of a run whose processes wrote ``logs``."""
    probe = ProbeResult(name=STRICT_PROBE, status="ok")
    probe.data = {
        "options": options.to_dict(),
        "claim": _claim_text(logs),
        "processes": [log.to_dict() for log in logs],
    }
    watched = max((log.watched_steps for log in logs), default=0)
    ops = sum(log.ops_judged for log in logs)
    stopped = any(log.stopped for log in logs)
    errors = sorted({log.error for log in logs if log.error})
    claim = _claim_text(logs)
    for check in options.checks:
        check_id = CHECK_IDS[check]
        found = _merged([v for log in logs for v in log.violations if v.check == check])
        allowed = _merged([v for log in logs for v in log.allowed if v.check == check])
        notes = [n for log in logs for n in log.not_judged if n.check == check]
        if found:
            probe.add_finding(
                strict_finding(
                    check,
                    [v.to_dict() for v in found],
                    stopped=stopped,
                    watched_steps=watched,
                    claim=claim or "a fused attention kernel where one runs",
                    allowed=[v.to_dict() for v in allowed],
                )
            )
        elif errors:
            probe.add_not_judged(check_id, f"strict {check}: strict mode failed: {errors[0]}")
        elif stopped:
            probe.add_not_judged(check_id, stopped_text(check, ops))
        elif not logs or (not watched and not stopped):
            probe.add_not_judged(
                check_id, f"strict {check}: no watched step ended (the run stopped before)"
            )
        elif check == "precision" and not claim:
            probe.add_not_judged(check_id, no_claim_text())
        elif notes and check == "attention":
            first = notes[0]
            more = f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""
            probe.add_not_judged(check_id, f"strict attention: {first.text}{more}")
        else:
            text = ok_text(check, watched, ops, claim)
            if allowed:
                text += f"; {sum(v.count for v in allowed)} call(s) accepted by --strict-allow"
            probe.add_ok(check_id, text)
    return probe


def add_strict(record: RunRecord, options: StrictOptions, logs: Sequence[StrictLog]) -> None:
    """Put strict mode's result into ``record``, with notes on what it did to the steps."""
    record.probes.append(strict_result(options, logs))
    stopped = next((log for log in logs if log.stopped), None)
    if stopped is not None:
        record.notes.append(
            f"--strict stopped the run at its first violation, in watched step "
            f"{max(1, stopped.watched_steps + 1)}: the steps after it were not measured."
        )
    elif record.timing.samples and any(log.watched_steps for log in logs):
        record.notes.append(
            "The steps were measured with --strict's checks installed: the s/it includes their "
            "cost on every op (see docs/strict.md); measure without --strict for the run's "
            "own s/it."
        )


def has_violations(record: RunRecord) -> bool:
    """Whether ``record``'s strict result holds a violation (accepted ones do not count)."""
    return any(p.checks_with("finding") for p in record.probes if p.name == STRICT_PROBE)


def summary_line(logs: Sequence[StrictLog]) -> str:
    """One line for the terminal: how many violations, and the first."""
    found = _merged([v for log in logs for v in log.violations])
    if not found:
        return "strict: no violation"
    first = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"strict: {len(found)} violation(s): {first.check}: {first.headline()}{more}"


__all__ = [
    "STRICT_PROBE",
    "add_strict",
    "has_violations",
    "read_logs",
    "strict_result",
    "summary_line",
    "violation_count",
]
