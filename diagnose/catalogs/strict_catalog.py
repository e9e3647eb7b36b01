"""What the project knows about strict mode (``--strict``): its finding ids, wording and fixes.

Strict mode judges the same questions as the precision and attention concerns (an op in fp32
where the run asked for bf16/fp16; SDPA's math path or a hand-written attention where a fused
kernel runs), but live, in the trainer's process, op by op, and stops the run at the first one.
Its findings carry the violations it saw, deduplicated by module and op; their fixes are the
precision and attention catalogs' own, cut to the words of the trainer that made the claim.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over
from diagnose.catalogs.precision_catalog import FP32_WEIGHTS_FIX, UPCAST_FIX
from diagnose.record import Finding
from diagnose.trainers import speak_to

PRECISION = FindingSpec(
    "precision.strict_violation",
    "precision",
    "`--strict precision`: a matmul/conv/attention op computed in fp32 where the run asked for "
    "bf16/fp16 (caught live at the op, the run stopped there unless `warn`)",
    ("probe",),
    phases=("forward",),
    # The user asked for this to be an error: without a saving it is still the first thing to fix.
    severity_without_saving="critical",
    at_full_size=carries_over("which ops leave the requested precision is set by the code path"),
)
ATTENTION = FindingSpec(
    "attention.strict_violation",
    "attention",
    "`--strict attention`: SDPA's math path or a hand-written softmax(QKᵀ)V ran where a fused "
    "kernel runs on this device, dtype and shape (caught live at the call)",
    ("probe",),
    phases=("forward",),
    severity_without_saving="critical",
    at_full_size=carries_over("the path attention takes is set by the code, switches and dtype"),
)
SPECS = (PRECISION, ATTENTION)

#: The check id of each strict check (one outcome per record: finding, ok or not judged).
CHECK_IDS: dict[str, str] = {"precision": PRECISION.id, "attention": ATTENTION.id}
#: The rows of violations a finding's evidence lists (the rest are counted).
MAX_ROWS = 20

# --------------------------------------------------------------------------------------------
# Fixes, in the words of the trainer that made the claim


def precision_fix(trainer: str, hand_cast: bool) -> str:
    """The fix for an fp32 op in a run that claimed low precision, in ``trainer``'s words."""
    return speak_to(FP32_WEIGHTS_FIX if hand_cast else UPCAST_FIX, trainer)


# --------------------------------------------------------------------------------------------
# Wording of the checks


def ok_text(check: str, watched_steps: int, ops: int, claim: str) -> str:
    """The answer when a check was made and nothing left the precision or the fused path."""
    steps = f"{ops} op(s) judged over {watched_steps} watched step(s)"
    if check == "precision":
        return f"strict precision: every matmul/conv/attention op computed in {claim} ({steps})"
    return f"strict attention: no attention ran unfused where a fused kernel runs ({steps})"


def stopped_text(check: str, ops: int) -> str:
    """The answer of a check that found nothing before another check's violation stopped the
    run: the steps after the stop were never watched."""
    return (
        f"strict {check}: nothing found in the {ops} op(s) judged before the run was stopped at "
        "another check's violation; the rest of the run was not watched"
    )


def no_claim_text() -> str:
    return (
        "strict precision: not judged, the run claimed no low precision (no bf16/fp16 autocast, "
        "trainer setting or --expect)"
    )


def _rows(violations: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("op", "module", "module_class", "count", "ran", "inputs", "code", "reasons")
    return [{k: v[k] for k in keys if v.get(k)} for v in violations[:MAX_ROWS]]


def strict_finding(
    check: str,
    violations: Sequence[Mapping[str, Any]],
    *,
    stopped: bool,
    watched_steps: int,
    claim: str,
    allowed: Sequence[Mapping[str, Any]] = (),
) -> Finding:
    """The finding of one strict check: its violations (already deduplicated, largest count
    first), the claim they broke, whether the run was stopped at the first."""
    spec = PRECISION if check == "precision" else ATTENTION
    first = violations[0]
    calls = sum(int(v.get("count") or 0) for v in violations)
    where = str(first.get("module") or first.get("code") or "outside any module")
    more = f" and {len(violations) - 1} more" if len(violations) > 1 else ""
    if check == "precision":
        lead = f"{first.get('op')} ran in {first.get('ran')} in {where}{more}"
    else:
        lead = f"{first.get('op')} ran unfused ({first.get('ran')}) in {where}{more}"
    how = (
        "stopped the run at the first"
        if stopped
        else f"{calls} call(s) over {watched_steps} step(s)"
    )
    title = f"Strict {check}: {lead} ({how})"
    detail = (
        f"Requested: {claim}. "
        + (
            "The run was stopped at the first violation, inside the trainer at that op; "
            if stopped
            else "Every violation was recorded and the run went on (--strict warn); "
        )
        + "each row is one module and op, counted over the watched steps."
    )
    evidence: dict[str, Any] = {"violations": _rows(violations), "requested": claim}
    if len(violations) > MAX_ROWS:
        evidence["more_violations"] = len(violations) - MAX_ROWS
    if allowed:
        evidence["accepted_by_strict_allow"] = [
            {
                "op": a.get("op"),
                "module": a.get("module"),
                "count": a.get("count"),
                "pattern": a.get("allowed_by"),
            }
            for a in allowed[:MAX_ROWS]
        ]
    return spec.build(title, fix=str(first.get("fix") or ""), evidence=evidence, detail=detail)


__all__ = [
    "ATTENTION",
    "CHECK_IDS",
    "MAX_ROWS",
    "PRECISION",
    "SPECS",
    "no_claim_text",
    "ok_text",
    "precision_fix",
    "stopped_text",
    "strict_finding",
]
