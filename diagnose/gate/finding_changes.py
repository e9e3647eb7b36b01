"""The findings diff: new, gone and re-graded findings between the records.

A finding borderline on either side (its deciding value straddled its line, see
:class:`diagnose.record.Borderline`) that moved only across that line is listed as
``borderline``, never as new or re-graded: a rerun of the same code may land on either side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from diagnose.record import SEVERITIES, Finding, RunRecord

FindingChangeKind = Literal["new", "gone", "escalated", "deescalated", "borderline"]
_SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class FindingChange:
    """A finding that appeared, disappeared or changed severity between the records."""

    id: str
    change: FindingChangeKind
    title: str
    category: str
    baseline_severity: str | None
    current_severity: str | None
    #: The current finding's estimated saving (or the baseline's, for a gone one).
    est_seconds_saved_per_it: float | None = None
    #: For a ``borderline`` change: which side was borderline and at what, in words.
    note: str = ""

    @property
    def severity(self) -> str:
        """The severity that matters now: the current one, else the baseline's."""
        return self.current_severity or self.baseline_severity or "info"


def diff_findings(
    baseline: RunRecord | Sequence[RunRecord], current: RunRecord
) -> tuple[FindingChange, ...]:
    """New, gone and re-graded findings by id: new and escalated first, most severe first.

    With several baselines, a finding changes only when its current severity is outside the
    range the baselines showed (absent counting below info): a finding that some baselines had
    as info and others as warn is not "escalated" when it is warn now.
    """
    baselines = [baseline] if isinstance(baseline, RunRecord) else list(baseline)
    before = [{f.id: f for f in record.findings} for record in baselines]
    after = {f.id: f for f in current.findings}
    absent = -1

    def rank(finding: Finding | None) -> int:
        return absent if finding is None else _SEVERITY_RANK.get(finding.severity, 0)

    ids = list(after) + [fid for found in before for fid in found if fid not in after]
    out: list[FindingChange] = []
    for fid in dict.fromkeys(ids):
        olds = [found.get(fid) for found in before]
        ranks = [rank(old) for old in olds]
        low, high = min(ranks), max(ranks)
        now = after.get(fid)
        current_rank = rank(now)
        kind: FindingChangeKind
        if current_rank > high:
            kind, bound = ("new" if high == absent else "escalated"), high
        elif current_rank < low:
            kind, bound = ("gone" if now is None else "deescalated"), low
        else:
            continue
        latest = next((old for old in reversed(olds) if old is not None), None)
        shown = now or latest
        assert shown is not None  # the id came from the current record or a baseline
        note = _across_a_borderline(olds, now, [*ranks, current_rank])
        if note:
            kind = "borderline"
        out.append(
            FindingChange(
                id=fid,
                change=kind,
                title=shown.title,
                category=shown.category,
                baseline_severity=SEVERITIES[bound] if bound != absent else None,
                current_severity=now.severity if now else None,
                est_seconds_saved_per_it=shown.est_seconds_saved_per_it,
                note=note,
            )
        )
    order = {"new": 0, "escalated": 1, "deescalated": 2, "gone": 3, "borderline": 4}
    out.sort(key=lambda c: (order[c.change], -_SEVERITY_RANK.get(c.severity, 0), c.id))
    return tuple(out)


#: The severities (ranks; -1 absent) a finding moves between when its value sits on a line:
#: a rule's own line or the warn line (absent, info, warn), the critical line (warn, critical).
_ACROSS = {"": (-1, 1), "warn": (-1, 1), "critical": (1, 2)}


def _across_a_borderline(
    olds: Sequence[Finding | None], now: Finding | None, ranks: Sequence[int]
) -> str:
    """Why a change is no change: a side was borderline at a line and every side's severity is
    one a value on that line gives. "" when the change stands."""
    sides = [
        (f"baseline {i + 1}" if len(olds) > 1 else "the baseline", old)
        for i, old in enumerate(olds)
    ]
    sides.append(("the current record", now))
    for name, finding in sides:
        if finding is None or finding.borderline is None:
            continue
        low, high = _ACROSS.get(finding.borderline.line_severity, (-1, 1))
        if all(low <= r <= high for r in ranks):
            return f"borderline in {name} ({finding.borderline.text}): not counted as a change"
    return ""
