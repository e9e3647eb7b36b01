"""The attention probe's answers (pure): a finding, or found fine, per question.

Each rule reads the judged groups of the profiled step and builds its finding through
:mod:`diagnose.catalogs.attention_catalog`, the same builders the trace rule uses. Severity is not
decided here: a finding carries its measured saving and the part of it the A/B is sure of, and
:func:`diagnose.verdicts.settle` grades it. :func:`answer_checks` says "found fine" only for a
question none of the findings answered, under that finding's id, and only when it is true.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diagnose import attention_paths as ap
from diagnose.catalogs import attention_catalog as ac
from diagnose.probes.attention.calls import AttentionCall
from diagnose.probes.attention.environment import (
    PackageStatus,
    rocm_experimental_missing,
    torch_base_version,
)
from diagnose.probes.attention.full_size import FullSizeJudgement
from diagnose.probes.attention.judging import (
    Judged,
    best_backend,
    best_label,
    evidence_rows,
    measured_detail,
    modules_text,
    sure_total,
    total_saving,
)
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.record import Finding, Outcome, ProbeResult
from diagnose.stats import at_line
from diagnose.units import ms_significant

_NOTHING_FASTER = (
    " No fused backend measured faster than math at these inputs here, so fixing it saves "
    "nothing on this device (measured)."
)
_NOT_MEASURED = " No fused backend could run these inputs here, so the saving was not measured."
_BUDGET_CUT = f" Not measured: {BUDGET_STOPPED} whether a fused backend is faster at these inputs."


def _measured(judged: Sequence[Judged]) -> tuple[float | None, float | None, str | None, str]:
    """The saving to report, the part the A/B is sure of, the faster backend's label, and how
    the saving was obtained (for the detail)."""
    saving, savings = total_saving(judged)
    best = best_backend(savings)
    if saving is None:
        return None, None, None, _NOT_MEASURED
    if best is None and any(j.trials is not None and j.trials.stopped_by_budget for j in judged):
        return None, None, None, _BUDGET_CUT
    if best is None:
        # Measured, and nothing was surely faster: a saving of zero, which grades as info.
        return 0.0, 0.0, None, _NOTHING_FASTER
    return saving, sure_total(savings), best_label(best, savings), measured_detail(judged)


def math_rule(
    judged: Sequence[Judged],
    *,
    device_kind: str,
    arch: str,
    rocm: Mapping[str, Any],
    total_calls: int,
) -> Finding | None:
    """``attention.math_fallback`` when SDPA ran its unfused math path."""
    math_groups = [j for j in judged if j.group.path == ap.MATH]
    if not math_groups:
        return None
    calls = sum(j.group.calls for j in math_groups)
    saving, sure, faster_with, how = _measured(math_groups)
    why = list(dict.fromkeys(w for j in math_groups for w in j.why))
    forced = any(
        j.group.switches_off & {"flash_sdp_enabled", "mem_efficient_sdp_enabled"}
        for j in math_groups
    )
    fix = ac.math_fix(
        device_kind,
        arch,
        forced=forced,
        fp32_inputs=any(
            j.group.signature and j.group.signature.dtype == "float32" for j in math_groups
        ),
        dropout=any(j.group.signature and j.group.signature.dropout_p > 0 for j in math_groups),
        rocm_experimental_missing=rocm_experimental_missing(rocm),
    )
    best = best_backend(total_saving(math_groups)[1])
    if faster_with and best:
        fix += (
            f" Fastest measured here: {faster_with}; to select it: "
            f"{ac.BACKEND_SWITCH.get(best, best)}."
        )
    return ac.math_fallback(
        calls=calls,
        total_calls=total_calls,
        faster_with=faster_with,
        why=why or ["not known"],
        how_measured=how,
        fix=fix,
        evidence={
            "calls_per_step": calls,
            "attention_calls_per_step": total_calls,
            "profiled_seconds_per_step": sum(j.group.seconds for j in math_groups),
            "modules": modules_text([j.group for j in math_groups]),
            "why": why,
            "groups": evidence_rows(math_groups),
        },
        saving=saving,
        sure_saving=sure,
        basis="measured" if saving is not None else "none",
    )


def manual_rule(judged: Sequence[Judged]) -> Finding | None:
    """``attention.unfused_manual`` when attention is computed by hand (matmul/softmax/matmul)."""
    groups = [j for j in judged if j.group.path == ap.MANUAL]
    if not groups:
        return None
    calls = sum(j.group.calls for j in groups)
    processors: Counter[str] = Counter()
    for j in groups:
        processors.update(j.group.processors)
    saving, sure, faster_with, how = _measured(groups)
    if how == _NOTHING_FASTER:
        how = " No SDPA backend measured faster at these inputs here (measured)."
    elif how == _NOT_MEASURED:
        how = ""
    modules = modules_text([j.group for j in groups])
    return ac.unfused_manual(
        calls=calls,
        processors=", ".join(p for p, _ in processors.most_common(3)),
        modules=modules,
        faster_with=faster_with,
        how_measured=how,
        fix_extra=f"Fastest measured here: {faster_with}." if faster_with else "",
        evidence={
            "calls_per_step": calls,
            "processors": dict(processors),
            "modules": modules,
            "groups": evidence_rows(groups),
        },
        saving=saving,
        sure_saving=sure,
        basis="measured" if saving is not None else "none",
    )


def fused_with_alternative(judged: Sequence[Judged]) -> list[Judged]:
    return [j for j in judged if j.group.path in ap.FUSED_PATHS and j.saving is not None]


def worth_acting_on(saving: float, s_per_it: float | None) -> bool:
    """Whether a faster fused backend saves enough to raise ``attention.slower_backend``."""
    if s_per_it:
        return at_line(saving / s_per_it, ac.MIN_SHARE_OF_S_PER_IT).above
    return at_line(saving, ac.MIN_ABSOLUTE_SAVING_S).above


def slower_backend_rule(judged: Sequence[Judged], *, s_per_it: float | None) -> Finding | None:
    """``attention.slower_backend`` when a fused path ran but another backend is clearly faster."""
    groups = [
        j for j in fused_with_alternative(judged) if j.saving is not None and j.saving.clearly
    ]
    saving, savings = total_saving(groups)
    if not groups or saving is None or not worth_acting_on(saving, s_per_it):
        return None
    best = best_backend(savings)
    assert best is not None
    ran: Counter[str] = Counter()
    for j in groups:
        if j.saving is not None:
            ran[j.saving.ran] += j.group.calls
    calls = sum(j.group.calls for j in groups)
    return ac.slower_backend(
        ran=", ".join(ac.BACKEND_LABELS.get(b, b) for b, _ in ran.most_common()),
        calls=calls,
        best=best,
        best_label=best_label(best, savings),
        how_measured=measured_detail(groups),
        evidence={
            "calls_per_step": calls,
            "ran": dict(ran),
            "best": best,
            "groups": evidence_rows(groups),
        },
        saving=saving,
        sure_saving=sure_total(savings),
        total_calls=sum(j.group.calls for j in judged),
    )


def _label(backend: str) -> str:
    return ac.BACKEND_LABELS.get(backend, backend)


def tiny_shapes_text(judged: Sequence[Judged]) -> str:
    """``Lq ≤ 256, head dims 8/16/32``: the shapes a shrunk model's kernel choice was made at."""
    signatures = [j.group.signature for j in judged if j.group.signature is not None]
    if not signatures:
        return "unknown shapes"
    dims = "/".join(str(d) for d in sorted({s.head_dim for s in signatures}))
    return f"Lq ≤ {max(s.q_len for s in signatures)}, head dims {dims}"


def slower_backend_at_full_size(
    tiny: Finding | None, judged: Sequence[Judged], judgement: FullSizeJudgement
) -> tuple[Finding | None, Outcome | None, str]:
    """The answer to ``attention.slower_backend`` of a run that trained a shrunk model, judged
    at the full-size shapes: the tiny model's finding only where the full-size measurement finds
    the same backend surely faster; otherwise found fine (nothing is faster there), or not
    judged (not measured, inconclusive, or faster there by a saving not measured for a step),
    naming the tiny model's own result as the artefact it is. Returns the finding, or the
    outcome and text of the check that replaces it (None: the tiny model's answer stands)."""
    where = judgement.shape_text()
    ran = _label(judgement.ran)
    measured = "; ".join(f"{_label(b)} {v.text()}" for b, v in judgement.verdicts.items())
    artefact = (
        f' (this tiny model\'s own result, "{tiny.title}", is an artefact of its shapes, '
        "not advice for the real model)"
        if tiny is not None
        else ""
    )
    if tiny is not None:
        best = tiny.evidence.get("best")
        if isinstance(best, str) and best in judgement.faster:
            tiny.evidence = {**tiny.evidence, "full_size": judgement.to_dict()}
            tiny.detail += (
                f" At {where} {_label(best)} is measured faster too: "
                f"{judgement.verdicts[best].text()} of {ran}'s."
            )
            return tiny, None, ""
    if judgement.none_faster:
        return (
            None,
            "ok",
            f"attention: no backend that runs here is faster than {ran} at {where} (measured, "
            f"per call: {measured}){artefact}",
        )
    if judgement.faster:
        faster = ", ".join(_label(b) for b in judgement.faster)
        return (
            None,
            "not_judged",
            f"attention: at {where} {faster} is measured faster per call than {ran} "
            f"({measured}), but what that saves a step of the real model is not measured on a "
            f"tiny run: run it at full size to judge it{artefact}",
        )
    stopped = judgement.trials is not None and judgement.trials.stopped_by_budget
    why = judgement.not_measured or (
        f"the comparison is inconclusive ({BUDGET_STOPPED}: {measured})"
        if stopped
        else f"the comparison is inconclusive ({measured})"
    )
    return (
        None,
        "not_judged",
        "attention: which kernel is fastest depends on the shapes, and this tiny model's "
        f"({tiny_shapes_text(judged)}) are not {judgement.shapes.preset}'s "
        f"({judgement.shapes.summary()}); at full size it was not judged: {why}{artefact}",
    )


def xformers_rule(status: PackageStatus, *, config_attention: str) -> Finding | None:
    """``attention.xformers_unavailable`` when xFormers was asked for or is installed broken."""
    asked = config_attention == "xformers"
    if not status.broken and not (asked and not status.installed):
        return None
    return ac.xformers_unavailable(
        summary=status.summary(),
        torch_version=torch_base_version(torch.__version__),
        evidence={
            "installed": status.installed,
            "version": status.version,
            "imports": status.imports,
            "error": status.error,
            "torch_requirement": status.torch_requirement,
            "torch": torch.__version__,
            "asked_for": asked,
        },
    )


# --------------------------------------------------------------------------------------------
# Found fine: one answer per question, never beside its own finding


def _fused_kinds(calls: Sequence[AttentionCall]) -> str:
    first: dict[str, AttentionCall] = {}
    for call in calls:
        if call.path in ap.FUSED_PATHS:
            first.setdefault(call.provider or call.path, call)
    return ", ".join(f"{provider} {call.path}" for provider, call in first.items())


def _no_faster_backend_text(judged: Sequence[Judged], s_per_it: float | None) -> str:
    """The answer to ``attention.slower_backend`` when every call ran a fused kernel and no other
    backend is worth switching to."""
    signatures = len({j.group.signature for j in judged})
    saving, savings = total_saving(judged)
    best = best_backend(savings)
    if not saving or best is None:
        return (
            "attention: no backend that runs here is measurably faster than the fused kernel "
            f"that ran, at {signatures} attention signatures (microbenchmarked, interleaved)"
        )
    share = f" ({saving / s_per_it:.1%} of s/it)" if s_per_it else ""
    return (
        f"attention: {best_label(best, savings)} measured {ms_significant(saving)}/it faster than "
        f"the fused kernel that ran{share}: too little to act on (microbenchmarked at "
        f"{signatures} attention signatures)"
    )


def answer_checks(
    result: ProbeResult,
    *,
    calls: Sequence[AttentionCall],
    judged: Sequence[Judged],
    packages: Mapping[str, PackageStatus],
    s_per_it: float | None,
) -> None:
    """Add the "found fine" and "could not judge" answers to the questions the findings in
    ``result`` left open, each under the id of the finding it excludes."""
    # A question already answered (a full-size judgement on a shrunk model's run) keeps its answer.
    raised = {f.id for f in result.findings} | {c.id for c in result.checks}
    paths = Counter(c.path for c in calls)
    fused_calls = sum(n for p, n in paths.items() if p in ap.FUSED_PATHS)
    unknown = paths.get("unknown", 0)
    if ac.MATH_ID not in raised:
        if unknown:
            result.add_not_judged(
                ac.MATH_ID,
                f"attention: the profiler did not show which kernel ran for {unknown} of "
                f"{len(calls)} calls per step",
            )
        elif fused_calls:
            result.add_ok(ac.MATH_ID, ac.no_math_text(fused_calls, len(calls), _fused_kinds(calls)))
    if ac.MANUAL_ID not in raised and not unknown:
        result.add_ok(ac.MANUAL_ID, ac.NO_MANUAL_TEXT)
    # "Nothing is faster than the fused kernel that ran" is only true of a step whose every call
    # ran one: beside a math or hand-written path it would deny the saving that finding measured.
    every_call_fused = bool(calls) and fused_calls == len(calls)
    if ac.SLOWER_ID not in raised and every_call_fused:
        compared = fused_with_alternative(judged)
        unsure = [j for j in compared if j.saving and j.saving.verdict.outcome == "inconclusive"]
        if unsure and best_backend(total_saving(compared)[1]) is None:
            worst = max(unsure, key=lambda j: j.group.seconds)
            assert worst.saving is not None and worst.group.signature is not None
            stopped = any(j.trials is not None and j.trials.stopped_by_budget for j in unsure)
            until = BUDGET_STOPPED if stopped else "after interleaved samples up to the time budget"
            result.add_not_judged(
                ac.SLOWER_ID,
                f"attention: whether another backend is faster than the fused kernel that ran "
                f"is inconclusive at {len(unsure)} of {len(compared)} attention signatures, "
                f"{until} (at "
                f"{worst.group.signature.label()}: {_label(worst.saving.best)} "
                f"{worst.saving.verdict.text()} of {_label(worst.saving.ran)}'s)",
            )
        elif compared:
            result.add_ok(ac.SLOWER_ID, _no_faster_backend_text(compared, s_per_it))
        else:
            result.add_not_judged(
                ac.SLOWER_ID,
                "attention: no other backend runs the step's attention inputs here, so the fused "
                "kernel that ran was not compared",
            )
    xformers, flash_attn = packages.get("xformers"), packages.get("flash_attn")
    if xformers is not None and ac.XFORMERS_ID not in raised:
        result.add_ok(ac.XFORMERS_ID, f"attention: {xformers.summary()}")
    if flash_attn is not None:
        if flash_attn.broken:
            result.add_not_judged(
                ac.FLASH_ATTN_CHECK,
                f"attention: {flash_attn.summary()}: its backend was not benchmarked",
            )
        else:
            result.add_ok(ac.FLASH_ATTN_CHECK, f"attention: {flash_attn.summary()}")


__all__ = [
    "answer_checks",
    "fused_with_alternative",
    "manual_rule",
    "math_rule",
    "slower_backend_at_full_size",
    "slower_backend_rule",
    "tiny_shapes_text",
    "worth_acting_on",
    "xformers_rule",
]
