"""What the project knows about a quantized frozen base as a finding: its id, threshold, wording
and fix. Which ops and kernels do the work, and what each storage kind is, lives in
:mod:`diagnose.quantized_base`; the trace rule :mod:`diagnose.trace.rules.quantization` measures
it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Basis, Finding
from diagnose.stats import at_line
from diagnose.units import ms, pct, per_it

DEQUANT_COST = FindingSpec(
    "quantization.dequant_cost",
    "quantization",
    "the frozen base is stored quantized (NF4/FP4/INT8 or fp8) and expanding its weights back "
    "to the compute dtype takes a real share of every step",
    ("probe", "trace"),
    # The text encoders' layers expand in the encode phase when their captions are not cached.
    phases=("encode", "forward", "backward"),
    probe_answer_stands=True,
    at_full_size=tiny_model_only(
        "expanding a weight costs the same per weight at any image size, while the matmuls grow "
        "with the tokens: at the real resolution the expansion is a smaller share of the step"
    ),
)
NUMERICS = FindingSpec(
    "quantization.numerics",
    "quantization",
    "the quantized base's output strays from the unquantized base's by more than its storage "
    "kind's documented bound: the stored layers compute something else, not just less exactly",
    ("probe",),
    severity_without_saving="critical",
    at_full_size=carries_over(
        "a broken quantized kernel or a wrong compute dtype is a property of the code path and "
        "the library build, whatever the model's size"
    ),
)
SPECS = (DEQUANT_COST, NUMERICS)

#: Below this share of the step the expansion is reported as fine, not as a finding.
MIN_SHARE = 0.05
#: An A/B slowdown this many times the quantized layers' kernel share of the step is mostly not
#: the kernels: the finding then says where the rest goes (the layers' host path).
HOST_PATH_GAP = 3.0

FIX = in_trainers(
    "Store the frozen base in bf16 when it fits in the GPU's memory beside the activations "
    "(the expansion then disappears); when it does not, fp8 storage expands with a plain cast, "
    "cheaper than a 4-bit table lookup",
    kohya="keep --fp8_base only when bf16 does not fit (no 4-bit option)",
    diffusers="load the model without BitsAndBytesConfig (or with load_in_8bit instead of 4bit)",
    onetrainer="weight dtype BFLOAT_16, or FLOAT_8 instead of NFLOAT_4/INT_8",
    ai_toolkit="quantize: false in the model section, or qfloat8",
)


def dequant_cost(
    *,
    storage: str,
    seconds: float,
    step_seconds: float,
    calls: float,
    evidence: Mapping[str, Any],
    saving: float | None,
    basis: Basis,
    source: str,
) -> Finding:
    share = seconds / step_seconds if step_seconds else 0.0
    expansion = (
        f", {ms(saving)} of it expanding the weights"
        if saving is not None and saving < seconds
        else ""
    )
    return DEQUANT_COST.build(
        f"The base is stored as {storage}: its quantized layers take {pct(share)} of each "
        f"profiled step ({ms(seconds)}/step in {calls:.0f} calls{expansion})",
        fix=FIX,
        evidence=evidence,
        saving=saving,
        basis=basis,
        detail=(
            "Every forward expands each quantized weight back to the compute dtype, and every "
            "backward does again for the input's gradient. "
            + (
                f"The expansion alone takes {ms(saving)} per step: a base stored in the compute "
                "dtype spends none of it, while the matmuls remain. "
                if saving is not None
                else "The trace cannot separate the expansion from the matmuls it feeds here "
                "(it runs unnamed inside them), so no saving is stated. "
            )
            + "It costs memory: a bf16 base takes 2 bytes a weight, fp8 1, NF4 about 0.52."
        ),
        source=source,
    )


def measured_cost(
    *,
    storage: str,
    unquantized: str,
    stored_step: float,
    unquantized_step: float,
    whole_step: float,
    ratio: str,
    encode_seconds: float,
    saving: float,
    sure: float,
    trace_share: float | None,
    memory: str,
    evidence: Mapping[str, Any],
    source: str,
    trace_host_share: float | None = None,
    on_gpu: bool = False,
) -> Finding:
    """The A/B's answer: the same step with the base unquantized measured faster. The steps
    were timed past the VAE's encode when ``encode_seconds`` is not 0. ``trace_share``: the
    trace's share of the profiled step in the quantized layers (their kernels' on a GPU),
    ``trace_host_share`` the host's time in their ops; when the A/B's slowdown is far above the
    kernels' share, the finding says where the rest goes."""
    slowdown = saving / whole_step if whole_step else 0.0
    layers = "its quantized layers' kernels" if on_gpu else "its quantized layers"
    share = (
        f"; {layers} take {pct(trace_share)} of each profiled step"
        if trace_share is not None
        else ""
    )
    gap = ""
    if (
        on_gpu
        and trace_share is not None
        and at_line(slowdown / max(trace_share, 1e-9), HOST_PATH_GAP).above
    ):
        share += ", the rest is their host path"
        host = (
            f"; the host spends {pct(trace_host_share)} of each profiled step inside their "
            "bitsandbytes ops alone, a lower bound of that work"
            if trace_host_share
            else ""
        )
        gap = (
            f"The A/B's {pct(slowdown)} is far above the {pct(trace_share)} the quantized layers' "
            "kernels take on the GPU: the rest is host time. Each quantized layer adds work on "
            "the host to every call, forward and backward: bitsandbytes' Python around the "
            "matmul (its quantization state, the dequantize call, their extra launches)"
            + host
            + ". When the GPU waits for the host (a small model, a small batch), that work is "
            "the step's time whatever the kernels take. "
        )
    part = " past the VAE's encode" if encode_seconds > 0 else ""
    return DEQUANT_COST.build(
        f"The base stored as {storage} makes each step {per_it(saving)} slower than the same "
        f"base in {unquantized} ({pct(saving / whole_step if whole_step else 0.0)} of the "
        f"step): {per_it(stored_step)} against {per_it(unquantized_step)} measured{part}"
        f"{share}",
        fix=FIX,
        evidence=evidence,
        saving=saving,
        sure_saving=sure,
        basis="measured",
        detail=(
            f"The same training step ran with the base stored as {storage} and as {unquantized} "
            f"(the same weights, the same batches), interleaved: the {unquantized} base took "
            f"{ratio}. "
            + (
                f"The VAE is stored alike in both: its encode of those batches ran once before "
                f"the timing ({per_it(encode_seconds)} a batch), and the steps were timed past "
                "it. "
                if encode_seconds > 0
                else ""
            )
            + "Every forward expands each quantized weight back to the compute dtype, and every "
            "backward does again for the input's gradient: a cost per weight, the same at any "
            "image size, so the difference is stated in seconds as measured. " + gap + memory
        ).strip(),
        source=source,
    )


def numerics_off(
    *,
    storage: str,
    unquantized: str,
    error: float,
    bound: float,
    evidence: Mapping[str, Any],
    source: str,
) -> Finding:
    return NUMERICS.build(
        f"The {storage} base's output is {error:.3g} off the {unquantized} base's (relative "
        f"L2), beyond the {bound:.2g} its storage kind explains",
        fix=NUMERICS_FIX,
        evidence=evidence,
        detail=(
            "The same denoiser with the same weights and inputs, its base stored quantized and "
            "not: rounding to the stored kind explains an error up to the bound, more means the "
            "quantized layers compute something else (a bitsandbytes build without a working "
            "kernel for this device, a compute dtype the layers do not use)."
        ),
        source=source,
    )


NUMERICS_FIX = (
    "Check the bitsandbytes build on this device (python -m bitsandbytes) and update it; until "
    "the quantized base agrees, store it as bf16 or fp8"
)


__all__ = [
    "DEQUANT_COST",
    "FIX",
    "HOST_PATH_GAP",
    "MIN_SHARE",
    "NUMERICS",
    "NUMERICS_FIX",
    "SPECS",
    "dequant_cost",
    "measured_cost",
    "numerics_off",
]
