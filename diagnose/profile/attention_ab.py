"""The trace's math-path attention verdict, measured on the machine the command ran on.

A trace read anywhere can only estimate what a fused kernel would save (``FUSED_SPEEDUP`` in the
trace rule). ``diagnose profile`` runs where the training ran, once the command has ended: the
math path and every fused backend are timed there, interleaved, at the most common shape of the
trace's math calls (forward and backward, as the step ran them). The finding then says what was
measured: the saving and the backend that gives it, or that no fused backend was faster here
(which the estimate would have got wrong: on a CPU, flash loses to math at short sequences), or
that the A/B could not decide. When the shape cannot be read back or one round would not fit the
budget, the estimate stays and the finding says why it was not measured.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from diagnose import stats
from diagnose.attention_paths import classify_op
from diagnose.catalogs import attention_catalog as ac
from diagnose.probes.attention.attribution import ProfEvent, signature_from_op
from diagnose.probes.attention.bench import SDPA_BACKENDS, SignatureTrials
from diagnose.probes.attention.calls import Signature
from diagnose.probes.attention.full_size import RealShapes, judge_at_full_size
from diagnose.record import Finding, RunRecord
from diagnose.units import ms

#: Seconds the measurement may take, its pilot included (it runs after the user's command).
BUDGET_S = 5.0
#: The backends tried against the math path (those this build has no kernel for say so).
FUSED = tuple(name for name in SDPA_BACKENDS if name != "math")


def math_signature(evidence: Mapping[str, Any], *, training: bool) -> Signature | None:
    """The trace's most common math-path call, from the finding's evidence (its op, shapes and
    dtypes as the trace recorded them); None when they cannot be read back."""
    ops = [name for name in evidence.get("ops") or {} if _is_sdpa(name)]
    shapes = evidence.get("input_shapes") or []
    types = evidence.get("input_types") or []
    if not ops or not shapes:
        return None
    try:
        dims = json.loads(f"[{shapes[0]}]")
    except ValueError:
        return None
    dtypes = [t.strip() for t in str(types[0]).split(",")] if types else []
    op = ProfEvent(
        id=0,
        name=ops[0],
        parent=None,
        start_us=0.0,
        end_us=0.0,
        cpu_us=0.0,
        input_dtypes=dtypes,
        input_shapes=dims,
    )
    signature = signature_from_op(op)
    if signature is None or not signature.dtype:
        return None
    return Signature(**{**signature.__dict__, "backward": training})


def _is_sdpa(name: str) -> bool:
    kind = classify_op(name)
    return kind is not None and kind.provider.startswith("torch SDPA")


def measure_math_fallback(
    record: RunRecord, device: torch.device, sync: Callable[[], None], *, not_here: str = ""
) -> None:
    """Replace the trace's estimated math-path saving by one measured here (see the module).
    ``not_here``: why this machine cannot measure the command's kernels (another Python or
    device); the finding then says so and keeps its estimate."""
    trace = next((p for p in record.probes if p.name == "trace"), None)
    if trace is None:
        return
    at = next((i for i, f in enumerate(trace.findings) if f.id == ac.MATH_ID), None)
    if at is None:
        return
    finding = trace.findings[at]
    if not_here:
        _not_measured(finding, not_here)
        return
    signature = math_signature(finding.evidence, training=True)
    if signature is None:
        _not_measured(finding, "the trace's shapes of the math calls could not be read back")
        return
    finding.evidence = {**finding.evidence, "measured_here": {"signature": signature.label()}}
    shapes = RealShapes(
        preset="the trace", resolution=0, batch=signature.batch, signatures=(signature,)
    )
    judgement = judge_at_full_size(shapes, "math", FUSED, device, sync, budget_s=BUDGET_S)
    if not judgement.measured or judgement.trials is None:
        _not_measured(finding, judgement.not_measured)
        return
    trace.findings[at] = _measured(finding, signature, judgement.trials, judgement.verdicts)


def _not_measured(finding: Finding, why: str) -> None:
    # What was to be measured (the math call's signature) stays with the reason it was not.
    said = finding.evidence.get("measured_here") or {}
    finding.evidence = {**finding.evidence, "measured_here": {**said, "not_measured": why}}
    finding.detail = f"{finding.detail} Not measured on this machine: {why}.".strip()


def _measured(
    finding: Finding,
    signature: Signature,
    trials: SignatureTrials,
    verdicts: Mapping[str, stats.ABVerdict],
) -> Finding:
    # The saving is measured per step, not read off the profiled steps: no scaling applies.
    evidence = {
        k: v
        for k, v in finding.evidence.items()
        if k not in ("saving_in_profiled_steps_seconds", "saving_scaled_by")
    }
    calls = float(evidence.get("calls_per_step") or 0.0)
    math = trials.trial("math")
    assert math is not None  # judge_at_full_size measured it
    faster = {b: v for b, v in verdicts.items() if v.outcome == "faster"}
    best = min(
        (t for t in trials.trials if t.backend in faster and t.samples),
        key=lambda t: t.stats.median,
        default=None,
    )
    medians = ", ".join(
        f"{ac.BACKEND_LABELS.get(t.backend, t.backend)} {ms(t.stats.median)}"
        for t in trials.trials
        if t.samples
    )
    shape = f"{signature.label()}, the trace's most common math call"
    measured = {
        "signature": signature.label(),
        "ab": trials.to_dict(),
        "verdicts": {b: {"outcome": v.outcome, "ratio": v.text()} for b, v in verdicts.items()},
    }
    runs_in = str(evidence.get("runs_in") or "")
    how = (
        (f" {runs_in}" if runs_in else "")
        + f" Measured on this machine after the command, interleaved, at {shape}: {medians} "
        "a call (forward and backward)."
    )
    saving: float | None
    sure: float | None
    if best is not None:
        per_call = math.stats.median - best.stats.median
        saving = max(0.0, per_call) * calls
        sure = stats.sure_saving(best.samples, math.samples) * calls
        how += f" At {calls:g} calls per step that is {ms(saving)} per step."
        faster_with: str | None = ac.BACKEND_LABELS.get(best.backend, best.backend)
        basis = "measured"
    elif all(v.outcome == "not_faster" for v in verdicts.values()):
        saving, sure, faster_with, basis = 0.0, 0.0, None, "measured"
        ratios = "; ".join(f"{ac.BACKEND_LABELS.get(b, b)} {v.text()}" for b, v in verdicts.items())
        how += (
            f" No fused backend was faster here at this shape ({ratios}): on this machine the "
            "switch would not save time."
        )
    else:
        saving, sure, faster_with, basis = None, None, None, "none"
        how += " The A/B could not decide whether a fused backend is faster here."
    rebuilt = ac.math_fallback(
        calls=calls,
        seconds_per_step=evidence.get("seconds_per_step"),
        faster_with=faster_with,
        why=[str(w) for w in evidence.get("why") or []],
        how_measured=how,
        fix=finding.fix,
        evidence={**evidence, "measured_here": measured},
        saving=saving,
        sure_saving=sure,
        basis=basis,  # type: ignore[arg-type]
        source=finding.source,
    )
    return rebuilt


__all__ = ["BUDGET_S", "math_signature", "measure_math_fallback"]
