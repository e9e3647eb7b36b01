"""What the project knows about numeric precision: finding ids, thresholds, wording, fixes.

The ``precision`` probe (a run's audited step and its bf16/fp32 microbenchmarks) and the
``precision`` trace rule (a trace's input dtypes) both build their findings here, so one
phenomenon has one id and one wording whichever of them saw it. Severity is not decided here:
:func:`diagnose.verdicts.settle` grades every saving by the one rule. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Basis, Finding
from diagnose.units import ms

#: The phases in which the step computes with the model's weights.
COMPUTE_PHASES = ("encode", "forward", "backward")

UPCAST = FindingSpec(
    "precision.fp32_compute_in_low_precision_run",
    "precision",
    "matmuls/convolutions ran with fp32 inputs in an otherwise bf16/fp16 run (from a trace: "
    "needs `record_shapes`)",
    ("probe", "trace"),
    phases=COMPUTE_PHASES,
    # An fp32 island in a run that asked for low precision is a configuration fault even where
    # its cost cannot be put in seconds.
    severity_without_saving="warn",
    at_full_size=carries_over(
        "which ops run in fp32 is set by the code path and autocast, not by the model's size"
    ),
)
FP32_TRAINING = FindingSpec(
    "precision.fp32_training",
    "precision",
    "the whole run computes in fp32",
    ("probe", "trace"),
    phases=COMPUTE_PHASES,
    at_full_size=carries_over("the precision the run was configured with"),
)
FP32_WEIGHTS = FindingSpec(
    "precision.fp32_weights_in_full_bf16",
    "precision",
    "`bf16-full` was asked for but some weights are fp32",
    ("probe",),
    phases=COMPUTE_PHASES,
    severity_without_saving="warn",
    at_full_size=carries_over(
        "which weights stay fp32 is set by the code that casts them, not by the model's size"
    ),
)
DTYPE_MISMATCH = FindingSpec(
    "precision.dtype_mismatch_warning",
    "precision",
    "a fused kernel warned about mismatched dtypes and fell back",
    ("probe",),
    phases=COMPUTE_PHASES,
    severity_without_saving="warn",
    at_full_size=carries_over(
        "the dtypes a kernel is handed are set by the code path, not by the model's size"
    ),
)
BF16_NOT_NATIVE = FindingSpec(
    "precision.bf16_not_native",
    "precision",
    "bf16 on a device without native bf16 units (emulated, slow)",
    ("probe",),
    phases=COMPUTE_PHASES,
    severity_without_saving="warn",
    at_full_size=carries_over("a property of the device"),
)
BF16_SLOWER = FindingSpec(
    "precision.bf16_slower_than_fp32",
    "precision",
    "bf16 measured slower than fp32 on this device",
    ("probe",),
    phases=COMPUTE_PHASES,
    at_full_size=tiny_model_only(
        "measured at the tiny model's matmul/convolution shapes; at the real model's larger "
        "shapes the bf16/fp32 ratio differs"
    ),
)
SPECS = (UPCAST, FP32_TRAINING, FP32_WEIGHTS, DTYPE_MISMATCH, BF16_NOT_NATIVE, BF16_SLOWER)

UPCAST_ID = UPCAST.id
FP32_TRAINING_ID = FP32_TRAINING.id
FP32_WEIGHTS_ID = FP32_WEIGHTS.id
DTYPE_MISMATCH_ID = DTYPE_MISMATCH.id
BF16_NOT_NATIVE_ID = BF16_NOT_NATIVE.id
BF16_SLOWER_ID = BF16_SLOWER.id

# --------------------------------------------------------------------------------------------
# Check ids of the questions that cannot end in a finding

#: An fp16 run: is fp16 slower than fp32 at the model's shapes here (reported, never a finding:
#: fp16 is the fallback the other findings recommend).
FP16_SPEED_CHECK = "precision.fp16_speed"

# --------------------------------------------------------------------------------------------
# Thresholds (whether a finding is raised; how severe it is is verdicts' business)

#: bf16 counts as slower than fp32 when the benchmarked signatures take at least this factor
#: longer in bf16 (and the A/B is sure bf16 is slower).
SLOWER_FACTOR = 1.10
#: fp32 training is worth a finding when bf16 runs the model's shapes at least this much faster.
FP32_TRAINING_MIN_SPEEDUP = 1.25
#: A trace counts as a low-precision run when this share of its compute calls ran in
#: bf16/fp16/fp8.
LOW_PRECISION_RUN_SHARE = 0.5
#: Without a measurement (a trace): a bf16/fp16 matmul runs at least about twice as fast as
#: fp32/tf32 on tensor cores / matrix cores (conservative: on most GPUs the gain is larger).
ASSUMED_LOW_PRECISION_SPEEDUP = 2.0
#: Without per-op backward attribution, training compute is about 3x its forward (fwd + 2x bwd).
TRAINING_FACTOR = 3.0

# --------------------------------------------------------------------------------------------
# Fixes, in each trainer's words

UPCAST_FIX = in_trainers(
    "Let autocast run these ops in the requested dtype: find the code that calls .float() on "
    "their inputs or wraps them in torch.autocast(enabled=False) (attention or norm upcasts, "
    "custom layers, a LoRA/adapter that keeps fp32 weights) and drop the upcast, or cast the "
    "weights to bf16",
    kohya="--mixed_precision bf16 --save_precision bf16",
    diffusers="--mixed_precision bf16 and no --upcast_attention",
    onetrainer="train dtype and weight dtype BFLOAT_16",
    lightning='Trainer(precision="bf16-mixed") and no .float() in the LightningModule',
)

FP32_WEIGHTS_FIX = in_trainers(
    "Cast every weight to bf16 after adding the adapter; modules that must stay fp32 belong in "
    "the model's _keep_in_fp32_modules",
    kohya="--full_bf16",
    diffusers="model.to(torch.bfloat16), and no cast_training_params(model, dtype=torch.float32)",
    onetrainer="train dtype and weight dtype BFLOAT_16",
)

DTYPE_MISMATCH_FIX = (
    "Give the op inputs of one dtype: cast the norm's weight to its input's dtype (or the input "
    "to the weight's), e.g. keep an upcast RMSNorm's weight in fp32 with its fp32 input (list "
    "the module in _keep_in_fp32_modules) or run both in bf16."
)

FP32_HERE_FIX = in_trainers(
    "Train in fp32 on this device (diagnose run --precision fp32); on a GPU without fast bf16 use "
    "fp16 mixed precision",
    kohya="--mixed_precision no",
    diffusers="accelerate launch --mixed_precision no",
    onetrainer="train dtype FLOAT_32",
    lightning='Trainer(precision="32-true")',
)

FP16_INSTEAD_FIX = in_trainers(
    "Use fp16 mixed precision, which this GPU computes natively (with loss scaling, which these "
    "set up)",
    kohya="--mixed_precision fp16",
    diffusers="accelerate launch --mixed_precision fp16",
    onetrainer="train dtype FLOAT_16",
    lightning='Trainer(precision="16-mixed")',
)

CPU_WITHOUT_BF16_FIX = in_trainers(
    "Train in fp32 on this CPU (diagnose run --precision fp32), or use a CPU with AVX512-BF16 "
    "or AMX",
    kohya="--mixed_precision no",
    diffusers="accelerate launch --mixed_precision no",
    onetrainer="train dtype FLOAT_32",
    lightning='Trainer(precision="32-true")',
)


def mixed_precision_fix(low: str) -> str:
    """The flags that turn on ``low`` (bf16/fp16) mixed precision in the trainers users run."""
    lightning = "16-mixed" if low == "fp16" else "bf16-mixed"
    onetrainer = "FLOAT_16" if low == "fp16" else "BFLOAT_16"
    return in_trainers(
        f"Train with {low} mixed precision (fp32 master weights keep the update as accurate)",
        kohya=f"--mixed_precision {low}",
        diffusers=f"accelerate launch --mixed_precision {low}",
        onetrainer=f"train dtype {onetrainer}",
        lightning=f'Trainer(precision="{lightning}")',
    )


_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


def claim_not_applied_fix(said: str, low: str) -> str:
    """The fix when the command line asks for ``low`` (``said``) and the steps ran in fp32."""
    return (
        f"`{said}` did not reach the training step: its forward ran without {low} autocast on "
        "fp32 weights. Check that the flag is read by the script that trains (accelerate: "
        f'`Accelerator(mixed_precision="{low}")` or `accelerate launch --mixed_precision '
        f"{low}`, with the forward inside `accelerator.autocast()` or a prepared model; a plain "
        f"loop: `with torch.autocast(device_type, dtype=torch.{_TORCH_DTYPE.get(low, low)})`), "
        "and that no config file or preset sets it back."
    )


# --------------------------------------------------------------------------------------------
# Builders: one per id, called by the probe and the trace rule alike


def upcast_finding(
    *,
    calls_per_step: float,
    run: str,
    where: str,
    fp32_seconds: float,
    seconds_label: str,
    evidence: Mapping[str, Any],
    saving: float | None,
    basis: Basis,
    detail: str,
    source: str = "",
) -> Finding:
    """``precision.fp32_compute_in_low_precision_run``. ``fp32_seconds`` is per iteration of the
    run the report leads with (``seconds_label`` says what it covers: "of compute", "forward")."""
    return UPCAST.build(
        f"{calls_per_step:.0f} matmul/conv call(s) per step ran in fp32 in a {run} run: "
        f"{where}; {ms(fp32_seconds)}/it {seconds_label}",
        fix=UPCAST_FIX,
        evidence=evidence,
        saving=saving,
        basis=basis if saving is not None else "none",
        detail=detail,
        source=source,
    )


def fp32_training_finding(
    *,
    how_known: str,
    low: str,
    evidence: Mapping[str, Any],
    saving: float | None,
    sure_saving: float | None = None,
    basis: Basis,
    detail: str,
    no_fast_bf16: bool = False,
    source: str = "",
) -> Finding:
    """``precision.fp32_training``: ``how_known`` finishes the title ("bf16 runs this model's
    matmul/conv shapes 1.80x faster on this device", "12 matmul/conv calls per step ...")."""
    fix = mixed_precision_fix(low)
    if no_fast_bf16:
        fix += " This GPU has no fast bf16, hence fp16."
    return FP32_TRAINING.build(
        f"Training computes in fp32; {how_known}",
        fix=fix,
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis=basis if saving is not None else "none",
        detail=detail,
        source=source,
    )


def fp32_weights_finding(
    *, tensors: int, kinds: str, mib: float, where: str, evidence: Mapping[str, Any], detail: str
) -> Finding:
    """``precision.fp32_weights_in_full_bf16``."""
    return FP32_WEIGHTS.build(
        f"{tensors} weight tensor(s) stay fp32 in a bf16-full run ({kinds}; {mib:.1f} MiB): "
        f"{where}",
        fix=FP32_WEIGHTS_FIX,
        evidence=evidence,
        detail=detail,
    )


def dtype_mismatch_finding(
    *, count: int, origin: str, message: str, evidence: Mapping[str, Any]
) -> Finding:
    """``precision.dtype_mismatch_warning``."""
    return DTYPE_MISMATCH.build(
        f"torch warned {count} time(s) per step about mismatched dtypes"
        + (f" ({origin})" if origin else "")
        + f": {message.split('(Triggered')[0].strip()[:140]}",
        fix=DTYPE_MISMATCH_FIX,
        evidence=evidence,
        detail=(
            "With the input and the weight in different dtypes torch cannot use the fused kernel "
            "and runs a slower composite path (and casts). The warnings were captured during the "
            "audited step with torch.set_warn_always(True), so warnings torch otherwise shows "
            "only once per process are counted per call; each is attributed to the torch call "
            "and the module that raised it."
        ),
    )


def bf16_not_native_finding(
    *,
    device: str,
    on_cpu: bool,
    evidence: Mapping[str, Any],
    saving: float | None = None,
    sure_saving: float | None = None,
    detail: str = "",
    source: str = "",
) -> Finding:
    """``precision.bf16_not_native`` (``device`` as the title names it: "gfx1030 (AMD ...)")."""
    return BF16_NOT_NATIVE.build(
        f"bf16 requested, but {device} has no native bf16 arithmetic",
        fix=CPU_WITHOUT_BF16_FIX if on_cpu else FP16_INSTEAD_FIX,
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis="estimated" if saving is not None else "none",
        detail=detail,
        source=source,
    )


def bf16_slower_finding(
    *,
    slowdown: float,
    signatures: int,
    evidence: Mapping[str, Any],
    saving: float | None,
    sure_saving: float | None,
    detail: str,
    not_native: str = "",
    on_cpu: bool = False,
) -> Finding:
    """``precision.bf16_slower_than_fp32``. The title quotes only the measured ratio: the
    microbenchmark's own seconds are not the run's, and the saving the report shows next to the
    title is the run's (see the probe's headline scaling).

    ``not_native`` (the device as titles name it) says the device has no native bf16 arithmetic:
    the cause of the slowdown, carried by this one finding rather than raised a second time as
    ``precision.bf16_not_native``. The title then names it, and a CPU gets that finding's fix
    (fp32, or a CPU with bf16 units)."""
    title = (
        f"bf16 runs this model's {signatures} largest matmul/conv signature(s) {slowdown:.2f}x "
        "slower than fp32 on this device"
    )
    if not_native:
        title += f": {not_native} has no native bf16 arithmetic"
    return BF16_SLOWER.build(
        title,
        fix=CPU_WITHOUT_BF16_FIX if not_native and on_cpu else FP32_HERE_FIX,
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        basis="estimated" if saving is not None else "none",
        detail=detail,
    )


__all__ = [
    "ASSUMED_LOW_PRECISION_SPEEDUP",
    "BF16_NOT_NATIVE",
    "BF16_NOT_NATIVE_ID",
    "BF16_SLOWER",
    "BF16_SLOWER_ID",
    "COMPUTE_PHASES",
    "CPU_WITHOUT_BF16_FIX",
    "DTYPE_MISMATCH",
    "DTYPE_MISMATCH_FIX",
    "DTYPE_MISMATCH_ID",
    "FP16_INSTEAD_FIX",
    "FP16_SPEED_CHECK",
    "FP32_HERE_FIX",
    "FP32_TRAINING",
    "FP32_TRAINING_ID",
    "FP32_TRAINING_MIN_SPEEDUP",
    "FP32_WEIGHTS",
    "FP32_WEIGHTS_FIX",
    "FP32_WEIGHTS_ID",
    "LOW_PRECISION_RUN_SHARE",
    "SLOWER_FACTOR",
    "SPECS",
    "TRAINING_FACTOR",
    "UPCAST",
    "UPCAST_FIX",
    "UPCAST_ID",
    "bf16_not_native_finding",
    "bf16_slower_finding",
    "claim_not_applied_fix",
    "dtype_mismatch_finding",
    "fp32_training_finding",
    "fp32_weights_finding",
    "mixed_precision_fix",
    "ms",
    "upcast_finding",
]
