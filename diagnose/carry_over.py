"""What a run on a shrunk model says about the real one.

On a CPU the default run trains a preset's ``tiny`` size: the same architecture, shrunk until a
step takes a fraction of a second. Some of its verdicts hold for the real model (a math-path
attention, an fp32 island, an environment variable), some were judged again on the preset's
real configuration built on the meta device (an 8-bit optimizer's size threshold, the attention
kernel choice), and some hold for the tiny model only (a data-loader wait measured against its
short step). Each concern's catalog says which of these its questions are
(:attr:`diagnose.catalogs.FindingSpec.at_full_size`); :func:`carry_over` sorts a record's
answers by it, once, for the top of the report. Pure and torch-free: reports import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from diagnose.record import Check, Outcome, RunRecord

#: How a tiny run's answer relates to the real model: the three kinds of
#: :data:`diagnose.catalogs.CarryOverKind`, plus "withheld" (a question judged at full size whose
#: answer could not be had there, so the tiny model's was not given either) and "unclassified"
#: (a check whose id the catalog does not know).
ItemKind = Literal[
    "carries over", "judged at full size", "withheld", "tiny-model only", "unclassified"
]


def shrunk_preset(config: Any) -> str | None:
    """The preset a run trained a shrunk (``tiny``) stand-in of, or None when it trained the
    model at the size it really trains (a full preset or a ``--model`` folder).

    ``config``: a :class:`diagnose.config.RunConfig` or a record's ``config`` dict."""

    def get(name: str) -> Any:
        if isinstance(config, Mapping):
            return config.get(name)
        return getattr(config, name, None)

    preset, size, model_dir = get("preset"), get("size"), get("model_dir")
    if size != "tiny" or not preset or model_dir:
        return None
    return str(preset)


@dataclass(frozen=True)
class CarryOverItem:
    """One answer of the record and what it says about the real model."""

    check_id: str
    outcome: Outcome
    #: The check's own line (the finding's title, what was found fine, why it was not judged).
    text: str
    kind: ItemKind
    #: Why, in one line (the catalog's reason).
    why: str


@dataclass(frozen=True)
class CarryOver:
    """A tiny run's answers, sorted by what they say about the real model.

    Only verdicts are listed (findings and "found fine"), plus the questions judged at full
    size whose answer was withheld there: a check that could not be judged on the tiny model
    says nothing either way and stays in the report's "could not be checked" list.
    """

    preset: str
    size: str
    items: tuple[CarryOverItem, ...]

    def of(self, kind: ItemKind) -> list[CarryOverItem]:
        return [i for i in self.items if i.kind == kind]

    @property
    def carries_over(self) -> list[CarryOverItem]:
        """Hold for the real model as they are."""
        return self.of("carries over")

    @property
    def judged_at_full_size(self) -> list[CarryOverItem]:
        """Answered on the preset's real shapes or sizes."""
        return self.of("judged at full size")

    @property
    def withheld(self) -> list[CarryOverItem]:
        """Depend on the real shapes, which could not be judged here: no answer given."""
        return self.of("withheld")

    @property
    def tiny_only(self) -> list[CarryOverItem]:
        """Hold for the tiny model only: no advice for the real one."""
        return self.of("tiny-model only")

    def summary(self) -> str:
        """The one line for the top of the report, e.g. "This run trained a tiny stand-in of
        sd15: 12 verdicts carry over to the real model, 1 was judged at its full size, 1 was
        withheld, 3 hold for the tiny model only (dataloader.gpu_starved, ...)." """
        parts = [f"{len(self.carries_over)} carry over to the real model"]
        if self.judged_at_full_size:
            parts.append(f"{len(self.judged_at_full_size)} judged at its full size")
        if self.withheld:
            parts.append(
                f"{len(self.withheld)} withheld (depends on the real shapes: {_ids(self.withheld)})"
            )
        if self.tiny_only:
            parts.append(
                f"{len(self.tiny_only)} hold for the tiny model only ({_ids(self.tiny_only)})"
            )
        unclassified = self.of("unclassified")
        if unclassified:
            # Counted too, so that the line and the list under it add up.
            parts.append(
                f"{len(unclassified)} the catalog does not classify ({_ids(unclassified)})"
            )
        return f"This run trained a {self.size} stand-in of {self.preset}; of its verdicts, " + (
            ", ".join(parts) + "."
        )

    def lines(self) -> list[str]:
        """One line per verdict, grouped by kind (for the report's detail and the terminal's
        ``--verbose``): ``tiny-model only · dataloader.gpu_starved: <why>``."""
        order: tuple[ItemKind, ...] = (
            "tiny-model only",
            "withheld",
            "judged at full size",
            "carries over",
            "unclassified",
        )
        return [f"{i.kind} · {i.check_id}: {i.why}" for k in order for i in self.of(k)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "size": self.size,
            "summary": self.summary(),
            "items": [
                {
                    "id": i.check_id,
                    "outcome": i.outcome,
                    "text": i.text,
                    "kind": i.kind,
                    "why": i.why,
                }
                for i in self.items
            ],
        }


def _ids(items: list[CarryOverItem]) -> str:
    return ", ".join(sorted({i.check_id for i in items}))


def _item(check: Check) -> CarryOverItem | None:
    from diagnose.catalogs import spec

    entry = spec(check.id)
    if entry is None or entry.at_full_size is None:
        if check.outcome == "not_judged":
            return None
        return CarryOverItem(
            check.id, check.outcome, check.text, "unclassified", "the catalog does not say"
        )
    kind: ItemKind = entry.at_full_size.kind
    why = entry.at_full_size.why
    if check.outcome == "not_judged":
        if kind != "judged at full size":
            return None  # not a verdict: listed under "could not be checked"
        kind = "withheld"
    return CarryOverItem(check.id, check.outcome, check.text, kind, why)


def carry_over(record: RunRecord) -> CarryOver | None:
    """What the record's verdicts say about the real model, or None when the run trained the
    model at the size it really trains (or is a trace)."""
    if record.mode != "run":
        return None
    preset = shrunk_preset(record.config)
    if preset is None:
        return None
    items: dict[str, CarryOverItem] = {}
    for check in record.all_checks():
        item = _item(check)
        if item is not None and check.id not in items:
            items[check.id] = item
    ordered = sorted(items.values(), key=lambda i: i.check_id)
    return CarryOver(preset=preset, size=str(record.config.get("size")), items=tuple(ordered))


__all__ = [
    "CarryOver",
    "CarryOverItem",
    "ItemKind",
    "carry_over",
    "shrunk_preset",
]
