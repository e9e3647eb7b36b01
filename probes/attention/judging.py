"""What each group of attention calls costs and why it did not run fused (pure).

The probe groups the calls of its profiled step by (signature, path), benchmarks every backend at
each signature (:mod:`diagnose.probes.attention.bench`) and reads here: the measured saving of
moving a group to the best backend that runs, whether the A/B is sure of it, and torch's own
reasons a fused kernel refused the inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose import attention_paths as ap
from diagnose import contention, stats
from diagnose.catalogs.attention_catalog import BACKEND_LABELS, MIN_RELATIVE_GAIN
from diagnose.probes.attention.bench import GPU_ONLY, SignatureTrials, Trial
from diagnose.probes.attention.calls import AttentionCall, Signature
from diagnose.probes.attention.environment import rocm_experimental_missing

_SWITCH_LABEL = {
    "flash_sdp_enabled": "flash",
    "mem_efficient_sdp_enabled": "memory-efficient",
    "cudnn_sdp_enabled": "cuDNN",
    "math_sdp_enabled": "math",
}


# --------------------------------------------------------------------------------------------
# Grouping calls (pure)


@dataclass
class PathGroup:
    """The calls of one step with one signature that took one path."""

    signature: Signature | None
    path: str
    provider: str
    calls: int = 0
    modules: Counter[str] = field(default_factory=Counter)
    processors: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    kernels: Counter[str] = field(default_factory=Counter)
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    #: SDPA switches that were off at one or more of these calls.
    switches_off: set[str] = field(default_factory=set)

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def backend(self) -> str | None:
        return ap.backend_for_path(self.path, self.provider)


def group_calls(calls: Sequence[AttentionCall]) -> list[PathGroup]:
    """Calls grouped by (signature, path, provider), most expensive group first."""
    groups: dict[tuple[Signature | None, str, str], PathGroup] = {}
    for call in calls:
        key = (call.signature, call.path, call.provider)
        group = groups.setdefault(key, PathGroup(call.signature, call.path, call.provider))
        group.calls += 1
        group.modules[call.module or "(outside attention modules)"] += 1
        group.processors[call.processor or "-"] += 1
        group.ops.update(call.ops)
        group.kernels.update(call.kernels)
        group.forward_seconds += call.forward_seconds
        group.backward_seconds += call.backward_seconds
        group.switches_off.update(k for k, on in call.switches.items() if not on)
    return sorted(groups.values(), key=lambda g: (-g.seconds, -g.calls, g.path))


# --------------------------------------------------------------------------------------------
# Savings (pure)


@dataclass
class Saving:
    """What switching one group to the best measured backend saves."""

    ran: str
    best: str
    ran_seconds: float
    best_seconds: float
    calls: int
    #: Whether the best is surely faster by more than MIN_RELATIVE_GAIN (diagnose.stats'
    #: interleaved A/B verdict): "faster", "not_faster" or "inconclusive".
    verdict: stats.ABVerdict
    best_note: str = ""
    #: The per-call saving the A/B is sure of (diagnose.stats.sure_saving, never negative):
    #: severity is graded on it, so that it does not flip between runs.
    sure_per_call: float = 0.0

    @property
    def clearly(self) -> bool:
        return self.verdict.outcome == "faster"

    @property
    def per_call(self) -> float:
        return self.ran_seconds - self.best_seconds

    @property
    def per_step(self) -> float:
        return max(0.0, self.per_call) * self.calls if self.clearly else 0.0

    @property
    def sure_per_step(self) -> float:
        return self.sure_per_call * self.calls if self.clearly else 0.0


def faster_verdict(ran: Trial, other: Trial) -> stats.ABVerdict:
    """Whether ``other`` is surely faster than ``ran`` by more than MIN_RELATIVE_GAIN, on their
    interleaved samples (diagnose.stats.ab_verdict): faster, not faster, or inconclusive."""
    verdict = stats.ab_verdict(ran.samples, other.samples, min_relative=MIN_RELATIVE_GAIN)
    if verdict.set_aside:
        contention.note_set_aside()
    return verdict


def comparisons_decided(
    ran_backends: Sequence[str], *, exclude: Sequence[str] = ("manual",)
) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """The benchmark's stopping rule at one signature: every backend that ran there compared
    with every other one that runs has a sure answer (faster or not faster). With no backend
    known to have run, nothing needs deciding."""

    def decided(samples: Mapping[str, Sequence[float]]) -> bool:
        for ran in ran_backends:
            base = samples.get(ran)
            if not base:
                continue
            for other, values in samples.items():
                if other == ran or other in exclude or not values:
                    continue
                verdict = stats.ab_verdict(base, values, min_relative=MIN_RELATIVE_GAIN)
                if not verdict.decided:
                    return False
        return True

    return decided


def best_alternative(
    trials: SignatureTrials, ran_backend: str | None, *, exclude: Sequence[str] = ("manual",)
) -> Trial | None:
    """The fastest backend that ran here (never ``exclude``, never the one that ran)."""
    candidates = [
        t
        for t in trials.trials
        if t.samples and t.backend not in exclude and t.backend != ran_backend
    ]
    return min(candidates, key=lambda t: t.stats.median, default=None)


def group_saving(group: PathGroup, trials: SignatureTrials | None) -> Saving | None:
    """The measured saving of moving ``group`` to the best backend, or None if unmeasurable."""
    if trials is None or group.backend is None:
        return None
    ran = trials.trial(group.backend)
    best = best_alternative(trials, group.backend)
    if ran is None or not ran.samples or best is None:
        return None
    return Saving(
        ran=group.backend,
        best=best.backend,
        ran_seconds=ran.stats.median,
        best_seconds=best.stats.median,
        calls=group.calls,
        verdict=faster_verdict(ran, best),
        best_note=best.note,
        sure_per_call=stats.sure_saving(best.samples, ran.samples),
    )


# --------------------------------------------------------------------------------------------
# Why (pure): the reasons behind a math path


def why_not_fused(
    group: PathGroup,
    trials: SignatureTrials | None,
    *,
    device_kind: str,
    rocm: Mapping[str, Any],
    config_attention: str,
    diffusers: Mapping[str, Any],
) -> list[str]:
    """Plain reasons, most decisive first, that the fused kernels did not run for ``group``."""
    reasons: list[str] = []
    sig = group.signature
    # On the CPU only the flash switch matters: it is the one fused CPU kernel.
    fused_switches = (
        {"flash_sdp_enabled"}
        if device_kind == "cpu"
        else {"flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled"}
    )
    off = sorted(group.switches_off & fused_switches)
    if off:
        names = ", ".join(_SWITCH_LABEL[s] for s in off)
        who = []
        if config_attention == "math":
            who.append("this run's --attention math")
        backend = str(diffusers.get("active") or "")
        if backend == "_native_math" or diffusers.get("DIFFUSERS_ATTN_BACKEND") == "_native_math":
            who.append("diffusers' _native_math attention backend")
        by = f" (set by {' and '.join(who)})" if who else ""
        cpu_note = (
            "; on the CPU the flash switch also turns off the CPU's fused kernel"
            if device_kind == "cpu" and "flash_sdp_enabled" in off
            else ""
        )
        reasons.append(
            f"the {names} SDPA kernel(s) were switched off at the call{by}: "
            f"sdpa_kernel(SDPBackend.MATH) or torch.backends.cuda.enable_*_sdp(False){cpu_note}"
        )
    if rocm_experimental_missing(rocm):
        reasons.append(
            f"{rocm.get('arch')} needs {ap.ROCM_EXPERIMENTAL_ENV}=1 for torch's fused AOTriton "
            "kernels, and it is not set"
        )
    if sig is not None and sig.dropout_p > 0:
        reasons.append(
            f"attention dropout_p={sig.dropout_p:g}"
            + (": no fused CPU kernel supports dropout" if device_kind == "cpu" else "")
        )
    if trials is not None:
        for trial in trials.trials:
            gpu_only_here = device_kind == "cpu" and trial.backend in GPU_ONLY
            if (
                trial.backend in ("flash", "efficient", "cudnn")
                and not trial.runs
                and not gpu_only_here
            ):
                reasons.append(f"{BACKEND_LABELS[trial.backend]}: {_join(trial.reasons)}")
        for backend, texts in trials.can_use.items():
            if texts:
                reasons.append(f"can_use_{backend}_attention: {_join(texts)}")
    return reasons


#: torch's closing error after its specific reasons: says nothing the reasons do not.
_GENERIC_ERRORS = ("No available kernel", "No viable backend")


def _join(reasons: Sequence[str], limit: int = 3) -> str:
    specific = [r for r in reasons if not r.startswith(_GENERIC_ERRORS)] or list(reasons)
    return "; ".join(r.rstrip(". ") for r in specific[:limit]) or "refused"


# --------------------------------------------------------------------------------------------
# Groups with their saving: what the findings read


@dataclass
class Judged:
    """One group with its benchmark and saving, what the rules read."""

    group: PathGroup
    trials: SignatureTrials | None
    saving: Saving | None
    why: list[str] = field(default_factory=list)


def modules_text(groups: Sequence[PathGroup], limit: int = 4) -> str:
    modules: Counter[str] = Counter()
    for g in groups:
        modules.update(g.modules)
    names = [m for m, _ in modules.most_common(limit)]
    more = len(modules) - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def evidence_rows(judged: Sequence[Judged]) -> list[dict[str, Any]]:
    rows = []
    for j in judged:
        g = j.group
        row: dict[str, Any] = {
            "signature": g.signature.label() if g.signature else "unknown shapes",
            "calls_per_step": g.calls,
            "path": g.path,
            "provider": g.provider,
            "ops": dict(g.ops.most_common(3)),
            "processors": dict(g.processors),
            "profiled_ms_per_step": round(g.seconds * 1e3, 4),
        }
        if j.saving is not None:
            row.update(
                ran=j.saving.ran,
                ran_ms_per_call=round(j.saving.ran_seconds * 1e3, 5),
                best=j.saving.best,
                best_ms_per_call=round(j.saving.best_seconds * 1e3, 5),
                clearly_faster=j.saving.clearly,
                verdict=j.saving.verdict.outcome,
                ratio=j.saving.verdict.text(),
                saving_ms_per_step=round(j.saving.per_step * 1e3, 4),
            )
        if j.trials is not None:
            memory = {t.backend: t.peak_bytes for t in j.trials.trials if t.peak_bytes is not None}
            if memory:
                row["peak_bytes_per_call"] = memory
                row["memory_basis"] = next(
                    (t.memory_basis for t in j.trials.trials if t.memory_basis), ""
                )
        if j.why:
            row["why"] = list(j.why)
        rows.append(row)
    return rows


def total_saving(judged: Sequence[Judged]) -> tuple[float | None, list[Saving]]:
    savings = [j.saving for j in judged if j.saving is not None]
    if not savings:
        return None, []
    return sum(s.per_step for s in savings), savings


def sure_total(savings: Sequence[Saving]) -> float:
    """The per-step saving the A/B is sure of (diagnose.verdicts grades severity on it)."""
    return sum(s.sure_per_step for s in savings)


def best_backend(savings: Sequence[Saving]) -> str | None:
    weighted: dict[str, float] = {}
    for s in savings:
        if s.clearly:
            weighted[s.best] = weighted.get(s.best, 0.0) + s.per_step
    return max(weighted, key=lambda b: weighted[b]) if weighted else None


def best_label(best: str, savings: Sequence[Saving]) -> str:
    """The backend's name plus how it was measured when that differs from the run (a note)."""
    notes = sorted({s.best_note for s in savings if s.best == best and s.clearly and s.best_note})
    label = BACKEND_LABELS.get(best, best)
    return f"{label} ({'; '.join(notes)})" if notes else label


_MEASURED_DETAIL = (
    " Each backend was microbenchmarked per call at the model's exact attention inputs "
    "(forward{bwd}, device-synchronised, the backends sampled in turn) and the difference of "
    "medians scaled by the calls per step; a backend counts as faster only when the U test's "
    "interval of its time ratio lies wholly below {keep:.0%} of the one that ran's."
)


def measured_detail(judged: Sequence[Judged]) -> str:
    backward = any(j.group.signature and j.group.signature.backward for j in judged)
    return _MEASURED_DETAIL.format(bwd="+backward" if backward else "", keep=1 - MIN_RELATIVE_GAIN)


__all__ = [
    "Judged",
    "PathGroup",
    "Saving",
    "best_alternative",
    "best_backend",
    "best_label",
    "comparisons_decided",
    "evidence_rows",
    "faster_verdict",
    "group_calls",
    "group_saving",
    "measured_detail",
    "modules_text",
    "sure_total",
    "total_saving",
    "why_not_fused",
]
