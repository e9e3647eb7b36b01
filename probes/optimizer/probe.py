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
   (:mod:`diagnose.probes.optimizer.numerics`).

Each step is a module of its own: :mod:`~diagnose.probes.optimizer.syncs` (what the step waits
for), :mod:`~diagnose.probes.optimizer.ab` (the A/B and its rule),
:mod:`~diagnose.probes.optimizer.inventory` (what the optimizer is and holds),
:mod:`~diagnose.probes.optimizer.verdict` (what the measurements mean); this one runs them on the
workload. Findings are built by :mod:`diagnose.catalogs.optimizer_catalog`, which words
them in the trainers' vocabulary and never proposes the optimizer the run already uses. A
finding that quotes the optimizer's time quotes the record's optimizer phase (the phase bar).

The workload is left as found: the configured optimizer's state, the parameters, the gradients,
the GradScaler and the sync debug mode are put back. Only its data iterator moves on by one
batch (the gradients come from a real step on the next batch).
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.errors import first_line
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.budgets import budget_spent
from diagnose.probes.optimizer.ab import (
    CANDIDATES,
    MAX_CALLS,
    MIN_CALLS,
    TIME_BUDGET_S,
    ABRow,
    Candidate,
    clearly_faster_alternative,
    implied_s_per_it,
    leaf_copies,
    slower_than_alternative_rule,
    time_steps,
    warning_texts,
)
from diagnose.probes.optimizer.inventory import (
    EightBitSplit,
    bitsandbytes_inventory,
    describe_optimizer,
    eight_bit_rule,
    eight_bit_split,
    is_bnb_8bit,
    optimizer_key,
    optimizer_label,
    state_bytes_by_dtype,
)
from diagnose.probes.optimizer.numerics import (
    MAX_NUMERICS_TENSORS,
    AdamHyper,
    NumericsReport,
    run_numerics,
)
from diagnose.probes.optimizer.syncs import (
    ProfiledEvent,
    StepSyncs,
    count_step_syncs,
    profile_steps,
    sync_debug_warnings,
    sync_in_step_finding,
)
from diagnose.probes.optimizer.verdict import (
    NUMERICS,
    STATE_FP32,
    SYNC,
    judge_ab,
    judge_numerics,
    judge_syncs,
    numerics_failed,
    shrunk_model_artefact,
    trace_finding,
)
from diagnose.quiet import capture_output
from diagnose.record import ProbeResult
from diagnose.timing import PhaseTimer, device_synchronizer
from diagnose.units import ms_value
from diagnose.workload.untouched import GradientCatcher, steps_without_update

#: Calls recorded by the profiler per optimizer (after the timed ones).
PROFILED_CALLS = 3
#: Calls run with torch.cuda.set_sync_debug_mode("warn") (GPU only).
SYNC_DEBUG_CALLS = 2
#: Tries at a finite gradient (an fp16 GradScaler may skip a step on inf/nan).
GRADIENT_TRIES = 3


# --------------------------------------------------------------------------------------------
# Real gradients


def real_gradients(
    workload: Any, params: list[torch.nn.Parameter], sync: Callable[[], None]
) -> tuple[list[torch.Tensor | None], str]:
    """Gradients of ``params`` from a real forward and backward (cloned), and where they came from.

    Gradients already present (a workload stepped without zero_grad) are used as they are;
    otherwise training steps run on the next batch without updating anything
    (:func:`~diagnose.workload.untouched.steps_without_update`), so the parameters, the
    optimizer state, the GradScaler and the random streams stay as they were.
    """
    if params and all(p.grad is not None for p in params):
        return [p.grad.detach().clone() for p in params if p.grad is not None], "present"
    with steps_without_update(workload, stand_in=GradientCatcher) as catcher:
        assert isinstance(catcher, GradientCatcher)
        batches = workload.batches()
        for _ in range(GRADIENT_TRIES):
            workload.step(next(batches), PhaseTimer(sync))
            if catcher.caught is not None:
                break
        caught = catcher.caught
    if caught is None:
        raise ProbeSkipped(f"no finite gradients in {GRADIENT_TRIES} training steps")
    # The catcher holds every parameter of the optimizer; the probe steps the trainable ones.
    by_param = dict(zip(_optimizer_params(workload.optimizer), caught, strict=True))
    return [by_param.get(p) for p in params], "one forward+backward on the next batch"


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class _Measured:
    row: ABRow
    #: None for an alternative on the CPU: there is no device to wait for, and only the
    #: configured optimizer's reads are judged.
    syncs: StepSyncs | None
    debug_warnings: list[dict[str, Any]] = field(default_factory=list)


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
        deadline: float | None = None,
    ) -> _Measured:
        row = ABRow(optimizer=label, key=key, configured=configured, warnings=warnings_seen)

        def step() -> None:
            optimizer.step()

        # The first call initialises a fresh optimizer's state; it is not a sample.
        with warnings.catch_warnings(record=True) as caught, capture_output() as printed:
            warnings.simplefilter("always")
            step()
            sync()
        row.warnings = list(dict.fromkeys(warnings_seen + warning_texts(caught, printed.text)))
        row.state_bytes = state_bytes_by_dtype(optimizer)
        row.step_seconds = time_steps(
            step,
            sync,
            min_calls=self.min_calls,
            max_calls=self.max_calls,
            budget_s=self.budget_s,
            deadline=deadline,
        )
        row.stopped_by_budget = len(row.step_seconds) < self.max_calls and budget_spent(deadline)
        syncs: StepSyncs | None = None
        if configured or device.type != "cpu":
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
        deadline: float | None = None,
    ) -> tuple[ABRow, Any]:
        """One alternative on copies of the parameters and gradients; (row, the optimizer)."""
        if candidate.needs and available.get(candidate.needs):
            return ABRow(candidate.label, candidate.key, error=available[candidate.needs]), None
        leaves = leaf_copies(params, grads)
        with warnings.catch_warnings(record=True) as caught, capture_output() as printed:
            warnings.simplefilter("always")
            try:
                optimizer = candidate.make(leaves, lr)
            except Exception as exc:
                error = f"not available here: {type(exc).__name__}: {first_line(str(exc))}"
                return ABRow(candidate.label, candidate.key, error=error), None
        seen = warning_texts(caught, printed.text)
        try:
            measured = self._measure(
                optimizer,
                key=candidate.key,
                label=candidate.label,
                configured=False,
                device=device,
                sync=sync,
                warnings_seen=seen,
                deadline=deadline,
            )
        except Exception as exc:  # e.g. fused AdamW refusing this device or dtype at step time
            error = f"step failed: {type(exc).__name__}: {first_line(str(exc))}"
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
        # What the run steps with, by what it is (fused and foreach AdamW differ): the object
        # the run built from --optimizer, so fixes never propose it.
        running = optimizer_key(optimizer, device)
        running_label = optimizer_label(optimizer, device)
        data["inventory"] = {
            "bitsandbytes": bnb,
            "configured_optimizer": describe_optimizer(optimizer, device),
            "configured_name": getattr(ctx.config, "optimizer", None),
        }
        available: dict[str, str] = {}
        if not bnb.get("imports"):
            available["bitsandbytes"] = "skipped: " + str(bnb.get("reason", "no bitsandbytes"))
        try:
            importlib.import_module("transformers.optimization")
        except Exception as exc:
            available["transformers"] = f"skipped: transformers: {first_line(str(exc))}"

        # Real gradients for everything below.
        say("optimizer: gradients from one real backward")
        grads, source = real_gradients(workload, params, sync)
        data["gradients"] = {
            "source": source,
            "tensors": sum(g is not None for g in grads),
            "elements": sum(g.numel() for g in grads if g is not None),
        }
        s_per_it = _positive(ctx.record.timing.headline.median)
        # The optimizer phase as the report's phase bar shows it: what findings quote.
        phase = (
            _positive(ctx.record.breakdown.seconds.get("optimizer", math.nan))
            if ctx.record.breakdown
            else None
        )

        # 2. The configured optimizer's step, on the real parameters (put back afterwards).
        say(f"optimizer: timing {running_label}")
        split: EightBitSplit | None = None
        snapshot = workload.snapshot()
        try:
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param.grad = None if grad is None else grad.clone()
            measured = self._measure(
                optimizer,
                key=running,
                label=running_label,
                configured=True,
                device=device,
                sync=sync,
                warnings_seen=[],
                deadline=ctx.deadline,
            )
            split = eight_bit_split(optimizer)
        finally:
            snapshot.restore()
        configured_row = measured.row
        configured_step = _positive(configured_row.stats.median)
        configured_row.implied_s_per_it = s_per_it
        syncs = measured.syncs
        assert syncs is not None  # the configured optimizer is always profiled
        data["configured"] = {
            "optimizer": running_label,
            "key": running,
            "step_ms_median": ms_value(configured_row.stats.median),
            "step_ms_iqr": ms_value(configured_row.stats.iqr),
            "samples": configured_row.stats.n,
            "s_per_it": s_per_it,
            "share_of_s_per_it": (
                configured_step / s_per_it if configured_step and s_per_it else None
            ),
            "optimizer_phase_seconds": phase,
            "timed_alone_vs_phase": (
                "step_ms_median is optimizer.step() timed alone on copies of the gradients; "
                "optimizer_phase_seconds is step() and zero_grad() inside the unprofiled "
                "training steps (the phase bar)"
            ),
            "syncs": {
                **asdict(syncs),
                "host_syncs_per_step": syncs.per_step(syncs.host_syncs),
                "scalar_reads_per_step": syncs.per_step(syncs.scalar_reads),
            },
            "sync_debug_warnings": measured.debug_warnings[:10],
            "sync_debug_warning_count": len(measured.debug_warnings),
        }

        # 3. A/B on copies of the same parameters and gradients.
        rows = [configured_row]
        eight_bit_candidate: Any = None
        lr = _hyper_from(optimizer).lr
        for candidate in self.candidates:
            if candidate.key == running:
                continue
            say(f"optimizer: timing {candidate.label}")
            row, stepped = self._measure_candidate(
                candidate, params, grads, lr, device, sync, available, ctx.deadline
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
                "min_relative_gain": catalog.MIN_RELATIVE_GAIN,
                "min_absolute_gain_ms": catalog.MIN_ABSOLUTE_GAIN_S * 1e3,
                "judged_on": "the low end of the saving's confidence interval",
            },
        }
        bnb_warnings = [w for r in rows if "8bit" in r.key for w in r.warnings]
        bnb["construction_warnings"] = list(dict.fromkeys(bnb_warnings))
        synchronising = judge_syncs(
            result,
            syncs,
            _positive(measured.row.stats.median),
            len(measured.debug_warnings),
            device_kind,
            running,
            running_label,
            phase,
            rows,
            trace_finding(ctx, SYNC),
        )
        judge_ab(result, rows, running_label, s_per_it, phase, synchronising)

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
            artefact = shrunk_model_artefact(ctx, split, data) if finding else None
            if artefact is not None:
                result.add_ok(STATE_FP32, artefact)
            elif finding is not None:
                result.add_finding(finding)
            else:
                result.add_ok(
                    STATE_FP32,
                    f"{split.optimizer}: {1 - split.fp32_share:.0%} of its state is 8-bit "
                    f"(saves {split.saved_bytes / 2**20:.2f} MiB against AdamW)",
                )
        else:
            data["eight_bit"] = {"skipped": available.get("bitsandbytes", "no 8-bit optimizer")}
        del eight_bit_candidate

        # 5. Numerics of this build's 8-bit update.
        self._judge_numerics(result, params, grads, optimizer, device, running, available, say)
        return result

    def _judge_numerics(
        self,
        result: ProbeResult,
        params: Sequence[torch.nn.Parameter],
        grads: Sequence[torch.Tensor | None],
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        running: str,
        available: dict[str, str],
        say: Callable[[str], None],
    ) -> None:
        data = result.data
        if not self.numerics:
            data["numerics"] = {"skipped": "turned off"}
            result.add_not_judged(NUMERICS, "AdamW8bit numerics: turned off")
            return
        if "bitsandbytes" in available:
            data["numerics"] = {"skipped": available["bitsandbytes"]}
            result.add_not_judged(NUMERICS, f"AdamW8bit numerics: {available['bitsandbytes']}")
            return
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
            data["numerics"] = {"error": f"{type(exc).__name__}: {first_line(str(exc))}"}
            result.add_finding(numerics_failed(exc, running=running))
            return
        data["numerics"] = report.to_dict()
        judge_numerics(result, report, running)


__all__ = [
    "CANDIDATES",
    "ABRow",
    "Candidate",
    "EightBitSplit",
    "OptimizerProbe",
    "ProfiledEvent",
    "StepSyncs",
    "bitsandbytes_inventory",
    "clearly_faster_alternative",
    "count_step_syncs",
    "describe_optimizer",
    "eight_bit_rule",
    "eight_bit_split",
    "implied_s_per_it",
    "is_bnb_8bit",
    "optimizer_key",
    "optimizer_label",
    "profile_steps",
    "real_gradients",
    "slower_than_alternative_rule",
    "state_bytes_by_dtype",
    "sync_debug_warnings",
    "sync_in_step_finding",
    "time_steps",
]
