"""Passive rules: each reads a :class:`TraceContext` and reports findings and what it checked.

Rules are listed explicitly, in report order. A rule never takes the analysis down: an
unexpected error becomes a "could not judge" line naming the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from diagnose.record import ProbeResult

if TYPE_CHECKING:
    # Only for annotations: the trace engine the context is built from imports the rules.
    from diagnose.trace.context import TraceContext

#: A rule reads the trace and returns the same result type as a probe (named after the rule).
Rule = Callable[["TraceContext"], ProbeResult]


def _registry() -> list[tuple[str, Rule]]:
    from diagnose.trace.rules import (
        attention,
        communication,
        dataloader,
        launch,
        precision,
        quantization,
        roofline,
        syncs,
    )

    return [
        ("dataloader", dataloader.check),
        ("precision", precision.check),
        ("attention", attention.check),
        ("syncs", syncs.check),
        ("launch", launch.check),
        ("communication", communication.check),
        ("quantization", quantization.check),
        ("roofline", roofline.check),
    ]


def import_rules() -> None:
    """Import every rule module now: a process about to fork workers calls this, so each worker
    inherits them instead of importing them again."""
    _registry()


def run_rules(ctx: TraceContext) -> list[ProbeResult]:
    """Every rule's result, named after the rule, its findings and checks sourced
    ``trace:<rule>``."""
    results: list[ProbeResult] = []
    for name, rule in _registry():
        try:
            result = rule(ctx)
        except Exception as exc:  # a rule bug must not hide the rest of the analysis
            result = ProbeResult(name=name, status="error", reason=f"{type(exc).__name__}: {exc}")
            result.add_not_judged(
                f"trace.{name}", f"{name}: the rule failed on this trace ({result.reason})"
            )
        result.name = name
        result.settle_checks(f"trace:{name}")
        results.append(result)
    return results
