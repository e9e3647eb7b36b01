"""The ``precision`` probe: bf16/fp16 compute that silently runs in fp32, and what it costs.

A user asks for bf16 (``--mixed_precision bf16``, Lightning ``precision="bf16-mixed"``,
``--full_bf16``) and the stack reports bf16, while parts of the compute path run in fp32: a model
that disables autocast around a block, a layer cast back to fp32, weights left in fp32, a dtype
mismatch that blocks a fused kernel, or a device with no native bf16 at all. This probe turns that
into evidence:

1. **Dtype audit of one extra step** (:mod:`diagnose.probes.precision.audit`): every operator's
   real compute dtype, the module that issued it (backward ops through their autograd node), and
   its device-synchronised time; warnings raised meanwhile, with the call that raised them.
2. **Classification** (:mod:`diagnose.precision_policy`, shared with the trace rule): fp32
   matmul/conv/attention in a bf16/fp16 run is *unexpected*; softmax, norms, losses and reductions
   are fp32 *by policy*; RoPE tables in complex64 or a VAE kept in fp32 under ``force_upcast``
   are *deliberate*.
3. **Cost**: the unexpected ops' time, and the saving estimated by re-running the same op
   signatures (shapes, strides) in the requested dtype and in fp32 on this device
   (:mod:`diagnose.probes.precision.speed`), both per iteration of the headline run.
4. **More facts**: fp32 weights in a bf16-full run, dtype-mismatch warnings, bf16 without native
   support, bf16 measured slower than fp32 at the model's shapes, fp32 training on a device that
   is faster in bf16.
5. **Claimed vs actual**: "requested bf16-mixed → actual: 93% of GEMM/conv/attention time in
   bf16, 7% in fp32 (...)".

The judgements are in :mod:`diagnose.probes.precision.findings`, the wording in
:mod:`diagnose.catalogs.precision_catalog`. The workload is left as found (see
:func:`~diagnose.probes.precision.audit.audit_step`).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Sequence

import torch

from diagnose.catalogs.precision_catalog import (
    ASSUMED_LOW_PRECISION_SPEEDUP,
    BF16_NOT_NATIVE_ID,
    BF16_SLOWER_ID,
    DTYPE_MISMATCH_ID,
    FP16_SPEED_CHECK,
    FP32_TRAINING_ID,
    FP32_WEIGHTS_ID,
    UPCAST_ID,
)
from diagnose.device import bf16_native
from diagnose.precision_policy import (
    claimed_vs_actual,
    dtype_shares,
    normalize_dtype,
    requested_low_dtype,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.budgets import BUDGET_RAN_OUT, budget_spent
from diagnose.probes.precision.audit import AuditLog, OpGroup, ReplaySpec, audit_step
from diagnose.probes.precision.findings import (
    Bf16Hardware,
    UpcastSite,
    bf16_hardware,
    bf16_not_native_rule,
    bf16_slower_rule,
    dtype_warning_rule,
    fp32_compute_sites,
    fp32_training_rule,
    fp32_weights_rule,
    op_table,
    upcast_rule,
    upcast_sites,
    verdict_totals,
)
from diagnose.probes.precision.replay import BenchResult, bench_pair
from diagnose.probes.precision.speed import (
    TORCH_DTYPES,
    Bencher,
    HeadlineScale,
    SpeedComparison,
    compare_speed,
    headline_scale,
    largest_signatures,
    round_or_none,
    speed_summary,
)
from diagnose.probes.precision.weights import (
    Fp32Weights,
    component_reasons,
    fp32_parameters,
    keep_fp32_parts,
    workload_components,
)
from diagnose.record import DeviceInfo, Finding, ProbeResult
from diagnose.timing import device_synchronizer

#: Signatures (largest estimated work first) benchmarked for the model-shape speed comparison.
BENCH_SIGNATURES = 8
#: Unexpected-fp32 signatures benchmarked for the saving estimate (the rest use the average).
UPCAST_BENCH_SIGNATURES = 12
BENCH_REPEATS = 15
BENCH_BUDGET_S = 0.25
#: All benchmarking of one probe run stops starting new signatures past this many seconds (a
#: full-size model on a CPU takes seconds per call).
TOTAL_BENCH_BUDGET_S = 20.0


class PrecisionProbe:
    """Finds bf16/fp16 compute that silently runs in fp32, and what it costs."""

    name = "precision"
    description = (
        "bf16/fp16 compute that silently runs in fp32: which ops, in which module, how many per "
        "step, how much time; fp32 weights, dtype-mismatch warnings, bf16 speed on this device"
    )
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        bench_signatures: int = BENCH_SIGNATURES,
        upcast_bench_signatures: int = UPCAST_BENCH_SIGNATURES,
        bench_repeats: int = BENCH_REPEATS,
        bench_budget_s: float = BENCH_BUDGET_S,
        total_bench_budget_s: float = TOTAL_BENCH_BUDGET_S,
    ) -> None:
        self.bench_signatures = bench_signatures
        self.upcast_bench_signatures = upcast_bench_signatures
        self.bench_repeats = bench_repeats
        self.bench_budget_s = bench_budget_s
        self.total_bench_budget_s = total_bench_budget_s

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped(
                "needs the run's training step; a trace is judged from its input dtypes by the "
                "trace rule"
            )
        say = ctx.progress
        precision = ctx.config.precision
        low = requested_low_dtype(precision)
        device = ctx.device
        result = ProbeResult()
        data = result.data
        native = bf16_native(ctx.device_info)
        s_per_it = ctx.record.timing.headline.median
        data.update(
            requested=precision,
            requested_dtype=low or "fp32",
            bf16_native=native,
            s_per_it=s_per_it if math.isfinite(s_per_it) and s_per_it > 0 else None,
        )

        components = workload_components(workload)
        keep = keep_fp32_parts(components)
        weights = fp32_parameters(components, keep) if precision == "bf16-full" else []
        data["fp32_weights"] = [w.to_dict() for w in weights[:40]]

        say("precision: auditing the dtypes of one training step")
        log: AuditLog | None = None
        try:
            log = audit_step(
                workload,
                precision=precision,
                requested_low=low,
                device=device,
                component_reasons=component_reasons(components, low),
                keep_fp32_parts=keep,
            )
        except Exception as exc:  # report what the static checks found; say the audit failed
            first = (str(exc).strip().splitlines() or [""])[0]
            result.status = "error"
            result.reason = f"audit step failed: {type(exc).__name__}: {first}".rstrip(": ")
            result.traceback = traceback.format_exc()
            for check_id in (UPCAST_ID, DTYPE_MISMATCH_ID):
                result.add_not_judged(check_id, f"precision: {result.reason}")

        bench = self._bencher(device, ctx.deadline)
        comparison: SpeedComparison | None = None
        fp16_comparison: SpeedComparison | None = None
        scale: HeadlineScale | None = None
        sites: list[UpcastSite] = []
        if log is not None:
            scale = headline_scale(log, ctx.record)
            self._describe_audit(result, log, scale)
            largest = largest_signatures(log, self.bench_signatures)
            say("precision: timing the model's largest ops in fp32 and low precision")
            comparison = compare_speed(largest, "fp32", low or "bf16", bench)
            data["speed_comparison"] = comparison.to_dict()
            data["speed_summary"] = speed_summary(comparison)
            if low == "bf16" and native is False and ctx.device_info.kind != "cpu":
                fp16_comparison = compare_speed(largest, "bf16", "fp16", bench)
                data["fp16_comparison"] = fp16_comparison.to_dict()
            sites, method = self._upcast_sites(log, comparison, precision, weights, bench, device)
            data["claimed_vs_actual"] = claimed_vs_actual(
                precision, log.compute_seconds_by_dtype(), fp32_compute_sites(log)
            )
            self._audit_findings(result, log, sites, method, scale)

        weight_finding = fp32_weights_rule(precision, weights, {s.where for s in sites})
        if weight_finding is not None:
            result.add_finding(weight_finding)
        elif precision == "bf16-full":
            result.add_ok(
                FP32_WEIGHTS_ID,
                "precision: every weight is bf16 in this bf16-full run (no fp32 parameters)",
            )
        hardware = bf16_hardware(precision, ctx.device_info, native)
        not_native = bf16_not_native_rule(
            precision, ctx.device_info, native, fp16_comparison, scale
        )
        # One cause, one finding: the hardware fact alone (no measured saving of its own) is
        # carried by the measured slowdown when there is one.
        alone = not_native is not None and not_native.est_seconds_saved_per_it is None
        foldable = hardware if alone else None
        folded = self._speed_check(result, precision, ctx.device_info, comparison, scale, foldable)
        self._native_check(result, precision, native, ctx.device_info, not_native, folded)
        return result

    # ------------------------------------------------------------ parts of run()

    def _bencher(self, device: torch.device, deadline: float | None = None) -> Bencher:
        """The benchmark of one signature in two dtypes, cached, within the probe's benchmark
        budget and its time budget (``deadline``): past either, a pair is not timed."""
        sync = device_synchronizer(device)
        cache: dict[tuple[str, torch.dtype, torch.dtype], tuple[BenchResult, BenchResult]] = {}
        started = time.perf_counter()

        def bench(
            spec: ReplaySpec, base: torch.dtype, lowered: torch.dtype
        ) -> tuple[BenchResult, BenchResult]:
            key = (spec.key, base, lowered)
            if key in cache:
                return cache[key]
            spent = budget_spent(deadline)
            if spent or time.perf_counter() - started > self.total_bench_budget_s:
                skipped = (
                    f"not timed: {BUDGET_RAN_OUT}"
                    if spent
                    else "not timed: the probe's benchmark time budget was spent"
                )
                return (
                    BenchResult(normalize_dtype(str(base)) or str(base), error=skipped),
                    BenchResult(normalize_dtype(str(lowered)) or str(lowered), error=skipped),
                )
            cache[key] = bench_pair(
                spec,
                base,
                lowered,
                sync,
                repeats=self.bench_repeats,
                budget_s=self.bench_budget_s,
                deadline=deadline,
            )
            return cache[key]

        return bench

    @staticmethod
    def _describe_audit(result: ProbeResult, log: AuditLog, scale: HeadlineScale) -> None:
        data = result.data
        data["audit"] = {
            "ops": log.ops,
            "wall_seconds": round_or_none(log.wall_seconds),
            "backward_attribution": (
                "autograd node of the forward call"
                if log.node_attribution
                else "unavailable on this torch (backward ops unattributed)"
            ),
            "note": (
                "one extra step, each op timed alone with the device synchronised: op times "
                "are real, the step's wall time is not a step time"
            ),
            "headline_scale": scale.to_dict(),
        }
        by_dtype = log.compute_seconds_by_dtype()
        data["compute_seconds_by_dtype"] = {k: round_or_none(v) for k, v in by_dtype.items()}
        data["compute_share_by_dtype"] = {
            k: round_or_none(v, 4) for k, v in dtype_shares(by_dtype).items()
        }
        data["compute_seconds_by_component"] = {
            component or "outside the models": {k: round_or_none(v) for k, v in by.items()}
            for component, by in log.compute_seconds_by_component().items()
        }
        data["verdicts"] = verdict_totals(log)
        data["ops"] = op_table(log)
        data["warnings"] = [w.to_dict() for w in log.warnings[:20]]

    def _upcast_sites(
        self,
        log: AuditLog,
        comparison: SpeedComparison,
        precision: str,
        weights: Sequence[Fp32Weights],
        bench: Bencher,
        device: torch.device,
    ) -> tuple[list[UpcastSite], str]:
        unexpected = [g for g in log.with_verdict("unexpected") if g.kind != "other"]
        if not unexpected or log.requested_low is None:
            return [], ""
        low_dtype = TORCH_DTYPES[log.requested_low]
        speedups: dict[str, float] = {}
        for spec_key in sorted(
            {g.signature for g in unexpected if g.signature},
            key=lambda k: (-log.replays[k].work * log.replays[k].calls, k),
        )[: self.upcast_bench_signatures]:
            fp32, lowered = bench(log.replays[spec_key], torch.float32, low_dtype)
            if fp32.samples and lowered.samples and lowered.median > 0:
                speedups[spec_key] = fp32.median / lowered.median
        fallback = comparison.speedup
        fallback_basis = "the model's largest ops measured here"
        if not math.isfinite(fallback):
            if device.type == "cpu":
                fallback, fallback_basis = math.nan, ""
            else:
                fallback = ASSUMED_LOW_PRECISION_SPEEDUP
                fallback_basis = f"an assumed {ASSUMED_LOW_PRECISION_SPEEDUP:.0f}x"

        def saving_of(group: OpGroup) -> float | None:
            speedup = float(speedups.get(group.signature, fallback))
            if not math.isfinite(speedup) or speedup <= 0:
                return None
            return float(group.seconds) * (1 - 1 / speedup)

        method = (
            f"each fp32 op signature re-run in {log.requested_low} and in fp32 on this device "
            f"(device-synchronised medians; {len(speedups)} signature(s) timed"
            + (f", others at {fallback_basis}" if fallback_basis else "")
            + "), applied to its time per iteration of the headline run"
        )
        weight_sites = {w.where for w in weights}
        return upcast_sites(unexpected, saving_of, precision, weight_sites), method

    @staticmethod
    def _audit_findings(
        result: ProbeResult,
        log: AuditLog,
        sites: Sequence[UpcastSite],
        method: str,
        scale: HeadlineScale,
    ) -> None:
        by_dtype = log.compute_seconds_by_dtype()
        if log.requested_low is None:
            result.add_ok(
                UPCAST_ID,
                f"precision: the run asked for fp32, so there is no bf16/fp16 upcast to look for "
                f"(upcast audit skipped; {claimed_vs_actual(log.precision, by_dtype)})",
            )
        else:
            finding = upcast_rule(log, sites, scale=scale, saving_method=method)
            if finding is not None:
                result.add_finding(finding)
            else:
                totals = verdict_totals(log)
                policy = int(totals.get("by_policy", {}).get("calls", 0))
                deliberate = int(totals.get("deliberate", {}).get("calls", 0))
                result.add_ok(
                    UPCAST_ID,
                    "precision: "
                    + claimed_vs_actual(log.precision, by_dtype, fp32_compute_sites(log))
                    + f"; no unexpected fp32 matmul/conv/attention ({policy} fp32 op call(s) by "
                    f"autocast policy: softmax, norms, loss; {deliberate} deliberate)",
                )
        warning = dtype_warning_rule(log.warnings)
        if warning is not None:
            result.add_finding(warning)
        else:
            result.add_ok(
                DTYPE_MISMATCH_ID,
                "precision: no dtype-mismatch or fused-kernel warnings during the audited step",
            )

    @staticmethod
    def _native_check(
        result: ProbeResult,
        precision: str,
        native: bool | None,
        info: DeviceInfo,
        finding: Finding | None,
        folded: Finding | None,
    ) -> None:
        """The answer to "does this device compute bf16 natively?" in a bf16 run: the
        ``bf16_not_native`` finding, or, when the measured slowdown ``folded`` carries that fact,
        a check that names it and points there (one cause is not counted twice)."""
        if requested_low_dtype(precision) != "bf16":
            return
        device = f"{info.name or info.kind}" + (f" ({info.arch})" if info.arch else "")
        if folded is not None:
            result.add_ok(
                BF16_NOT_NATIVE_ID,
                f"precision: {device} has no native bf16 arithmetic: the cause of the measured "
                f"bf16 slowdown, so it is said there ({folded.id}), not as a second finding",
            )
        elif finding is not None:
            result.add_finding(finding)
        elif native:
            result.add_ok(BF16_NOT_NATIVE_ID, f"precision: {device} computes bf16 natively")
        else:
            result.add_not_judged(
                BF16_NOT_NATIVE_ID,
                f"precision: whether {device} computes bf16 natively cannot be told from its "
                "architecture name",
            )

    @staticmethod
    def _speed_check(
        result: ProbeResult,
        precision: str,
        info: DeviceInfo,
        comparison: SpeedComparison | None,
        scale: HeadlineScale | None,
        hardware: Bf16Hardware | None = None,
    ) -> Finding | None:
        """One answer to the speed question of this run's precision: bf16 slower than fp32 (a
        bf16 run), fp32 training where low precision is faster (an fp32 run), or fp16's speed.

        ``hardware``: the device lacks native bf16, a fact with no measurement of its own; a
        bf16-slower finding carries it. Returns that finding when it did, else None."""
        low = requested_low_dtype(precision)
        check_id = {"bf16": BF16_SLOWER_ID, None: FP32_TRAINING_ID}.get(low, FP16_SPEED_CHECK)
        if comparison is None or not math.isfinite(comparison.speedup):
            why = "the audit failed" if comparison is None else speed_summary(comparison)
            result.add_not_judged(
                check_id,
                f"precision: {comparison.low if comparison else low or 'bf16'} "
                f"against fp32 at this model's shapes was not measured ({why})",
            )
            return None
        finding = (
            bf16_slower_rule(precision, comparison, scale, hardware)
            if check_id == BF16_SLOWER_ID
            else fp32_training_rule(precision, info, comparison, scale)
            if check_id == FP32_TRAINING_ID
            else None
        )
        if finding is not None:
            result.add_finding(finding)
            return finding if hardware is not None and finding.id == BF16_SLOWER_ID else None
        measured = speed_summary(comparison)
        if low is None:
            if comparison.clearly_slower:
                measured += " (fp32 is the faster choice on this device)"
            elif comparison.clearly_faster:
                measured += " (too small a gain to recommend mixed precision)"
            result.add_ok(check_id, f"precision: {measured}")
        elif comparison.clearly_slower and check_id == BF16_SLOWER_ID:
            result.add_ok(
                check_id,
                f"precision: {measured}, by less than the margin that makes it a finding",
            )
        elif comparison.clearly_slower:  # fp16: the fallback the other checks recommend
            result.add_ok(check_id, f"precision: {measured}")
        else:
            result.add_ok(
                check_id, f"precision: {measured}, so {precision} is not a measurable slowdown here"
            )
        return None


__all__ = ["PrecisionProbe"]
