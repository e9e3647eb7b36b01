"""What the project knows about attention: finding ids, the questions asked, thresholds, wording
and fixes.

The attention probe (``diagnose run``, which profiles a step and microbenchmarks every backend) and
the attention trace rule (any Kineto trace) both build their findings here, so the math fallback
reads the same whichever way it was found. Which op or kernel is which path lives in
:mod:`diagnose.attention_paths`; what to do about it lives here. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.attention_paths import ROCM_EXPERIMENTAL_ENV, rocm_needs_experimental
from diagnose.catalogs import FindingSpec, carries_over, in_trainers, judged_at_full_size
from diagnose.record import Basis, Finding
from diagnose.units import ms_significant

#: The phases in which attention runs.
ATTENTION_PHASES = ("encode", "forward", "backward")

MATH_FALLBACK = FindingSpec(
    "attention.math_fallback",
    "attention",
    "attention ran SDPA's unfused math path",
    ("probe", "trace"),
    phases=ATTENTION_PHASES,
    # Without a measured saving (no fused kernel could run the inputs here) the fallback is still
    # worth a warning: on the user's GPU it is usually the largest attention cost.
    severity_without_saving="warn",
    at_full_size=carries_over(
        "the path SDPA takes is set by the switches, dtype, dropout and device, the same at "
        "full size; its saving was measured at the tiny model's shapes"
    ),
)
UNFUSED_MANUAL = FindingSpec(
    "attention.unfused_manual",
    "attention",
    "attention is computed by hand with `bmm → softmax → bmm`",
    ("probe", "trace"),
    phases=ATTENTION_PHASES,
    severity_without_saving="warn",
    at_full_size=carries_over(
        "the attention processor the code installs, whatever the model's size; its saving was "
        "measured at the tiny model's shapes"
    ),
)
SLOWER_BACKEND = FindingSpec(
    "attention.slower_backend",
    "attention",
    "a fused backend ran, and another one that runs here was measured faster",
    ("probe",),
    phases=ATTENTION_PHASES,
    at_full_size=judged_at_full_size(
        "which kernel is fastest depends on sequence length and head dim: judged at the "
        "preset's real attention shapes (meta device), or withheld"
    ),
)
XFORMERS_UNAVAILABLE = FindingSpec(
    "attention.xformers_unavailable",
    "attention",
    "the run asked for xFormers, which does not import here",
    ("probe",),
    phases=ATTENTION_PHASES,
    at_full_size=carries_over("a property of the installed packages"),
)
SPECS = (MATH_FALLBACK, UNFUSED_MANUAL, SLOWER_BACKEND, XFORMERS_UNAVAILABLE)

#: Finding ids (stable: the CI gate diffs findings by id). Each is also the id of the question
#: whose "found fine" answer excludes it.
MATH_ID = MATH_FALLBACK.id
MANUAL_ID = UNFUSED_MANUAL.id
SLOWER_ID = SLOWER_BACKEND.id
XFORMERS_ID = XFORMERS_UNAVAILABLE.id

#: Questions that cannot end in a finding: why an answer is partial, or what was not measured.
#: Were all attention signatures of the step microbenchmarked (the cheapest are left out)?
COVERAGE_CHECK = "attention.signatures_benchmarked"
#: Were the per-call times taken at the step's own thread count (a CPU run benchmarks on fewer)?
THREADS_CHECK = "attention.benchmark_threads"
#: Did every signature take its rounds until its comparisons were sure (the probe's time budget
#: stops them past the fewest)?
ROUNDS_CHECK = "attention.benchmark_rounds"
#: Was each backend's peak memory measured (the CPU allocator keeps no peak)?
MEMORY_CHECK = "attention.memory_per_backend"
#: Does the flash-attn package import and match this torch (its backend is benchmarked if so)?
FLASH_ATTN_CHECK = "attention.flash_attn_package"

# --------------------------------------------------------------------------------------------
# Thresholds that decide whether a finding is raised (severity is diagnose.verdicts' alone)

#: A backend counts as faster only when the interleaved A/B is sure it takes less than 1 - this
#: share of the time of the one that ran (diagnose.stats.ab_verdict): a smaller gain is noise
#: between kernels that a rerun can reverse.
MIN_RELATIVE_GAIN = 0.10
#: A faster fused backend is worth a finding from this share of s/it (or, without a measured
#: s/it, from this many seconds per step): below, switching kernels is not worth the user's time.
MIN_SHARE_OF_S_PER_IT = 0.01
MIN_ABSOLUTE_SAVING_S = 0.5e-3

# --------------------------------------------------------------------------------------------
# Wording

#: Readable names of the benchmarked backends.
BACKEND_LABELS: dict[str, str] = {
    "flash": "SDPA flash",
    "efficient": "SDPA memory-efficient",
    "cudnn": "SDPA cuDNN",
    "math": "SDPA math (unfused)",
    "manual": "hand-written softmax(QKᵀ)V",
    "xformers": "xFormers memory_efficient_attention",
    "flash_attn": "flash-attn flash_attn_func",
}


def _sdpa_switch(diffusers_name: str, sdp_backend: str, kohya: str = "") -> str:
    return in_trainers(
        f"own code and Lightning: torch.nn.attention.sdpa_kernel(SDPBackend.{sdp_backend})",
        kohya=kohya,
        diffusers=(
            f"model.set_attention_backend('{diffusers_name}') or "
            f"DIFFUSERS_ATTN_BACKEND={diffusers_name}"
        ),
    )


#: How to select each backend the probe benchmarks.
BACKEND_SWITCH: dict[str, str] = {
    "flash": _sdpa_switch("_native_flash", "FLASH_ATTENTION", "--sdpa (torch picks)"),
    "efficient": _sdpa_switch("_native_efficient", "EFFICIENT_ATTENTION", "--sdpa (torch picks)"),
    "cudnn": _sdpa_switch("_native_cudnn", "CUDNN_ATTENTION"),
    "math": _sdpa_switch("_native_math", "MATH"),
    "xformers": in_trainers(
        kohya="--xformers",
        diffusers=(
            "model.enable_xformers_memory_efficient_attention() (UNet, SD3) or "
            "model.set_attention_backend('xformers') (Flux, Z-Image), "
            "DIFFUSERS_ATTN_BACKEND=xformers"
        ),
    ),
    "flash_attn": in_trainers(
        "needs the flash-attn package built for this torch",
        diffusers="model.set_attention_backend('flash') or DIFFUSERS_ATTN_BACKEND=flash",
    ),
}


def _count(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


# --------------------------------------------------------------------------------------------
# Fixes, in the words of the trainers LoRA users run

#: The trainer-level switch that picks a fused attention.
_USE_SDPA = in_trainers(
    kohya="pass --sdpa (or --xformers), never neither",
    diffusers=(
        "SDPA is the default (model.set_attention_backend('native') undoes a forced backend)"
    ),
    lightning="call torch.nn.functional.scaled_dot_product_attention with no backend forced",
)


def math_fix(
    device_kind: str,
    arch: str = "",
    *,
    forced: bool = False,
    fp32_inputs: bool = False,
    dropout: bool = False,
    rocm_experimental_missing: bool = False,
) -> str:
    """What to change when SDPA ran its math path, most specific cause first."""
    parts: list[str] = []
    if rocm_experimental_missing or (device_kind == "rocm" and rocm_needs_experimental(arch)):
        parts.append(
            f"Start the trainer with {ROCM_EXPERIMENTAL_ENV}=1 (export it before launching): on "
            f"{arch or 'RDNA3/RDNA4'} torch's AOTriton flash and memory-efficient kernels are "
            "experimental and off without it"
        )
    elif device_kind == "rocm" and not arch:  # a trace that does not name the GPU
        parts.append(
            f"On RDNA3/RDNA4 GPUs (gfx11xx, gfx12xx) start the trainer with "
            f"{ROCM_EXPERIMENTAL_ENV}=1: torch's AOTriton fused kernels are off there without it"
        )
    if forced:
        parts.append(
            "Remove what forces the math backend: torch.nn.attention.sdpa_kernel(SDPBackend.MATH), "
            "torch.backends.cuda.enable_flash_sdp(False) / enable_mem_efficient_sdp(False) (on "
            "the CPU enable_flash_sdp(False) also turns off the CPU's fused kernel), diffusers "
            "DIFFUSERS_ATTN_BACKEND=_native_math or set_attention_backend('_native_math')"
        )
    if dropout:
        parts.append(
            "Set attention dropout to 0 (kohya and diffusers LoRA training use none): no fused "
            "CPU kernel supports dropout"
            if device_kind == "cpu"
            else "Set attention dropout to 0"
        )
    if fp32_inputs and device_kind in ("cuda", "rocm"):
        parts.append(
            "Train in bf16 or fp16 mixed precision (kohya --mixed_precision bf16, accelerate "
            "--mixed_precision bf16): the flash kernel takes only fp16/bf16"
        )
    if forced or device_kind == "rocm" or not parts:
        # The usual trainer-level switches; dropout or dtype alone are fixed where they are set.
        parts.append(_USE_SDPA)
    return "; ".join(p.rstrip(".") for p in parts) + "."


MANUAL_FIX = (
    in_trainers(
        "Compute attention with torch.nn.functional.scaled_dot_product_attention",
        kohya="pass --sdpa or --xformers (without either, and with --mem_eff_attn, it computes "
        "softmax(QKᵀ)V by hand)",
        diffusers="model.set_attn_processor(AttnProcessor2_0()) (or "
        "model.set_default_attn_processor()) instead of a hand-written processor or the legacy "
        "AttnProcessor",
    )
    + "."
)


#: Hand-written attention inside the text encoder is the encoder's own code (T5 adds a relative
#: position bias, older transformers releases compute it by hand): the denoiser's attention
#: switches do not reach it.
TEXT_ENCODER_MANUAL_FIX = (
    "This is the text encoder's own attention; the denoiser's attention settings (diffusers "
    "set_attn_processor, kohya --sdpa/--xformers) do not change it. "
    + in_trainers(
        "When the text encoder is not trained, encode each caption once instead of every step; "
        "load it with attn_implementation='sdpa' (transformers) where its class supports it",
        kohya="--cache_text_encoder_outputs (--cache_text_encoder_outputs_to_disk)",
        diffusers="precompute the prompt embeddings (encode_prompt) before the training loop",
    )
    + "."
)
#: The VAE's mid-block attention runs only to encode the images.
VAE_MANUAL_FIX = (
    "This is the VAE's own attention, which runs only to encode the images. "
    + in_trainers(
        "Cache the latents so the VAE does not run every step, or give it SDPA processors: "
        "vae.set_attn_processor(AttnProcessor2_0())",
        kohya="--cache_latents (--cache_latents_to_disk)",
        diffusers="precompute the latents before the training loop",
    )
    + "."
)


def manual_fix_for(component: str) -> str:
    """The fix for hand-written attention run by ``component`` ("text_encoder", "vae", or the
    denoiser / unknown, which the trainers' attention switches govern)."""
    if component == "text_encoder":
        return TEXT_ENCODER_MANUAL_FIX
    if component == "vae":
        return VAE_MANUAL_FIX
    return MANUAL_FIX


def xformers_fix(torch_version: str = "") -> str:
    """Reinstall xFormers against the installed torch, or do without it."""
    pin = f"torch {torch_version}" if torch_version else "the installed torch"
    return in_trainers(
        f"Reinstall the xFormers wheel built for {pin} (pip install -U xformers --index-url "
        "the index your torch came from), or do without it",
        kohya="drop --xformers and pass --sdpa",
        diffusers="the default SDPA processors (do not call "
        "enable_xformers_memory_efficient_attention)",
    )


# --------------------------------------------------------------------------------------------
# Builders: the one wording of each finding

_MATH_LEAD = (
    "scaled_dot_product_attention dispatched to _scaled_dot_product_attention_math, which "
    "materialises the full B·H·Lq·Lk attention matrix (and keeps it for the backward) instead of "
    "running a fused kernel."
)
_MANUAL_LEAD = (
    " multiplies queries and keys, takes a softmax and multiplies by the values as separate ops, "
    "outside scaled_dot_product_attention, so no fused kernel can run and the full attention "
    "matrix is kept for the backward."
)


def _measured_tail(faster_with: str | None, saving: float | None) -> str:
    if faster_with and saving:
        return f" — measured {ms_significant(saving)}/it faster with {faster_with}"
    return ""


def math_fallback(
    *,
    calls: float,
    total_calls: float | None = None,
    seconds_per_step: float | None = None,
    faster_with: str | None = None,
    why: Sequence[str] = (),
    how_measured: str = "",
    fix: str,
    evidence: Mapping[str, Any],
    saving: float | None,
    sure_saving: float | None = None,
    basis: Basis = "none",
    source: str = "",
) -> Finding:
    """``attention.math_fallback``: ``calls`` per step (of ``total_calls``) ran SDPA's math path;
    ``faster_with`` names the backend measured faster, ``how_measured`` says how the saving was
    obtained (or why there is none)."""
    of = f" of {_count(total_calls)}" if total_calls is not None else ""
    took = f", {ms_significant(seconds_per_step)}/step" if seconds_per_step is not None else ""
    title = (
        f"Attention ran on the unfused math path in {_count(calls)}{of} calls per step{took}"
        + _measured_tail(faster_with, saving)
    )
    reasons = "; ".join(why)
    detail = _MATH_LEAD + (f" Why: {reasons}." if reasons else "") + how_measured
    return MATH_FALLBACK.build(
        title,
        fix=fix,
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis=basis,
        detail=detail,
        source=source,
    )


def unfused_manual(
    *,
    calls: float,
    processors: str = "",
    modules: str = "",
    seconds_per_step: float | None = None,
    faster_with: str | None = None,
    how_measured: str = "",
    fix_extra: str = "",
    where: str = "",
    fix: str = MANUAL_FIX,
    evidence: Mapping[str, Any],
    saving: float | None,
    sure_saving: float | None = None,
    basis: Basis = "none",
    source: str = "",
) -> Finding:
    """``attention.unfused_manual``: ``calls`` per step compute softmax(QKᵀ)V by hand (by
    ``processors`` on ``modules``, when known; inside the component ``where``, e.g. "the text
    encoder (T5EncoderModel)", with that component's ``fix``)."""
    by = f" by {processors}" if processors else ""
    took = (
        f", {ms_significant(seconds_per_step)}/step forward" if seconds_per_step is not None else ""
    )
    count = f" in {where}, {_count(calls)} calls" if where else f" in {_count(calls)} calls"
    title = (
        f"Attention is computed by hand (matmul → softmax → matmul){by}{count} per step{took}"
        + _measured_tail(faster_with, saving)
    )
    who = f"{processors} on {modules}" if processors and modules else "The forward pass"
    if where and not (processors and modules):
        who = where[0].upper() + where[1:]
    return UNFUSED_MANUAL.build(
        title,
        fix=fix + (f" {fix_extra}" if fix_extra else ""),
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis=basis,
        detail=who + _MANUAL_LEAD + how_measured,
        source=source,
    )


def slower_backend(
    *,
    ran: str,
    calls: float,
    best: str,
    best_label: str,
    how_measured: str,
    evidence: Mapping[str, Any],
    saving: float,
    sure_saving: float | None,
    total_calls: float | None = None,
) -> Finding:
    """``attention.slower_backend``: the fused ``ran`` is measured ``saving`` s/it slower than
    ``best`` at the shapes of ``calls`` of the step's ``total_calls`` attention calls."""
    some = total_calls is not None and total_calls > calls
    which = (
        f"{_count(calls)} of the {_count(total_calls or calls)} attention calls per step; at "
        "their shapes"
        if some
        else f"{_count(calls)} attention calls per step;"
    )
    return SLOWER_BACKEND.build(
        f"{ran} ran for {which} {best_label} is measured {ms_significant(saving)}/it faster",
        fix=f"Select {BACKEND_LABELS.get(best, best)}: {BACKEND_SWITCH.get(best, best)}.",
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis="measured",
        detail=(
            "A fused kernel ran, but another backend that runs on this device is faster at the "
            "model's attention inputs." + how_measured
        ),
    )


def xformers_unavailable(
    *, summary: str, torch_version: str, evidence: Mapping[str, Any]
) -> Finding:
    """``attention.xformers_unavailable``: xFormers was asked for, or is installed and broken."""
    return XFORMERS_UNAVAILABLE.build(
        f"xFormers is unavailable: {summary}",
        fix=xformers_fix(torch_version),
        evidence=evidence,
        detail=(
            "A trainer told to use xFormers (kohya --xformers, diffusers "
            "enable_xformers_memory_efficient_attention) fails or quietly falls back when the "
            "installed xFormers does not load with this torch; SDPA is used instead. The "
            "attention table says what actually ran and what each backend costs here."
        ),
    )


# --------------------------------------------------------------------------------------------
# "Checked and found fine" wording shared by the probe and the trace rule


def no_math_text(fused_calls: float, total_calls: float, kinds: str) -> str:
    """The answer to ``attention.math_fallback`` when no call ran the math path."""
    if fused_calls >= total_calls:
        return (
            f"attention: all {_count(fused_calls)} of {_count(total_calls)} calls per step ran "
            f"fused kernels ({kinds})"
        )
    return (
        f"attention: no call ran SDPA's math path ({_count(fused_calls)} of "
        f"{_count(total_calls)} calls per step ran fused kernels: {kinds})"
    )


NO_MANUAL_TEXT = (
    "attention: no hand-written attention (matmul → softmax → matmul outside SDPA) was found"
)


__all__ = [
    "ATTENTION_PHASES",
    "BACKEND_LABELS",
    "BACKEND_SWITCH",
    "COVERAGE_CHECK",
    "FLASH_ATTN_CHECK",
    "MANUAL_FIX",
    "MANUAL_ID",
    "MATH_FALLBACK",
    "MATH_ID",
    "MEMORY_CHECK",
    "MIN_ABSOLUTE_SAVING_S",
    "MIN_RELATIVE_GAIN",
    "MIN_SHARE_OF_S_PER_IT",
    "NO_MANUAL_TEXT",
    "ROUNDS_CHECK",
    "SLOWER_BACKEND",
    "SLOWER_ID",
    "SPECS",
    "TEXT_ENCODER_MANUAL_FIX",
    "THREADS_CHECK",
    "UNFUSED_MANUAL",
    "VAE_MANUAL_FIX",
    "XFORMERS_ID",
    "XFORMERS_UNAVAILABLE",
    "manual_fix_for",
    "math_fallback",
    "math_fix",
    "no_math_text",
    "slower_backend",
    "unfused_manual",
    "xformers_fix",
    "xformers_unavailable",
]
