"""What the project knows about slow distributed steps: ids, thresholds, wording and fixes.

Both the multi-rank trace analysis (``diagnose trace DIR``) and ``diagnose run --nproc`` build
their findings here, so a straggler reads the same whichever way it was found.
"""

from __future__ import annotations

from diagnose.catalogs import FindingSpec, tiny_model_only
from diagnose.catalogs.dataloader_catalog import (
    CACHE_LATENTS_ADVICE,
    DEFAULT_WORKERS,
    workers_advice,
)
from diagnose.record import PHASE_LABELS, Finding
from diagnose.stats import AtLine
from diagnose.units import ms, pct, pct_fine
from diagnose.verdicts import WARN_SHARE, borderline_at

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
    "collective time with nothing else running: on one rank's trace (transfer or a wait for "
    "slower ranks), or, with every rank's trace, on the rank that waits least (transfer)",
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
#: Profiled steps a straggler can be named from: the per-step wait differences between ranks
#: then have a spread (the steps' jitter) to hold their size against; fewer say nothing.
STRAGGLER_STEPS = 3
#: A phase is named as the straggler's when it holds at least this share of the others' wait.
PHASE_EXPLAINS = 0.5

#: Phases in which a rank's extra time means its device (or its host) computes slower.
_COMPUTE_PHASES = frozenset({"forward", "backward", "optimizer", "encode"})


INTERVAL_NOTE = (
    "the interval of the per-step values (the profiled steps' jitter), held against the line: "
    "the finding is judged on what every step shows, not on one slow step"
)


def steps_to_name_a_straggler(world_size: int) -> int:
    """The fewest profiled steps a straggler among ``world_size`` ranks can be named from
    (:data:`STRAGGLER_STEPS`; 1 for a single process). diagnose/profile/capture_contract.py asks the
    same in the user's processes."""
    return STRAGGLER_STEPS if world_size > 1 else 1


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
    reading: AtLine,
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
        sure_saving=max(0.0, reading.low) * step_seconds,
        high_saving=reading.high * step_seconds,
        basis="trace",
        fix=_straggler_fix(straggler, phase),
        detail=(
            "In synchronous data-parallel training every rank waits in each collective until "
            "the slowest one arrives, so the job runs at the straggler's pace. The wait is read "
            "from the traces without trusting their clocks: per step, each rank's time in "
            "collectives minus the least any rank spent in the same step's collectives. The "
            "straggler is named from the size of those waits against their step-to-step jitter "
            f"({reading.words('the others wait longer by', pct_fine, ' of the step')}, an "
            "interval over the profiled steps), not from which rank happened to be last. The "
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
    rank: int | None,
    exposed: float,
    reading: AtLine,
    step_seconds: float,
    by_kind: dict[str, float],
    evidence: dict[str, object],
    source: str,
    single_rank: bool = False,
) -> Finding:
    """``exposed`` seconds per step of collective time on ``rank`` that no compute hides;
    ``reading``: its share of the step against :data:`RAISE_SHARE`, with the steps' interval.
    ``single_rank``: read on one rank's trace alone, where a wait for a slower rank looks the
    same as transfer."""
    share = exposed / step_seconds if step_seconds else 0.0
    where = collective_words(by_kind)
    fsdp = "all_gather" in by_kind or "reduce_scatter" in by_kind
    on = "this rank's trace" if rank is None else f"rank {rank}"
    if single_rank:
        read = (
            f"Read on {on} alone: this is transfer, or a wait for a slower rank, which one "
            "rank's trace cannot tell apart; give every rank's trace (diagnose trace DIR) to "
            "tell them. "
        )
        fix = (
            _exposed_fix(fsdp)
            + " If another rank is slower, part of this is a wait for it: read every rank's "
            "trace together (diagnose trace DIR) to name it."
        )
    else:
        read = (
            f"Read on {on}, the rank that waits least for the others, so this is transfer time "
            "rather than a wait for a straggler. "
        )
        fix = _exposed_fix(fsdp)
    return EXPOSED_COMM.build(
        (
            f"Communication is not hidden behind compute: {ms(exposed)} per step "
            f"({pct(share)} of the step) in {where} with nothing else running"
        ),
        evidence=evidence,
        saving=min(exposed, step_seconds),
        sure_saving=max(0.0, reading.low) * step_seconds,
        high_saving=reading.high * step_seconds,
        borderline=(
            borderline_at(reading, "exposed communication", " of the step")
            if reading.borderline
            else None
        ),
        basis="trace",
        fix=fix,
        detail=(
            read + "Overlapping it with the backward pass would save up to this much (an upper "
            "bound: some transfer cannot overlap)."
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


def too_few_steps_straggler_line(rank: int, steps: int) -> str:
    return (
        f"ranks: inconclusive: rank {rank} was waited for in {steps} profiled step"
        f"{'s' if steps != 1 else ''}: no step-to-step jitter to hold the wait against; profile "
        f"at least {STRAGGLER_STEPS} steps to tell a straggler from a busy machine"
    )


def jittery_straggler_line(rank: int, reading: AtLine, step_seconds: float, steps: int) -> str:
    """Rank ``rank`` was waited for in every step, but the waits vary too much, against their
    line, to name it."""
    low, high = (max(0.0, v) * step_seconds for v in (reading.low, reading.high))
    return (
        f"ranks: inconclusive: rank {rank} was waited for in every one of {steps} profiled "
        f"steps, but by {ms(low)}–{ms(high)} per step (the interval of the steps' waits), "
        f"which straddles the {pct(RAISE_SHARE)} line: too much jitter to name a straggler; "
        "profile more steps"
    )


def hidden_comm_line(exposed: float, comm: float, step_seconds: float) -> str:
    share = exposed / step_seconds if step_seconds else 0.0
    return (
        f"communication: {ms(comm)} per step in collectives, {ms(exposed)} of it exposed "
        f"({pct(share)} of the step, below {pct(RAISE_SHARE)})"
    )
