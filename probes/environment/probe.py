"""The ``environment`` probe: machine-level causes of a slow step.

Many "why is my LoRA slow" threads end here rather than in the model: training silently on the
CPU or on an integrated GPU, VRAM spilling into shared system memory, MIOpen searching
convolution kernels for every new shape, TunableOp tuning live, hipBLASLt requested on a GPU it
does not support, HSA_OVERRIDE_GFX_VERSION games, allocator settings that fight each other,
CUDA_LAUNCH_BLOCKING=1 left set, throttled clocks, a narrow PCIe link, an old driver.

The probe only gathers :class:`EnvironmentFacts` from the run's context and runs :data:`RULES`,
pure functions kept by concern (``environment_device``, ``environment_memory``,
``environment_rocm``, ``environment_cpu``); their findings' words and fixes are in
``diagnose/catalogs/environment_catalog.py`` and ``memory_catalog.py``. It re-runs nothing, so it
costs milliseconds. Whether bf16 is native on the device is the precision probe's question.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from diagnose.carry_over import shrunk_preset
from diagnose.probes.base import ProbeContext
from diagnose.probes.environment.cpu import rule_cpu_threads
from diagnose.probes.environment.device import (
    rule_cpu_with_gpu_present,
    rule_driver,
    rule_integrated_gpu,
    rule_launch_blocking,
    rule_pcie_link,
    rule_throttling,
)
from diagnose.probes.environment.facts import EnvironmentFacts, FullSizeMemory, Rule
from diagnose.probes.environment.memory import (
    rule_allocator_retries,
    rule_allocator_settings,
    rule_vram_spill,
)
from diagnose.probes.environment.rocm import (
    hipblaslt_supported,
    hsa_override_target,
    rule_hipblaslt,
    rule_hsa_override,
    rule_rocm_warmup,
    rule_tunableop_tuning,
)
from diagnose.quantized_base import stored_bytes_of
from diagnose.record import ProbeResult
from diagnose.telemetry import TelemetrySummary
from diagnose.workload.presets import PresetCount

#: The rules in report order; each is a pure function of EnvironmentFacts.
RULES: tuple[Rule, ...] = (
    rule_cpu_with_gpu_present,
    rule_integrated_gpu,
    rule_vram_spill,
    rule_allocator_retries,
    rule_allocator_settings,
    rule_rocm_warmup,
    rule_tunableop_tuning,
    rule_hsa_override,
    rule_hipblaslt,
    rule_launch_blocking,
    rule_throttling,
    rule_pcie_link,
    rule_driver,
    rule_cpu_threads,
)


def evaluate(facts: EnvironmentFacts, rules: Sequence[Rule] = RULES) -> ProbeResult:
    """Run the rules into one result named "environment". A rule that raises is a question not
    judged (``environment.<rule>``), with its error, so one broken rule does not hide the
    others."""
    total = ProbeResult(name="environment")
    for rule in rules:
        try:
            result = rule(facts)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            total.add_not_judged(
                f"environment.{rule.__name__.removeprefix('rule_')}",
                f"{rule.__name__} failed: {type(exc).__name__}: {exc} "
                f"({os.path.basename(last.filename)}:{last.lineno})",
            )
            continue
        total.findings.extend(result.findings)
        total.checks.extend(result.checks)
    total.settle_checks("environment")
    return total


# --- gathering from a run ------------------------------------------------------------------------


def telemetry_from_record(
    inventory: Mapping[str, Any], record: Any = None
) -> TelemetrySummary | None:
    """The telemetry sampled during the timed steps, where the run stored it:
    ``record.telemetry`` (a later field) or ``inventory["telemetry"]["during_steps"]``."""
    stored = getattr(record, "telemetry", None)
    if isinstance(stored, TelemetrySummary):
        return stored
    if isinstance(stored, Mapping) and stored:
        return TelemetrySummary.from_dict(stored)
    section = inventory.get("telemetry")
    during = section.get("during_steps") if isinstance(section, Mapping) else None
    return TelemetrySummary.from_dict(during) if isinstance(during, Mapping) else None


def _allocator_from_torch(ctx: ProbeContext) -> dict[str, int]:
    import torch

    try:
        stats = torch.cuda.memory_stats(ctx.device)
    except Exception:
        return {}
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
    return {k: int(stats[k]) for k in keys if k in stats}


def gather_facts(ctx: ProbeContext) -> EnvironmentFacts:
    record = ctx.record
    telemetry = telemetry_from_record(record.inventory, record)
    allocator: dict[str, int] = {}
    scope = ""
    if telemetry is not None and telemetry.allocator:
        allocator, scope = dict(telemetry.allocator), "timed steps"
    elif ctx.device.type == "cuda":
        # Counters since the process started: model build, warm-up, timed and profiled steps.
        allocator, scope = _allocator_from_torch(ctx), "whole run"
    resolutions = record.config.get("resolution") or ctx.config.resolution or []
    on_gpu = ctx.device_info.kind in ("cuda", "rocm")
    return EnvironmentFacts(
        device=ctx.device_info,
        inventory=record.inventory,
        telemetry=telemetry,
        timing=record.timing,
        precision=ctx.config.precision,
        allocator=allocator,
        allocator_scope=scope,
        resolutions=[int(r) for r in resolutions if isinstance(r, int)],
        full_size=full_size_memory(ctx.config) if on_gpu else None,
    )


#: Bytes a trainable parameter holds besides itself and its gradient, per optimizer: AdamW's two
#: fp32 moments, AdamW8bit's two 8-bit ones, Adafactor's factored second moment (at most one
#: fp32 value a parameter, counted in full).
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "adafactor": 4}


def full_size_memory(config: Any, *, activations: bool = True) -> FullSizeMemory | None:
    """The real model's memory, for a run that trained a shrunk stand-in (None otherwise, or
    when the full-size preset cannot be built on the meta device); with ``activations``, one
    step's peak too (see :func:`preset_memory`)."""
    preset = shrunk_preset(config)
    return None if preset is None else preset_memory(config, preset, activations=activations)


def preset_memory(
    config: Any, preset: str, size: str = "full", *, activations: bool = False
) -> FullSizeMemory | None:
    """``preset``'s memory at ``size`` before activations, as ``config`` stores and trains it
    (None when it cannot be counted); with ``activations``, also one step's peak beyond the
    weights, without and with gradient checkpointing (seconds of counting)."""
    count = _preset_count(config, preset, size)
    if count is None:
        return None
    memory = memory_of(config, preset, count)
    return with_activations(memory, config, size) if activations else memory


def _preset_count(config: Any, preset: str, size: str) -> PresetCount | None:
    """The counts a preset's memory is counted from: the shipped ones for the preset's own LoRA
    targets (no model built, so that a run can say a full-size model will not fit before it
    imports diffusers), else its models built on the meta device (seconds at full size)."""
    from diagnose.workload.presets import preset_counts

    targets = getattr(config, "target_modules", None)
    try:
        shipped = preset_counts().get((preset, size)) if targets is None else None
        if shipped is not None:
            return shipped.at_rank(config.rank)
        from diagnose.workload.models import count_preset

        return count_preset(preset, size, config.rank, targets)
    except Exception:  # the full-size numbers only refine the verdict; without them it stands
        return None


def memory_of(config: Any, preset: str, count: PresetCount) -> FullSizeMemory:
    """The memory of ``preset``'s models, counted as ``count``, as ``config`` stores and trains
    them, before activations."""
    weight = 4 if config.precision == "fp32" else 2
    base = getattr(config, "base", None)
    encoder_base = getattr(config, "text_encoder_base", None) or base
    frozen = stored_bytes_of(count.parameters, count.stored_linear_weights, base, weight)
    frozen += sum(
        stored_bytes_of(e.parameters, e.stored_linear_weights, encoder_base, weight)
        for e in count.text_encoders
    )
    frozen += count.vae_parameters * weight
    others = count.vae_parameters + sum(e.parameters for e in count.text_encoders)
    lora = 2 if config.precision == "bf16-full" else 4
    state = _OPTIMIZER_STATE_BYTES.get(config.optimizer, 8)
    trainable = count.trainable_parameters
    stored = (
        f" (the denoiser stored as {base}, the text encoders as {encoder_base})"
        if base or encoder_base
        else f" at {weight} bytes"
    )
    return FullSizeMemory(
        preset=preset,
        frozen_bytes=frozen,
        trainable_bytes=trainable * (2 * lora + state),
        basis=(
            f"counted from its configs: {count.parameters + others:,} "
            f"frozen parameters{stored}, {trainable:,} LoRA "
            f"parameters at {lora} bytes plus their gradient and {state} bytes of "
            f"{config.optimizer} state"
        ),
    )


def with_activations(
    memory: FullSizeMemory,
    config: Any,
    size: str = "full",
    *,
    checkpointing: bool | None = None,
) -> FullSizeMemory:
    """``memory`` with one step's peak beyond the weights, without and with gradient
    checkpointing (:func:`diagnose.workload.memory.step_memory`: seconds of counting each), or
    only the one ``checkpointing`` names (the other stays as ``memory`` had it)."""
    from diagnose.workload.memory import step_memory

    modes = (False, True) if checkpointing is None else (checkpointing,)
    step = step_memory(config, memory.preset, size, checkpointing=modes)
    if step.error:
        return dataclasses.replace(
            memory,
            activation_bytes=None,
            checkpointed_activation_bytes=None,
            activations_at=step.error,
        )
    return dataclasses.replace(
        memory,
        activation_bytes=step.peak_bytes if False in modes else memory.activation_bytes,
        checkpointed_activation_bytes=(
            step.checkpointed_peak_bytes if True in modes else memory.checkpointed_activation_bytes
        ),
        activations_at=step.at,
    )


class EnvironmentProbe:
    name = "environment"
    description = (
        "machine-level causes of slow steps: device choice, VRAM, allocator, kernel search, "
        "throttling, PCIe, driver and environment variables"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        facts = gather_facts(ctx)
        result = evaluate(facts)
        telemetry = facts.telemetry
        result.data = {
            "allocator": facts.allocator,
            "allocator_scope": facts.allocator_scope,
            "telemetry": (
                "not sampled"
                if telemetry is None
                else f"{telemetry.backend}: {telemetry.stats.n} samples"
                if telemetry.available
                else f"unavailable: {telemetry.reason}"
            ),
        }
        return result


__all__ = [
    "RULES",
    "EnvironmentFacts",
    "EnvironmentProbe",
    "Rule",
    "evaluate",
    "full_size_memory",
    "gather_facts",
    "hipblaslt_supported",
    "hsa_override_target",
    "telemetry_from_record",
    "with_activations",
]
