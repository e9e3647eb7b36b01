"""What the project knows about slow distributed steps: ids, thresholds, wording and fixes.

Both the multi-rank trace analysis (``diagnose trace DIR``) and ``diagnose run --nproc`` build
their findings here, so a straggler reads the same whichever way it was found.
"""

from __future__ import annotations

import math

from diagnose.catalogs import FindingSpec, tiny_model_only
from diagnose.catalogs.dataloader_catalog import (
    CACHE_LATENTS_ADVICE,
    DEFAULT_WORKERS,
    workers_advice,
)
from diagnose.record import PHASE_LABELS, Finding
from diagnose.trace.rules import ms, pct
from diagnose.verdicts import WARN_SHARE

STRAGGLER = FindingSpec(
    "distributed.straggler",
    "distributed",
    "(rank traces, `run --nproc`) one rank is slower in a compute phase and the others wait for "
    "it in every step's collectives",
    ("trace",),
    at_full_size=tiny_model_only(
        "a tiny model's short steps make a little host jitter on one rank look like a slow rank"
    ),
)
DATA_WAIT_IMBALANCE = FindingSpec(
    "distributed.data_wait_imbalance",
    "distributed",
    "(rank traces, `run --nproc`) the same, when the slow rank's extra time is its wait for data",
    ("trace",),
    phases=("data_wait",),
    at_full_size=tiny_model_only("data waits are inflated by the tiny model's short steps"),
)
EXPOSED_COMM = FindingSpec(
    "distributed.exposed_communication",
    "distributed",
    "(rank traces, `run --nproc`) collective time with nothing else running, on the rank that "
    "waits least (transfer, not a wait)",
    ("trace",),
    at_full_size=tiny_model_only(
        "the tiny LoRA's gradients are smaller and its step shorter: how much communication "
        "hides behind compute differs at full size"
    ),
)
SPECS = (STRAGGLER, DATA_WAIT_IMBALANCE, EXPOSED_COMM)
#: A wait (or exposed transfer) is raised as a finding from the share the one severity rule
#: calls a warning: below it, it is said as checked and fine.
RAISE_SHARE = WARN_SHARE
STRAGGLER_ID = STRAGGLER.id
DATA_WAIT_IMBALANCE_ID = DATA_WAIT_IMBALANCE.id
EXPOSED_COMM_ID = EXPOSED_COMM.id

#: Below this many seconds per step a difference between ranks is timer and scheduling noise.
MIN_SECONDS = 1e-3
#: A rank is named the straggler only when it being the one waited for in every profiled step
#: would happen by chance at most this often, were each rank equally likely to be last in a step
#: (a busy machine deschedules ranks at random).
STRAGGLER_CHANCE = 0.05
#: A phase is named as the straggler's when it holds at least this share of the others' wait.
PHASE_EXPLAINS = 0.5

#: Phases in which a rank's extra time means its device (or its host) computes slower.
_COMPUTE_PHASES = frozenset({"forward", "backward", "optimizer", "encode"})


REPEATED_NOTE = (
    "the smallest per-step value, leaving out the single smallest when there are 3 or more "
    "steps: the findings are judged on what repeats in every step, not on one slow step"
)


def steps_to_name_a_straggler(world_size: int) -> int:
    """The fewest profiled steps in which one rank being last in all of them is not chance:
    ``world_size ** -(steps - 1) <= STRAGGLER_CHANCE`` (6 steps for 2 ranks, 4 for 4, 3 for 8).
    diagnose/profile/capture.py computes the same in the user's processes."""
    if world_size < 2:
        return 1
    return 1 + math.ceil(math.log(1 / STRAGGLER_CHANCE) / math.log(world_size) - 1e-9)


def chance_of_one_last(world_size: int, steps: int) -> float:
    """How often chance alone makes one rank the last in every one of ``steps`` steps."""
    return float(world_size) ** -(steps - 1) if world_size > 1 and steps > 0 else 1.0


def repeated(per_step: list[float]) -> float:
    """The value that repeats: the smallest over the steps, leaving out the single smallest
    when there are 3 or more (on a shared machine any rank is descheduled in some step)."""
    values = sorted(per_step)
    if not values:
        return 0.0
    return values[1] if len(values) >= 3 else values[0]


def collective_words(by_kind: dict[str, float]) -> str:
    """``all-reduce`` or ``all-gather and reduce-scatter``: the collectives that took the time."""
    total = sum(by_kind.values())
    # Only the kinds that hold a real part of the time: DDP's buffer broadcast is a sliver.
    kinds = [
        k
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        if k != "other" and v >= 0.2 * total
    ][:2]
    if not kinds:
        return "collectives"
    return " and ".join(k.replace("_", "-") for k in kinds)


def straggler_finding(
    *,
    straggler: int,
    world_size: int,
    others_wait: float,
    sure_share: float,
    step_seconds: float,
    phase: str | None,
    phase_excess: float,
    by_kind: dict[str, float],
    evidence: dict[str, object],
    source: str,
) -> Finding:
    """Rank ``straggler`` sets the pace; the others wait ``others_wait`` s per step for it."""
    share = others_wait / step_seconds if step_seconds else 0.0
    where = collective_words(by_kind)
    others = "the other rank waits" if world_size == 2 else "the other ranks wait"
    title = (
        f"Rank {straggler} is the straggler: {others} {ms(others_wait)} per step "
        f"({pct(share)} of the step) in {where} for it"
    )
    if phase is not None:
        title += f"; its {PHASE_LABELS.get(phase, phase)} takes {ms(phase_excess)} longer"
    spec = DATA_WAIT_IMBALANCE if phase == "data_wait" else STRAGGLER
    return spec.build(
        title,
        evidence=evidence,
        # Were the straggler as fast as the others, none would wait: that is the whole saving,
        # and it can never exceed the step (others_wait is a part of each waiting rank's step).
        saving=min(others_wait, step_seconds),
        sure_saving=sure_share * step_seconds,
        basis="trace",
        fix=_straggler_fix(straggler, phase),
        detail=(
            "In synchronous data-parallel training every rank waits in each collective until "
            "the slowest one arrives, so the job runs at the straggler's pace. The wait is read "
            "from the traces without trusting their clocks: per step, each rank's time in "
            "collectives minus the least any rank spent in the same step's collectives. The "
            "phase is where the straggler spends more than the median of the other ranks."
        ),
        source=source,
    )


def _straggler_fix(rank: int, phase: str | None) -> str:
    if phase == "data_wait":
        return (
            f"Give rank {rank} its batches as fast as the others: "
            + workers_advice(DEFAULT_WORKERS, pin_memory=True)
            + "; or "
            + CACHE_LATENTS_ADVICE
            + ". Check that its images are on a local disk like the other ranks'."
        )
    if phase in _COMPUTE_PHASES:
        return (
            f"Find why rank {rank}'s device computes slower: another process on that GPU, lower "
            "clocks (power or thermal limits: nvidia-smi -q -d PERFORMANCE, amd-smi metric), a "
            "narrower PCIe link, or a different GPU model. With aspect-ratio buckets, make every "
            "rank draw the same bucket in a step (one bucket choice per step for all ranks), so "
            "no rank trains a larger resolution while the others wait."
        )
    return (
        f"Rank {rank} spends its extra time outside one phase: compare its trace with another "
        "rank's (host load, CPU frequency, logging or checkpointing on that rank only)."
    )


def exposed_finding(
    *,
    rank: int,
    exposed: float,
    sure_share: float,
    step_seconds: float,
    by_kind: dict[str, float],
    evidence: dict[str, object],
    source: str,
) -> Finding:
    """``exposed`` seconds per step of collective time on ``rank`` that no compute hides."""
    share = exposed / step_seconds if step_seconds else 0.0
    where = collective_words(by_kind)
    fsdp = "all_gather" in by_kind or "reduce_scatter" in by_kind
    return EXPOSED_COMM.build(
        (
            f"Communication is not hidden behind compute: {ms(exposed)} per step "
            f"({pct(share)} of the step) in {where} with nothing else running"
        ),
        evidence=evidence,
        saving=min(exposed, step_seconds),
        sure_saving=sure_share * step_seconds,
        basis="trace",
        fix=_exposed_fix(fsdp),
        detail=(
            f"Read on rank {rank}, the rank that waits least for the others, so this is transfer "
            "time rather than a wait for a straggler. Overlapping it with the backward pass "
            "would save up to this much (an upper bound: some transfer cannot overlap)."
        ),
        source=source,
    )


def _exposed_fix(fsdp: bool) -> str:
    if fsdp:
        return (
            "FSDP: prefetch the next all-gather (backward_prefetch=BackwardPrefetch.BACKWARD_PRE, "
            "forward_prefetch=True); for a LoRA whose frozen base fits on one GPU, shard less "
            "(ShardingStrategy.SHARD_GRAD_OP or NO_SHARD, or DDP): gathering frozen weights "
            "every step is pure overhead."
        )
    return (
        "DDP: let the gradient all-reduce run during backward, with "
        "DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True) and a "
        "bucket_cap_mb that splits the LoRA gradients into several buckets (kohya: "
        "--ddp_gradient_as_bucket_view --ddp_static_graph); with gradient accumulation, "
        "skip the all-reduce on the accumulation steps (accelerate's accumulate() or "
        "model.no_sync())."
    )


def no_straggler_line(max_wait: float, step_seconds: float, world_size: int) -> str:
    share = max_wait / step_seconds if step_seconds else 0.0
    return (
        f"ranks: {world_size} ranks keep pace; no rank waits for another more than "
        f"{ms(max_wait)} per step ({pct(share)}, below {pct(RAISE_SHARE)})"
    )


def inconclusive_straggler_line(median_wait: float, step_seconds: float, waited: list[int]) -> str:
    share = median_wait / step_seconds if step_seconds else 0.0
    who = ", ".join(str(r) for r in waited)
    return (
        f"ranks: inconclusive: ranks wait for each other {ms(median_wait)} per step on the median "
        f"({pct(share)}), but not for the same rank in every step (ranks {who} each waited in "
        "some): a busy machine, not a straggler, or too few steps to tell; profile more steps"
    )


def too_few_steps_straggler_line(rank: int, steps: int, world_size: int) -> str:
    chance = chance_of_one_last(world_size, steps)
    return (
        f"ranks: inconclusive: rank {rank} was the one waited for in all {steps} profiled "
        f"steps, which chance alone gives 1 time in {1 / chance:.0f} with {world_size} ranks; "
        f"profile at least {steps_to_name_a_straggler(world_size)} steps to tell a straggler "
        "from a busy machine"
    )


def hidden_comm_line(exposed: float, comm: float, step_seconds: float) -> str:
    share = exposed / step_seconds if step_seconds else 0.0
    return (
        f"communication: {ms(comm)} per step in collectives, {ms(exposed)} of it exposed "
        f"({pct(share)} of the step, below {pct(RAISE_SHARE)})"
    )
