"""The gate's decision: which ``--fail-on`` criteria fired on a comparison, and the exit code:
a regression (ExitCode.REGRESSION), or a gated metric that could not be judged and nothing worse
(ExitCode.INCONCLUSIVE), or neither."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate.comparison import Comparison
from diagnose.gate.finding_changes import _SEVERITY_RANK, FindingChange
from diagnose.gate.options import FAIL_ON_CHOICES
from diagnose.units import pct_change


@dataclass(frozen=True)
class GateFailure:
    """One reason the gate fails the job."""

    #: The --fail-on criterion that fired.
    criterion: str
    #: The metric key or finding id it fired on.
    subject: str
    message: str


def parse_fail_on(text: str) -> frozenset[str]:
    """``"slower,new-critical"`` -> the criteria; DiagnoseError(USAGE) on an unknown one."""
    items = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(items - set(FAIL_ON_CHOICES))
    if unknown:
        raise DiagnoseError(
            f"--fail-on {unknown[0]}: unknown; choose from {', '.join(FAIL_ON_CHOICES)}",
            ExitCode.USAGE,
        )
    return items


def _raises_to(change: FindingChange, severity: str) -> bool:
    """A finding that is new, or more severe than before, and now at least ``severity``."""
    if change.change not in ("new", "escalated") or change.current_severity is None:
        return False
    return _SEVERITY_RANK.get(change.current_severity, 0) >= _SEVERITY_RANK[severity]


def gate_failures(
    comparison: Comparison, fail_on: Iterable[str] | None = None
) -> tuple[GateFailure, ...]:
    """Every reason the job fails under ``fail_on`` (default: the comparison's options)."""
    criteria = frozenset(comparison.options.fail_on if fail_on is None else fail_on)
    out: list[GateFailure] = []
    for metric in comparison.metrics:
        criterion = _CRITERION[metric.kind]
        if metric.regressed and criterion in criteria:
            message = f"{metric.label} {metric.verdict}: {metric.reason}"
            if metric.kind == "step":
                message += _where_slower(comparison)
            out.append(GateFailure(criterion, metric.key, message))
        if (
            metric.verdict == "inconclusive"
            and criterion in criteria
            and "inconclusive" in criteria
        ):
            out.append(
                GateFailure(
                    "inconclusive", metric.key, f"{metric.label} inconclusive: {metric.reason}"
                )
            )
    for change in comparison.findings:
        for criterion, severity in (("new-critical", "critical"), ("new-warn", "warn")):
            if criterion in criteria and _raises_to(change, severity):
                was = f" (was {change.baseline_severity})" if change.baseline_severity else ""
                out.append(
                    GateFailure(
                        criterion,
                        change.id,
                        f"{change.change} {change.current_severity} finding {change.id}{was}: "
                        f"{change.title}",
                    )
                )
                break  # one failure per finding, under the strictest criterion that fired
    return tuple(out)


def _where_slower(comparison: Comparison) -> str:
    """Which phases the slower step went into (they are judged at a stricter level; see
    :mod:`diagnose.gate.metrics`), for the s/it failure message."""
    phases = [m for m in comparison.metrics if m.kind == "phase" and m.verdict == "slower"]
    if not phases:
        return "; no single phase is significantly slower"
    parts = [
        f"{m.label} {pct_change(m.change)}" if m.change is not None else m.label for m in phases
    ]
    return "; slower phases: " + ", ".join(parts)


def gate_exit_code(comparison: Comparison, fail_on: Iterable[str] | None = None) -> int:
    """ExitCode.REGRESSION when anything in ``fail_on`` but ``inconclusive`` fired,
    ExitCode.INCONCLUSIVE when only that did, else ExitCode.OK."""
    return int(gate_status(gate_failures(comparison, fail_on)))


def gate_status(failures: Iterable[GateFailure]) -> ExitCode:
    """What the failures add up to (see :func:`gate_exit_code`)."""
    criteria = {f.criterion for f in failures}
    if criteria - {"inconclusive"}:
        return ExitCode.REGRESSION
    return ExitCode.INCONCLUSIVE if criteria else ExitCode.OK


#: The ``--fail-on`` criterion that gates each kind of metric.
_CRITERION = {
    "step": "slower",
    "phase": "phase",
    "memory": "memory",
    "kernel_class": "kernel",
    "utilisation": "mfu",
}
