"""The terminal summary: the report's first screen as a few lines, printed at the end of a run."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

from diagnose.record import RunRecord
from diagnose.record import step_seconds as step_seconds_of

from .checks import NOT_JUDGED, build_checks
from .headline import build_headline, describe_wall, phase_bar_steps
from .ranked_findings import FindingView, build_findings
from .ranks import build_ranks
from .step_time import build_breakdown
from .utilisation import build_utilisation

#: How many findings the summary lists; the rest are counted and left to the report.
TOP_FINDINGS = 3

_RESET = "\033[0m"
_STYLES: dict[str, str] = {
    "bold": "\033[1m",
    "dim": "\033[2m",
    "critical": "\033[1;31m",
    "warn": "\033[1;33m",
    "info": "\033[1;34m",
    "ok": "\033[32m",
    "skipped": "\033[2m",
    "error": "\033[31m",
}


#: Ranks listed on the terminal; the report's table has them all.
_RANKS_LISTED = 8


def terminal_summary(
    record: RunRecord,
    *,
    color: bool = False,
    paths: Mapping[str, Path | str] | None = None,
    width: int = 100,
) -> str:
    """The headline, where the time goes, the top findings, probe statuses and where files are.

    ``paths`` maps a label to a file ("report" -> report.html, "record" -> record.json, "trace" ->
    trace.json.gz) and is printed in that order. ``color`` adds ANSI colours (for a TTY).
    Ends without a trailing newline.
    """

    def style(text: str, name: str) -> str:
        return f"{_STYLES[name]}{text}{_RESET}" if color and name in _STYLES else text

    lines: list[str] = []
    headline = build_headline(record)
    lines.append(f"{style('diagnose:', 'bold')} {style(_clean(headline.sentence), 'bold')}")
    if headline.busy:
        lines.append(f"  {style('machine busy:', 'warn')} {headline.busy_text}")
    if headline.scale_text:
        lines.append(f"  {style('tiny model:', 'dim')} {_clean(headline.scale_text)}")
    if headline.noisy:
        lines.append(f"  {style('noisy:', 'warn')} {headline.noise_text}")
    if headline.profiler_text:
        lines.append(f"  {style(headline.profiler_text, 'dim')}")
    if headline.device_text:
        lines.append(f"  {_clean(headline.device_text)}")
    utilisation = build_utilisation(record)
    if utilisation is not None:
        lines.append(f"  {style('peak:', 'dim')} {_clean(utilisation.line)}")

    step_seconds = step_seconds_of(record)
    breakdown = build_breakdown(record.breakdown, step_seconds, [], draw=False)
    if breakdown.phases:
        basis = "from the trace" if record.breakdown.basis == "trace" else record.breakdown.basis
        phases = " · ".join(f"{_clean(p.label)} {p.seconds}" for p in breakdown.phases)
        lines.append(f"where it goes ({basis}, per {phase_bar_steps(record)}): {phases}")
    else:
        lines.append("where it goes: not measured")

    ranks = build_ranks(record.ranks)
    if ranks is not None:
        cells = [
            f"{row.rank}{' (shown above)' if row.pacing else ''} {row.median}, waits {row.wait}"
            for row in ranks.rows[:_RANKS_LISTED]
        ]
        more = len(ranks.rows) - _RANKS_LISTED
        lines.append(
            "ranks (s/it, wait for others per step): "
            + " · ".join(cells)
            + (f" (+{more} more in the report)" if more > 0 else "")
        )

    findings = build_findings(record)
    checks = build_checks(record.probes, record.findings)
    if findings:
        lines.append("why, ranked by what it costs:")
        for finding in findings[:TOP_FINDINGS]:
            lines.extend(_finding_lines(finding, style, width))
        if len(findings) > TOP_FINDINGS:
            more = len(findings) - TOP_FINDINGS
            lines.append(f"  (+{more} more finding{'s' if more > 1 else ''} in the report)")
    else:
        if checks.ran:
            ran = _clean(", ".join(checks.ran))
        elif record.mode == "trace":
            ran = "the trace rules"
        else:
            ran = "no probe ran to completion"
        lines.append(f"no slow-down found by the checks that ran ({ran})")

    probe_line = f"probes: {checks.status_counts}"
    troubles = [
        f"{style(_clean(item.status), item.status)} {_clean(item.probe)} ({_clean(item.reason)})"
        for item in checks.could_not_check
        if item.status != NOT_JUDGED
    ]
    unjudged = sum(item.status == NOT_JUDGED for item in checks.could_not_check)
    if unjudged:
        troubles.append(
            f"{unjudged} check{'s' if unjudged != 1 else ''} not judged here (see the report)"
        )
    if troubles:
        probe_line += " — " + "; ".join(troubles)
    lines.append(probe_line)
    wall = describe_wall(record.wall_seconds)
    if wall:
        lines.append(style(_clean(wall), "dim"))

    for label, path in (paths or {}).items():
        lines.append(f"{_clean(label)}: {_clean(str(path))}")
    return "\n".join(lines)


# C0/C1 control characters (ESC starts terminal escape sequences) and line breaks inside a value.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def _clean(text: str) -> str:
    """A record string made safe to print: a crafted record cannot drive the terminal."""
    return " ".join(_CONTROL.sub(" ", text).split())


def _finding_lines(finding: FindingView, style: Callable[[str, str], str], width: int) -> list[str]:
    saving = (
        f"saves ~{finding.saving}, {finding.saving_basis}"
        if finding.saving
        else f"saving {finding.saving_basis}"
    )
    badge = style(f"[{_clean(finding.severity)}]", finding.severity)
    head = f"  {finding.rank}. {badge} {_clean(finding.title)}"
    if finding.at_full_size.startswith("holds for the tiny model only"):
        head += style(" (tiny model only)", "dim")
    out = [f"{head} — {saving}"]
    if finding.borderline:
        out.append(f"     {style(_clean(finding.borderline), 'dim')}")
    if finding.fix:
        fix = textwrap.fill(
            _clean(finding.fix),
            width=max(width, 40),
            initial_indent="     fix: ",
            subsequent_indent="          ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        out.append(fix)
    return out


__all__ = ["TOP_FINDINGS", "terminal_summary"]
