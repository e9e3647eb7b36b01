"""One rule for every verdict: how a finding's saving is bounded, how severe it is, how findings
rank, and how the checks of several probes and trace rules become one answer per question.

Probes and trace rules say what they measured (a saving, its basis, how sure it is, the phases it
lives in); this module alone turns that into severity and order when the record is settled, so two
findings of the same size always read the same, whoever raised them. Torch-free: reports and the
CI gate import it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diagnose.record import (
    SEVERITIES,
    Borderline,
    Check,
    Finding,
    Outcome,
    ProbeResult,
    RunRecord,
    Severity,
    phase_bound,
    step_seconds,
)
from diagnose.stats import AtLine, at_line
from diagnose.units import pct_fine

if TYPE_CHECKING:
    from diagnose.catalogs import FindingSpec

#: Share of the step a finding's (sure) saving must reach to be a warning, and to be critical.
WARN_SHARE = 0.10
CRITICAL_SHARE = 0.30
#: An estimate (a model of what a fix would save, not a measurement) is never graded above this:
#: critical needs an A/B measurement or time read off a trace.
ESTIMATE_CEILING: Severity = "warn"
#: Slack when checking a bound, for rounding in the recorded numbers.
_TOLERANCE = 1e-9
#: Evidence key of a finding: {label of a change its A/B measured no faster: the words of that
#: change's advice}. Its fix must not carry those words (:func:`contradictions` checks).
NO_FASTER_KEY = "measured_no_faster"
#: How a line states the threads torch computes on ("torch uses 2 threads").
_THREADS_SAID = re.compile(r"torch (?:uses|is set to|computes on) (\d+) threads?")

_SEVERITY_ORDER = {s: i for i, s in enumerate(SEVERITIES)}
#: When two sources answer one question differently, the answer kept: a finding (time measured
#: lost) over ok (found fine) over not judged (no answer here).
_OUTCOME_STRENGTH: dict[Outcome, int] = {"finding": 2, "ok": 1, "not_judged": 0}


@dataclass(frozen=True)
class Grade:
    """A saving's severity, and the line its interval straddles, if any."""

    severity: Severity
    #: Set when the interval straddles the next severity's line: the finding is borderline there.
    borderline: Borderline | None = None


#: The lines a saving's share of the step is held against, lowest first.
_SEVERITY_LINES: tuple[tuple[Severity, float], ...] = (
    ("warn", WARN_SHARE),
    ("critical", CRITICAL_SHARE),
)


def graded(
    share: float | None,
    basis: str,
    fallback: Severity = "info",
    *,
    low: float | None = None,
    high: float | None = None,
) -> Grade:
    """The severity of a saving of ``share`` of the step, obtained on ``basis``, whose interval
    is ``low``–``high`` (each the share itself when not given).

    Each severity's line is passed when the whole interval lies at or above it
    (:func:`diagnose.stats.at_line`); an interval that straddles a line leaves the finding one
    severity below it, borderline there. None (no saving can be said) gives ``fallback``, the
    severity the finding's own kind carries."""
    if share is None or not math.isfinite(share):
        return Grade(fallback)
    interval = (share if low is None else low, share if high is None else high)
    severity: Severity = "info"
    borderline: Borderline | None = None
    for name, line in _SEVERITY_LINES:
        reading = at_line(share, line, interval=interval)
        if reading.above:
            severity = name
            continue
        if reading.borderline:
            borderline = borderline_at(reading, "saving", " of the step", line_severity=name)
        break
    ceiling = _SEVERITY_ORDER[ESTIMATE_CEILING]
    if basis == "estimated" and _SEVERITY_ORDER[severity] >= ceiling:
        # Never graded above the ceiling, so there is no line above it to be borderline at.
        severity, borderline = ESTIMATE_CEILING, None
    return Grade(severity, borderline)


def grade(share: float | None, basis: str, fallback: Severity = "info") -> Severity:
    """The severity of a saving of ``share`` of the step (a single number) on ``basis``."""
    return graded(share, basis, fallback).severity


def borderline_at(
    reading: AtLine, what: str, of: str = "", *, line_severity: str = "", ratio: bool = False
) -> Borderline:
    """The :class:`Borderline` of a share (``ratio``: a factor) straddling its line, in words:
    ``data wait 9.6%–12.3% of the step, at the 10% line``. ``line_severity``: the severity the
    line gives, "" for a rule's own line (whether the finding is raised at all)."""
    if not ratio:
        # The statistical interval of a few steps' shares may reach past 0 or 1; no share can.
        low, high = reading.share_interval()
        reading = replace(reading, low=min(low, reading.value), high=max(high, reading.value))
    return Borderline(
        line_severity=line_severity,
        text=reading.words(what, _times if ratio else pct_fine, of),
        value=reading.value,
        line=reading.line,
        low=reading.low,
        high=reading.high,
    )


def _times(factor: float) -> str:
    return f"{factor:.2f}×"


def shown_severity(grade: Grade, borderline: Borderline | None) -> Severity:
    """The severity a finding is shown at: its grade, held one below a line it is borderline at
    (a rule's own line or the warn line: info; the critical line: warn)."""
    if borderline is None:
        return grade.severity
    below: Severity = "warn" if borderline.line_severity == "critical" else "info"
    return below if _SEVERITY_ORDER[grade.severity] > _SEVERITY_ORDER[below] else grade.severity


def saving_bound(
    record: RunRecord, finding: Finding, specs: Sequence[FindingSpec]
) -> tuple[float | None, str]:
    """The most ``finding`` could save, and what bounds it ("the step", "its phases: ...", "the
    step less the GPU's busy time" for time the device waits for the host)."""
    step = step_seconds(record)
    bound, why = step, "the step"
    if finding.phases:
        in_phases = phase_bound(record, finding.phases)
        if in_phases is not None and (bound is None or in_phases < bound):
            bound, why = in_phases, "the time of " + " + ".join(finding.phases)
    busy = record.breakdown.device_busy_seconds
    entry = (
        next((s for s in specs if s.id == finding.id), None)
        if busy is not None and step is not None
        else None
    )
    if entry is not None and entry.host_bound and step is not None and busy is not None:
        idle = max(step - busy, 0.0)
        if bound is None or idle < bound:
            bound, why = idle, "the step less the GPU's busy time"
    return bound, why


def settle_findings(record: RunRecord, specs: Sequence[FindingSpec]) -> None:
    """Bound every saving by its step and phases, then grade every finding by the one rule."""
    step = step_seconds(record)
    for finding in record.findings:
        bound, why = saving_bound(record, finding, specs)
        saving = finding.est_seconds_saved_per_it
        if saving is not None and bound is not None and saving > bound + _TOLERANCE:
            finding.evidence = {
                **finding.evidence,
                "saving_before_cap_seconds": saving,
                "saving_cap": f"capped at {why}: a fix cannot save more than that",
            }
            finding.est_seconds_saved_per_it = bound
        est = finding.est_seconds_saved_per_it
        sure = finding.sure_seconds_saved_per_it
        if sure is not None and est is not None:
            finding.sure_seconds_saved_per_it = min(sure, est)
        high = finding.high_seconds_saved_per_it
        if high is not None and est is not None:
            finding.high_seconds_saved_per_it = max(high, est)
            if bound is not None:
                finding.high_seconds_saved_per_it = min(finding.high_seconds_saved_per_it, bound)
        result = finding_grade(finding, step)
        # A rule's own line (whether to raise it at all) straddled stands; else the grade's.
        if finding.borderline is None or finding.borderline.line_severity:
            finding.borderline = result.borderline
        finding.severity = shown_severity(result, finding.borderline)


def finding_grade(finding: Finding, step: float | None) -> Grade:
    """The grade of ``finding``'s saving: its share of ``step``, on the interval from the part
    the measurement is sure of to its high end (a saving without an interval: the sure saving,
    else the saving, as a single number)."""
    saving = finding.est_seconds_saved_per_it
    sure = finding.sure_seconds_saved_per_it
    if saving is None or step is None:
        share = None if sure is None or step is None else max(0.0, sure) / step
        return graded(share, finding.saving_basis, finding.severity)
    share = max(0.0, saving) / step
    low = None if sure is None else max(0.0, sure) / step
    high = finding.high_seconds_saved_per_it
    return graded(
        share,
        finding.saving_basis,
        finding.severity,
        low=low,
        high=None if high is None else max(0.0, high) / step,
    )


def ranked(findings: Iterable[Finding]) -> list[Finding]:
    """Critical, then warn, then info; within a severity the largest saving first, then by id."""
    return sorted(
        findings,
        key=lambda f: (
            -_SEVERITY_ORDER.get(f.severity, -1),
            -(f.est_seconds_saved_per_it or 0.0),
            f.id,
        ),
    )


# --------------------------------------------------------------------------------------------
# One answer per question


def reconcile_checks(record: RunRecord, specs: Sequence[FindingSpec]) -> None:
    """Give every check id one outcome in the record.

    Sources can disagree (a probe that measured a slow loader, a trace rule that saw little wait
    in the profiled steps): the strongest answer stands, a finding over ok over not judged, and a
    finding keeps what the weaker answers said in its evidence so the reader sees both numbers.
    A finding check without a finding in the record (its finding was merged away) is dropped.
    """
    _set_aside_trace_answers(record, specs)
    finding_ids = {f.id for f in record.findings}
    best: dict[str, int] = {}
    for check in record.all_checks():
        if check.outcome == "finding" and check.id not in finding_ids:
            continue
        best[check.id] = max(best.get(check.id, -1), _OUTCOME_STRENGTH[check.outcome])
    overruled: dict[str, list[Check]] = {}
    for probe in record.probes:
        kept: list[Check] = []
        seen_finding: set[str] = set()
        for check in probe.checks:
            if check.outcome == "finding" and check.id not in finding_ids:
                continue
            if _OUTCOME_STRENGTH[check.outcome] < best.get(check.id, -1):
                overruled.setdefault(check.id, []).append(check)
                continue
            if check.outcome == "finding":
                if check.id in seen_finding:
                    continue
                seen_finding.add(check.id)
            kept.append(check)
        probe.checks = kept
    # A finding whose probe was merged away still has its check, under the source that raised it.
    present = {c.id for c in record.all_checks() if c.outcome == "finding"}
    for finding in record.findings:
        if finding.id in present:
            continue
        owner = _owner(record, finding.source)
        owner.checks.append(Check(finding.id, "finding", finding.title, finding.source))
        present.add(finding.id)
    for finding in record.findings:
        others = overruled.get(finding.id)
        if others:
            finding.evidence = {
                **finding.evidence,
                "also_checked": [f"{c.source}: {c.text}" for c in others if c.outcome == "ok"],
            }
            if not finding.evidence["also_checked"]:
                del finding.evidence["also_checked"]


def from_trace(source: str) -> bool:
    """Whether a check or finding was read off a trace by a trace rule (``trace:<rule>``)."""
    return source == "trace" or source.startswith("trace:")


def _set_aside_trace_answers(record: RunRecord, specs: Sequence[FindingSpec]) -> None:
    """For the questions whose catalog entry says a probe's answer stands, drop the trace rules'
    answers when a probe answered too; what they said is kept in the probe's finding's evidence,
    or in a note when the probe found nothing."""
    for entry in specs:
        if not entry.probe_answer_stands:
            continue
        answers = [c for c in record.all_checks() if c.id == entry.id]
        if not any(not from_trace(c.source) for c in answers):
            continue
        said = [f"{c.source}: {c.text}" for c in answers if from_trace(c.source)]
        for probe in record.probes:
            probe.checks = [
                c for c in probe.checks if not (c.id == entry.id and from_trace(c.source))
            ]
        record.findings = [
            f for f in record.findings if not (f.id == entry.id and from_trace(f.source))
        ]
        if not said:
            continue
        kept = next((f for f in record.findings if f.id == entry.id), None)
        if kept is not None:
            kept.evidence = {**kept.evidence, "trace_profiled_steps_said": said}
        else:
            record.notes.append(
                "The profiled steps' trace answered differently, set aside for the timed "
                "steps' measurement: " + "; ".join(said)
            )


def _owner(record: RunRecord, source: str) -> ProbeResult:
    name = source.split(":", 1)[0] or "record"
    for probe in record.probes:
        if probe.name == name:
            return probe
    probe = ProbeResult(name=name, status="ok")
    record.probes.append(probe)
    return probe


def settle(record: RunRecord, specs: Sequence[FindingSpec]) -> None:
    """What every record goes through before it is saved: one answer per question, savings
    bounded, severities graded by the one rule. ``specs``: the catalog's entries
    (:func:`diagnose.catalogs.specs`), passed in: the catalogs grade with this module."""
    for probe in record.probes:
        probe.settle_checks(probe.name)
    settle_findings(record, specs)
    reconcile_checks(record, specs)
    # Whatever is left would be a bug of ours: the page says so rather than hide it.
    for problem in contradictions(record, specs):
        record.notes.append(f"Internal inconsistency in this record (please report it): {problem}")


# --------------------------------------------------------------------------------------------
# The consistency a settled record must have


@dataclass(frozen=True)
class Contradiction:
    check_id: str
    problem: str

    def __str__(self) -> str:
        return f"{self.check_id}: {self.problem}"


def contradictions(record: RunRecord, specs: Sequence[FindingSpec]) -> list[Contradiction]:
    """Everything on the page that disagrees with something else on it (empty for a sound
    record): a question with two answers, a finding without its check or a check without its
    finding, a saving above its step or phases, a severity the one rule would not give."""
    problems: list[Contradiction] = []
    outcomes: dict[str, set[str]] = {}
    for check in record.all_checks():
        outcomes.setdefault(check.id, set()).add(check.outcome)
    for check_id, found in sorted(outcomes.items()):
        if len(found) > 1:
            problems.append(Contradiction(check_id, f"answered {' and '.join(sorted(found))}"))
    finding_ids = {f.id for f in record.findings}
    for check_id, found in outcomes.items():
        if "finding" in found and check_id not in finding_ids:
            problems.append(Contradiction(check_id, "a finding check without its finding"))
    for finding in record.findings:
        if "finding" not in outcomes.get(finding.id, set()):
            problems.append(Contradiction(finding.id, "a finding without its check"))
    raised = [f.id for f in record.findings]
    for twice in sorted({i for i in raised if raised.count(i) > 1}):
        problems.append(Contradiction(twice, "raised as two findings"))
    step = step_seconds(record)
    for finding in record.findings:
        saving = finding.est_seconds_saved_per_it
        bound, why = saving_bound(record, finding, specs)
        if saving is not None and bound is not None and saving > bound * (1 + 1e-6) + _TOLERANCE:
            problems.append(
                Contradiction(finding.id, f"saves {saving:.6g} s/it, more than {why} ({bound:.6g})")
            )
        result = finding_grade(finding, step)
        rule_line = finding.borderline is not None and not finding.borderline.line_severity
        kept = finding.borderline if rule_line else result.borderline
        expected = shown_severity(result, kept)
        if expected != finding.severity:
            problems.append(
                Contradiction(finding.id, f"severity {finding.severity}, the rule gives {expected}")
            )
        if not rule_line and (finding.borderline is None) != (result.borderline is None):
            said = "borderline" if finding.borderline is not None else "not borderline"
            problems.append(
                Contradiction(finding.id, f"{said}, while its saving's interval says otherwise")
            )
    problems.extend(_one_story(record))
    return problems


def _one_story(record: RunRecord) -> list[Contradiction]:
    """A fix its own evidence contradicts (it advises a change the A/B measured no faster), and
    a line that states other torch threads than the steps ran on without saying so."""
    problems: list[Contradiction] = []
    for finding in record.findings:
        no_faster = finding.evidence.get(NO_FASTER_KEY)
        if not isinstance(no_faster, dict):
            continue
        for label, words in no_faster.items():
            if isinstance(words, str) and words.lower() in finding.fix.lower():
                problems.append(
                    Contradiction(
                        finding.id, f"its fix advises {words!r}, measured no faster ({label})"
                    )
                )
    ran = record.device.extra.get("torch_threads")
    if isinstance(ran, int) and not isinstance(ran, bool):
        lines = [(c.id, c.text) for c in record.all_checks()]
        lines += [(f.id, f.title) for f in record.findings]
        for check_id, text in lines:
            for said in _THREADS_SAID.finditer(text):
                if int(said.group(1)) != ran and f"ran on {ran}" not in text:
                    problems.append(
                        Contradiction(
                            check_id, f"says {said.group(0)!r}, while the steps ran on {ran}"
                        )
                    )
    return problems


__all__ = [
    "CRITICAL_SHARE",
    "ESTIMATE_CEILING",
    "NO_FASTER_KEY",
    "WARN_SHARE",
    "Contradiction",
    "Grade",
    "borderline_at",
    "contradictions",
    "finding_grade",
    "from_trace",
    "grade",
    "graded",
    "phase_bound",
    "ranked",
    "reconcile_checks",
    "saving_bound",
    "settle",
    "settle_findings",
    "shown_severity",
    "step_seconds",
]
