"""The findings catalog: every finding id the tool can raise, one module per concern.

A concern (precision, attention, optimizer, dataloader, memory, environment, triton, compute,
distributed) keeps in its ``<concern>_catalog.py`` the ids it raises, their thresholds, their
wording, their fixes in each trainer's vocabulary, and one builder per id. Its probe and its trace
rule both build findings from there, so one phenomenon has one id and one wording however it was
found. A finding is only ever made by :meth:`FindingSpec.build`, which fills in what the catalog
knows (category, the phases the saving lives in); severity is left to :mod:`diagnose.verdicts`.

``python -m diagnose.catalogs`` prints the table of findings (``--write docs/findings.md`` puts
it in that page); a test keeps the two equal.
Torch-free: the report and the CI gate import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from diagnose.record import PHASES, Basis, Borderline, Category, Finding, Severity
from diagnose.trainers import TRAINERS, in_trainers

#: Where a finding can come from: an active probe of ``diagnose run``, or a rule that reads any
#: trace (``diagnose trace`` and the trace ``diagnose run`` captures).
FoundBy = Literal["probe", "trace"]

#: Whether a run that trained a shrunk model (a preset's ``tiny`` size) answers a question for the
#: real model too: "carries over" (a property of the code path, settings or machine, whatever the
#: model's size), "judged at full size" (it depends on shapes or sizes, and the probe judges it
#: on the preset's real configuration, built on the meta device, or withholds it with the
#: reason), "tiny-model only" (it depends on the model's size and is not judged again: the tiny
#: run's answer says nothing about the real model).
CarryOverKind = Literal["carries over", "judged at full size", "tiny-model only"]
CARRY_OVER_KINDS: tuple[CarryOverKind, ...] = get_args(CarryOverKind)


@dataclass(frozen=True)
class AtFullSize:
    """What a tiny run's answer to one question says about the real model, and why."""

    kind: CarryOverKind
    #: One line: why (what the answer depends on).
    why: str


def carries_over(why: str) -> AtFullSize:
    return AtFullSize("carries over", why)


def judged_at_full_size(why: str) -> AtFullSize:
    return AtFullSize("judged at full size", why)


def tiny_model_only(why: str) -> AtFullSize:
    return AtFullSize("tiny-model only", why)


#: The concern modules, in the findings table's order.
CONCERN_MODULES: tuple[str, ...] = (
    "diagnose.catalogs.dataloader_catalog",
    "diagnose.catalogs.precision_catalog",
    "diagnose.catalogs.attention_catalog",
    "diagnose.catalogs.optimizer_catalog",
    "diagnose.catalogs.compute_catalog",
    "diagnose.catalogs.memory_catalog",
    "diagnose.catalogs.environment_catalog",
    "diagnose.catalogs.triton_catalog",
    "diagnose.catalogs.distributed_catalog",
    "diagnose.catalogs.quantization_catalog",
    "diagnose.catalogs.strict_catalog",
)


@dataclass(frozen=True)
class FindingSpec:
    """What the project knows about one finding id."""

    id: str
    category: Category
    #: One line: what it means (the findings table, docs/findings.md).
    meaning: str
    #: Which kinds of check can raise it.
    found_by: tuple[FoundBy, ...]
    #: The phases of the step its saving lives in (a fix cannot save more than their time).
    phases: tuple[str, ...] = ()
    #: Its saving is time the device waits for the host (launch overhead, host stalls): never
    #: more than the step less the device's busy time, which no host-side fix can shorten.
    host_bound: bool = False
    #: The severity when no saving can be said (a correctness fault is critical without one).
    severity_without_saving: Severity = "info"
    #: When a probe of ``diagnose run`` answered this question, its answer stands and a trace
    #: rule's answer to it is set aside (kept as evidence or a note): the probe measured the
    #: timed steps the headline and the phase bar come from, the rule only the profiled ones.
    probe_answer_stands: bool = False
    #: What a tiny run's answer says about the real model (diagnose.carry_over reads it).
    #: Every spec sets it; None only while a new one is being written (a test says which).
    at_full_size: AtFullSize | None = None

    def __post_init__(self) -> None:
        concern = self.id.split(".", 1)[0]
        if concern != self.category:
            raise ValueError(f"finding id {self.id!r} is not in its category {self.category!r}")
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown:
            raise ValueError(f"finding {self.id!r}: unknown phases {unknown}")

    def build(
        self,
        title: str,
        *,
        fix: str = "",
        evidence: Mapping[str, Any] | None = None,
        saving: float | None = None,
        sure_saving: float | None = None,
        high_saving: float | None = None,
        basis: Basis = "none",
        detail: str = "",
        source: str = "",
        severity: Severity | None = None,
        borderline: Borderline | None = None,
    ) -> Finding:
        """The finding, with what the catalog knows filled in. ``severity`` is only the fallback
        for a finding without a saving; :func:`diagnose.verdicts.settle` grades the others.
        ``sure_saving``–``high_saving``: the saving's interval; ``borderline``: the value that
        decides whether it is raised at all straddles the rule's line."""
        return Finding(
            id=self.id,
            category=self.category,
            severity=severity or self.severity_without_saving,
            title=title,
            evidence=dict(evidence or {}),
            est_seconds_saved_per_it=saving,
            saving_basis=basis if saving is not None else "none",
            sure_seconds_saved_per_it=sure_saving,
            high_seconds_saved_per_it=high_saving,
            borderline=borderline,
            phases=list(self.phases),
            fix=fix,
            detail=detail,
            source=source,
        )


def specs() -> list[FindingSpec]:
    """Every finding the tool can raise, concern by concern."""
    found: list[FindingSpec] = []
    for name in CONCERN_MODULES:
        module = importlib.import_module(name)
        found.extend(module.SPECS)
    ids = [s.id for s in found]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"finding ids declared twice: {', '.join(duplicated)}")
    return found


def spec(finding_id: str) -> FindingSpec | None:
    """The catalog entry of ``finding_id``, or None for an id the catalog does not know."""
    return next((s for s in specs() if s.id == finding_id), None)


def markdown_table() -> str:
    """The table of findings (docs/findings.md)."""
    lines = ["| finding id | found by | what it means |", "|---|---|---|"]
    for s in specs():
        lines.append(f"| `{s.id}` | {' + '.join(s.found_by)} | {s.meaning} |")
    return "\n".join(lines)


__all__ = [
    "CARRY_OVER_KINDS",
    "CONCERN_MODULES",
    "TRAINERS",
    "AtFullSize",
    "CarryOverKind",
    "FindingSpec",
    "carries_over",
    "in_trainers",
    "judged_at_full_size",
    "markdown_table",
    "spec",
    "specs",
    "tiny_model_only",
]
