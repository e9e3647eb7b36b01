"""The quantized base measured against the unquantized one: the same LoRA training step with the
frozen base stored as ``--base`` says and stored in the compute dtype, built from the same
weights, timed interleaved on the same batches; the two bases' outputs on the same inputs; the
memory each holds, measured, against the prediction the full-size numbers come from.

The trace rule (:mod:`diagnose.trace.rules.quantization`) reads the share of the profiled steps
the quantized layers take; this probe's A/B says what storing the base unquantized would save,
and its answer stands over the rule's (the catalog says so). The unquantized twin is only built
when it fits beside the run on the device.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Mapping
from typing import Any

import torch

from diagnose import quantized_base as qb
from diagnose.capture import input_shape
from diagnose.catalogs import quantization_catalog as catalog
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.environment.facts import GIB
from diagnose.probes.quantization.ab import (
    BUDGET_S,
    MIN_ROUNDS,
    compare_outputs,
    held_bytes,
    interleaved_steps,
    judged_step,
    min_relative,
    shared_latents,
    stored_kinds,
)
from diagnose.record import Finding, ProbeResult, RunRecord, step_seconds
from diagnose.stats import ab_verdict, sure_saving
from diagnose.trace.rules.quantization import RULE
from diagnose.units import format_gib, pct, per_it
from diagnose.workload.data import ImageBatch
from diagnose.workload.quantize import FLOAT_BASES

SOURCE = "quantization"
#: The twin is built only when the device has this much more free memory than it needs.
FREE_MEMORY_MARGIN = 1.15

#: The unquantized kind of each compute dtype (the precision's weight dtype names the twin).
_DTYPE_KINDS = {dtype: kind for kind, dtype in FLOAT_BASES.items()}


def _frozen_modules(workload: Any) -> list[torch.nn.Module]:
    return [workload.denoiser, *workload.text_encoders, workload.vae]


def _free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except Exception:
        return None
    return int(free)


def _bucket_seconds(record: RunRecord, batch: ImageBatch) -> float | None:
    """The run's s/it in ``batch``'s resolution bucket, when its steps recorded buckets."""
    stats = record.timing.buckets().get(input_shape(tuple(batch.pixels.shape)))
    return stats.median if stats is not None and stats.n else None


def _no_answer(
    record: RunRecord,
    result: ProbeResult,
    said: str,
    ab: Mapping[str, Any] | None = None,
    memory: str = "",
) -> None:
    """The probe has no answer of its own: the trace rule's reading of the profiled steps
    stands and says why the A/B did not answer; without one, the question stays open. What
    each base needs in memory (``memory``, :func:`_memory_text`) is said either way: it is
    measured or counted, not timed, and it is what decides which base to store."""
    result.data["memory_text"] = memory
    traced = _trace_finding(record)
    if traced is None:
        trace = next((p for p in record.probes if p.name == "trace"), None)
        read = [c for c in trace.checks if c.id == catalog.DEQUANT_COST.id] if trace else []
        if read:  # the rule read a share too small to be a finding: that answer stands
            read[0].text = f"{read[0].text}; not measured against the unquantized base: {said}"
            if memory:
                read[0].text += f". {memory.rstrip('.')}"
        else:
            text = f"quantization: {said}" + (f". {memory.rstrip('.')}" if memory else "")
            result.add_not_judged(catalog.DEQUANT_COST.id, text)
        return
    if ab is not None:
        traced.evidence = {**traced.evidence, "measured_here": dict(ab)}
    traced.detail = (
        f"{traced.detail} Not measured against the unquantized base: {said}. {memory}".strip()
    )


def _trace_finding(record: RunRecord) -> Finding | None:
    """The trace rule's finding: on the trace's result while a run's probes run, on the record
    once a trace's analysis has handed it over."""
    trace = next((p for p in record.probes if p.name == "trace"), None)
    findings = [*(trace.findings if trace is not None else []), *record.findings]
    return next(
        (f for f in findings if f.id == catalog.DEQUANT_COST.id and f.source.startswith("trace")),
        None,
    )


def _trace_share(record: RunRecord, key: str = "share_of_step") -> float | None:
    """The share of the profiled steps the trace rule gave the quantized layers (``key``: their
    kernels', or with "host_share_of_step" the host's time in their ops), if it read it: in its
    finding's evidence, or in the rule's data when the share was too small for one."""
    traced = _trace_finding(record)
    if traced is not None:
        evidence: object = traced.evidence
    else:
        trace = next((p for p in record.probes if p.name == "trace"), None)
        rules = trace.data.get("rules") if trace is not None else None
        rule = rules.get(RULE) if isinstance(rules, Mapping) else None
        evidence = rule.get(RULE) if isinstance(rule, Mapping) else None
    share = evidence.get(key) if isinstance(evidence, Mapping) else None
    return float(share) if isinstance(share, (int, float)) else None


class QuantizationProbe:
    """The quantized base against the unquantized one: step time, outputs and memory."""

    name = "quantization"
    description = (
        "the quantized base (--base nf4/fp4/int8/fp8) against the same base unquantized: "
        "training-step A/B, output error and memory"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        kinds = stored_kinds(ctx.config)
        if not kinds:
            raise ProbeSkipped("the frozen base is not stored quantized (see --base)")
        if ctx.workload is None:
            raise ProbeSkipped("no training step was built (trace mode)")
        from diagnose.workload.step import build_workload

        stored = ctx.workload
        unquantized_kind = _DTYPE_KINDS.get(stored.policy.weight_dtype, "bf16")
        twin_config = dataclasses.replace(ctx.config, base=None, text_encoder_base=None, workers=0)
        storage = " and ".join(dict.fromkeys(kinds.values())).upper()
        result = ProbeResult()
        result.data = {"stored": kinds, "unquantized": unquantized_kind}
        memory = self._predicted_memory(ctx, twin_config)
        result.data["memory"] = memory
        held_stored = held_bytes(_frozen_modules(stored))
        free = _free_device_bytes(ctx.device)
        twin_needs = memory.get("unquantized_bytes")
        if free is not None and twin_needs and twin_needs * FREE_MEMORY_MARGIN > free:
            _no_answer(
                ctx.record,
                result,
                f"the {unquantized_kind} base was not measured: it needs "
                f"{twin_needs / GIB:.2f} GiB beside this run, and the device has "
                f"{free / GIB:.2f} GiB free",
                memory=_memory_text(storage, unquantized_kind, memory),
            )
            return result
        ctx.progress(f"quantization: building the {unquantized_kind} base to compare")
        snapshot = stored.snapshot()
        twin = None
        stopped = False
        try:
            shared = shared_latents(stored)
            result.data["vae_encode_seconds"] = shared.encode_seconds
            # Rounds of both bases' steps, at the s/it of the A/B's bucket less the encode they
            # share: over the budget, the outputs are still compared but not timed.
            headline = step_seconds(ctx.record)
            bucket_step = _bucket_seconds(ctx.record, shared.batches[0]) or headline
            ab_step = None if bucket_step is None else max(bucket_step - shared.encode_seconds, 0.0)
            timed = ab_step is None or 2 * MIN_ROUNDS * ab_step <= BUDGET_S
            twin = build_workload(twin_config, ctx.device)
            twin.share_caches(stored)
            held_twin = held_bytes(_frozen_modules(twin))
            result.data["memory"].update(
                stored_held_bytes=held_stored, unquantized_held_bytes=held_twin
            )
            ctx.progress("quantization: comparing the two bases' outputs")
            errors = compare_outputs(stored, twin, shared)
            result.data["relative_error"] = errors
            self._judge_numerics(result, kinds, unquantized_kind, errors)
            if timed:
                ctx.progress("quantization: timing steps of both bases, interleaved")
                stored_times, twin_times, stopped = interleaved_steps(
                    stored, twin, shared, headline=headline, deadline=ctx.deadline
                )
        finally:
            if twin is not None:
                twin.close()
                del twin
            gc.collect()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            snapshot.restore()
        if not timed:
            assert ab_step is not None
            _no_answer(
                ctx.record,
                result,
                f"the steps were not timed against the {unquantized_kind} base: "
                f"{MIN_ROUNDS} rounds of both at {ab_step:.3g} s a step (the s/it less the "
                f"VAE's encode, which both share) take about {2 * MIN_ROUNDS * ab_step:.0f} s, "
                f"over the {BUDGET_S:.0f} s this A/B may take",
                memory=_memory_text(storage, unquantized_kind, result.data["memory"]),
            )
            return result
        self._judge_speed(
            ctx.record,
            result,
            storage,
            unquantized_kind,
            (stored_times, twin_times),
            shared.encode_seconds,
            memory,
            stopped=stopped,
        )
        return result

    @staticmethod
    def _predicted_memory(ctx: ProbeContext, twin_config: Any) -> dict[str, Any]:
        """Static bytes (weights, LoRA, gradients, optimizer state) of this run's model and of
        the real one, with the base stored and unquantized, from their parameter counts."""
        from diagnose.probes.environment.probe import preset_memory

        config = ctx.config
        memory: dict[str, Any] = {}
        if config.preset is None or config.model_dir is not None:
            return memory
        size = config.size or "tiny"
        fp8 = dataclasses.replace(twin_config, base="fp8", text_encoder_base="fp8")
        for label, cfg in (("stored", config), ("unquantized", twin_config), ("fp8", fp8)):
            here = preset_memory(cfg, config.preset, size=size)
            if here is not None and label != "fp8":
                memory[f"{label}_bytes"] = here.static_bytes
                memory[f"{label}_frozen_bytes"] = here.frozen_bytes
            full = here if size == "full" else preset_memory(cfg, config.preset)
            if full is not None:
                memory[f"{label}_full_size_bytes"] = full.static_bytes
        if ctx.device_info.kind in ("cuda", "rocm") and ctx.device_info.memory_bytes:
            memory["device_bytes"] = ctx.device_info.memory_bytes
        return memory

    @staticmethod
    def _judge_numerics(
        result: ProbeResult, kinds: Mapping[str, str], unquantized: str, errors: Mapping[str, float]
    ) -> None:
        worst: tuple[float, float, str, str] | None = None
        for part, error in errors.items():
            kind = kinds.get(part)
            if kind is None:
                continue
            bound = qb.storage(kind).relative_error_bound
            if worst is None or error / bound > worst[0] / worst[1]:
                worst = (error, bound, part, kind)
        if worst is None:
            return
        error, bound, part, kind = worst
        said = ", ".join(f"{p} {e:.3g}" for p, e in errors.items())
        if error <= bound:
            result.add_ok(
                catalog.NUMERICS.id,
                f"quantization: the {kind} base's outputs are within its bound of the "
                f"{unquantized} base's (relative L2: {said}; bound {bound:.2g})",
            )
            return
        result.add_finding(
            catalog.numerics_off(
                storage=f"{kind} {part}",
                unquantized=unquantized,
                error=error,
                bound=bound,
                evidence={"relative_error": dict(errors), "bound": bound, "kind": kind},
                source=SOURCE,
            )
        )

    @staticmethod
    def _judge_speed(
        record: RunRecord,
        result: ProbeResult,
        storage: str,
        unquantized: str,
        times: tuple[list[float], list[float]],
        encode_seconds: float,
        memory: Mapping[str, Any],
        *,
        stopped: bool = False,
    ) -> None:
        """The A/B's steps leave out the VAE's encode (the same in both arms, done once before).
        The saving is their difference in seconds: expanding the weights costs the same at any
        image size, so it is not scaled to the headline's step, only kept within it. ``stopped``:
        the probe's time budget ended the rounds before the A/B was sure."""
        stored_times, twin_times = times
        whole = judged_step(step_seconds(record), stored_times, encode_seconds)
        memory_text = _memory_text(storage, unquantized, memory)
        verdict = ab_verdict(
            stored_times, twin_times, min_relative=min_relative(stored_times, whole)
        )
        stored_step = statistics.median(stored_times)
        twin_step = statistics.median(twin_times)
        ab = {
            "stored_step_seconds": stored_times,
            "unquantized_step_seconds": twin_times,
            "vae_encode_seconds": encode_seconds,
            "judged_against_seconds": whole,
            "outcome": verdict.outcome,
            "ratio": verdict.text(),
            "stopped_by_budget": stopped,
        }
        result.data["ab"] = ab
        past_vae = " past the VAE's encode" if encode_seconds > 0 else ""
        said = (
            f"a {unquantized} base took {verdict.text()} of the {storage} base's time{past_vae} "
            f"({per_it(twin_step)} against {per_it(stored_step)}; the whole step "
            f"{per_it(whole)})"
        )
        if verdict.outcome == "inconclusive":
            why = f" ({BUDGET_STOPPED})" if stopped else ""
            _no_answer(
                record,
                result,
                f"the A/B could not decide{why}: {said}",
                ab,
                memory=memory_text,
            )
            return
        if verdict.outcome == "not_faster":
            share = _trace_share(record)
            traced = (
                f"; the trace gives its quantized layers {pct(share)} of each profiled step"
                if share is not None
                else ""
            )
            result.add_ok(
                catalog.DEQUANT_COST.id,
                f"quantization: the {storage} base costs no real share of the step: {said}"
                + traced
                + (f". {memory_text.rstrip('.')}" if memory_text else ""),
            )
            return
        saving = min(max(0.0, stored_step - twin_step), whole)
        sure = min(sure_saving(twin_times, stored_times), saving)
        result.add_finding(
            catalog.measured_cost(
                storage=storage,
                unquantized=unquantized,
                stored_step=stored_step,
                unquantized_step=twin_step,
                whole_step=whole,
                ratio=f"{verdict.text()} of the {storage} base's time{past_vae}",
                encode_seconds=encode_seconds,
                saving=saving,
                sure=sure,
                trace_share=_trace_share(record),
                trace_host_share=_trace_share(record, "host_share_of_step"),
                on_gpu=record.device.kind in ("cuda", "rocm"),
                memory=memory_text,
                evidence={"ab": ab, "memory": dict(memory)},
                source=SOURCE,
            )
        )


def _memory_text(storage: str, unquantized: str, memory: Mapping[str, Any]) -> str:
    """What the quantized base buys in memory, measured here and predicted at full size."""
    parts = []
    held_stored = memory.get("stored_held_bytes")
    held_twin = memory.get("unquantized_held_bytes")
    if held_stored and held_twin:
        parts.append(
            f"Here the frozen weights held {format_gib(held_stored)} as {storage} against "
            f"{format_gib(held_twin)} as {unquantized}."
        )
    full_stored = memory.get("stored_full_size_bytes")
    full_twin = memory.get("unquantized_full_size_bytes")
    full_fp8 = memory.get("fp8_full_size_bytes")
    if not (full_stored and full_twin):
        return " ".join(parts)
    parts.append(
        f"At full size the model needs {format_gib(full_stored)} before activations as {storage} "
        f"against {format_gib(full_twin)} as {unquantized}"
        + (f" and {format_gib(full_fp8)} as fp8" if full_fp8 and storage != "FP8" else "")
        + "."
    )
    device = memory.get("device_bytes")
    if not device:
        parts.append("Keep the quantized base only where the unquantized one does not fit.")
    elif full_twin <= device:
        parts.append(
            f"On this GPU's {format_gib(device)} the {unquantized} base fits before activations: "
            "store the base unquantized."
        )
    elif full_fp8 and full_fp8 <= device and storage != "FP8":
        parts.append(
            f"The {unquantized} base does not fit this GPU's {format_gib(device)}, "
            "fp8 storage does: "
            "it expands with a plain cast, cheaper than a 4-bit table lookup."
        )
    else:
        parts.append(f"On this GPU's {format_gib(device)} only the quantized base fits.")
    return " ".join(parts)


__all__ = ["QuantizationProbe"]
