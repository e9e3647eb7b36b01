"""The findings as the report lists them, ranked by what each costs: title, saving and its basis,
share of the step, fix, evidence, what a tiny run's finding says about the real model, and a
borderline value's line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diagnose.carry_over import carry_over
from diagnose.record import Finding, RunRecord
from diagnose.record import step_seconds as step_seconds_of
from diagnose.units import format_per_iteration, format_percent, is_number
from diagnose.verdicts import ranked

from .key_values import KV, kv_rows

#: How each saving basis reads in the report.
SAVING_BASIS_LABELS: dict[str, str] = {
    "measured": "measured (A/B)",
    "estimated": "estimated",
    "trace": "from the trace",
    "none": "not quantified",
}


@dataclass(frozen=True)
class FindingView:
    rank: int
    id: str
    severity: str
    category: str
    title: str
    #: "0.52 s/it", or "" when the saving is not quantified.
    saving: str
    #: "measured (A/B)", "estimated", "from the trace", "not quantified".
    saving_basis: str
    #: "28% of the step", or "".
    saving_share: str
    fix: str
    detail: str
    source: str
    evidence: tuple[KV, ...]
    #: On a tiny run, what this finding says about the real model ("" at the real size):
    #: "holds for the tiny model only: <why>", "carries over", "judged at full size".
    at_full_size: str = ""
    #: "borderline: data wait 9.6%–12.3% of the step, at the 10% line", or "".
    borderline: str = ""


def build_findings(record: RunRecord) -> tuple[FindingView, ...]:
    # Shares are of the step the verdicts graded against (the bucket mix's s/it, when mixed).
    step = step_seconds_of(record)
    scale = carry_over(record)
    kinds = {} if scale is None else {i.check_id: i for i in scale.items}
    views = []
    for i, finding in enumerate(ranked(record.findings)):
        view = _finding_view(i + 1, finding, step)
        item = kinds.get(finding.id)
        if item is not None and item.kind != "unclassified":
            note = (
                item.kind
                if item.kind != "tiny-model only"
                else f"holds for the tiny model only: {item.why}"
            )
            view = dataclasses.replace(view, at_full_size=note)
        views.append(view)
    return tuple(views)


def _finding_view(rank: int, finding: Finding, step_seconds: float | None) -> FindingView:
    saved = finding.est_seconds_saved_per_it
    quantified = saved is not None and is_number(saved)
    share = ""
    if quantified and step_seconds and saved is not None and step_seconds > 0:
        share = f"{format_percent(saved / step_seconds)} of the step"
    return FindingView(
        rank=rank,
        id=finding.id,
        severity=finding.severity,
        category=finding.category,
        title=finding.title or finding.id or "(untitled finding)",
        saving=format_per_iteration(saved, like=step_seconds) if quantified else "",
        saving_basis=_saving_basis(finding.saving_basis, quantified),
        saving_share=share,
        fix=finding.fix,
        detail=finding.detail,
        source=finding.source,
        evidence=kv_rows(finding.evidence) if finding.evidence else (),
        borderline=borderline_line(finding),
    )


def borderline_line(finding: Finding) -> str:
    """What a borderline finding's value says against its line, for the finding's line."""
    if finding.borderline is None or not finding.borderline.text:
        return ""
    return (
        f"borderline: {finding.borderline.text} (a rerun may land on either side; "
        "the CI gate reads a change across it as no change)"
    )


def _saving_basis(basis: str, quantified: bool) -> str:
    if not quantified:
        return SAVING_BASIS_LABELS["none"]
    if basis == "none":  # a number without its basis (an older or hand-written record)
        return "how obtained not recorded"
    return SAVING_BASIS_LABELS.get(basis, basis)


__all__ = ["SAVING_BASIS_LABELS", "FindingView", "borderline_line", "build_findings"]
