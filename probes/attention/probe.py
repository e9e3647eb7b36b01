"""The ``attention`` probe: which attention kernel really ran, why not a fused one, what it costs.

The most common cause of "my LoRA is 3x slower than it should be" is attention silently taking a
non-fused path: on ROCm consumer GPUs the fused SDPA kernels are off without
``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1`` and torch falls back to math; xFormers fails to load
after a torch upgrade and the trainer quietly uses something slower; kohya without ``--sdpa`` /
``--xformers`` computes attention by hand; a custom processor does softmax(QKᵀ)V itself. The probe:

1. **What ran** — one extra training step (the workload left untouched) under the profiler with
   module hooks and a TorchFunctionMode (:mod:`diagnose.probes.attention.capture`): every
   attention call with its module, processor class, q/k/v shapes, dtype, mask, dropout, the op and
   kernels that executed (classified by :mod:`diagnose.attention_paths`, shared with the trace
   rule) and its forward and backward time.
2. **Why** — per distinct input signature, whether each fused backend can run and torch's
   reasons when not (:mod:`diagnose.probes.attention.bench`); the SDPA switches at the moment of
   each call; the ROCm architecture against the experimental switch; diffusers' attention
   backend; whether xFormers and flash-attn are installed, import, and match this torch
   (:mod:`diagnose.probes.attention.environment`).
3. **What it costs** — every backend that runs here is microbenchmarked at the exact
   signatures, forward+backward, with memory, the backends sampled in turn until
   :func:`diagnose.stats.ab_verdict` is sure or the time budget is spent (then inconclusive);
   the saving is (time of the path that ran − best available) per call × calls per step
   (:mod:`diagnose.probes.attention.judging`).
4. **At full size** — on a run that trained a preset's tiny stand-in, which kernel is fastest
   is judged again at the real model's attention shapes, or withheld with the reason
   (:mod:`diagnose.probes.attention.full_size`): the tiny shapes' winner is no advice.

Its answers (:mod:`diagnose.probes.attention.findings`) use the ids of
:mod:`diagnose.catalogs.attention_catalog`, the same as the trace rule's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from diagnose import attention_paths as ap
from diagnose.carry_over import shrunk_preset
from diagnose.catalogs import attention_catalog as ac
from diagnose.probes.attention.bench import GPU_ONLY, SignatureTrials, benchmark_signature
from diagnose.probes.attention.calls import AttentionCall, Signature, sdpa_switches
from diagnose.probes.attention.capture import capture_step
from diagnose.probes.attention.environment import (
    PackageStatus,
    diffusers_backend,
    package_status,
    rocm_experimental_missing,
    rocm_facts,
    torch_requirement,
)
from diagnose.probes.attention.findings import (
    answer_checks,
    fused_with_alternative,
    manual_rule,
    math_rule,
    slower_backend_at_full_size,
    slower_backend_rule,
    xformers_rule,
)
from diagnose.probes.attention.full_size import (
    FULL_SIZE_BUDGET_S,
    FullSizeJudgement,
    RealShapes,
    judge_at_full_size,
    real_attention_shapes,
)
from diagnose.probes.attention.judging import (
    Judged,
    PathGroup,
    Saving,
    comparisons_decided,
    evidence_rows,
    group_calls,
    group_saving,
    why_not_fused,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.record import Check, ProbeResult
from diagnose.stats import SEQUENTIAL_SIGNIFICANCE, minimum_samples
from diagnose.timing import device_synchronizer

#: Benchmark settings (per signature, the backends sampled in turn). Fewer samples than the U
#: test needs at the sequential level could never show a backend to be faster; past them, more
#: rounds are taken until every comparison at the signature is sure, up to MAX_SAMPLES a backend
#: or TRIAL_BUDGET_S seconds of sampling, after which an unsure comparison is inconclusive.
MIN_SAMPLES = max(5, minimum_samples(SEQUENTIAL_SIGNIFICANCE))
MAX_SAMPLES = 40
TRIAL_BUDGET_S = 1.0
#: At most this many signatures are benchmarked (the most expensive first).
MAX_SIGNATURES = 16
#: CPU microbenchmarks run on this many threads (None: as the run). With several threads a
#: parallel region waits for every thread, so one busy core elsewhere stalls each call by a
#: scheduler tick; one thread keeps the comparison between backends stable. GPU benchmarks are
#: unaffected.
CPU_BENCHMARK_THREADS: int | None = 1


def _positive(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value > 0 else None


def _backends_for(device_kind: str, packages: Mapping[str, PackageStatus]) -> list[str]:
    backends = ["flash", "efficient", "cudnn", "math"]
    if device_kind != "cpu":
        backends += [n for n in ("xformers", "flash_attn") if n in packages and packages[n].imports]
    return backends


class AttentionProbe:
    name = "attention"
    description = "Which attention kernel really ran, why not a fused one, and what it costs"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        min_samples: int = MIN_SAMPLES,
        max_samples: int = MAX_SAMPLES,
        trial_budget_s: float = TRIAL_BUDGET_S,
        max_signatures: int = MAX_SIGNATURES,
        cpu_threads: int | None = CPU_BENCHMARK_THREADS,
        full_size_budget_s: float = FULL_SIZE_BUDGET_S,
        real_shapes: Callable[[str, int, str], RealShapes] = real_attention_shapes,
    ) -> None:
        """``real_shapes``: the attention shapes of a preset's full-size model, (preset, batch,
        dtype) -> RealShapes; ``full_size_budget_s``: what measuring the kernel choice there
        may take."""
        self.real_shapes = real_shapes
        self.full_size_budget_s = full_size_budget_s
        self.cpu_threads = cpu_threads
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.trial_budget_s = trial_budget_s
        self.max_signatures = max_signatures

    def run(self, ctx: ProbeContext) -> ProbeResult:
        workload = ctx.workload
        if workload is None:
            raise ProbeSkipped("no training workload (trace mode: the attention trace rule runs)")
        device = ctx.device
        device_kind = ctx.device_info.kind or device.type
        arch = ctx.device_info.arch
        sync = device_synchronizer(device)
        say = ctx.progress
        result = ProbeResult(name=self.name)
        data: dict[str, Any] = result.data

        # Why, part 1: the environment.
        inventory = ctx.record.inventory.get("packages") if ctx.record.inventory else None
        packages = {n: package_status(n, inventory) for n in ("xformers", "flash_attn")}
        rocm = rocm_facts(device_kind, arch)
        diffusers = diffusers_backend([workload.denoiser])
        config_attention = str(getattr(ctx.config, "attention", "auto"))
        data["environment"] = {
            "torch": torch.__version__,
            "hip": torch.version.hip,
            "device_kind": device_kind,
            "arch": arch,
            "sdpa_switches_outside_the_step": sdpa_switches(),
            "config_attention": config_attention,
            "rocm": rocm,
            "diffusers": diffusers,
            "packages": {n: vars(p) | {"summary": p.summary()} for n, p in packages.items()},
        }

        # What ran.
        say("attention: profiling one step")
        captured = capture_step(workload, sync)
        calls = captured.calls
        groups = group_calls(calls)
        data["step"] = {
            "calls_per_step": len(calls),
            "profiled_step_seconds": captured.step_seconds,
            "attention_seconds_per_step": sum(c.seconds for c in calls),
            "calls_by_path": dict(Counter(c.path for c in calls)),
            "basis": "one extra step under torch.profiler (device time on a GPU, host time on "
            "the CPU); parameters left as they were",
        }
        data["modules"] = _module_table(calls)
        if not calls:
            result.add_ok(ac.MATH_ID, "attention: the step makes no attention call")
            result.add_ok(ac.MANUAL_ID, ac.NO_MANUAL_TEXT)
            return result

        # Why, part 2, and what it costs: every backend at every signature.
        benchmarked = self._benchmark_all(
            result, groups, device, sync, device_kind, packages, rocm, say, ctx.deadline
        )
        judged: list[Judged] = []
        for group in groups:
            trials_for = benchmarked.get(group.signature) if group.signature else None
            j = Judged(group, trials_for, group_saving(group, trials_for))
            if group.path == ap.MATH:
                j.why = why_not_fused(
                    group,
                    trials_for,
                    device_kind=device_kind,
                    rocm=rocm,
                    config_attention=config_attention,
                    diffusers=diffusers,
                )
            judged.append(j)
        data["signatures"] = [
            {
                **t.to_dict(),
                "calls_per_step": sum(g.calls for g in groups if g.signature == s),
                "paths": _calls_by_path(g for g in groups if g.signature == s),
            }
            for s, t in benchmarked.items()
        ]
        data["groups"] = evidence_rows(judged)

        # The answers: findings first, then what they leave found fine or not judged.
        s_per_it = _positive(ctx.record.timing.headline.median)
        slower = slower_backend_rule(judged, s_per_it=s_per_it)
        shrunk = shrunk_preset(ctx.config)
        every_call_fused = all(c.path in ap.FUSED_PATHS for c in calls)
        # A shrunk model's answer to it (a finding, or "nothing faster" when every call ran
        # fused) depends on its shapes: judged again at the real model's, or withheld.
        if (
            shrunk is not None
            and fused_with_alternative(judged)
            and (slower is not None or every_call_fused)
        ):
            say("attention: judging the kernel choice at the full-size shapes")
            backends = _backends_for(device_kind, packages)
            judgement = self._judge_full_size(
                shrunk, judged, calls, device, sync, backends, ctx.deadline
            )
            data["full_size"] = judgement.to_dict()
            slower, outcome, text = slower_backend_at_full_size(slower, judged, judgement)
            if outcome is not None:
                result.checks.append(Check(ac.SLOWER_ID, outcome, text))
        for finding in (
            math_rule(
                judged, device_kind=device_kind, arch=arch, rocm=rocm, total_calls=len(calls)
            ),
            manual_rule(judged),
            slower,
            xformers_rule(packages["xformers"], config_attention=config_attention),
        ):
            if finding is not None:
                result.add_finding(finding)
        answer_checks(result, calls=calls, judged=judged, packages=packages, s_per_it=s_per_it)
        return result

    def _judge_full_size(
        self,
        preset: str,
        judged: Sequence[Judged],
        calls: Sequence[AttentionCall],
        device: torch.device,
        sync: Any,
        backends: Sequence[str],
        deadline: float | None = None,
    ) -> FullSizeJudgement:
        """The fused backend that ran most against the others at the preset's largest real
        attention shape, in the dtype the step's attention ran in."""
        fused = [j for j in fused_with_alternative(judged) if j.saving is not None]
        ran: Counter[str] = Counter()
        for j in fused:
            if j.saving is not None:
                ran[j.saving.ran] += j.group.calls
        heaviest = max(fused, key=lambda j: j.group.seconds)
        dtype = heaviest.group.signature.dtype if heaviest.group.signature else "float32"
        batch = max(
            (c.signature.batch for c in calls if c.signature and c.signature.backward), default=1
        )
        shapes = self.real_shapes(preset, batch, dtype)
        threads = torch.get_num_threads()
        if device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)  # as the other microbenchmarks (see above)
        try:
            return judge_at_full_size(
                shapes,
                ran.most_common(1)[0][0],
                [b for b in backends if b not in GPU_ONLY or device.type == "cuda"],
                device,
                sync,
                budget_s=self.full_size_budget_s,
                deadline=deadline,
            )
        finally:
            torch.set_num_threads(threads)

    def _benchmark_all(
        self,
        result: ProbeResult,
        groups: Sequence[PathGroup],
        device: torch.device,
        sync: Any,
        device_kind: str,
        packages: Mapping[str, PackageStatus],
        rocm: Mapping[str, Any],
        say: Callable[[str], None],
        deadline: float | None = None,
    ) -> dict[Signature, SignatureTrials]:
        """Every backend at every signature of the step, the most expensive first; what could not
        be measured becomes a not-judged check. Past the probe's ``deadline`` each signature
        takes its fewest rounds only."""
        backends = _backends_for(device_kind, packages)
        experimental = rocm_experimental_missing(rocm)
        unique = list(dict.fromkeys(g.signature for g in groups if g.signature is not None))
        if len(unique) > self.max_signatures:
            result.add_not_judged(
                ac.COVERAGE_CHECK,
                f"attention: {len(unique) - self.max_signatures} cheaper attention signatures "
                "were not benchmarked: their saving is not counted",
            )
            unique = unique[: self.max_signatures]
        threads = torch.get_num_threads()
        bench_threads = self.cpu_threads if device.type == "cpu" and self.cpu_threads else threads
        result.data["benchmark"] = {
            "threads": bench_threads,
            "step_threads": threads,
            "min_samples": self.min_samples,
            "max_samples": self.max_samples,
            "seconds_per_signature": self.trial_budget_s,
            "order": "interleaved: the backends sampled in turn, until every comparison with the "
            "backend that ran is sure or the budget (the signature's, or the probe's) is spent",
        }
        benchmarked: dict[Signature, SignatureTrials] = {}
        torch.set_num_threads(bench_threads)
        try:
            for n, signature in enumerate(unique, 1):
                say(f"attention: benchmarking {n}/{len(unique)} ({signature.label()})")
                benchmarked[signature] = self._benchmark(
                    signature, groups, device, sync, backends, experimental, deadline
                )
        finally:
            torch.set_num_threads(threads)
        stopped = sum(t.stopped_by_budget for t in benchmarked.values())
        if stopped:
            result.add_not_judged(
                ac.ROUNDS_CHECK,
                f"attention: {BUDGET_STOPPED} at {stopped} of {len(benchmarked)} attention "
                f"signatures ({self.min_samples} rounds each there): comparisons still unsure "
                "there are inconclusive",
            )
        if bench_threads != threads:
            result.add_not_judged(
                ac.THREADS_CHECK,
                f"attention: CPU microbenchmarks ran on {bench_threads} thread(s) (the step uses "
                f"{threads}): per-call times compare backends, they are not the step's own times",
            )
        if device_kind == "cpu":
            result.add_not_judged(
                ac.MEMORY_CHECK,
                "attention: peak memory per backend on the CPU is estimated from the shapes (the "
                "CPU allocator keeps no peak); it is measured with max_memory_allocated on GPUs",
            )
        return benchmarked

    def _benchmark(
        self,
        signature: Signature,
        groups: Sequence[PathGroup],
        device: torch.device,
        sync: Any,
        backends: list[str],
        experimental: bool,
        deadline: float | None = None,
    ) -> SignatureTrials:
        """Every backend at ``signature`` (plus the hand-written one where it ran)."""
        needs_manual = any(g.signature == signature and g.path == ap.MANUAL for g in groups)
        ran = sorted({g.backend for g in groups if g.signature == signature and g.backend})
        trials = benchmark_signature(
            signature,
            device,
            sync,
            backends + (["manual"] if needs_manual else []),
            min_samples=self.min_samples,
            max_samples=self.max_samples,
            budget_s=self.trial_budget_s,
            rocm_experimental=experimental,
            decided=comparisons_decided(ran),
            deadline=deadline,
        )
        fused_ran = any(t.runs for t in trials.trials if t.backend not in ("math", "manual"))
        if signature.dropout_p > 0 and not fused_ran:
            # Dropout keeps every fused kernel out here; measure what dropout 0 would buy.
            undropped = benchmark_signature(
                Signature(**{**signature.__dict__, "dropout_p": 0.0}),
                device,
                sync,
                [b for b in backends if b != "math"],
                min_samples=self.min_samples,
                max_samples=self.max_samples,
                budget_s=self.trial_budget_s,
                rocm_experimental=experimental,
            )
            for trial in undropped.trials:
                if trial.runs:
                    trial.note = (trial.note + "; " if trial.note else "") + "at dropout_p=0"
                    trials.trials.append(trial)
        return trials


def _calls_by_path(groups: Iterable[PathGroup]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for g in groups:
        counts[g.path] += g.calls
    return dict(counts)


def _module_table(calls: Sequence[AttentionCall]) -> list[dict[str, Any]]:
    """Per module: processor, path, calls, shapes and time (the report's table)."""
    rows: dict[tuple[str, str, str, str, bool], dict[str, Any]] = {}
    for call in calls:
        key = (
            call.module,
            call.processor,
            call.path,
            call.signature.label() if call.signature else "",
            call.recomputed,
        )
        row = rows.setdefault(
            key,
            {
                "module": call.module or "(outside attention modules)",
                "processor": call.processor,
                "path": call.path,
                "provider": call.provider,
                "entry": call.entry,
                "signature": key[3],
                "ops": call.ops[:2],
                "kernels": call.kernels[:2],
                "recomputed": call.recomputed,
                "calls": 0,
                "forward_ms": 0.0,
                "backward_ms": 0.0,
            },
        )
        row["calls"] += 1
        row["forward_ms"] = round(row["forward_ms"] + call.forward_seconds * 1e3, 4)
        row["backward_ms"] = round(row["backward_ms"] + call.backward_seconds * 1e3, 4)
    return list(rows.values())


__all__ = [
    "AttentionProbe",
    "Judged",
    "PackageStatus",
    "PathGroup",
    "Saving",
    "group_calls",
    "group_saving",
    "manual_rule",
    "math_rule",
    "slower_backend_rule",
    "torch_requirement",
    "why_not_fused",
    "xformers_rule",
]
