"""The ``attention`` probe: which attention kernel really ran, why not a fused one, what it costs.

The most common cause of "my LoRA is 3x slower than it should be" is attention silently taking a
non-fused path: on ROCm consumer GPUs the fused SDPA kernels are off without
``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1`` and torch falls back to math; xFormers fails to load
after a torch upgrade and the trainer quietly uses something slower; kohya without ``--sdpa`` /
``--xformers`` computes attention by hand; a custom processor does softmax(QKᵀ)V itself. The probe:

1. **What ran** — one extra training step (parameters untouched) under the profiler with module
   hooks and a TorchFunctionMode (:mod:`diagnose.probes.attention_capture`): every attention call
   with its module, processor class, q/k/v shapes, dtype, mask, dropout, the op and kernels that
   executed (classified by :mod:`diagnose.attention_paths`, shared with the trace rule) and its
   forward and backward time.
2. **Why** — per distinct input signature, whether each fused backend can run and torch's
   reasons when not (:mod:`diagnose.probes.attention_bench`); the SDPA switches at the moment of
   each call; the ROCm architecture against the experimental switch; diffusers' attention
   backend; whether xFormers and flash-attn are installed, import, and match this torch.
3. **What it costs** — every backend that runs here is microbenchmarked at the exact
   signatures, forward+backward, with memory; the saving is (time of the path that ran − best
   available) per call × calls per step.

Findings: ``attention.math_fallback``, ``attention.unfused_manual`` (the same ids as the trace
rule), ``attention.slower_backend``, ``attention.xformers_unavailable`` (info, when it matters).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose import attention_paths as ap
from diagnose.probes.attention_bench import GPU_ONLY, SignatureTrials, Trial, benchmark_signature
from diagnose.probes.attention_capture import (
    AttentionCall,
    Signature,
    capture_step,
    sdpa_switches,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped, sure_saving
from diagnose.record import Finding, ProbeResult, Severity
from diagnose.timing import device_synchronizer

#: A backend counts as faster only when both its median and its lower quartile beat those of the
#: one that ran by this share (see clearly_faster).
MIN_RELATIVE_GAIN = 0.10
#: A faster fused backend is worth a finding from this share of s/it (or, without a measured
#: s/it, from this many seconds per step).
MIN_SHARE_OF_S_PER_IT = 0.01
MIN_ABSOLUTE_SAVING_S = 0.5e-3
WARN_SHARE = 0.05
CRITICAL_SHARE = 0.20
#: Benchmark settings (per backend and signature).
MIN_SAMPLES = 3
MAX_SAMPLES = 15
TRIAL_BUDGET_S = 0.15
#: At most this many signatures are benchmarked (the most expensive first).
MAX_SIGNATURES = 16
#: CPU microbenchmarks run on this many threads (None: as the run). With several threads a
#: parallel region waits for every thread, so one busy core elsewhere stalls each call by a
#: scheduler tick (measured here: 16 ms instead of 0.14 ms per call); one thread keeps the
#: comparison between backends stable. GPU benchmarks are unaffected.
CPU_BENCHMARK_THREADS: int | None = 1

_SWITCH_LABEL = {
    "flash_sdp_enabled": "flash",
    "mem_efficient_sdp_enabled": "memory-efficient",
    "cudnn_sdp_enabled": "cuDNN",
    "math_sdp_enabled": "math",
}


# --------------------------------------------------------------------------------------------
# The environment: ROCm switch, diffusers backend, xFormers / flash-attn


@dataclass
class PackageStatus:
    """An optional attention package: installed, importing, built for this torch."""

    name: str
    installed: bool = False
    version: str | None = None
    #: None when the import was not checked.
    imports: bool | None = None
    #: The import error, verbatim (first lines).
    error: str = ""
    #: The torch requirement in the wheel's metadata ("torch==2.5.1"), if any.
    torch_requirement: str = ""
    #: Whether an exact pin matches the installed torch; None without an exact pin.
    matches_torch: bool | None = None
    source: str = ""

    @property
    def broken(self) -> bool:
        return self.installed and (self.imports is False or self.matches_torch is False)

    def summary(self) -> str:
        if not self.installed:
            return f"{self.name}: not installed (unavailable; SDPA is used instead)"
        text = f"{self.name} {self.version or '?'}"
        if self.imports is False:
            return f"{text}: installed but does not import: {self.error or 'unknown error'}"
        if self.matches_torch is False:
            return f"{text}: built for {self.torch_requirement}, this is torch {torch.__version__}"
        if self.imports is None:
            return f"{text}: installed (import not checked)"
        return f"{text}: imports"


_DISTRIBUTIONS = {"xformers": ("xformers",), "flash_attn": ("flash-attn", "flash_attn")}


def _torch_base_version(version: str) -> str:
    return version.split("+")[0]


def torch_requirement(requirements: Sequence[str]) -> tuple[str, bool | None]:
    """The torch requirement among a wheel's ``Requires-Dist`` and whether an exact pin matches."""
    for requirement in requirements:
        text = requirement.split(";")[0].strip()
        if not re.match(r"^torch\b(?![-_.\w])", text):
            continue
        pin = re.match(r"^torch\s*==\s*([\w.+]+)", text)
        if pin is None:
            return text, None
        return text, _torch_base_version(pin.group(1)) == _torch_base_version(torch.__version__)
    return "", None


def package_status(name: str, inventory_packages: Mapping[str, Any] | None) -> PackageStatus:
    """Status of xformers or flash_attn, from the run's inventory when it has the entry.

    Without an inventory entry an installed package is import-checked in a child interpreter
    (diagnose.inventory does that: a broken build may crash the process that imports it).
    """
    status = PackageStatus(name)
    entry = (inventory_packages or {}).get(name)
    if not isinstance(entry, Mapping):
        try:
            present = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            present = False
        if present:
            from diagnose.inventory import PACKAGES, collect_packages

            specs = [s for s in PACKAGES if s.name == name]
            entry = collect_packages(specs).get(name) if specs else None
        status.source = "checked by the probe"
    else:
        status.source = "inventory"
    if isinstance(entry, Mapping):
        status.installed = bool(entry.get("installed"))
        status.version = entry.get("version")
        imports = entry.get("imports")
        status.imports = imports if isinstance(imports, bool) else None
        status.error = str(entry.get("error") or "")
    for dist in _DISTRIBUTIONS.get(name, (name,)):
        try:
            requirements = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        status.installed = True
        status.version = status.version or importlib.metadata.version(dist)
        status.torch_requirement, status.matches_torch = torch_requirement(requirements)
        break
    return status


def diffusers_backend(models: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """diffusers' attention backend: the environment variable, the active one, per processor."""
    info: dict[str, Any] = {"DIFFUSERS_ATTN_BACKEND": os.environ.get("DIFFUSERS_ATTN_BACKEND")}
    try:
        from diffusers.models import attention_dispatch
    except Exception:  # an old diffusers without dispatch, or none at all
        return info
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    active = getattr(registry, "_active_backend", None)
    info["active"] = getattr(active, "value", None) or (str(active) if active else None)
    per_processor: Counter[str] = Counter()
    for model in models:
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_attention_backend"):
                backend = processor._attention_backend
                per_processor[getattr(backend, "value", None) or str(backend or "default")] += 1
    info["processor_backends"] = dict(per_processor)
    return info


def rocm_facts(device_kind: str, arch: str) -> dict[str, Any]:
    """The ROCm experimental-kernel switch against this GPU's architecture."""
    if device_kind != "rocm":
        return {}
    value = os.environ.get(ap.ROCM_EXPERIMENTAL_ENV)
    facts: dict[str, Any] = {
        "arch": arch,
        "needs_experimental": ap.rocm_needs_experimental(arch),
        ap.ROCM_EXPERIMENTAL_ENV: value,
        "experimental_enabled": ap.env_enabled(value),
    }
    preferred = getattr(torch.backends.cuda, "preferred_rocm_fa_library", None)
    if callable(preferred):
        try:
            facts["preferred_rocm_fa_library"] = str(preferred())
        except Exception as exc:
            facts["preferred_rocm_fa_library"] = f"unknown ({type(exc).__name__})"
    return facts


def rocm_experimental_missing(facts: Mapping[str, Any]) -> bool:
    return bool(facts.get("needs_experimental")) and not facts.get("experimental_enabled")


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
    #: Whether the best is faster beyond the noise (MIN_RELATIVE_GAIN and quartiles apart).
    clearly: bool
    best_note: str = ""
    #: The per-call saving the A/B is sure of (probes.base.sure_saving, never negative): severity
    #: is judged on it, so that it does not flip between runs.
    sure_per_call: float = 0.0

    @property
    def per_call(self) -> float:
        return self.ran_seconds - self.best_seconds

    @property
    def per_step(self) -> float:
        return max(0.0, self.per_call) * self.calls if self.clearly else 0.0

    @property
    def sure_per_step(self) -> float:
        return self.sure_per_call * self.calls if self.clearly else 0.0


def clearly_faster(ran: Trial, other: Trial, min_relative: float = MIN_RELATIVE_GAIN) -> bool:
    """Whether ``other`` beats ``ran`` by ``min_relative`` in both median and lower quartile.

    Timing noise on a shared machine only adds time, and comes in bursts (a descheduled thread
    costs a scheduler tick), so upper quartiles say little; the lower quartile is the stable
    part of the distribution and the median the typical one. Requiring both keeps one lucky or
    unlucky burst from making a finding.
    """
    base, alt = ran.stats, other.stats
    if not (base.n and alt.n):
        return False
    keep = 1 - min_relative
    return bool(alt.median <= base.median * keep and alt.q1 <= base.q1 * keep)


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
        clearly=clearly_faster(ran, best),
        best_note=best.note,
        sure_per_call=sure_saving(best.samples, ran.samples),
    )


def severity_for(saving_s: float | None, s_per_it: float | None, floor: Severity) -> Severity:
    """By share of s/it; ``floor`` when the share cannot be said."""
    if saving_s is None or not s_per_it:
        return floor
    share = saving_s / s_per_it
    if share >= CRITICAL_SHARE:
        return "critical"
    if share >= WARN_SHARE:
        return "warn"
    return "info"


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
                reasons.append(f"{ap.BACKEND_LABELS[trial.backend]}: {_join(trial.reasons)}")
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
# Findings (pure)


@dataclass
class Judged:
    """One group with its benchmark and saving, what the rules read."""

    group: PathGroup
    trials: SignatureTrials | None
    saving: Saving | None
    why: list[str] = field(default_factory=list)


def _ms_text(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _modules_text(groups: Sequence[PathGroup], limit: int = 4) -> str:
    modules: Counter[str] = Counter()
    for g in groups:
        modules.update(g.modules)
    names = [m for m, _ in modules.most_common(limit)]
    more = len(modules) - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def _evidence_rows(judged: Sequence[Judged]) -> list[dict[str, Any]]:
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


def _total_saving(judged: Sequence[Judged]) -> tuple[float | None, list[Saving]]:
    savings = [j.saving for j in judged if j.saving is not None]
    if not savings:
        return None, []
    return sum(s.per_step for s in savings), savings


def _sure_saving(savings: Sequence[Saving]) -> float:
    """The per-step saving the A/B is sure of (what severity is judged on)."""
    return sum(s.sure_per_step for s in savings)


def _best_backend(savings: Sequence[Saving]) -> str | None:
    weighted: dict[str, float] = {}
    for s in savings:
        if s.clearly:
            weighted[s.best] = weighted.get(s.best, 0.0) + s.per_step
    return max(weighted, key=lambda b: weighted[b]) if weighted else None


def _best_label(best: str, savings: Sequence[Saving]) -> str:
    """The backend's name plus how it was measured when that differs from the run (a note)."""
    notes = sorted({s.best_note for s in savings if s.best == best and s.clearly and s.best_note})
    label = ap.BACKEND_LABELS.get(best, best)
    return f"{label} ({'; '.join(notes)})" if notes else label


_MEASURED_DETAIL = (
    " Each backend was microbenchmarked per call at the model's exact attention inputs "
    "(forward{bwd}, device-synchronised median) and the difference scaled by the calls per step; "
    "a backend counts as faster only when both its median and its lower quartile are at least "
    "{gain:.0%} lower than those of the one that ran."
)


def _measured_detail(judged: Sequence[Judged]) -> str:
    backward = any(j.group.signature and j.group.signature.backward for j in judged)
    return _MEASURED_DETAIL.format(bwd="+backward" if backward else "", gain=MIN_RELATIVE_GAIN)


def math_rule(
    judged: Sequence[Judged],
    *,
    device_kind: str,
    arch: str,
    rocm: Mapping[str, Any],
    s_per_it: float | None,
    total_calls: int,
) -> Finding | None:
    """``attention.math_fallback`` when SDPA ran its unfused math path."""
    math_groups = [j for j in judged if j.group.path == ap.MATH]
    if not math_groups:
        return None
    calls = sum(j.group.calls for j in math_groups)
    saving, savings = _total_saving(math_groups)
    best = _best_backend(savings)
    why = [w for j in math_groups for w in j.why]
    why = list(dict.fromkeys(why))
    forced = any(
        j.group.switches_off & {"flash_sdp_enabled", "mem_efficient_sdp_enabled"}
        for j in math_groups
    )
    fp32 = any(j.group.signature and j.group.signature.dtype == "float32" for j in math_groups)
    dropout = any(j.group.signature and j.group.signature.dropout_p > 0 for j in math_groups)
    fix = ap.math_fix(
        device_kind,
        arch,
        forced=forced,
        fp32_inputs=fp32,
        dropout=dropout,
        rocm_experimental_missing=rocm_experimental_missing(rocm),
    )
    if best is not None:
        fix += (
            f" Fastest measured here: {_best_label(best, savings)}; to select it: "
            f"{ap.BACKEND_SWITCH.get(best, '')}."
        )
    measured = saving is not None and any(s.clearly for s in savings)
    seconds = sum(j.group.seconds for j in math_groups)
    title = f"Attention ran on the unfused math path in {calls} of {total_calls} calls per step" + (
        f" — measured {_ms_text(saving)}/it faster with {_best_label(best, savings)}"
        if measured and saving is not None and best
        else ""
    )
    detail = (
        "scaled_dot_product_attention dispatched to _scaled_dot_product_attention_math, which "
        "materialises the full B·H·Lq·Lk attention matrix (and keeps it for the backward) "
        "instead of running a fused kernel. Why: " + ("; ".join(why) if why else "not known") + "."
    )
    if measured:
        detail += _measured_detail(math_groups)
    elif saving is not None:
        detail += (
            " No fused backend measured faster than math at these inputs here, so fixing it "
            "saves nothing on this device (measured)."
        )
    else:
        detail += " No fused backend could run these inputs here, so the saving was not measured."
    severity: Severity = (
        severity_for(_sure_saving(savings), s_per_it, "warn")
        if measured
        else ("info" if saving is not None else "warn")
    )
    return Finding(
        id=ap.MATH_ID,
        category="attention",
        severity=severity,
        title=title,
        evidence={
            "calls_per_step": calls,
            "attention_calls_per_step": total_calls,
            "profiled_seconds_per_step": seconds,
            "modules": _modules_text([j.group for j in math_groups]),
            "why": why,
            "groups": _evidence_rows(math_groups),
        },
        est_seconds_saved_per_it=saving if saving is not None else None,
        saving_basis="measured" if saving is not None else "none",
        fix=fix,
        detail=detail,
    )


def manual_rule(judged: Sequence[Judged], *, s_per_it: float | None) -> Finding | None:
    """``attention.unfused_manual`` when attention is computed by hand (matmul/softmax/matmul)."""
    groups = [j for j in judged if j.group.path == ap.MANUAL]
    if not groups:
        return None
    calls = sum(j.group.calls for j in groups)
    processors: Counter[str] = Counter()
    for j in groups:
        processors.update(j.group.processors)
    saving, savings = _total_saving(groups)
    best = _best_backend(savings)
    measured = saving is not None and any(s.clearly for s in savings)
    names = ", ".join(p for p, _ in processors.most_common(3))
    title = (
        f"Attention is computed by hand (matmul → softmax → matmul) by {names} in {calls} "
        "calls per step"
        + (
            f" — measured {_ms_text(saving)}/it faster with {_best_label(best, savings)}"
            if measured and saving is not None and best
            else ""
        )
    )
    detail = (
        f"The processor(s) {names} on {_modules_text([j.group for j in groups])} multiply queries "
        "and keys, take a softmax and multiply by the values as separate ops, outside "
        "scaled_dot_product_attention, so no fused kernel can run and the full attention matrix "
        "is kept for the backward."
    )
    if measured:
        detail += _measured_detail(groups)
    elif saving is not None:
        detail += " No SDPA backend measured faster at these inputs here (measured)."
    fix = ap.MANUAL_FIX
    if best is not None:
        fix += f" Fastest measured here: {_best_label(best, savings)}."
    return Finding(
        id=ap.MANUAL_ID,
        category="attention",
        severity=severity_for(_sure_saving(savings), s_per_it, "warn")
        if measured
        else ("info" if saving is not None else "warn"),
        title=title,
        evidence={
            "calls_per_step": calls,
            "processors": dict(processors),
            "modules": _modules_text([j.group for j in groups]),
            "groups": _evidence_rows(groups),
        },
        est_seconds_saved_per_it=saving,
        saving_basis="measured" if saving is not None else "none",
        fix=fix,
        detail=detail,
    )


def slower_backend_rule(judged: Sequence[Judged], *, s_per_it: float | None) -> Finding | None:
    """``attention.slower_backend`` when a fused path ran but another backend is clearly faster."""
    groups = [
        j
        for j in judged
        if j.group.path in ap.FUSED_PATHS and j.saving is not None and j.saving.clearly
    ]
    saving, savings = _total_saving(groups)
    if not groups or saving is None:
        return None
    if (s_per_it and saving / s_per_it < MIN_SHARE_OF_S_PER_IT) or (
        not s_per_it and saving < MIN_ABSOLUTE_SAVING_S
    ):
        return None
    best = _best_backend(savings)
    assert best is not None
    ran: Counter[str] = Counter()
    for j in groups:
        if j.saving is not None:
            ran[j.saving.ran] += j.group.calls
    ran_text = ", ".join(ap.BACKEND_LABELS.get(b, b) for b, _ in ran.most_common())
    calls = sum(j.group.calls for j in groups)
    return Finding(
        id=ap.SLOWER_ID,
        category="attention",
        severity=severity_for(_sure_saving(savings), s_per_it, "info"),
        title=(
            f"{ran_text} ran for {calls} attention calls per step; "
            f"{_best_label(best, savings)} is measured {_ms_text(saving)}/it faster"
        ),
        evidence={
            "calls_per_step": calls,
            "ran": dict(ran),
            "best": best,
            "groups": _evidence_rows(groups),
        },
        est_seconds_saved_per_it=saving,
        saving_basis="measured",
        fix=f"Select {ap.BACKEND_LABELS.get(best, best)}: {ap.BACKEND_SWITCH.get(best, best)}.",
        detail=(
            "A fused kernel ran, but another backend that runs on this device is faster at the "
            "model's attention inputs." + _measured_detail(groups)
        ),
    )


def xformers_rule(status: PackageStatus, *, config_attention: str) -> Finding | None:
    """``attention.xformers_unavailable`` (info) when xFormers was asked for or is broken."""
    asked = config_attention == "xformers"
    if not status.broken and not (asked and not status.installed):
        return None
    return Finding(
        id=ap.XFORMERS_ID,
        category="attention",
        severity="info",
        title=f"xFormers is unavailable: {status.summary()}",
        evidence={
            "installed": status.installed,
            "version": status.version,
            "imports": status.imports,
            "error": status.error,
            "torch_requirement": status.torch_requirement,
            "torch": torch.__version__,
            "asked_for": asked,
        },
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=ap.xformers_fix(_torch_base_version(torch.__version__)),
        detail=(
            "A trainer told to use xFormers (kohya --xformers, diffusers "
            "enable_xformers_memory_efficient_attention) fails or quietly falls back when the "
            "installed xFormers does not load with this torch; SDPA is used instead. The "
            "attention table says what actually ran and what each backend costs here."
        ),
    )


# --------------------------------------------------------------------------------------------
# The probe


def _positive(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value > 0 else None


def _backends_for(device_kind: str, packages: Mapping[str, PackageStatus]) -> list[str]:
    backends = ["flash", "efficient", "cudnn", "math"]
    if device_kind != "cpu":
        backends += [n for n in ("xformers", "flash_attn") if packages[n].imports]
    return backends


class AttentionProbe:
    name = "attention"
    description = "Which attention kernel really ran, why not a fused one, and what it costs"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        min_samples: int = MIN_SAMPLES,
        max_samples: int = MAX_SAMPLES,
        trial_budget_s: float = TRIAL_BUDGET_S,
        max_signatures: int = MAX_SIGNATURES,
        cpu_threads: int | None = CPU_BENCHMARK_THREADS,
    ) -> None:
        self.cpu_threads = cpu_threads
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.trial_budget_s = trial_budget_s
        self.max_signatures = max_signatures

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped("no training workload (trace mode: the attention trace rule runs)")
        device = ctx.device
        device_kind = ctx.device_info.kind or device.type
        arch = ctx.device_info.arch
        sync = device_synchronizer(device)
        say = ctx.progress
        result = ProbeResult()
        data: dict[str, Any] = result.data
        not_checked: list[str] = data.setdefault("not_checked", [])

        # Why, part 1: the environment.
        inventory = ctx.record.inventory.get("packages") if ctx.record.inventory else None
        packages = {n: package_status(n, inventory) for n in ("xformers", "flash_attn")}
        rocm = rocm_facts(device_kind, arch)
        diffusers = diffusers_backend([workload.denoiser])
        config_attention = str(getattr(ctx.config, "attention", "auto"))
        data["environment"] = {
            "torch": torch.__version__,
            "hip": torch.version.hip,
            "device_kind": device_kind,
            "arch": arch,
            "sdpa_switches_outside_the_step": sdpa_switches(),
            "config_attention": config_attention,
            "rocm": rocm,
            "diffusers": diffusers,
            "packages": {n: vars(p) | {"summary": p.summary()} for n, p in packages.items()},
        }

        # What ran.
        say("attention: profiling one step")
        captured = capture_step(workload, sync)
        calls = captured.calls
        total_calls = len(calls)
        groups = group_calls(calls)
        data["step"] = {
            "calls_per_step": total_calls,
            "profiled_step_seconds": captured.step_seconds,
            "attention_seconds_per_step": sum(c.seconds for c in calls),
            "calls_by_path": dict(Counter(c.path for c in calls)),
            "basis": "one extra step under torch.profiler (device time on a GPU, host time on "
            "the CPU); parameters left as they were",
        }
        data["modules"] = _module_table(calls)
        if not calls:
            result.checked_ok.append("attention: the step makes no attention call")
            return result

        # Why, part 2, and what it costs: every backend at every signature.
        backends = _backends_for(device_kind, packages)
        experimental = rocm_experimental_missing(rocm)
        signatures = [g.signature for g in groups if g.signature is not None]
        unique = list(dict.fromkeys(signatures))
        if len(unique) > self.max_signatures:
            not_checked.append(
                f"{len(unique) - self.max_signatures} cheaper attention signatures were not "
                "benchmarked"
            )
            unique = unique[: self.max_signatures]
        benchmarked: dict[Signature, SignatureTrials] = {}
        threads = torch.get_num_threads()
        bench_threads = threads
        if device.type == "cpu" and self.cpu_threads:
            bench_threads = self.cpu_threads
        data["benchmark"] = {
            "threads": bench_threads,
            "step_threads": threads,
            "min_samples": self.min_samples,
            "max_samples": self.max_samples,
            "seconds_per_trial": self.trial_budget_s,
        }
        torch.set_num_threads(bench_threads)
        try:
            for n, signature in enumerate(unique, 1):
                say(f"attention: benchmarking {n}/{len(unique)} ({signature.label()})")
                benchmarked[signature] = self._benchmark(
                    signature, groups, device, sync, backends, experimental
                )
        finally:
            torch.set_num_threads(threads)
        if bench_threads != threads:
            not_checked.append(
                f"CPU microbenchmarks ran on {bench_threads} thread(s) (the step uses {threads}): "
                "per-call times compare backends, they are not the step's own times"
            )
        if device_kind == "cpu":
            not_checked.append(
                "peak memory per backend on the CPU: estimated from the shapes (the CPU "
                "allocator keeps no peak); measured with max_memory_allocated on GPUs"
            )

        judged: list[Judged] = []
        for group in groups:
            trials_for = benchmarked.get(group.signature) if group.signature else None
            j = Judged(group, trials_for, group_saving(group, trials_for))
            if group.path == ap.MATH:
                j.why = why_not_fused(
                    group,
                    trials_for,
                    device_kind=device_kind,
                    rocm=rocm,
                    config_attention=config_attention,
                    diffusers=diffusers,
                )
            judged.append(j)
        data["signatures"] = [
            {
                **t.to_dict(),
                "calls_per_step": sum(g.calls for g in groups if g.signature == s),
                "paths": _calls_by_path(g for g in groups if g.signature == s),
            }
            for s, t in benchmarked.items()
        ]
        data["groups"] = _evidence_rows(judged)

        # Findings.
        s_per_it = _positive(ctx.record.timing.headline.median)
        for finding in (
            math_rule(
                judged,
                device_kind=device_kind,
                arch=arch,
                rocm=rocm,
                s_per_it=s_per_it,
                total_calls=total_calls,
            ),
            manual_rule(judged, s_per_it=s_per_it),
            slower_backend_rule(judged, s_per_it=s_per_it),
            xformers_rule(packages["xformers"], config_attention=config_attention),
        ):
            if finding is not None:
                result.findings.append(finding)

        # What was checked and found fine.
        ids = {f.id for f in result.findings}
        fused = Counter(c.provider or c.path for c in calls if c.path in ap.FUSED_PATHS)
        if ap.MATH_ID not in ids and ap.MANUAL_ID not in ids and fused:
            kinds = ", ".join(f"{p} {c.path}" for p, c in _first_calls(calls).items())
            result.checked_ok.append(
                f"attention: all {sum(fused.values())} of {total_calls} calls per step ran fused "
                f"kernels ({kinds})"
            )
        fused_judged = [j for j in judged if j.saving and j.group.path in ap.FUSED_PATHS]
        if ap.SLOWER_ID not in ids and fused_judged:
            result.checked_ok.append(_slower_backend_checked(fused_judged, s_per_it))
        for status in packages.values():
            if not status.broken:
                result.checked_ok.append(f"attention: {status.summary()}")
        return result

    def _benchmark(
        self,
        signature: Signature,
        groups: Sequence[PathGroup],
        device: torch.device,
        sync: Any,
        backends: list[str],
        experimental: bool,
    ) -> SignatureTrials:
        """Every backend at ``signature`` (plus the hand-written one where it ran)."""
        needs_manual = any(g.signature == signature and g.path == ap.MANUAL for g in groups)
        trials = benchmark_signature(
            signature,
            device,
            sync,
            backends + (["manual"] if needs_manual else []),
            min_samples=self.min_samples,
            max_samples=self.max_samples,
            budget_s=self.trial_budget_s,
            rocm_experimental=experimental,
        )
        fused_ran = any(t.runs for t in trials.trials if t.backend not in ("math", "manual"))
        if signature.dropout_p > 0 and not fused_ran:
            # Dropout keeps every fused kernel out here; measure what dropout 0 would buy.
            undropped = benchmark_signature(
                Signature(**{**signature.__dict__, "dropout_p": 0.0}),
                device,
                sync,
                [b for b in backends if b != "math"],
                min_samples=self.min_samples,
                max_samples=self.max_samples,
                budget_s=self.trial_budget_s,
                rocm_experimental=experimental,
            )
            for trial in undropped.trials:
                if trial.runs:
                    trial.note = (trial.note + "; " if trial.note else "") + "at dropout_p=0"
                    trials.trials.append(trial)
        return trials


def _slower_backend_checked(judged: Sequence[Judged], s_per_it: float | None) -> str:
    """The "checked, fine" line when no slower_backend finding was made."""
    signatures = len({j.group.signature for j in judged})
    saving, savings = _total_saving(judged)
    best = _best_backend(savings)
    if not saving or best is None:
        return (
            "attention: no backend that runs here is measurably faster than the fused kernel "
            f"that ran, at {signatures} attention signatures (microbenchmarked)"
        )
    share = f" ({saving / s_per_it:.1%} of s/it)" if s_per_it else ""
    return (
        f"attention: {_best_label(best, savings)} measured {_ms_text(saving)}/it faster than the "
        f"fused kernel that ran{share}: too little to act on (microbenchmarked at {signatures} "
        "attention signatures)"
    )


def _calls_by_path(groups: Iterable[PathGroup]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for g in groups:
        counts[g.path] += g.calls
    return dict(counts)


def _first_calls(calls: Sequence[AttentionCall]) -> dict[str, AttentionCall]:
    first: dict[str, AttentionCall] = {}
    for call in calls:
        if call.path in ap.FUSED_PATHS:
            first.setdefault(call.provider or call.path, call)
    return first


def _module_table(calls: Sequence[AttentionCall]) -> list[dict[str, Any]]:
    """Per module: processor, path, calls, shapes and time (the report's table)."""
    rows: dict[tuple[str, str, str, str, bool], dict[str, Any]] = {}
    for call in calls:
        key = (
            call.module,
            call.processor,
            call.path,
            call.signature.label() if call.signature else "",
            call.recomputed,
        )
        row = rows.setdefault(
            key,
            {
                "module": call.module or "(outside attention modules)",
                "processor": call.processor,
                "path": call.path,
                "provider": call.provider,
                "entry": call.entry,
                "signature": key[3],
                "ops": call.ops[:2],
                "kernels": call.kernels[:2],
                "recomputed": call.recomputed,
                "calls": 0,
                "forward_ms": 0.0,
                "backward_ms": 0.0,
            },
        )
        row["calls"] += 1
        row["forward_ms"] = round(row["forward_ms"] + call.forward_seconds * 1e3, 4)
        row["backward_ms"] = round(row["backward_ms"] + call.backward_seconds * 1e3, 4)
    return list(rows.values())


__all__ = [
    "AttentionProbe",
    "Judged",
    "PackageStatus",
    "PathGroup",
    "Saving",
    "best_alternative",
    "clearly_faster",
    "diffusers_backend",
    "group_calls",
    "group_saving",
    "manual_rule",
    "math_rule",
    "package_status",
    "rocm_facts",
    "severity_for",
    "slower_backend_rule",
    "torch_requirement",
    "why_not_fused",
    "xformers_rule",
]
