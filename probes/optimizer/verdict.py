"""The optimizer probe's verdicts: what its measurements mean, question by question (the step's
syncs, the A/B against other optimizers, 8-bit state held in fp32, the 8-bit update's numerics).

The probe (:mod:`.probe`) measures; these functions turn its rows and reports into findings and
checks, worded by :mod:`diagnose.catalogs.optimizer_catalog`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.errors import first_line
from diagnose.probes.base import ProbeContext
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.optimizer.ab import (
    ABRow,
    ab_saving,
    clearly_faster_alternative,
    slower_than_alternative_rule,
)
from diagnose.probes.optimizer.inventory import EightBitSplit, fp32_state_share
from diagnose.probes.optimizer.numerics import NumericsReport, numerics_rule
from diagnose.probes.optimizer.syncs import (
    MeasuredCost,
    StepSyncs,
    sync_in_step_finding,
    sync_question,
)
from diagnose.record import Finding, ProbeResult
from diagnose.stats import at_line

SYNC = catalog.SYNC_IN_STEP.id
SLOWER = catalog.SLOWER_THAN_ALTERNATIVE.id
STATE_FP32 = catalog.STATE_MOSTLY_FP32.id
NUMERICS = catalog.NUMERICS_8BIT.id
#: Questions that cannot end in a finding: was each A/B candidate measured here?
AB_CANDIDATE = "optimizer.ab_candidate"


def judge_syncs(
    result: ProbeResult,
    syncs: StepSyncs,
    alone_seconds: float | None,
    debug_warnings: int,
    device_kind: str,
    running: str,
    running_label: str,
    phase: float | None,
    rows: Sequence[ABRow],
    traced: Finding | None,
) -> bool:
    """The sync question, its cost the A/B's against torch AdamW (fused) when both stepped,
    else the trace rule's estimate (``traced``, which this answer sets aside). True when the
    step synchronises (the A/B's saving is then this finding's)."""
    cost = cost_against_fused(rows)
    finding = sync_in_step_finding(
        syncs,
        device_kind=device_kind,
        running=running,
        running_label=running_label,
        alone_seconds=alone_seconds,
        phase_seconds=phase,
        debug_warnings=debug_warnings,
        measured=cost,
    )
    if finding is not None:
        if cost is None and traced is not None and traced.est_seconds_saved_per_it:
            finding.est_seconds_saved_per_it = traced.est_seconds_saved_per_it
            finding.saving_basis = traced.saving_basis
            finding.title = f"{finding.title}: {traced.title.split(': ', 1)[-1]}"
            finding.evidence["saving_from"] = (
                "the trace's estimate of the profiled steps (no A/B against torch AdamW "
                "(fused) here)"
            )
        result.add_finding(finding)
        return True
    unjudged = sync_question(syncs, device_kind, running_label)
    if unjudged is not None and device_kind == "cpu":
        result.add_ok(SYNC, unjudged)
    elif unjudged is not None:
        result.add_not_judged(SYNC, unjudged)
    else:
        result.add_ok(
            SYNC, f"{running_label}: no host-device synchronisation inside optimizer.step()"
        )
    return False


def shrunk_model_artefact(
    ctx: ProbeContext, split: EightBitSplit, data: dict[str, Any]
) -> str | None:
    """Whether state held in fp32 is only the tiny model's: bitsandbytes' size threshold is
    judged on the preset's real LoRA tensors (built on the meta device), and a tiny run's
    small tensors are no advice for the real model. The explanation, or None when the
    finding holds (or the real sizes cannot be had)."""
    config = ctx.config
    if config.size != "tiny" or config.preset is None or config.model_dir is not None:
        return None
    from diagnose.workload.models import lora_tensor_sizes

    try:
        sizes = lora_tensor_sizes(config.preset, "full", config.rank, config.target_modules)
    except Exception as exc:  # the shapes only refine the verdict; without them it stands
        data["eight_bit"]["full_size"] = {"error": f"{type(exc).__name__}: {first_line(str(exc))}"}
        return None
    minimum = split.min_8bit_size or catalog.BNB_DEFAULT_MIN_8BIT_SIZE
    share = fp32_state_share(sizes, minimum)
    below = sum(n < minimum for n in sizes)
    data["eight_bit"]["full_size"] = {
        "preset": config.preset,
        "lora_tensors": len(sizes),
        "below_min_8bit_size": below,
        "smallest_tensor": min(sizes, default=0),
        "fp32_state_share": share,
        "basis": "computed from the full-size preset built on the meta device",
    }
    if not sizes or at_line(share, catalog.FP32_SHARE_RAISED).above:
        return None
    return (
        f"{split.optimizer}: on this tiny model {split.tensors_fp32} of "
        f"{split.tensors_fp32 + split.tensors_8bit} LoRA tensors are below "
        f"min_8bit_size={minimum} and keep fp32 state, but at {config.preset}'s full size "
        f"{below} of its {len(sizes)} are (smallest {min(sizes):,} elements): "
        f"{1 - share:.0%} of the real model's state is 8-bit. An artefact of the shrunk "
        "model, not advice for the real one"
    )


def judge_ab(
    result: ProbeResult,
    rows: Sequence[ABRow],
    running_label: str,
    s_per_it: float | None,
    phase: float | None,
    synchronising: bool = False,
) -> None:
    """The A/B question: another optimizer measured clearly faster here, one faster by too little
    to matter, or none; said once, by the sync finding, when the step synchronises."""
    for row in rows:
        if row.error:
            result.add_not_judged(
                f"{AB_CANDIDATE}.{row.key}", f"A/B of {row.optimizer}: {row.error}"
            )
    measured = [r for r in rows if r.step_seconds and not r.error]
    slower = slower_than_alternative_rule(rows, s_per_it, phase_seconds=phase)
    faster = clearly_faster_alternative(rows)
    configured = rows[0]
    if slower is not None and synchronising:
        # The same switch, the same time: said once, by the finding that names the cause.
        result.add_ok(
            SLOWER,
            f"{running_label}: {slower.title}; the saving is {SYNC}'s (the step synchronises)",
        )
    elif slower is not None:
        result.add_finding(slower)
    elif faster is not None:
        saving, _ = ab_saving(configured, faster, phase)
        result.add_ok(
            SLOWER,
            f"{running_label}: {faster.optimizer} would save {saving * 1e3:.2f} ms per "
            f"step here, under {catalog.MIN_SHARE_OF_S_PER_IT:.0%} of s/it: not worth a "
            "switch",
        )
    elif len(measured) > 1 and any(r.stopped_by_budget for r in measured):
        result.add_not_judged(
            SLOWER,
            f"{running_label}: no other optimizer's step was clearly faster here, but "
            f"{BUDGET_STOPPED}",
        )
    elif len(measured) > 1:
        result.add_ok(SLOWER, f"{running_label}: no other optimizer's step was clearly faster here")
    else:
        result.add_not_judged(SLOWER, "no other optimizer could be stepped here to compare")


def judge_numerics(result: ProbeResult, report: NumericsReport, running: str) -> None:
    """The 8-bit numerics question, from one update compared with fp32 AdamW's."""
    finding = numerics_rule(report.stats, running=running)
    if finding is not None:
        result.add_finding(finding)
    elif report.stats.elements:
        result.add_ok(
            NUMERICS,
            f"AdamW8bit numerics: {report.stats.elements} elements of one update within the "
            "8-bit quantisation bound of fp32 AdamW (mean relative error "
            f"{report.stats.rel_error_mean:.2%})",
        )
    else:
        result.add_not_judged(NUMERICS, "AdamW8bit numerics: no element to compare")


def trace_finding(ctx: ProbeContext, finding_id: str) -> Finding | None:
    """The trace rules' finding of ``finding_id`` in this run, when they raised one."""
    return next(
        (
            f
            for p in ctx.record.probes
            if p.name == "trace"
            for f in p.findings
            if f.id == finding_id
        ),
        None,
    )


def cost_against_fused(rows: Sequence[ABRow]) -> MeasuredCost | None:
    """The configured step timed alone less torch AdamW (fused)'s on the same tensors, when both
    stepped and the configured one is not fused AdamW itself."""
    configured = next((r for r in rows if r.configured and r.step_seconds), None)
    fused = next(
        (r for r in rows if r.key == "adamw-fused" and r.step_seconds and not r.error), None
    )
    if configured is None or fused is None or configured.key == "adamw-fused":
        return None
    saving, sure = ab_saving(configured, fused, None)
    if saving <= 0:
        return None
    return MeasuredCost(saving, sure, catalog.LABELS["adamw-fused"])


def numerics_failed(exc: BaseException, *, running: str) -> Finding:
    """AdamW8bit raised instead of stepping: fatal for a run that uses it, a warning otherwise."""
    return catalog.numerics_8bit(
        what=f"it raises {type(exc).__name__} instead of stepping",
        running=running,
        evidence={"error": first_line(str(exc))},
        detail="Two AdamW8bit steps on copies of the LoRA tensors raised instead of updating.",
    )
