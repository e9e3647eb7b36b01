"""What the project knows about a quantized frozen base as a finding: its id, threshold, wording
and fix. Which ops and kernels do the work, and what each storage kind is, lives in
:mod:`diagnose.quantized_base`; the trace rule :mod:`diagnose.trace.rules.quantization` measures
it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import FindingSpec, in_trainers, tiny_model_only
from diagnose.record import Basis, Finding
from diagnose.trace.rules import ms, pct

DEQUANT_COST = FindingSpec(
    "quantization.dequant_cost",
    "quantization",
    "the frozen base is stored quantized (NF4/FP4/INT8 or fp8) and expanding its weights back "
    "to the compute dtype takes a real share of every step",
    ("trace",),
    phases=("forward", "backward"),
    at_full_size=tiny_model_only(
        "expanding a weight costs the same per weight at any image size, while the matmuls grow "
        "with the tokens: at the real resolution the expansion is a smaller share of the step"
    ),
)
SPECS = (DEQUANT_COST,)

#: Below this share of the step the expansion is reported as fine, not as a finding.
MIN_SHARE = 0.05

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


__all__ = ["DEQUANT_COST", "FIX", "MIN_SHARE", "SPECS", "dequant_cost"]
