"""What strict mode found in one process: the claim it judged against, the violations
(deduplicated by check, module and op, with counts), the accepted ones and what it could not judge.

The :class:`StrictLog` is the file a trainer's process writes (``strict-<pid>.json`` in the
capture folder) and ``diagnose profile`` reads back; :class:`StrictViolation` is the error raised
inside the trainer at the first violation. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from diagnose.strict.options import StrictOptions

#: File name of one process's log in the capture folder: ``strict-<pid>.json``.
LOG_PREFIX = "strict-"
LOG_SUFFIX = ".json"
#: Distinct violations, accepted violations and notes kept per process (a model in fp32 under a
#: bf16 claim has one per module: the file must stay small).
MAX_ENTRIES = 256


@dataclass(frozen=True)
class Claim:
    """The precision the run asked for, and who asked."""

    #: "bf16" or "fp16".
    dtype: str
    #: Who claimed it, in their words: ``Lightning Trainer(precision="bf16-mixed")``,
    #: ``accelerate launch --mixed_precision bf16``, ``torch.autocast(..., dtype=torch.bfloat16)
    #: at train.py:52``, ``--expect bf16``.
    by: str
    #: The trainer whose words the fix is written in (a key of diagnose.trainers.TRAINERS), or "".
    trainer: str = ""
    #: The run casts its weights itself instead of using autocast (bf16-true, --expect).
    hand_cast: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Claim:
        return cls(
            dtype=str(data.get("dtype") or ""),
            by=str(data.get("by") or ""),
            trainer=str(data.get("trainer") or ""),
            hand_cast=bool(data.get("hand_cast")),
        )


@dataclass
class Violation:
    """One op (or attention call) that left the precision or the fused path the run asked for."""

    #: "precision" or "attention".
    check: str
    #: The op: "addmm", "convolution", "scaled_dot_product_attention", "softmax(QKᵀ)V".
    op: str
    #: The module that ran it (``unet.down_blocks.1.attentions.0...ff.net.2``), "" outside any.
    module: str = ""
    module_class: str = ""
    #: The innermost frame of the user's own code: ``train.py:31, in loss_of``.
    code: str = ""
    #: The op's tensor inputs: ``float32[64, 256]``.
    inputs: list[str] = field(default_factory=list)
    #: What ran instead of what was asked: "fp32" (precision), "math" / "hand-written" (attention).
    ran: str = ""
    requested: str = ""
    claimed_by: str = ""
    #: Why no fused kernel ran (attention): torch's reasons and the SDPA switches.
    reasons: list[str] = field(default_factory=list)
    fix: str = ""
    #: The ``--strict-allow`` pattern that accepted it ("" when it was not accepted).
    allowed_by: str = ""
    count: int = 0
    #: The watched step (1 = the first watched) in which it was first seen.
    first_step: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.check, self.module, self.op)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Violation:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})

    def headline(self) -> str:
        """One line: ``precision: addmm ran in fp32 in net.2 (Linear) where the run asked for
        bf16``."""
        where = f" in {self.module}" if self.module else ""
        if self.module_class:
            where += f" ({self.module_class})"
        if self.check == "precision":
            return f"{self.op} ran in {self.ran}{where} where the run asked for {self.requested}"
        return f"{self.op} ran unfused ({self.ran}){where} where a fused kernel runs"

    def message(self) -> str:
        """The text of the error raised in the trainer: op, inputs, module, code, the claim, why
        and the fix."""
        lines = [f"diagnose strict {self.check}: {self.headline()}"]
        if self.code:
            lines.append(f"  code:      {self.code}")
        if self.inputs:
            lines.append(f"  inputs:    {', '.join(self.inputs)}")
        if self.requested:
            lines.append(f"  requested: {self.requested}, claimed by {self.claimed_by}")
        for reason in self.reasons[:4]:
            lines.append(f"  why:       {reason}")
        if self.fix:
            lines.append(f"  fix:       {self.fix}")
        target = self.module or self.op
        lines.append(f"  accept it: --strict-allow '{target}' (if this is intended)")
        return "\n".join(lines)


class StrictViolation(Exception):
    """Raised inside the trainer at the op that left the precision or fused path asked for."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.message())
        self.violation = violation


StrictViolation.__module__ = "diagnose.strict"


@dataclass
class NotJudged:
    """A question strict mode could not answer for some calls, and why (counted)."""

    check: str
    text: str
    count: int = 0


@dataclass
class StrictLog:
    """Everything one process's strict mode saw."""

    options: StrictOptions = field(default_factory=StrictOptions)
    pid: int = 0
    rank: int = 0
    argv: list[str] = field(default_factory=list)
    claim: Claim | None = None
    violations: list[Violation] = field(default_factory=list)
    allowed: list[Violation] = field(default_factory=list)
    not_judged: list[NotJudged] = field(default_factory=list)
    #: Optimizer steps that ran with the checks installed, and the ops they judged.
    watched_steps: int = 0
    ops_judged: int = 0
    #: True when the first violation stopped the run (fail mode).
    stopped: bool = False
    #: A failure of strict mode itself ("" when none): the checks then stopped, the run did not.
    error: str = ""

    def add(self, violation: Violation) -> Violation:
        """Count ``violation`` under its key (a new one is kept when there is room); returns the
        entry that counts it."""
        entries = self.allowed if violation.allowed_by else self.violations
        for entry in entries:
            if entry.key == violation.key:
                entry.count += 1
                return entry
        violation.count = 1
        if len(entries) < MAX_ENTRIES:
            entries.append(violation)
        return violation

    def note(self, check: str, text: str) -> None:
        for entry in self.not_judged:
            if entry.check == check and entry.text == text:
                entry.count += 1
                return
        if len(self.not_judged) < MAX_ENTRIES:
            self.not_judged.append(NotJudged(check, text, 1))

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options.to_dict(),
            "pid": self.pid,
            "rank": self.rank,
            "argv": list(self.argv),
            "claim": asdict(self.claim) if self.claim is not None else None,
            "violations": [v.to_dict() for v in self.violations],
            "allowed": [v.to_dict() for v in self.allowed],
            "not_judged": [asdict(n) for n in self.not_judged],
            "watched_steps": self.watched_steps,
            "ops_judged": self.ops_judged,
            "stopped": self.stopped,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StrictLog:
        claim = data.get("claim")

        def violations(key: str) -> list[Violation]:
            rows = data.get(key) or []
            return [Violation.from_dict(r) for r in rows if isinstance(r, Mapping)]

        notes: Sequence[Any] = data.get("not_judged") or []
        return cls(
            options=StrictOptions.from_dict(data.get("options") or {}),
            pid=int(data.get("pid") or 0),
            rank=int(data.get("rank") or 0),
            argv=[str(a) for a in data.get("argv") or []],
            claim=Claim.from_dict(claim) if isinstance(claim, Mapping) else None,
            violations=violations("violations"),
            allowed=violations("allowed"),
            not_judged=[
                NotJudged(str(n.get("check")), str(n.get("text")), int(n.get("count") or 0))
                for n in notes
                if isinstance(n, Mapping)
            ],
            watched_steps=int(data.get("watched_steps") or 0),
            ops_judged=int(data.get("ops_judged") or 0),
            stopped=bool(data.get("stopped")),
            error=str(data.get("error") or ""),
        )


__all__ = [
    "LOG_PREFIX",
    "LOG_SUFFIX",
    "MAX_ENTRIES",
    "Claim",
    "NotJudged",
    "StrictLog",
    "StrictViolation",
    "Violation",
]
