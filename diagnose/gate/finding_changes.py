"""The findings diff: new, gone and re-graded findings between the records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from diagnose.record import SEVERITIES, Finding, RunRecord

FindingChangeKind = Literal["new", "gone", "escalated", "deescalated"]
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
        out.append(
            FindingChange(
                id=fid,
                change=kind,
                title=shown.title,
                category=shown.category,
                baseline_severity=SEVERITIES[bound] if bound != absent else None,
                current_severity=now.severity if now else None,
                est_seconds_saved_per_it=shown.est_seconds_saved_per_it,
            )
        )
    order = {"new": 0, "escalated": 1, "deescalated": 2, "gone": 3}
    out.sort(key=lambda c: (order[c.change], -_SEVERITY_RANK.get(c.severity, 0), c.id))
    return tuple(out)
