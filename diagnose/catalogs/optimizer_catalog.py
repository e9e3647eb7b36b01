"""What the project knows about the optimizer step: finding ids, thresholds, wording, fixes.

The probe (``diagnose run``) and the trace rule both build their optimizer findings here, so a
synchronising step reads the same whoever found it. Optimizers are named by a key that says what
they are (``adamw-fused`` and ``adamw-foreach`` are different, two ``adamw-fused`` the same), and
a fix never proposes the key the run already uses. Torch-free: the report imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.catalogs import (
    FindingSpec,
    carries_over,
    in_trainers,
    judged_at_full_size,
    tiny_model_only,
)
from diagnose.record import Finding, Severity
from diagnose.stats import at_line
from diagnose.units import format_seconds

SYNC_IN_STEP = FindingSpec(
    "optimizer.sync_in_step",
    "optimizer",
    "host-device synchronisations inside `Optimizer.step`",
    ("probe", "trace"),
    # No phase bound: a wait drains the queue the rest of the step was overlapping, so its cost
    # spills out of the optimizer's own time (bounded by the step).
    # The probe's A/B times the step without the profiler; the trace rule reads profiled steps.
    probe_answer_stands=True,
    at_full_size=carries_over("the optimizer's code synchronises whatever the tensors' sizes"),
)
SLOWER_THAN_ALTERNATIVE = FindingSpec(
    "optimizer.slower_than_alternative",
    "optimizer",
    "another optimizer that trains the same LoRA was measured faster here",
    ("probe",),
    phases=("optimizer",),
    at_full_size=tiny_model_only(
        "which optimizer steps fastest depends on the number and size of the LoRA tensors, "
        "measured here on the tiny model's"
    ),
)
STATE_MOSTLY_FP32 = FindingSpec(
    "optimizer.8bit_state_mostly_fp32",
    "optimizer",
    "an 8-bit optimizer keeps most of its state in fp32 (tensors below its size threshold)",
    ("probe",),
    phases=("optimizer",),
    at_full_size=judged_at_full_size(
        "bitsandbytes' size threshold is judged on the preset's real LoRA tensors (meta device)"
    ),
)
NUMERICS_8BIT = FindingSpec(
    "optimizer.8bit_numerics",
    "optimizer",
    "AdamW8bit fails to step here, or its update differs from fp32 AdamW beyond the "
    "quantisation bound",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over(
        "the numerics of this build's 8-bit kernels, whatever the tensors' sizes"
    ),
)
SPECS = (SYNC_IN_STEP, SLOWER_THAN_ALTERNATIVE, STATE_MOSTLY_FP32, NUMERICS_8BIT)

# --------------------------------------------------------------------------------------------
# Thresholds that decide whether a finding is raised

#: An alternative counts as faster only when the A/B is sure (the low end of the saving's
#: interval) it saves both this share of the configured step and MIN_ABSOLUTE_GAIN_S.
MIN_RELATIVE_GAIN = 0.10
MIN_ABSOLUTE_GAIN_S = 0.5e-3
#: Share of s/it below which a faster alternative is not worth a finding (it is reported as
#: checked instead): switching optimizers changes the run, a fraction of a percent does not pay.
MIN_SHARE_OF_S_PER_IT = 0.01
#: Share of the 8-bit optimizer's moment bytes held in fp32 that raises the finding.
FP32_SHARE_RAISED = 0.5
#: The share at which it is a warning. It costs memory, not time, so no saving grades it: the
#: warning says the 8-bit optimizer buys (almost) nothing over AdamW.
FP32_SHARE_WARN = 0.9
#: bitsandbytes' default: tensors with fewer elements keep fp32 state.
BNB_DEFAULT_MIN_8BIT_SIZE = 4096
#: Share of elements allowed outside their quantisation bound before the build is called broken.
#: A healthy build has none beyond fp32 ties; a broken one has a large share.
MAX_SHARE_OUTSIDE_BOUND = 0.01

# --------------------------------------------------------------------------------------------
# What an optimizer is

#: Keys of the optimizers the probe knows, and how the report names them.
LABELS: dict[str, str] = {
    "adamw-fused": "torch AdamW (fused)",
    "adamw-foreach": "torch AdamW (foreach)",
    "adamw-single": "torch AdamW (for-loop)",
    "adamw8bit": "bitsandbytes AdamW8bit",
    "adamw8bit-paged": "bitsandbytes PagedAdamW8bit",
    "adafactor": "transformers Adafactor",
}
TORCH_ADAMW: tuple[str, ...] = ("adamw-fused", "adamw-foreach", "adamw-single")
EIGHT_BIT: tuple[str, ...] = ("adamw8bit", "adamw8bit-paged")


def label(key: str | None) -> str:
    if key is None:
        return "the optimizer"
    return LABELS.get(key, key.removeprefix("custom:"))


def key_of_step_range(class_name: str, op_names: Sequence[str] = ()) -> str:
    """The key of the optimizer whose ``Optimizer.step#<Class>.step`` range a trace shows;
    ``op_names`` (the ops inside its steps) tell torch AdamW's implementations apart."""
    if class_name == "AdamW":
        if any("_fused_adamw" in n for n in op_names):
            return "adamw-fused"
        if any("_foreach_" in n for n in op_names):
            return "adamw-foreach"
        return "adamw-single"
    return {
        "AdamW8bit": "adamw8bit",
        "PagedAdamW8bit": "adamw8bit-paged",
        "Adafactor": "adafactor",
    }.get(class_name, f"custom:{class_name}")


# --------------------------------------------------------------------------------------------
# Fixes, in each trainer's words

#: How to move to an optimizer from one of another kind.
_SWITCH_TO: dict[str, str] = {
    "adamw-foreach": in_trainers(
        "Switch to torch AdamW (foreach)",
        kohya="`--optimizer_type AdamW`",
        diffusers="drop `--use_8bit_adam`",
        onetrainer="optimizer ADAMW",
        lightning="return torch.optim.AdamW(..., foreach=True) from configure_optimizers",
    ),
    "adamw-fused": in_trainers(
        "Switch to torch AdamW with fused=True",
        kohya='`--optimizer_type AdamW --optimizer_args "fused=True"`',
        diffusers=(
            "drop `--use_8bit_adam` and pass fused=True where the script builds torch.optim.AdamW"
        ),
        onetrainer="optimizer ADAMW with Fused on",
        lightning="return torch.optim.AdamW(..., fused=True) from configure_optimizers",
    ),
    "adamw-single": in_trainers(
        "Switch to torch AdamW",
        kohya="`--optimizer_type AdamW`",
        diffusers="drop `--use_8bit_adam`",
        onetrainer="optimizer ADAMW",
    ),
    "adamw8bit": in_trainers(
        "Switch to bitsandbytes AdamW8bit",
        kohya="`--optimizer_type AdamW8bit`",
        diffusers="`--use_8bit_adam`",
        onetrainer="optimizer ADAMW_8BIT",
        ai_toolkit="optimizer: adamw8bit",
    ),
    "adamw8bit-paged": in_trainers(
        "Switch to bitsandbytes PagedAdamW8bit",
        kohya="`--optimizer_type PagedAdamW8bit`",
    ),
    "adafactor": in_trainers(
        "Switch to transformers Adafactor with a fixed learning rate (a different algorithm: "
        "re-tune the learning rate)",
        kohya=(
            '`--optimizer_type Adafactor --optimizer_args "scale_parameter=False" '
            '"relative_step=False" "warmup_init=False"`'
        ),
        onetrainer="optimizer ADAFACTOR",
        diffusers="no flag (replace the optimizer in the script)",
        ai_toolkit="optimizer: adafactor",
    ),
}
#: How to change torch AdamW's implementation when the run already uses torch AdamW.
_WITHIN_TORCH_ADAMW: dict[str, str] = {
    "adamw-foreach": in_trainers(
        "Keep torch AdamW and pass foreach=True",
        kohya='`--optimizer_args "foreach=True"`',
        diffusers="pass foreach=True where the script builds torch.optim.AdamW",
        onetrainer="optimizer ADAMW with Foreach on",
        lightning="torch.optim.AdamW(..., foreach=True) in configure_optimizers",
    ),
    "adamw-fused": in_trainers(
        "Keep torch AdamW and pass fused=True",
        kohya='`--optimizer_args "fused=True"`',
        diffusers="pass fused=True where the script builds torch.optim.AdamW",
        onetrainer="optimizer ADAMW with Fused on",
        lightning="torch.optim.AdamW(..., fused=True) in configure_optimizers",
    ),
    "adamw-single": in_trainers(
        "Keep torch AdamW and pass foreach=False",
        kohya='`--optimizer_args "foreach=False"`',
        diffusers="pass foreach=False where the script builds torch.optim.AdamW",
    ),
}


def switch_fix(running: str | None, target: str) -> str:
    """The fix that moves a run on ``running`` to ``target``; "" when it already uses it."""
    if running == target:
        return ""
    if running in TORCH_ADAMW and target in _WITHIN_TORCH_ADAMW:
        return _WITHIN_TORCH_ADAMW[target]
    return _SWITCH_TO.get(target, f"Switch to {label(target)}")


def sync_fix(running: str | None) -> str:
    """What to do about a synchronising step, given what the run steps with (None: unknown)."""
    if running in EIGHT_BIT:
        return (
            "bitsandbytes' 8-bit optimizers synchronise the device after each tensor they step "
            "(torch.cuda.synchronize() per parameter, whatever its size): a LoRA of hundreds of "
            "small tensors pays hundreds of round trips a step. "
            + switch_fix(running, "adamw-fused")
        )
    if running in TORCH_ADAMW:
        fix = (
            f"{label(running)} does not synchronise by itself: find what reads a device value "
            "inside the step (a step hook, gradient-norm logging with .item(), a learning rate "
            "held in a device tensor) and keep it on the device"
        )
        if running != "adamw-fused":
            fix += ". " + switch_fix(running, "adamw-fused")
        return fix
    general = (
        "Keep the optimizer's values on the device: for adaptive-step optimizers (Prodigy, "
        "D-Adaptation) use a release that keeps its step size on the device; drop .item() "
        "(gradient-norm logging) inside the step"
    )
    return general + ". " + switch_fix(running, "adamw-fused")


# --------------------------------------------------------------------------------------------
# Builders: the one wording of each finding


def sync_in_step(
    *,
    optimizers: Sequence[str],
    running: str | None,
    waits_per_step: float,
    flagged_by_debug_mode: int = 0,
    calls: Mapping[str, float] | None = None,
    cost_said: str = "",
    evidence: Mapping[str, Any] | None = None,
    detail: str = "",
    saving: float | None = None,
    sure_saving: float | None = None,
    basis: str = "none",
    source: str = "",
) -> Finding:
    """``optimizer.sync_in_step``: the step makes the host wait for the device.

    ``waits_per_step`` are the synchronising calls counted inside the step (0 when only torch's
    sync debug mode flagged some), ``calls`` their runtime calls per step by name; ``cost_said``
    what they cost per step, saying on which steps and how it was had; ``running`` what the run
    steps with (its key), so the fix proposes another.
    """
    names = ", ".join(optimizers) or label(running)
    if waits_per_step > 0:
        what = f"{waits_per_step:.0f} time(s) per step"
        if calls:
            what += " (" + ", ".join(f"{n:.0f} {call}" for call, n in calls.items()) + ")"
    else:
        what = f"torch's sync debug mode flagged {flagged_by_debug_mode} synchronising operations"
    title = f"optimizer.step() of {names} makes the host wait for the GPU {what}"
    if cost_said:
        title += f": {cost_said}"
    return SYNC_IN_STEP.build(
        title,
        fix=sync_fix(running),
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis=basis,  # type: ignore[arg-type]
        detail=detail
        or (
            "While the host waits it launches nothing, so the device idles between the small "
            "per-tensor kernels of the step once the queue drains."
        ),
        source=source,
    )


def phase_time_text(phase_seconds: float, step_seconds: float | None) -> str:
    """The optimizer phase's time written exactly as the report's phase bar writes it."""
    # Imported here: the reports package pulls in its renderers, which the catalog never needs.

    text: str = format_seconds(phase_seconds, like=step_seconds)
    return text


def slower_than_alternative(
    *,
    running: str,
    fastest: str,
    running_alone_seconds: float,
    fastest_alone_seconds: float,
    phase_seconds: float | None,
    step_seconds: float | None,
    saving: float,
    sure_saving: float,
    evidence: Mapping[str, Any] | None = None,
    confidence: float = 0.95,
) -> Finding:
    """``optimizer.slower_than_alternative``. When the record has an optimizer phase, the title
    quotes it as the phase bar does; the step timed alone in the A/B is given beside it, with why
    the two differ."""
    speedup = running_alone_seconds / fastest_alone_seconds if fastest_alone_seconds > 0 else 0.0
    faster = f"{speedup:.1f}x faster" if speedup > 0 else "faster"
    if phase_seconds is not None:
        title = (
            f"The optimizer phase takes {phase_time_text(phase_seconds, step_seconds)} per step "
            f"with {label(running)}; {label(fastest)} steps {faster} here "
            f"(timed alone: {format_seconds(running_alone_seconds)} against "
            f"{format_seconds(fastest_alone_seconds)})"
        )
        how = (
            "The optimizer phase of the phase bar is optimizer.step() and zero_grad() inside the "
            "unprofiled training steps; the A/B timed step() alone on a copy of the same "
            "parameters and gradients, so the two times differ (caches, the machine's load, "
            "zero_grad). The saving is the phase scaled by the A/B's ratio of step times."
        )
    else:
        title = (
            f"optimizer.step() takes {format_seconds(running_alone_seconds)} timed alone with "
            f"{label(running)}; {label(fastest)} takes "
            f"{format_seconds(fastest_alone_seconds)} here "
            f"({faster})"
        )
        how = "The saving is the difference of the medians of the steps timed alone."
    detail = (
        "Each optimizer stepped the same LoRA parameters with the same real gradients (median "
        f"of repeated device-synchronised step() calls). {how} It assumes one optimizer step "
        "per iteration (divide by the gradient-accumulation steps if you accumulate). AdamW and "
        "AdamW8bit are the same algorithm; Adafactor is not. Severity is graded on the saving "
        f"the A/B is {confidence:.0%} sure of ({format_seconds(sure_saving)}, the low end of its "
        "interval), "
        "so that it does not flip between runs of the same setup."
    )
    return SLOWER_THAN_ALTERNATIVE.build(
        title,
        fix=switch_fix(running, fastest) + ".",
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis="measured",
        detail=detail,
    )


def state_mostly_fp32(
    *,
    running: str,
    fp32_share: float,
    tensors_fp32: int,
    tensors_total: int,
    min_8bit_size: int | None,
    smallest_tensor: int,
    saved_bytes: int,
    saved_share: float,
    evidence: Mapping[str, Any] | None = None,
) -> Finding:
    """``optimizer.8bit_state_mostly_fp32`` (raised from FP32_SHARE_RAISED of the state)."""
    minimum = min_8bit_size if min_8bit_size is not None else BNB_DEFAULT_MIN_8BIT_SIZE
    suggested = max(1, smallest_tensor)
    severity: Severity = "warn" if at_line(fp32_share, FP32_SHARE_WARN).above else "info"
    plain = switch_fix(running, "adamw-fused")
    return STATE_MOSTLY_FP32.build(
        (
            f"{label(running)} keeps {fp32_share:.0%} of its state in fp32: {tensors_fp32} of "
            f"{tensors_total} LoRA tensors are below min_8bit_size={minimum}; it saves "
            f"{saved_bytes / 2**20:.2f} MiB ({saved_share:.0%}) against AdamW"
        ),
        fix=in_trainers(
            f"Quantise the LoRA tensors too with min_8bit_size={suggested} (the smallest LoRA "
            f"tensor): bnb.optim.AdamW8bit(params, min_8bit_size={suggested})",
            kohya=f'`--optimizer_args "min_8bit_size={suggested}"`',
        )
        + (
            f". Or, as the memory at stake is small and AdamW has no 8-bit overhead: {plain}."
            if plain
            else "."
        ),
        evidence=evidence,
        detail=(
            "bitsandbytes' 8-bit optimizers give fp32 state to every tensor with fewer than "
            f"min_8bit_size elements ({BNB_DEFAULT_MIN_8BIT_SIZE} by default). A small-rank LoRA "
            "is made of such tensors (rank x width), so the '8-bit' optimizer mostly runs its "
            "fp32 path and keeps the memory of AdamW, while still paying the per-tensor overhead "
            "of its Python step loop."
        ),
        severity=severity,
    )


def _numerics_fix(running: str | None) -> str:
    install = (
        "install a bitsandbytes build made for this device (on ROCm: the wheel for your ROCm "
        "version, or a source build with your gfx arch in BNB_ROCM_ARCH)"
    )
    if running in EIGHT_BIT:
        return f"{install[0].upper()}{install[1:]}. Or train without 8-bit state: " + (
            switch_fix(running, "adamw-fused") + "."
        )
    return f"Keep {label(running)}: do not switch to AdamW8bit here until you {install}."


def numerics_8bit(
    *,
    what: str,
    running: str | None,
    evidence: Mapping[str, Any] | None = None,
    detail: str = "",
) -> Finding:
    """``optimizer.8bit_numerics``: AdamW8bit computes something else than AdamW here (``what``
    says how). Critical for a run that trains with it; a warning against switching otherwise."""
    uses_it = running in EIGHT_BIT
    return NUMERICS_8BIT.build(
        f"AdamW8bit does not compute AdamW on this build: {what}"
        + ("" if uses_it else f" (this run uses {label(running)})"),
        fix=_numerics_fix(running),
        evidence=evidence,
        detail=detail,
        severity="critical" if uses_it else "warn",
    )


__all__ = [
    "BNB_DEFAULT_MIN_8BIT_SIZE",
    "EIGHT_BIT",
    "FP32_SHARE_RAISED",
    "FP32_SHARE_WARN",
    "LABELS",
    "MAX_SHARE_OUTSIDE_BOUND",
    "MIN_ABSOLUTE_GAIN_S",
    "MIN_RELATIVE_GAIN",
    "MIN_SHARE_OF_S_PER_IT",
    "SPECS",
    "TORCH_ADAMW",
    "key_of_step_range",
    "label",
    "numerics_8bit",
    "phase_time_text",
    "slower_than_alternative",
    "state_mostly_fp32",
    "switch_fix",
    "sync_fix",
    "sync_in_step",
]
