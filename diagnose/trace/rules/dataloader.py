"""Data loading: how much of each step the loop spends waiting for its next batch.

Reads the ``enumerate(DataLoader)#...__next__`` ranges torch.profiler records around every
``next()`` on a DataLoader iterator. On a GPU trace the cost is the device idle time while the
host waits (a prefetched batch costs nothing even if ``next()`` is slow to return); on a CPU trace
the compute device is the host itself, so the whole wait counts.
"""

from __future__ import annotations

from diagnose.record import Finding
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import complement, intersect
from diagnose.trace.rules import RuleResult, ms, pct

RULE = "dataloader"
FINDING_ID = "dataloader.gpu_starved"
#: Share of step time starved for data above which the finding is raised, and made critical.
WARN_SHARE = 0.10
CRITICAL_SHARE = 0.30


def _robust_share(per_step: list[dict[str, float]]) -> float:
    """Starved share of step time, leaving out the single worst step when there are 3 or more:
    one slow batch (a cold file cache, a hiccup of the machine) is not a data-loading problem,
    a wait that repeats is."""
    rows = sorted(per_step, key=lambda r: r["device_idle_while_waiting_ms"] / r["wall_ms"])
    if len(rows) >= 3:
        rows = rows[:-1]
    wall = sum(r["wall_ms"] for r in rows)
    return sum(r["device_idle_while_waiting_ms"] for r in rows) / wall if wall else 0.0


def check(ctx: TraceContext) -> RuleResult:
    result = RuleResult(rule=RULE)
    waits = ctx.phases.host.get("data_wait")
    if waits is None or not len(waits):
        result.not_judged.append(
            "data loading: no DataLoader iteration ranges in the profiled steps (the loop does "
            "not iterate a torch DataLoader there, or the batch was fetched outside them)"
        )
        return result

    per_step: list[dict[str, float]] = []
    total_wait = total_starved = 0.0
    for step in ctx.steps.steps:
        s, e = step.start_us, step.end_us
        wait = waits.clip(s, e)
        idle = complement(ctx.busy.clip(s, e), s, e)
        starved = intersect(wait, idle) if ctx.has_device else wait
        per_step.append(
            {
                "step": step.number,
                "wall_ms": round(step.wall_seconds * 1e3, 3),
                "data_wait_ms": round(wait.total / 1e3, 3),
                "device_idle_while_waiting_ms": round(starved.total / 1e3, 3),
            }
        )
        total_wait += wait.total / 1e6
        total_starved += starved.total / 1e6
    wall = ctx.wall_seconds or 1.0
    wait_share = total_wait / wall
    starved_share = _robust_share(per_step)
    starved_per_step = total_starved / ctx.n_steps
    iterators = ctx.phases.dataloader_names
    single_process = any("_SingleProcessDataLoaderIter" in n for n in iterators)
    result.data = {
        "data_wait_share": wait_share,
        "starved_share": starved_share,
        "per_step": per_step,
        "iterators": iterators,
    }
    device_word = "GPU" if ctx.has_device else "CPU"
    if starved_share < WARN_SHARE:
        result.checked_ok.append(
            f"data loading: the loop waited {pct(wait_share)} of step time for batches "
            f"({device_word} starved {pct(starved_share)}), below {pct(WARN_SHARE)}"
        )
        return result

    workers_hint = (
        "The iterator is _SingleProcessDataLoaderIter: the DataLoader runs with num_workers=0, so "
        "every batch is loaded and decoded on the training thread. "
        if single_process
        else ""
    )
    title_device = "the GPU idles" if ctx.has_device else "compute stops"
    finding = Finding(
        id=FINDING_ID,
        category="dataloader",
        severity="critical" if starved_share >= CRITICAL_SHARE else "warn",
        title=(
            f"The training loop waits for data {pct(starved_share)} of each step "
            f"({ms(starved_per_step)}/step) while {title_device}"
        ),
        evidence={
            "data_wait_seconds_per_step": total_wait / ctx.n_steps,
            "starved_seconds_per_step": starved_per_step,
            "data_wait_share_of_step": wait_share,
            "starved_share_of_step": starved_share,
            "starved_share_note": "leaving out the worst step when there are 3 or more",
            "steps": per_step,
            "dataloader_iterators": iterators,
            "num_workers_zero": single_process,
        },
        est_seconds_saved_per_it=starved_per_step,
        saving_basis="trace",
        fix=(
            "Load batches in background workers so the next batch is ready: "
            "DataLoader(num_workers=4 or more, pin_memory=True, persistent_workers=True) "
            "(kohya: --max_data_loader_n_workers 4 --persistent_data_loader_workers; diffusers "
            "examples: --dataloader_num_workers 4); cache latents and text embeddings so no VAE "
            "or image decode runs per step (kohya: --cache_latents --cache_text_encoder_outputs)."
        ),
        detail=(
            f"{workers_hint}The profiled steps spent {ms(total_wait / ctx.n_steps)} per step "
            f"inside next(dataloader); the {device_word} had no work for "
            f"{ms(starved_per_step)} of it. With the batch prepared ahead of time that wait "
            "disappears (the saving is the idle time read off the trace)."
        ),
        source=f"trace:{RULE}",
    )
    result.findings.append(finding)
    return result
