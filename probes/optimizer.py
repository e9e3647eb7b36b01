"""The ``optimizer`` probe: what the optimizer step costs, whether it stalls, and what 8-bit buys.

AdamW8bit (bitsandbytes) is the default of many LoRA recipes, and on ROCm it is a frequent
suspect: a fork or a build without the right arch, host-device synchronisation inside the step,
paged optimizers, quantisation that differs from the CUDA build. The standard advice is "try
plain AdamW to isolate it"; this probe runs that experiment and shows the result:

1. **Inventory**: bitsandbytes version, the backend and native library it loaded, ROCm or not,
   what it printed or warned at import and construction. Without bitsandbytes the 8-bit parts
   are skipped and the other optimizers still run.
2. **The configured optimizer's step**: device-synchronised time of ``optimizer.step()`` alone
   (median of repeated calls on real gradients from a real backward), its share of s/it, and
   what the step waits for: host-device synchronisations and blocking copies recorded by the
   profiler inside the step (plus ``torch.cuda.set_sync_debug_mode("warn")`` on a GPU). On the
   CPU there is no device to wait for: ``.item()`` reads are counted and never called stalls.
3. **A/B**: the same parameters and gradients stepped by torch AdamW (foreach, fused),
   bitsandbytes AdamW8bit and transformers Adafactor; step time, the s/it it implies, state
   memory by dtype.
4. **Is 8-bit really 8-bit?** bitsandbytes keeps fp32 state for tensors below ``min_8bit_size``
   (4096 elements by default), which covers most small-rank LoRA matrices.
5. **Numerics**: one 8-bit update against fp32 AdamW within the quantisation bound
   (:mod:`diagnose.probes.optimizer_numerics`).

The workload is left as found: the configured optimizer's state, the parameters, the gradients,
the GradScaler and the sync debug mode are put back. Only its data iterator moves on by one
batch (the gradients come from a real step on the next batch).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diagnose.probes.base import SAVING_SIGNIFICANCE, ProbeContext, ProbeSkipped, sure_saving
from diagnose.probes.optimizer_numerics import (
    MAX_NUMERICS_TENSORS,
    AdamHyper,
    NumericsReport,
    numerics_rule,
    run_numerics,
)
from diagnose.quiet import capture_output, native_stderr_filtered
from diagnose.record import Finding, ProbeResult, Severity, Stats
from diagnose.timing import PhaseTimer, device_synchronizer

#: Timed calls per optimizer: at least MIN_CALLS, then more until the budget is spent.
MIN_CALLS = 5
MAX_CALLS = 30
TIME_BUDGET_S = 0.5
#: Calls recorded by the profiler per optimizer (after the timed ones).
PROFILED_CALLS = 3
#: Calls run with torch.cuda.set_sync_debug_mode("warn") (GPU only).
SYNC_DEBUG_CALLS = 2
#: An alternative counts as faster only when its median beats the configured one by both
#: margins and its upper quartile lies below the configured lower quartile.
MIN_RELATIVE_GAIN = 0.10
MIN_ABSOLUTE_GAIN_S = 0.5e-3
#: Share of s/it below which a faster alternative is not worth a finding (it is reported as
#: checked instead): switching optimizers changes the run, a fraction of a percent does not pay.
MIN_SHARE_OF_S_PER_IT = 0.01
#: Share of s/it the saving must reach for warn / critical.
WARN_SHARE = 0.05
CRITICAL_SHARE = 0.20
#: bitsandbytes' default: tensors with fewer elements keep fp32 state.
BNB_DEFAULT_MIN_8BIT_SIZE = 4096
#: Share of the 8-bit optimizer's moment bytes held in fp32 that makes the finding (info),
#: and the share that makes it a warning.
FP32_SHARE_INFO = 0.5
FP32_SHARE_WARN = 0.9
#: Tries at a finite gradient (an fp16 GradScaler may skip a step on inf/nan).
GRADIENT_TRIES = 3

#: The label this probe puts around each profiled call, and the span torch's Optimizer puts
#: around ``step`` ("Optimizer.step#AdamW.step"); syncs inside either are counted.
PROBE_STEP_SPAN = "diagnose::optimizer_probe.step"
STEP_SPAN_PREFIXES: tuple[str, ...] = ("Optimizer.step#", PROBE_STEP_SPAN)
#: Runtime calls that block the host until the device is done (profiler CPU-side events).
#: "cudaMemcpy"/"hipMemcpy" are the synchronous copies; ROCm's torch reads device scalars with
#: hipMemcpyWithStream, which blocks as well.
HOST_SYNC_CALLS: frozenset[str] = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "hipDeviceSynchronize",
        "hipStreamSynchronize",
        "hipEventSynchronize",
        "hipMemcpy",
        "hipMemcpyWithStream",
    }
)
#: aten ops that read a tensor's value into Python (``.item()``, ``float(t)``). On a GPU tensor
#: they block; on a CPU tensor (torch AdamW's step counters) they do not.
SCALAR_READ_OPS: tuple[str, str] = ("aten::_local_scalar_dense", "aten::item")


# --------------------------------------------------------------------------------------------
# Host syncs inside the step (pure)


@dataclass
class ProfiledEvent:
    """One profiler event, reduced to what the sync count needs (times in microseconds)."""

    name: str
    start_us: float
    end_us: float
    thread: int = 0


@dataclass
class StepSyncs:
    """What the profiled optimizer steps waited for."""

    #: Step spans found (top-level; nested Optimizer.step# spans count once).
    steps: int = 0
    #: Runtime calls in HOST_SYNC_CALLS inside the steps, and the host time spent in them.
    host_syncs: int = 0
    host_sync_seconds: float = 0.0
    #: ``.item()``-style reads inside the steps (max of aten::item and _local_scalar_dense, as
    #: one nests in the other).
    scalar_reads: int = 0
    by_name: dict[str, int] = field(default_factory=dict)
    #: Whether the trace holds any CUDA/HIP runtime call at all (none on the CPU, or when the
    #: profiler's device tracer did not start).
    runtime_events_seen: bool = False

    def per_step(self, count: float) -> float:
        return count / self.steps if self.steps else 0.0


def _is_step_span(name: str) -> bool:
    return name.startswith(STEP_SPAN_PREFIXES)


def count_step_syncs(events: Sequence[ProfiledEvent]) -> StepSyncs:
    """Count host syncs and scalar reads that start inside optimizer-step spans."""
    spans = sorted((e for e in events if _is_step_span(e.name)), key=lambda e: e.start_us)
    merged: list[ProfiledEvent] = []
    for span in spans:
        last = next((m for m in reversed(merged) if m.thread == span.thread), None)
        if last is not None and span.start_us < last.end_us:
            last.end_us = max(last.end_us, span.end_us)  # nested or overlapping: one step
        else:
            merged.append(ProfiledEvent(span.name, span.start_us, span.end_us, span.thread))
    result = StepSyncs(steps=len(merged))
    result.runtime_events_seen = any(e.name.startswith(("cuda", "hip")) for e in events)
    reads: dict[str, int] = dict.fromkeys(SCALAR_READ_OPS, 0)
    for event in events:
        is_sync = event.name in HOST_SYNC_CALLS
        if not is_sync and event.name not in reads:
            continue
        # Runtime calls carry the OS thread id, torch ops the profiler's own thread numbering,
        # so runtime calls are matched by time alone (nothing else launches work meanwhile).
        inside = any(
            m.start_us <= event.start_us < m.end_us and (is_sync or m.thread == event.thread)
            for m in merged
        )
        if not inside:
            continue
        result.by_name[event.name] = result.by_name.get(event.name, 0) + 1
        if is_sync:
            result.host_syncs += 1
            result.host_sync_seconds += max(0.0, event.end_us - event.start_us) * 1e-6
        else:
            reads[event.name] += 1
    result.scalar_reads = max(reads.values())
    return result


def host_sync_rule(
    syncs: StepSyncs,
    *,
    device_kind: str,
    optimizer_label: str,
    step_seconds: float | None,
    s_per_it: float | None,
    debug_warnings: int = 0,
) -> Finding | None:
    """``optimizer.host_sync_in_step`` when the step makes the host wait for a GPU.

    On the CPU nothing is a stall. When the profiler recorded no runtime call at all (a device
    tracer that did not start), ``.item()`` reads inside the step stand in for the syncs.
    """
    if device_kind == "cpu" or syncs.steps == 0:
        return None
    counted = syncs.host_syncs if syncs.runtime_events_seen else syncs.scalar_reads
    if counted == 0 and debug_warnings == 0:
        return None
    per_step = syncs.per_step(counted)
    wait_ms = syncs.per_step(syncs.host_sync_seconds) * 1e3
    share = step_seconds / s_per_it if step_seconds is not None and s_per_it else None
    severity: Severity = "warn" if share is not None and share >= WARN_SHARE else "info"
    what = "syncs" if syncs.runtime_events_seen else ".item() reads (no runtime calls recorded)"
    evidence: dict[str, Any] = {
        "optimizer": optimizer_label,
        "host_syncs_per_step": round(per_step, 2),
        "host_wait_ms_per_step": round(wait_ms, 3),
        "calls_by_name": dict(sorted(syncs.by_name.items())),
        "profiled_steps": syncs.steps,
        "sync_debug_warnings": debug_warnings,
        "counted_from": what,
    }
    if step_seconds is not None:
        evidence["step_ms"] = round(step_seconds * 1e3, 3)
    if share is not None:
        evidence["share_of_s_per_it"] = round(share, 4)
    title = (
        f"{optimizer_label}: optimizer.step() makes the host wait for the GPU "
        f"{per_step:.0f} times per step"
        if counted
        else f"{optimizer_label}: torch's sync debug mode flagged {debug_warnings} synchronising "
        "operations in optimizer.step()"
    )
    return Finding(
        id="optimizer.host_sync_in_step",
        category="optimizer",
        severity=severity,
        title=title,
        evidence=evidence,
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=(
            "Use an optimizer whose step does not synchronise: torch AdamW, fused or foreach "
            '(kohya `--optimizer_type AdamW`, add `--optimizer_args "fused=True"` for fused; '
            "diffusers: drop `--use_8bit_adam`; OneTrainer: optimizer ADAMW). The A/B table "
            "says what each costs here."
        ),
        detail=(
            "While the host waits, it launches nothing, so the GPU idles between the small "
            "per-tensor kernels of the step. bitsandbytes' 8-bit optimizers call "
            "torch.cuda.synchronize() after each parameter (bitsandbytes.utils.sync_gpu in "
            "Optimizer8bit.step), which for a LoRA of hundreds of small tensors means hundreds "
            "of round trips per step. Synchronising calls are read from the profiler's runtime "
            "events inside Optimizer.step spans; torch.cuda.set_sync_debug_mode('warn') adds "
            "the synchronising torch operations (.item(), .cpu(), nonzero) with their stacks."
        ),
    )


# --------------------------------------------------------------------------------------------
# A/B rows and the "slower than an alternative" rule (pure)


@dataclass
class ABRow:
    """One optimizer stepped on the same parameters and gradients."""

    optimizer: str
    key: str
    configured: bool = False
    step_seconds: list[float] = field(default_factory=list)
    #: Derived: the record's s/it - the configured step + this step (None without a record).
    implied_s_per_it: float | None = None
    state_bytes: dict[str, int] = field(default_factory=dict)
    host_syncs_per_step: float | None = None
    scalar_reads_per_step: float | None = None
    warnings: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.step_seconds)

    def to_dict(self) -> dict[str, Any]:
        stats = self.stats
        row = asdict(self)
        row.update(
            step_ms_median=_ms(stats.median),
            step_ms_q1=_ms(stats.q1),
            step_ms_q3=_ms(stats.q3),
            step_ms_iqr=_ms(stats.iqr),
            samples=stats.n,
            state_bytes_total=sum(self.state_bytes.values()),
        )
        return row


def _ms(seconds: float) -> float | None:
    return round(seconds * 1e3, 4) if math.isfinite(seconds) else None


def implied_s_per_it(
    s_per_it: float | None, configured_step: float | None, this_step: float | None
) -> float | None:
    """s/it with this optimizer: the measured s/it with the configured step swapped for this one."""
    if s_per_it is None or configured_step is None or this_step is None:
        return None
    if not all(math.isfinite(v) for v in (s_per_it, configured_step, this_step)):
        return None
    return max(0.0, s_per_it - configured_step + this_step)


#: How to select each optimizer in the trainers LoRA users run.
SWITCH_FLAGS: dict[str, str] = {
    "adamw-foreach": (
        "torch AdamW: kohya `--optimizer_type AdamW`; diffusers scripts: drop `--use_8bit_adam`; "
        "OneTrainer: optimizer ADAMW"
    ),
    "adamw-single": (
        "torch AdamW: kohya `--optimizer_type AdamW`; diffusers scripts: drop `--use_8bit_adam`; "
        "OneTrainer: optimizer ADAMW"
    ),
    "adamw-fused": (
        "torch AdamW with fused=True: kohya `--optimizer_type AdamW --optimizer_args "
        '"fused=True"`; OneTrainer: optimizer ADAMW with Fused on; diffusers scripts: drop '
        "`--use_8bit_adam` and pass fused=True where the script builds torch.optim.AdamW"
    ),
    "adamw8bit": (
        "bitsandbytes AdamW8bit: kohya `--optimizer_type AdamW8bit`; diffusers scripts: "
        "`--use_8bit_adam`; OneTrainer: optimizer ADAMW_8BIT"
    ),
    "adafactor": (
        "transformers Adafactor with a fixed learning rate: kohya `--optimizer_type Adafactor "
        '--optimizer_args "scale_parameter=False" "relative_step=False" '
        '"warmup_init=False"`; OneTrainer: optimizer ADAFACTOR; diffusers scripts have no '
        "flag (replace the optimizer in the script). Adafactor is a different algorithm: "
        "re-tune the learning rate"
    ),
}


def _severity_for_share(share: float | None) -> Severity:
    if share is None:
        return "info"
    if share >= CRITICAL_SHARE:
        return "critical"
    if share >= WARN_SHARE:
        return "warn"
    return "info"


def clearly_faster(
    rows: Sequence[ABRow],
    *,
    min_relative: float = MIN_RELATIVE_GAIN,
    min_absolute_s: float = MIN_ABSOLUTE_GAIN_S,
) -> ABRow | None:
    """The fastest alternative whose step is clearly faster than the configured one, or None.

    Clearly: its median is lower by at least ``min_relative`` of the configured median and by
    ``min_absolute_s``, and its upper quartile lies below the configured lower quartile (the
    difference beats the spread).
    """
    configured = next((r for r in rows if r.configured and not r.error and r.step_seconds), None)
    if configured is None:
        return None
    base = configured.stats
    best: ABRow | None = None
    for row in rows:
        if row.configured or row.error or not row.step_seconds:
            continue
        stats = row.stats
        gain = base.median - stats.median
        if gain < min_absolute_s or gain < min_relative * base.median:
            continue
        if stats.q3 >= base.q1:
            continue
        if best is None or stats.median < best.stats.median:
            best = row
    return best


def slower_than_alternative_rule(
    rows: Sequence[ABRow],
    s_per_it: float | None,
    *,
    min_relative: float = MIN_RELATIVE_GAIN,
    min_absolute_s: float = MIN_ABSOLUTE_GAIN_S,
    min_share: float = MIN_SHARE_OF_S_PER_IT,
) -> Finding | None:
    """``optimizer.slower_than_alternative`` when another optimizer's step is clearly faster
    (:func:`clearly_faster`) by at least ``min_share`` of s/it (when s/it is known).

    The saving reported is the difference of the medians; the severity is judged on the low end
    of its Hodges–Lehmann interval (:func:`~diagnose.probes.base.sure_saving`), the saving the A/B
    is sure of.
    """
    best = clearly_faster(rows, min_relative=min_relative, min_absolute_s=min_absolute_s)
    configured = next((r for r in rows if r.configured), None)
    if best is None or configured is None:
        return None
    base = configured.stats
    fastest = best.stats
    saving = base.median - fastest.median
    share = saving / s_per_it if s_per_it else None
    if share is not None and share < min_share:
        return None
    sure = sure_saving(best.step_seconds, configured.step_seconds)
    sure_share = sure / s_per_it if s_per_it else None
    speedup = base.median / fastest.median if fastest.median > 0 else math.inf
    share_text = f", {share:.1%} of s/it" if share is not None else ""
    evidence: dict[str, Any] = {
        "configured": configured.optimizer,
        "configured_step_ms": _ms(base.median),
        "configured_step_ms_iqr": [_ms(base.q1), _ms(base.q3)],
        "fastest": best.optimizer,
        "fastest_step_ms": _ms(fastest.median),
        "fastest_step_ms_iqr": [_ms(fastest.q1), _ms(fastest.q3)],
        "saving_ms_per_step": _ms(saving),
        "speedup": round(speedup, 2) if math.isfinite(speedup) else None,
        "s_per_it": s_per_it,
        "implied_s_per_it": best.implied_s_per_it,
        "table": [
            {"optimizer": r.optimizer, "step_ms_median": _ms(r.stats.median)}
            for r in rows
            if r.step_seconds and not r.error
        ],
    }
    if share is not None:
        evidence["share_of_s_per_it"] = round(share, 4)
    evidence["saving_ms_per_step_low"] = _ms(sure)
    evidence["saving_interval_confidence"] = 1 - SAVING_SIGNIFICANCE
    if sure_share is not None:
        evidence["share_of_s_per_it_low"] = round(sure_share, 4)
    return Finding(
        id="optimizer.slower_than_alternative",
        category="optimizer",
        severity=_severity_for_share(sure_share),
        title=(
            f"optimizer.step() takes {base.median * 1e3:.1f} ms with {configured.optimizer}; "
            f"{best.optimizer} takes {fastest.median * 1e3:.1f} ms here "
            f"({speedup:.1f}x faster{share_text})"
        ),
        evidence=evidence,
        est_seconds_saved_per_it=saving,
        saving_basis="measured",
        fix="Switch to " + SWITCH_FLAGS.get(best.key, best.optimizer) + ".",
        detail=(
            "Each optimizer stepped the same LoRA parameters with the same real gradients "
            "(median of repeated device-synchronised step() calls). The saving assumes one "
            "optimizer step per iteration (divide by the gradient-accumulation steps if you "
            "accumulate). AdamW and AdamW8bit are the same algorithm; Adafactor is not. The "
            f"severity is judged on the saving the A/B is {1 - SAVING_SIGNIFICANCE:.0%} sure of "
            f"({sure * 1e3:.2f} ms, the low end of its confidence interval), so that it "
            "does not flip between runs of the same setup."
        ),
    )


# --------------------------------------------------------------------------------------------
# Optimizer state: bytes by dtype, and the 8-bit split (pure)


def _unique_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every state tensor, each storage once (bitsandbytes shares its maps)."""
    seen: set[tuple[int, int]] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
            if ident in seen and value.untyped_storage().data_ptr() != 0:
                continue
            seen.add(ident)
            yield key, value


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def state_bytes_by_dtype(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state tensors by dtype ("float32", "uint8", ...)."""
    totals: dict[str, int] = {}
    for _, tensor in _unique_state_tensors(optimizer):
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + _tensor_bytes(tensor)
    return dict(sorted(totals.items()))


@dataclass
class EightBitSplit:
    """How much of a bitsandbytes 8-bit optimizer's state is 8-bit, and what it saves."""

    optimizer: str = ""
    min_8bit_size: int | None = None
    tensors_8bit: int = 0
    tensors_fp32: int = 0
    tensors_without_state: int = 0
    elements_8bit: int = 0
    elements_fp32: int = 0
    #: uint8 moments.
    bytes_8bit: int = 0
    #: Block scales (absmax) and the shared code maps of the 8-bit tensors.
    bytes_8bit_overhead: int = 0
    #: fp32 moments of the tensors below min_8bit_size.
    bytes_fp32: int = 0
    smallest_tensor: int = 0
    largest_tensor: int = 0
    #: What torch AdamW would keep for the same tensors: two moments in the parameter dtype.
    adamw_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes_8bit + self.bytes_8bit_overhead + self.bytes_fp32

    @property
    def fp32_share(self) -> float:
        total = self.total_bytes
        return self.bytes_fp32 / total if total else 0.0

    @property
    def saved_bytes(self) -> int:
        return self.adamw_bytes - self.total_bytes

    @property
    def saved_share(self) -> float:
        return self.saved_bytes / self.adamw_bytes if self.adamw_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            total_bytes=self.total_bytes,
            fp32_share=round(self.fp32_share, 4),
            saved_bytes_vs_adamw=self.saved_bytes,
            saved_share_vs_adamw=round(self.saved_share, 4),
        )
        return out


def is_bnb_8bit(optimizer: object) -> bool:
    """A bitsandbytes optimizer configured for 8-bit state (AdamW8bit, PagedAdamW8bit, ...)."""
    args = getattr(optimizer, "args", None)
    return type(optimizer).__module__.startswith("bitsandbytes") and (
        getattr(args, "optim_bits", None) == 8
    )


def eight_bit_split(optimizer: torch.optim.Optimizer) -> EightBitSplit | None:
    """The byte split of a bitsandbytes 8-bit optimizer's state (None for other optimizers).

    Read from the state itself, so it says what the optimizer did after at least one step;
    parameters it has not stepped yet are counted in ``tensors_without_state``.
    """
    if not is_bnb_8bit(optimizer):
        return None
    args = getattr(optimizer, "args", None)
    minimum = getattr(args, "min_8bit_size", None)
    split = EightBitSplit(
        optimizer=optimizer_label(optimizer),
        min_8bit_size=int(minimum) if isinstance(minimum, int) else None,
    )
    sizes: list[int] = []
    shared_maps: dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            sizes.append(param.numel())
            state = optimizer.state.get(param) or {}
            split.adamw_bytes += 2 * _tensor_bytes(param)
            first = state.get("state1")
            if not isinstance(first, torch.Tensor):
                split.tensors_without_state += 1
                continue
            moments = [
                state[k] for k in ("state1", "state2") if isinstance(state.get(k), torch.Tensor)
            ]
            moment_bytes = sum(_tensor_bytes(t) for t in moments)
            if first.dtype == torch.uint8:
                split.tensors_8bit += 1
                split.elements_8bit += param.numel()
                split.bytes_8bit += moment_bytes
                for key in ("absmax1", "absmax2"):
                    value = state.get(key)
                    if isinstance(value, torch.Tensor):
                        split.bytes_8bit_overhead += _tensor_bytes(value)
                for key in ("qmap1", "qmap2"):
                    value = state.get(key)
                    if isinstance(value, torch.Tensor):
                        shared_maps[value.untyped_storage().data_ptr()] = _tensor_bytes(value)
            else:
                split.tensors_fp32 += 1
                split.elements_fp32 += param.numel()
                split.bytes_fp32 += moment_bytes
    split.bytes_8bit_overhead += sum(shared_maps.values())
    if sizes:
        split.smallest_tensor = min(sizes)
        split.largest_tensor = max(sizes)
    return split


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"


def eight_bit_rule(split: EightBitSplit | None) -> Finding | None:
    """``optimizer.8bit_state_mostly_fp32`` when most of the 8-bit optimizer's state is fp32."""
    if split is None or split.total_bytes == 0 or split.fp32_share < FP32_SHARE_INFO:
        return None
    severity: Severity = "warn" if split.fp32_share >= FP32_SHARE_WARN else "info"
    minimum = split.min_8bit_size if split.min_8bit_size is not None else BNB_DEFAULT_MIN_8BIT_SIZE
    suggested = max(1, split.smallest_tensor)
    return Finding(
        id="optimizer.8bit_state_mostly_fp32",
        category="optimizer",
        severity=severity,
        title=(
            f"{split.optimizer} keeps {split.fp32_share:.0%} of its state in fp32: "
            f"{split.tensors_fp32} of {split.tensors_fp32 + split.tensors_8bit} LoRA tensors are "
            f"below min_8bit_size={minimum}; it saves {_mib(split.saved_bytes)} "
            f"({split.saved_share:.0%}) against AdamW"
        ),
        evidence={
            **split.to_dict(),
            "bytes_by_kind": {
                "uint8 moments": split.bytes_8bit,
                "block scales and code maps": split.bytes_8bit_overhead,
                "fp32 moments (below min_8bit_size)": split.bytes_fp32,
            },
        },
        est_seconds_saved_per_it=None,
        saving_basis="none",
        fix=(
            f"Quantise the LoRA tensors too with min_8bit_size={suggested} (the smallest LoRA "
            f"tensor): bnb.optim.AdamW8bit(params, min_8bit_size={suggested}); kohya: "
            f'`--optimizer_args "min_8bit_size={suggested}"`. Or use plain AdamW (kohya '
            "`--optimizer_type AdamW`; diffusers: drop `--use_8bit_adam`; OneTrainer: ADAMW): "
            "the memory at stake is small and AdamW has no 8-bit overhead."
        ),
        detail=(
            "bitsandbytes' 8-bit optimizers give fp32 state to every tensor with fewer than "
            "min_8bit_size elements (4096 by default). A small-rank LoRA is made of such "
            "tensors (rank x width), so the '8-bit' optimizer mostly runs its fp32 path and "
            "keeps the memory of AdamW, while still paying the per-tensor overhead of its "
            "Python step loop."
        ),
    )


# --------------------------------------------------------------------------------------------
# Identifying optimizers


def optimizer_key(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """A short name for the kind of optimizer, matching the A/B candidates' keys."""
    cls = type(optimizer)
    module = cls.__module__
    if module.startswith("torch.optim") and cls.__name__ == "AdamW":
        defaults = optimizer.defaults
        if defaults.get("fused"):
            return "adamw-fused"
        foreach = defaults.get("foreach")
        if foreach or (foreach is None and device.type == "cuda"):
            return "adamw-foreach"
        return "adamw-single"
    if is_bnb_8bit(optimizer) and "AdamW" in cls.__name__:
        return "adamw8bit-paged" if getattr(optimizer, "is_paged", False) else "adamw8bit"
    if module.startswith("transformers") and cls.__name__ == "Adafactor":
        return "adafactor"
    return f"custom:{cls.__name__}"


_LABELS = {
    "adamw-fused": "torch AdamW (fused)",
    "adamw-foreach": "torch AdamW (foreach)",
    "adamw-single": "torch AdamW (for-loop)",
    "adamw8bit": "bitsandbytes AdamW8bit",
    "adamw8bit-paged": "bitsandbytes PagedAdamW8bit",
    "adafactor": "transformers Adafactor",
}


def optimizer_label(optimizer: torch.optim.Optimizer, device: torch.device | None = None) -> str:
    key = optimizer_key(optimizer, device or torch.device("cpu"))
    return _LABELS.get(key, f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")


def describe_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """The configured optimizer's class, hyper-parameters and 8-bit settings."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    described: dict[str, Any] = {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "key": optimizer_key(optimizer, device),
        "label": optimizer_label(optimizer, device),
        "param_groups": len(optimizer.param_groups),
        "tensors": len(params),
        "elements": sum(p.numel() for p in params),
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
    }
    for name in ("lr", "betas", "eps", "weight_decay", "foreach", "fused"):
        value = group.get(name)
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else None
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, list)):
            described[name] = value
    args = getattr(optimizer, "args", None)
    if type(optimizer).__module__.startswith("bitsandbytes") and args is not None:
        described["optim_bits"] = getattr(args, "optim_bits", None)
        described["min_8bit_size"] = getattr(args, "min_8bit_size", None)
        described["is_paged"] = bool(getattr(optimizer, "is_paged", False))
    return described


# --------------------------------------------------------------------------------------------
# bitsandbytes inventory


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def bitsandbytes_inventory(printed_at_import: str | None = None) -> dict[str, Any]:
    """Version, backend, native library and import messages of bitsandbytes.

    ``printed_at_import`` is what the run's inventory captured when it imported bitsandbytes
    (this process can capture it only when it is the first to import it).
    """
    info: dict[str, Any] = {"installed": False, "imports": False}
    try:
        # find_spec answers from sys.modules when it is imported (None there: blocked).
        present = importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        present = False
    if not present:
        info["reason"] = "bitsandbytes is not installed"
        return info
    info["installed"] = True
    already = "bitsandbytes" in sys.modules
    info["imported_before_probe"] = already
    module: Any = None
    with warnings.catch_warnings(record=True) as caught, capture_output() as captured:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module("bitsandbytes")
        except Exception as exc:  # a broken build may raise anything at import
            info["error"] = f"{type(exc).__name__}: {_first_line(str(exc))}"
    printed = [line for line in captured.text.splitlines() if line.strip()]
    printed += [f"{w.category.__name__}: {w.message}" for w in caught]
    if already and printed_at_import:
        printed = [line for line in printed_at_import.splitlines() if line.strip()] + printed
    info["import_messages"] = list(dict.fromkeys(printed))[:20]
    if module is None:
        info["reason"] = info.get("error", "bitsandbytes did not import")
        return info
    info["imports"] = True
    info["version"] = str(getattr(module, "__version__", ""))
    info["torch_build"] = (
        f"rocm {torch.version.hip}"
        if torch.version.hip
        else (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu")
    )
    cext = sys.modules.get("bitsandbytes.cextension")
    if cext is not None:
        info["backend"] = str(getattr(cext, "BNB_BACKEND", ""))
        info["hip_environment"] = bool(getattr(cext, "HIP_ENVIRONMENT", False))
        info["rocm_gpu_arch"] = str(getattr(cext, "ROCM_GPU_ARCH", ""))
        info["native_library"] = _native_library(getattr(cext, "lib", None))
    info["kernels"] = _registered_kernels()
    return info


def _native_library(lib: object) -> dict[str, Any]:
    """Which native library bitsandbytes loaded, or why none loaded."""
    if lib is None:
        return {"loaded": False}
    kind = type(lib).__name__
    if "Mock" in kind or "ErrorHandler" in kind:
        # The stand-in bitsandbytes installs when its library did not load: calls raise later.
        error = lib.__dict__.get("error_msg", "")
        return {"loaded": False, "class": kind, "error": _first_line(str(error))}
    handle = lib.__dict__.get("_lib")
    return {
        "loaded": True,
        "class": kind,
        "path": str(getattr(handle, "_name", "") or ""),
        "compiled_with_cuda": bool(getattr(type(lib), "compiled_with_cuda", False)),
    }


def _registered_kernels() -> dict[str, list[str]]:
    """Dispatch keys with a kernel for bitsandbytes' optimizer ops (private torch API: guarded)."""
    found: dict[str, list[str]] = {}
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is None:
        return found
    for op in ("optimizer_update_8bit_blockwise", "optimizer_update_32bit"):
        keys = []
        for key in ("CPU", "CUDA", "XPU", "MPS"):
            with contextlib.suppress(Exception):
                if has_kernel(f"bitsandbytes::{op}", key):
                    keys.append(key)
        found[op] = keys
    return found


# --------------------------------------------------------------------------------------------
# Real gradients, and putting the workload back


class _GradientCatcher(torch.optim.Optimizer):
    """Stands in for the workload's optimizer for one step: keeps the gradients, updates nothing."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})
        self.caught: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.caught = [
            None if p.grad is None else p.grad.detach().clone()
            for group in self.param_groups
            for p in group["params"]
        ]


def real_gradients(
    workload: Any, params: list[torch.nn.Parameter], sync: Callable[[], None]
) -> tuple[list[torch.Tensor | None], str]:
    """Gradients of ``params`` from a real forward and backward (cloned), and where they came from.

    Gradients already present (a workload stepped without zero_grad) are used as they are;
    otherwise one training step runs on the next batch with the optimizer swapped for a catcher
    that updates nothing, so parameters and optimizer state stay untouched. The GradScaler's
    state is put back.
    """
    if params and all(p.grad is not None for p in params):
        return [p.grad.detach().clone() for p in params if p.grad is not None], "present"
    optimizer = workload.optimizer
    scaler = getattr(workload, "scaler", None)
    scaler_state = scaler.state_dict() if scaler is not None else {}
    catcher = _GradientCatcher(params)
    workload.optimizer = catcher
    try:
        batches = workload.batches()
        for _ in range(GRADIENT_TRIES):
            workload.step(next(batches), PhaseTimer(sync))
            if catcher.caught is not None:
                break
    finally:
        workload.optimizer = optimizer
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        for p in params:
            p.grad = None
    if catcher.caught is None:
        raise ProbeSkipped(f"no finite gradients in {GRADIENT_TRIES} training steps")
    return catcher.caught, "one forward+backward on the next batch"


# --------------------------------------------------------------------------------------------
# Measuring one optimizer


def time_steps(
    step: Callable[[], object],
    sync: Callable[[], None],
    *,
    min_calls: int = MIN_CALLS,
    max_calls: int = MAX_CALLS,
    budget_s: float = TIME_BUDGET_S,
) -> list[float]:
    """Device-synchronised seconds of repeated ``step()`` calls."""
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_calls and (
        len(samples) < min_calls or time.perf_counter() - started < budget_s
    ):
        sync()
        begin = time.perf_counter()
        step()
        sync()
        samples.append(time.perf_counter() - begin)
    return samples


def profile_steps(
    step: Callable[[], object], sync: Callable[[], None], device: torch.device, calls: int
) -> list[ProfiledEvent]:
    """The profiler's events over ``calls`` step calls, each inside :data:`PROBE_STEP_SPAN`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with native_stderr_filtered(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            with torch.profiler.record_function(PROBE_STEP_SPAN):
                step()
            sync()
    return [
        ProfiledEvent(
            name=e.name,
            start_us=float(e.time_range.start),
            end_us=float(e.time_range.end),
            thread=int(e.thread),
        )
        for e in prof.events()
    ]


def sync_debug_warnings(step: Callable[[], object], calls: int) -> list[dict[str, Any]]:
    """Warnings of ``torch.cuda.set_sync_debug_mode("warn")`` over ``calls`` steps, with stacks.

    GPU only. The previous mode is restored whatever happens.
    """
    caught: list[dict[str, Any]] = []

    def keep(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        caught.append(
            {
                "message": _first_line(str(message)),
                "where": f"{filename}:{lineno}",
                "stack": traceback.format_stack(limit=10)[:-1],
            }
        )

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return caught


@dataclass
class _Measured:
    row: ABRow
    syncs: StepSyncs
    debug_warnings: list[dict[str, Any]] = field(default_factory=list)


def _warning_texts(caught: Sequence[warnings.WarningMessage], printed: str) -> list[str]:
    lines = [f"{w.category.__name__}: {_first_line(str(w.message))}" for w in caught]
    lines += [line for line in printed.splitlines() if line.strip()]
    return list(dict.fromkeys(lines))[:10]


def _leaf_copies(
    params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]
) -> list[torch.nn.Parameter]:
    leaves = []
    for param, grad in zip(params, grads, strict=True):
        leaf = torch.nn.Parameter(param.detach().clone(), requires_grad=True)
        leaf.grad = None if grad is None else grad.clone()
        leaves.append(leaf)
    return leaves


def _adamw_factory(**options: Any) -> Callable[[list[torch.nn.Parameter], float], Any]:
    def make(params: list[torch.nn.Parameter], lr: float) -> Any:
        return torch.optim.AdamW(params, lr=lr, **options)

    return make


def _adamw8bit(params: list[torch.nn.Parameter], lr: float) -> Any:
    import bitsandbytes

    return getattr(bitsandbytes.optim, "AdamW8bit")(params, lr=lr)  # noqa: B009 - untyped


def _adafactor(params: list[torch.nn.Parameter], lr: float) -> Any:
    from transformers.optimization import Adafactor

    adafactor: Any = Adafactor  # untyped constructor
    # Fixed learning rate, as kohya's and OneTrainer's LoRA presets set it.
    return adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


@dataclass(frozen=True)
class Candidate:
    """An optimizer the A/B tries: ``make(params, lr)`` builds it the way trainers do."""

    key: str
    label: str
    make: Callable[[list[torch.nn.Parameter], float], Any]
    #: Import name it needs (skipped with the reason when it does not import).
    needs: str = ""


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("adamw-foreach", _LABELS["adamw-foreach"], _adamw_factory(foreach=True)),
    Candidate("adamw-fused", _LABELS["adamw-fused"], _adamw_factory(fused=True)),
    Candidate("adamw8bit", _LABELS["adamw8bit"], _adamw8bit, needs="bitsandbytes"),
    Candidate("adafactor", _LABELS["adafactor"], _adafactor, needs="transformers"),
)


# --------------------------------------------------------------------------------------------
# The probe


def _positive(value: float) -> float | None:
    return value if math.isfinite(value) and value > 0 else None


def _hyper_from(optimizer: torch.optim.Optimizer) -> AdamHyper:
    """AdamW hyper-parameters for the numerics check: the configured ones where it has them."""
    hyper = AdamHyper()
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        lr = float(lr.item())
    if isinstance(lr, (int, float)) and lr > 0:
        hyper.lr = float(lr)
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) >= 2:
        hyper.beta1, hyper.beta2 = float(betas[0]), float(betas[1])
    eps = group.get("eps")
    if isinstance(eps, (int, float)) and eps > 0:
        hyper.eps = float(eps)
    decay = group.get("weight_decay")
    if isinstance(decay, (int, float)) and decay >= 0:
        hyper.weight_decay = float(decay)
    return hyper


class OptimizerProbe:
    """Times the optimizer step, finds syncs in it, compares optimizers, checks 8-bit numerics."""

    name = "optimizer"
    description = (
        "optimizer.step() time and host syncs; A/B against AdamW, AdamW8bit and Adafactor; "
        "how much of 8-bit state is 8-bit; AdamW8bit numerics"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        candidates: Sequence[Candidate] = CANDIDATES,
        min_calls: int = MIN_CALLS,
        max_calls: int = MAX_CALLS,
        budget_s: float = TIME_BUDGET_S,
        profiled_calls: int = PROFILED_CALLS,
        numerics: bool = True,
        numerics_tensors: int = MAX_NUMERICS_TENSORS,
    ) -> None:
        self.candidates = tuple(candidates)
        self.min_calls = min_calls
        self.max_calls = max_calls
        self.budget_s = budget_s
        self.profiled_calls = profiled_calls
        self.numerics = numerics
        self.numerics_tensors = numerics_tensors

    # ---------------------------------------------------------------- measuring

    def _measure(
        self,
        optimizer: Any,
        *,
        key: str,
        label: str,
        configured: bool,
        device: torch.device,
        sync: Callable[[], None],
        warnings_seen: list[str],
    ) -> _Measured:
        row = ABRow(optimizer=label, key=key, configured=configured, warnings=warnings_seen)

        def step() -> None:
            optimizer.step()

        # The first call initialises a fresh optimizer's state; it is not a sample.
        with warnings.catch_warnings(record=True) as caught, capture_output() as printed:
            warnings.simplefilter("always")
            step()
            sync()
        row.warnings = list(dict.fromkeys(warnings_seen + _warning_texts(caught, printed.text)))
        row.state_bytes = state_bytes_by_dtype(optimizer)
        row.step_seconds = time_steps(
            step, sync, min_calls=self.min_calls, max_calls=self.max_calls, budget_s=self.budget_s
        )
        syncs = count_step_syncs(profile_steps(step, sync, device, self.profiled_calls))
        row.host_syncs_per_step = syncs.per_step(syncs.host_syncs)
        row.scalar_reads_per_step = syncs.per_step(syncs.scalar_reads)
        debug: list[dict[str, Any]] = []
        if configured and device.type == "cuda":
            debug = sync_debug_warnings(step, SYNC_DEBUG_CALLS)
            sync()
        return _Measured(row=row, syncs=syncs, debug_warnings=debug)

    def _measure_candidate(
        self,
        candidate: Candidate,
        params: Sequence[torch.nn.Parameter],
        grads: Sequence[torch.Tensor | None],
        lr: float,
        device: torch.device,
        sync: Callable[[], None],
        available: dict[str, str],
    ) -> tuple[ABRow, Any]:
        """One alternative on copies of the parameters and gradients; (row, the optimizer)."""
        if candidate.needs and available.get(candidate.needs):
            return ABRow(candidate.label, candidate.key, error=available[candidate.needs]), None
        leaves = _leaf_copies(params, grads)
        with warnings.catch_warnings(record=True) as caught, capture_output() as printed:
            warnings.simplefilter("always")
            try:
                optimizer = candidate.make(leaves, lr)
            except Exception as exc:
                error = f"not available here: {type(exc).__name__}: {_first_line(str(exc))}"
                return ABRow(candidate.label, candidate.key, error=error), None
        seen = _warning_texts(caught, printed.text)
        try:
            measured = self._measure(
                optimizer,
                key=candidate.key,
                label=candidate.label,
                configured=False,
                device=device,
                sync=sync,
                warnings_seen=seen,
            )
        except Exception as exc:  # e.g. fused AdamW refusing this device or dtype at step time
            error = f"step failed: {type(exc).__name__}: {_first_line(str(exc))}"
            return ABRow(candidate.label, candidate.key, warnings=seen, error=error), None
        return measured.row, optimizer

    # ---------------------------------------------------------------- the run

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped("no training workload (trace mode)")
        optimizer: torch.optim.Optimizer = workload.optimizer
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ProbeSkipped("the optimizer holds no trainable parameter")
        device = ctx.device
        device_kind = ctx.device_info.kind or device.type
        sync = device_synchronizer(device)
        say = ctx.progress
        result = ProbeResult()
        data: dict[str, Any] = result.data

        # 1. Inventory.
        packages = ctx.record.inventory.get("packages", {}) if ctx.record.inventory else {}
        printed = (packages.get("bitsandbytes") or {}).get("printed") if packages else None
        bnb = bitsandbytes_inventory(printed if isinstance(printed, str) else None)
        configured_key = optimizer_key(optimizer, device)
        configured_label = optimizer_label(optimizer, device)
        data["inventory"] = {
            "bitsandbytes": bnb,
            "configured_optimizer": describe_optimizer(optimizer, device),
        }
        available: dict[str, str] = {}
        not_checked: list[str] = data.setdefault("not_checked", [])
        if not bnb.get("imports"):
            reason = str(bnb.get("reason", "no bitsandbytes"))
            available["bitsandbytes"] = "skipped: " + reason
            not_checked.append(f"AdamW8bit A/B, 8-bit state split and numerics: {reason}")
        try:
            importlib.import_module("transformers.optimization")
        except Exception as exc:
            available["transformers"] = f"skipped: transformers: {_first_line(str(exc))}"
            not_checked.append(f"Adafactor A/B: {available['transformers']}")

        # Real gradients for everything below.
        say("optimizer: gradients from one real backward")
        grads, source = real_gradients(workload, params, sync)
        data["gradients"] = {
            "source": source,
            "tensors": sum(g is not None for g in grads),
            "elements": sum(g.numel() for g in grads if g is not None),
        }
        s_per_it = _positive(ctx.record.timing.headline.median)
        phase = ctx.record.breakdown.seconds.get("optimizer") if ctx.record.breakdown else None

        # 2. The configured optimizer's step, on the real parameters (put back afterwards).
        say(f"optimizer: timing {configured_label}")
        split: EightBitSplit | None = None
        snapshot = workload.snapshot()
        try:
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param.grad = None if grad is None else grad.clone()
            measured = self._measure(
                optimizer,
                key=configured_key,
                label=configured_label,
                configured=True,
                device=device,
                sync=sync,
                warnings_seen=[],
            )
            split = eight_bit_split(optimizer)
        finally:
            snapshot.restore()
        configured_row = measured.row
        configured_step = _positive(configured_row.stats.median)
        configured_row.implied_s_per_it = s_per_it
        syncs = measured.syncs
        data["configured"] = {
            "optimizer": configured_label,
            "key": configured_key,
            "step_ms_median": _ms(configured_row.stats.median),
            "step_ms_iqr": _ms(configured_row.stats.iqr),
            "samples": configured_row.stats.n,
            "s_per_it": s_per_it,
            "share_of_s_per_it": (
                configured_step / s_per_it if configured_step and s_per_it else None
            ),
            "optimizer_phase_seconds": phase,
            "syncs": {
                **asdict(syncs),
                "host_syncs_per_step": syncs.per_step(syncs.host_syncs),
                "scalar_reads_per_step": syncs.per_step(syncs.scalar_reads),
            },
            "sync_debug_warnings": measured.debug_warnings[:10],
            "sync_debug_warning_count": len(measured.debug_warnings),
        }
        sync_finding = host_sync_rule(
            syncs,
            device_kind=device_kind,
            optimizer_label=configured_label,
            step_seconds=configured_step,
            s_per_it=s_per_it,
            debug_warnings=len(measured.debug_warnings),
        )
        if sync_finding is not None:
            result.findings.append(sync_finding)
        elif device_kind == "cpu":
            reads = syncs.per_step(syncs.scalar_reads)
            result.checked_ok.append(
                f"{configured_label}: no device to wait for on the CPU"
                + (
                    f"; its {reads:.0f} .item() reads per step are host reads, not stalls"
                    if reads
                    else "; no .item() reads in its step"
                )
            )
        else:
            result.checked_ok.append(
                f"{configured_label}: no host-device synchronisation inside optimizer.step()"
            )

        # 3. A/B on copies of the same parameters and gradients.
        rows = [configured_row]
        eight_bit_candidate: Any = None
        lr = _hyper_from(optimizer).lr
        for candidate in self.candidates:
            if candidate.key == configured_key:
                continue
            say(f"optimizer: timing {candidate.label}")
            row, stepped = self._measure_candidate(
                candidate, params, grads, lr, device, sync, available
            )
            row.implied_s_per_it = implied_s_per_it(
                s_per_it, configured_step, _positive(row.stats.median)
            )
            rows.append(row)
            if candidate.key == "adamw8bit" and stepped is not None:
                eight_bit_candidate = stepped
            del stepped
        data["ab"] = {
            "rows": [r.to_dict() for r in rows],
            "implied_s_per_it_basis": (
                "derived: the run's median s/it minus the configured optimizer's measured step "
                "plus this optimizer's measured step"
            ),
            "margins": {
                "min_relative_gain": MIN_RELATIVE_GAIN,
                "min_absolute_gain_ms": MIN_ABSOLUTE_GAIN_S * 1e3,
                "quartiles_must_not_overlap": True,
            },
        }
        bnb_warnings = [w for r in rows if "8bit" in r.key for w in r.warnings]
        bnb["construction_warnings"] = list(dict.fromkeys(bnb_warnings))
        slower = slower_than_alternative_rule(rows, s_per_it)
        faster = clearly_faster(rows)
        if slower is not None:
            result.findings.append(slower)
        elif faster is not None and configured_step is not None:
            saving = configured_step - faster.stats.median
            result.checked_ok.append(
                f"{configured_label}: {faster.optimizer} steps {saving * 1e3:.1f} ms faster "
                f"here, under {MIN_SHARE_OF_S_PER_IT:.0%} of s/it: not worth a switch"
            )
        elif len([r for r in rows if r.step_seconds]) > 1:
            result.checked_ok.append(
                f"{configured_label}: no other optimizer's step was clearly faster here"
            )

        # 4. Is 8-bit really 8-bit?
        if split is None and eight_bit_candidate is not None:
            candidate_split = eight_bit_split(eight_bit_candidate)
            data["eight_bit"] = {
                "of": "the A/B's AdamW8bit (not the configured optimizer)",
                **(candidate_split.to_dict() if candidate_split else {}),
            }
        elif split is not None:
            data["eight_bit"] = {"of": "the configured optimizer", **split.to_dict()}
            finding = eight_bit_rule(split)
            if finding is not None:
                result.findings.append(finding)
            else:
                result.checked_ok.append(
                    f"{split.optimizer}: {1 - split.fp32_share:.0%} of its state is 8-bit "
                    f"(saves {_mib(split.saved_bytes)} against AdamW)"
                )
        else:
            data["eight_bit"] = {"skipped": available.get("bitsandbytes", "no 8-bit optimizer")}
        del eight_bit_candidate

        # 5. Numerics of this build's 8-bit update.
        if not self.numerics:
            data["numerics"] = {"skipped": "turned off"}
        elif "bitsandbytes" in available:
            data["numerics"] = {"skipped": available["bitsandbytes"]}
        else:
            say("optimizer: 8-bit numerics")
            try:
                report: NumericsReport = run_numerics(
                    params,
                    grads,
                    hyper=_hyper_from(optimizer),
                    device=device,
                    max_tensors=self.numerics_tensors,
                )
            except Exception as exc:  # a broken native library raises at call time
                data["numerics"] = {
                    "error": f"{type(exc).__name__}: {_first_line(str(exc))}",
                }
                result.findings.append(_numerics_failed(exc, configured_8bit=split is not None))
            else:
                data["numerics"] = report.to_dict()
                finding = numerics_rule(report.stats)
                if finding is not None:
                    result.findings.append(finding)
                elif report.stats.elements:
                    result.checked_ok.append(
                        f"AdamW8bit numerics: {report.stats.elements} elements of one update "
                        "within the 8-bit quantisation bound of fp32 AdamW (mean relative error "
                        f"{report.stats.rel_error_mean:.2%})"
                    )
        return result


def _numerics_failed(exc: BaseException, *, configured_8bit: bool) -> Finding:
    """AdamW8bit raised instead of stepping: fatal for a run that uses it, a warning otherwise."""
    return Finding(
        id="optimizer.8bit_numerics",
        category="optimizer",
        severity="critical" if configured_8bit else "warn",
        title=f"AdamW8bit cannot step on this build: {type(exc).__name__}",
        evidence={"error": _first_line(str(exc))},
        fix=(
            "Install a bitsandbytes build made for this device (on ROCm: the wheel for your ROCm "
            "version), or train with plain AdamW (kohya `--optimizer_type AdamW`; diffusers: drop "
            "`--use_8bit_adam`)."
        ),
        detail="Two AdamW8bit steps on copies of the LoRA tensors raised instead of updating.",
    )


__all__ = [
    "CANDIDATES",
    "ABRow",
    "Candidate",
    "EightBitSplit",
    "OptimizerProbe",
    "ProfiledEvent",
    "StepSyncs",
    "bitsandbytes_inventory",
    "clearly_faster",
    "count_step_syncs",
    "describe_optimizer",
    "eight_bit_rule",
    "eight_bit_split",
    "host_sync_rule",
    "implied_s_per_it",
    "is_bnb_8bit",
    "optimizer_key",
    "optimizer_label",
    "profile_steps",
    "real_gradients",
    "slower_than_alternative_rule",
    "state_bytes_by_dtype",
    "sync_debug_warnings",
    "time_steps",
]
