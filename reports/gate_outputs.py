"""Renderers of a comparison (the CI gate): terminal table, JUnit XML, markdown, and the view the
HTML report's comparison section is laid out from.

They read a :class:`~diagnose.gate.Comparison` and the gate's criteria only: the statistics are
done. Every output says the verdict of the gate first, then says loudly when the records were not
like for like (``--allow-different``), then gives the table.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass

from diagnose.errors import ExitCode
from diagnose.gate import (
    Comparison,
    FindingChange,
    GateFailure,
    MetricComparison,
    RecordSide,
    baseline_name,
    gate_failures,
    gate_status,
)
from diagnose.units import (
    format_bytes,
    format_per_iteration,
    format_percent,
    format_seconds,
    is_number,
    pct_change,
)

#: How a verdict reads, and the badge class the HTML gives it (existing report.css classes).
VERDICT_BADGE: dict[str, str] = {
    "slower": "sev-critical",
    "larger": "sev-critical",
    "lower": "sev-critical",
    "inconclusive": "sev-warn",
    "faster": "status-ok",
    "smaller": "status-ok",
    "higher": "status-ok",
    "same": "",
}

_KIND_CLASSNAME: dict[str, str] = {
    "step": "diagnose.compare.step",
    "phase": "diagnose.compare.phase",
    "memory": "diagnose.compare.memory",
    "kernel_class": "diagnose.compare.kernel_class",
    "utilisation": "diagnose.compare.utilisation",
}
FINDINGS_CLASSNAME = "diagnose.compare.findings"

# C0/C1 control characters: invalid in XML 1.0, and able to drive a terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _clean(text: str) -> str:
    """One line of record text, safe for a terminal, an XML attribute or a table cell."""
    return " ".join(_CONTROL.sub(" ", text).split())


# --------------------------------------------------------------------------------------------
# The display-ready view (shared by every renderer)


@dataclass(frozen=True)
class MetricRow:
    key: str
    kind: str
    label: str
    baseline: str
    current: str
    change: str
    #: Confidence interval of the change ("+3.1%…+9.0%"), "" when none.
    interval: str
    p_value: str
    samples: str
    verdict: str
    badge: str
    reason: str
    #: The gate criterion this row fails, or "".
    fails: str


@dataclass(frozen=True)
class FindingRow:
    id: str
    change: str
    severity: str
    was: str
    title: str
    category: str
    fails: str
    #: Why a borderline change is no change, or "".
    note: str = ""


@dataclass(frozen=True)
class CompareView:
    passed: bool
    #: "PASS" or "FAIL".
    status: str
    #: One sentence: the gate's verdict and the s/it change.
    summary: str
    #: The loud not-like-for-like warning, or "".
    warning: str
    #: "--fail-on slower,new-critical · threshold 10% · significance 0.01 ...".
    gate: str
    #: One line per baseline record ("label · 88 ms/it (median of 30 ...) · created · ...").
    baselines: tuple[str, ...]
    current: str
    #: With several baselines: how far apart their s/it medians are (the runner's drift), or "".
    drift: str
    rows: tuple[MetricRow, ...]
    findings: tuple[FindingRow, ...]
    failures: tuple[str, ...]
    environment_changes: tuple[str, ...]
    notes: tuple[str, ...]
    #: Set instead of everything else when the records could not be compared at all.
    refused: str = ""
    #: The per-step chart (inline SVG), drawn for the HTML report only (see compare_chart_svg).
    chart: str = ""


def _value(metric: MetricComparison, value: float | None, like: float | None) -> str:
    if value is None or not is_number(value):
        return "—"
    if metric.unit == "bytes":
        return format_bytes(value)
    if metric.unit == "fraction":
        return format_percent(value)
    if metric.kind == "step":
        return format_per_iteration(value)
    return format_seconds(value, like=like)


def _interval(metric: MetricComparison) -> str:
    if metric.ci_low is None or metric.ci_high is None:
        return ""
    # To a tenth of a per cent, as the verdict's own words say it (a +10.4% end rounded to
    # "+10%" would read as inside a ±10% threshold the verdict says it reaches beyond).
    return f"{pct_change(metric.ci_low - 1)}…{pct_change(metric.ci_high - 1)}"


def _p_value(metric: MetricComparison) -> str:
    if metric.p_value is None:
        return "—"
    return f"{metric.p_value:.2g}" if metric.p_value >= 1e-4 else "<0.0001"


def _change(metric: MetricComparison) -> str:
    if metric.change is not None:
        return format_percent(metric.change, signed=True) or "—"
    if metric.baseline is not None and metric.current is not None:
        return "new" if metric.current > 0 else "0 → 0"
    return "—"


def gate_text(comparison: Comparison) -> str:
    o = comparison.options
    phases = [m for m in comparison.metrics if m.kind == "phase"]
    text = (
        f"--fail-on {','.join(sorted(o.fail_on)) or '(nothing)'} · threshold "
        f"{format_percent(o.threshold)} · significance {o.significance:g}"
    )
    if phases and phases[0].significance is not None:
        text += (
            f" (phases {phases[0].significance:.2g}, Bonferroni over {len(phases)}; a phase must "
            f"also move by {format_percent(o.phase_floor)} of the baseline step)"
        )
    return text + " · CI: confidence interval of the change at 1 − significance"


def _side_text(side: RecordSide) -> str:
    parts = [_clean(side.label)]
    if side.median_seconds is not None:
        parts.append(
            f"{format_per_iteration(side.median_seconds)} (median of {side.n_samples} "
            f"{side.samples_kind} steps)"
        )
    if side.created:
        parts.append(_clean(side.created))
    parts.append(f"diagnose {_clean(side.tool_version)}")
    if side.setup:
        parts.append(_clean(side.setup))
    return " · ".join(parts)


def drift_text(comparison: Comparison) -> str:
    """How far apart several baselines' s/it medians are, or "" with one baseline."""
    if comparison.baseline_drift is None:
        return ""
    n = sum(side.median_seconds is not None for side in comparison.baselines)
    beyond = comparison.baseline_drift > comparison.options.threshold
    return (
        f"the {n} baselines' s/it medians span {format_percent(comparison.baseline_drift)} "
        "(this runner's run-to-run drift" + (", more than the threshold)" if beyond else ")")
    )


def build_compare_view(comparison: Comparison, fail_on: Iterable[str] | None = None) -> CompareView:
    failures = gate_failures(comparison, fail_on)
    failing: dict[str, str] = {}
    for failure in failures:
        failing.setdefault(failure.subject, failure.criterion)
    step = comparison.step
    step_seconds = step.baseline if step is not None else None
    rows = tuple(
        MetricRow(
            key=m.key,
            kind=m.kind,
            label=_clean(m.label),
            baseline=_value(m, m.baseline, step_seconds),
            current=_value(m, m.current, step_seconds),
            change=_change(m),
            interval=_interval(m),
            p_value=_p_value(m),
            samples=f"{m.n_baseline} / {m.n_current}",
            verdict=m.verdict,
            badge=VERDICT_BADGE.get(m.verdict, ""),
            reason=_clean(m.reason),
            fails=failing.get(m.key, ""),
        )
        for m in comparison.metrics
    )
    findings = tuple(_finding_row(c, failing.get(c.id, "")) for c in comparison.findings)
    passed = not failures
    outcome = gate_status(failures)
    status = {ExitCode.OK: "PASS", ExitCode.INCONCLUSIVE: "INCONCLUSIVE"}.get(outcome, "FAIL")
    if step is None:
        s_it = "s/it not compared"
    else:
        s_it = f"s/it {step.verdict}"
        if step.change is not None:
            s_it += f" ({format_percent(step.change, signed=True)}"
            p_text = _p_value(step)
            p_text = p_text if p_text.startswith("<") else f"={p_text}"
            s_it += f", p{p_text})" if step.p_value is not None else ")"
    if passed:
        summary = f"No regression under the gate: {s_it}."
    elif outcome == ExitCode.INCONCLUSIVE:
        what = "; ".join(_clean(f.message) for f in failures[:3])
        summary = (
            f"Could not judge: {what}. Neither a pass nor a regression (exit "
            f"{int(ExitCode.INCONCLUSIVE)}); a --fail-on without inconclusive lets it pass."
        )
    else:
        what = "; ".join(_clean(f.message) for f in failures[:3])
        more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
        summary = f"Regression: {what}{more}."
    return CompareView(
        passed=passed,
        status=status,
        summary=summary,
        warning=_clean(comparison.different_warning),
        gate=gate_text(comparison),
        baselines=tuple(_side_text(side) for side in comparison.baselines),
        current=_side_text(comparison.current),
        drift=drift_text(comparison),
        rows=rows,
        findings=findings,
        failures=tuple(f"[{f.criterion}] {_clean(f.message)}" for f in failures),
        environment_changes=tuple(_clean(c) for c in comparison.environment_changes),
        notes=tuple(_clean(n) for n in comparison.notes),
    )


def compare_chart_svg(comparison: Comparison) -> str:
    """Every compared step of each record on one axis, with the threshold band around the
    baselines' median s/it: the HTML report's picture of the gate. "" when nothing was compared.
    """
    from .charts import compare_strip_svg

    sides = [*comparison.baselines, comparison.current]
    if not any(side.step_seconds for side in sides):
        return ""
    names = [baseline_name(i) for i in range(len(sides) - 1)]
    step = comparison.step
    band = None
    if step is not None and step.baseline is not None and step.baseline > 0:
        t = comparison.options.threshold
        band = (step.baseline / (1 + t), step.baseline * (1 + t))
    return compare_strip_svg([side.step_seconds for side in sides], [*names, "current"], band=band)


def refused_view(reason: str) -> CompareView:
    """What the HTML report shows when the baseline could not be compared with the record."""
    return CompareView(
        passed=True,
        status="NOT COMPARED",
        summary="",
        warning="",
        gate="",
        baselines=(),
        current="",
        drift="",
        rows=(),
        findings=(),
        failures=(),
        environment_changes=(),
        notes=(),
        refused=_clean(reason),
    )


def _finding_row(change: FindingChange, fails: str) -> FindingRow:
    was = change.baseline_severity or "—"
    return FindingRow(
        id=_clean(change.id),
        change=change.change,
        severity=change.current_severity or "—",
        was=was,
        title=_clean(change.title or change.id),
        category=_clean(change.category),
        fails=fails,
        note=_clean(change.note),
    )


# --------------------------------------------------------------------------------------------
# Terminal


_STYLES: dict[str, str] = {
    "bold": "\033[1m",
    "fail": "\033[1;31m",
    "warn": "\033[1;33m",
    "ok": "\033[32m",
    "dim": "\033[2m",
}
_VERDICT_STYLE = {
    "slower": "fail",
    "larger": "fail",
    "lower": "fail",
    "inconclusive": "warn",
    "faster": "ok",
    "smaller": "ok",
    "higher": "ok",
}


def compare_table(
    comparison: Comparison, fail_on: Iterable[str] | None = None, *, color: bool = False
) -> str:
    """The comparison for a terminal: gate verdict, a table of metrics, findings, what changed.

    Ends without a trailing newline.
    """
    view = build_compare_view(comparison, fail_on)

    def style(text: str, name: str) -> str:
        return f"{_STYLES[name]}{text}\033[0m" if color and name in _STYLES else text

    lines: list[str] = []
    head = style(
        view.status,
        "ok" if view.passed else "warn" if view.status == "INCONCLUSIVE" else "fail",
    )
    lines.append(f"{style('diagnose compare:', 'bold')} {head} — {view.summary}")
    if view.warning:
        lines.append(style(f"!! {view.warning}", "warn"))
    lines.extend(f"  baseline: {line}" for line in view.baselines)
    lines.append(f"  current:  {view.current}")
    if view.drift:
        lines.append(f"  drift:    {view.drift}")
    lines.append(f"  gate:     {view.gate}")
    lines.append("")
    header = ("metric", "baseline", "current", "change", "CI", "p", "n", "verdict")
    table = [header] + [
        (
            r.label,
            r.baseline,
            r.current,
            r.change,
            r.interval or "—",
            r.p_value,
            r.samples,
            r.verdict + (f" ✗ fails ({r.fails})" if r.fails else ""),
        )
        for r in view.rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    right = {1, 2, 3, 5}
    for index, row in enumerate(table):
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        text = "  ".join(cells).rstrip()
        if index == 0:
            text = style(text, "bold")
        elif view.rows[index - 1].verdict in _VERDICT_STYLE:
            text = style(text, _VERDICT_STYLE[view.rows[index - 1].verdict])
        lines.append(text)
    explained = [r for r in view.rows if r.verdict != "same" or r.kind == "step"]
    if explained:
        lines.append("")
        lines.extend(f"  {r.label}: {r.verdict} — {r.reason}" for r in explained)
    if view.findings:
        lines.append("")
        lines.append("findings:")
        for f in view.findings:
            was = f" (was {f.was})" if f.change in ("escalated", "deescalated") else ""
            fails = style(f" ✗ fails ({f.fails})", "fail") if f.fails else ""
            note = f" — {f.note}" if f.note else ""
            lines.append(f"  {f.change} {f.severity}{was} {f.id}: {f.title}{fails}{note}")
    else:
        lines.append("")
        lines.append("findings: no new, gone or re-graded finding")
    if view.environment_changes:
        lines.append("")
        lines.append("what else changed: " + "; ".join(view.environment_changes))
    for note in view.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# JUnit XML


def compare_junit(comparison: Comparison, fail_on: Iterable[str] | None = None) -> str:
    """JUnit XML: one testcase per metric and per new (or escalated) finding.

    A testcase fails when it fails the gate; an inconclusive metric is ``<skipped>`` with the
    reason; a regression that ``--fail-on`` does not gate passes, its verdict in ``system-out``.
    The layout is the common one (Jenkins, GitLab, GitHub test reporters, Azure):
    testsuites > testsuite(name, tests, failures, errors, skipped, time) > testcase(name,
    classname, time) > failure(message, type).
    """
    view = build_compare_view(comparison, fail_on)
    failures = gate_failures(comparison, fail_on)
    by_subject: dict[str, list[GateFailure]] = {}
    for failure in failures:
        by_subject.setdefault(failure.subject, []).append(failure)

    suite_name = "diagnose compare" + (" (NOT LIKE FOR LIKE)" if view.warning else "")
    root = ET.Element("testsuites", name=suite_name)
    suite = ET.SubElement(root, "testsuite", name=suite_name)
    properties = ET.SubElement(suite, "properties")
    named = [(baseline_name(i), line) for i, line in enumerate(view.baselines)]
    named += [("current", view.current), ("gate", view.gate), ("verdict", view.status)]
    if view.drift:
        named.append(("drift", view.drift))
    for name, value in named:
        ET.SubElement(properties, "property", name=name, value=value)
    if view.warning:
        ET.SubElement(properties, "property", name="warning", value=view.warning)

    counts = {"tests": 0, "failures": 0, "skipped": 0}
    for metric, row in zip(comparison.metrics, view.rows, strict=True):
        case = ET.SubElement(
            suite, "testcase", name=row.label, classname=_KIND_CLASSNAME[metric.kind], time="0"
        )
        counts["tests"] += 1
        detail = (
            f"{row.label}: {row.verdict}. baseline {row.baseline}, current {row.current}, change "
            f"{row.change}, CI {row.interval or '—'}, p {row.p_value}, n {row.samples}. "
            f"{row.reason}. Method: {_clean(metric.method)}."
        )
        if metric.key in by_subject:
            failure = by_subject[metric.key][0]
            node = ET.SubElement(
                case,
                "failure",
                message=_clean(failure.message),
                type=f"regression:{failure.criterion}",
            )
            node.text = detail
            counts["failures"] += 1
        elif metric.verdict == "inconclusive":
            ET.SubElement(case, "skipped", message=f"inconclusive: {row.reason}")
            counts["skipped"] += 1
        else:
            ET.SubElement(case, "system-out").text = detail
    for change, finding_row in zip(comparison.findings, view.findings, strict=True):
        if change.change not in ("new", "escalated"):
            continue
        case = ET.SubElement(
            suite, "testcase", name=finding_row.id, classname=FINDINGS_CLASSNAME, time="0"
        )
        counts["tests"] += 1
        f = finding_row
        detail = f"{f.change} {f.severity} finding (was {f.was}): {f.title}"
        if change.id in by_subject:
            failure = by_subject[change.id][0]
            node = ET.SubElement(
                case,
                "failure",
                message=_clean(failure.message),
                type=f"regression:{failure.criterion}",
            )
            node.text = detail
            counts["failures"] += 1
        else:
            ET.SubElement(case, "system-out").text = detail
    out_text = compare_table(comparison, fail_on)
    ET.SubElement(suite, "system-out").text = _CONTROL.sub(" ", out_text)
    if view.warning:
        ET.SubElement(suite, "system-err").text = view.warning
    for element in (root, suite):
        element.set("tests", str(counts["tests"]))
        element.set("failures", str(counts["failures"]))
        element.set("errors", "0")
        element.set("skipped", str(counts["skipped"]))
        element.set("time", "0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------------------------
# Markdown


def _md(text: str) -> str:
    """A record string made inert in a markdown table cell (and in the HTML GitHub allows)."""
    text = _clean(text)
    for char, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return re.sub(r"([\\|`*_\[\]])", r"\\\1", text)


def _md_code(text: str) -> str:
    """An id as inline code in a table cell: GFM splits cells on "|" even inside code spans."""
    return "`" + _clean(text).replace("`", "'").replace("|", "\\|") + "`"


def compare_markdown(comparison: Comparison, fail_on: Iterable[str] | None = None) -> str:
    """Markdown for a CI job summary or a PR comment (GitHub-flavoured tables and alerts)."""
    view = build_compare_view(comparison, fail_on)
    mark = "✅" if view.passed else "❌"
    lines = [f"## {mark} diagnose compare: {view.status}", ""]
    if view.warning:
        lines += ["> [!WARNING]", f"> **{_md(view.warning)}**", ""]
    lines += [f"**{_md(view.summary)}**", ""]
    lines += [f"- baseline: {_md(line)}" for line in view.baselines]
    lines.append(f"- current: {_md(view.current)}")
    if view.drift:
        lines.append(f"- drift: {_md(view.drift)}")
    lines += [f"- gate: {_md(view.gate)}", ""]
    lines += [
        "| metric | baseline | current | change | CI | p | n | verdict |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in view.rows:
        verdict = f"**{r.verdict}**" if r.verdict != "same" else r.verdict
        if r.fails:
            verdict += f" ❌ fails ({r.fails})"
        lines.append(
            f"| {_md(r.label)} | {r.baseline} | {r.current} | {r.change} | {r.interval or '—'} | "
            f"{r.p_value.replace('<', '&lt;')} | {r.samples} | {verdict} |"
        )
    explained = [r for r in view.rows if r.verdict != "same" or r.kind == "step"]
    if explained:
        lines.append("")
        lines.extend(f"- {_md(r.label)}: {r.verdict} — {_md(r.reason)}" for r in explained)
    lines += ["", "### Findings", ""]
    if view.findings:
        lines += ["| change | severity | was | id | title | gate |", "|---|---|---|---|---|---|"]
        for f in view.findings:
            lines.append(
                f"| {f.change} | {f.severity} | {f.was} | {_md_code(f.id)} | "
                f"{_md(f.title)}{(' — ' + _md(f.note)) if f.note else ''} | "
                f"{('❌ ' + f.fails) if f.fails else ''} |"
            )
    else:
        lines.append("No new, gone or re-graded finding.")
    if view.environment_changes:
        lines += ["", "<details><summary>What else changed between the records</summary>", ""]
        lines += [f"- {_md(c)}" for c in view.environment_changes]
        lines += ["", "</details>"]
    if view.notes:
        lines.append("")
        lines += [f"> {_md(n)}" for n in view.notes]
    return "\n".join(lines) + "\n"


__all__ = [
    "FINDINGS_CLASSNAME",
    "VERDICT_BADGE",
    "CompareView",
    "FindingRow",
    "MetricRow",
    "build_compare_view",
    "compare_chart_svg",
    "compare_junit",
    "compare_markdown",
    "compare_table",
    "drift_text",
    "gate_text",
    "refused_view",
]
