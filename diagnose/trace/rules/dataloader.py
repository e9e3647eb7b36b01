"""Data loading: how much of each step the loop spends waiting for its next batch.

Reads the ``enumerate(DataLoader)#...__next__`` ranges torch.profiler records around every
``next()`` on a DataLoader iterator. On a GPU trace the cost is the device idle time while the
host waits (a prefetched batch costs nothing even if ``next()`` is slow to return); on a CPU trace
the compute device is the host itself, so the whole wait counts.

This module is also the one place for the thresholds and the wording that the ``dataloader`` probe
(``diagnose.probes.dataloader``) shares with this rule: both raise ``dataloader.gpu_starved`` at
the same share of the step, with the same title and the same trainer flags in the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from diagnose.record import Finding, ProbeResult, Severity
from diagnose.trace.context import TraceContext
from diagnose.trace.intervals import complement, intersect
from diagnose.trace.rules import ms, pct

RULE = "dataloader"
#: The loop waits for batches while the device has nothing to do (trace rule and probe).
FINDING_ID = "dataloader.gpu_starved"
#: The loop hardly waits, yet a loader change (cached latents, pre-decoded images, workers) was
#: measured clearly faster: the per-step image work is paid inside the step (VAE encode of freshly
#: decoded pixels) rather than as a wait. Probe only: a trace cannot run the A/B.
SLOW_LOADER_ID = "dataloader.slow_loader"
#: Files of the data folder that could not be decoded (probe only).
CORRUPT_IMAGES_ID = "dataloader.corrupt_images"
#: Share of step time starved for data above which the finding is raised, and made critical.
WARN_SHARE = 0.10
CRITICAL_SHARE = 0.30
#: A loader change counts as measurably faster when it saves at least this share of the s/it
#: (and its steps clear the configured loader's spread: see the probe's ``clearly_faster``).
MIN_MEASURED_GAIN = 0.05
#: Workers recommended when the trace cannot tell how many cores the machine has.
DEFAULT_WORKERS = 4


# --------------------------------------------------------------------------------------------
# Wording shared with the probe


def severity_for_share(share: float) -> Severity:
    """Severity of a starved share (at or above :data:`WARN_SHARE`)."""
    return "critical" if share >= CRITICAL_SHARE else "warn"


def device_word(has_device: bool) -> str:
    """What computes the step: the GPU, or on a CPU run the CPU itself."""
    return "GPU" if has_device else "CPU"


def starved_title(share: float, seconds_per_step: float, has_device: bool) -> str:
    """``The training loop waits for data 35% of each step (310 ms/step) while the GPU idles``."""
    idle = "the GPU idles" if has_device else "compute stops"
    return (
        f"The training loop waits for data {pct(share)} of each step "
        f"({ms(seconds_per_step)}/step) while {idle}"
    )


def not_waiting_line(
    wait_share: float, has_device: bool, starved_share: float | None = None
) -> str:
    """The checked-fine line: ``data loading: 2% of the step; the GPU is not waiting``.

    ``starved_share`` (from a trace: device idle while the host waits) is added when known.
    """
    who = "the GPU is" if has_device else "compute is"
    line = f"data loading: {pct(wait_share)} of the step; {who} not waiting"
    if starved_share is not None:
        line += (
            f" ({device_word(has_device)} idle while waiting: {pct(starved_share)}, "
            f"below {pct(WARN_SHARE)})"
        )
    return line


def workers_advice(workers: int, pin_memory: bool) -> str:
    """Background workers, in torch's and the trainers' words."""
    pin = ", pin_memory=True" if pin_memory else ""
    return (
        f"load batches in background workers: DataLoader(num_workers={workers}{pin}, "
        f"persistent_workers=True) (kohya: --max_data_loader_n_workers {workers} "
        f"--persistent_data_loader_workers; diffusers examples: --dataloader_num_workers "
        f"{workers})"
    )


#: Cached latents, in the trainers' words.
CACHE_LATENTS_ADVICE = (
    "cache the latents so no image is decoded or VAE-encoded per step (kohya: --cache_latents, "
    "or --cache_latents_to_disk to keep them between runs; it cannot be combined with "
    "--random_crop or --color_aug; diffusers DreamBooth LoRA scripts: --cache_latents)"
)


def predecode_advice(pixel_ratio: float | None, bucket: int | None) -> str:
    """Decode (and shrink) the images once instead of every step."""
    why = ""
    if pixel_ratio is not None and pixel_ratio > 1.5 and bucket:
        why = f" (each step now decodes {pixel_ratio:.1f}x the pixels of the {bucket} px bucket)"
    return (
        "decode the images once: resize a copy of the folder to the training resolution, or "
        f"keep the decoded tensors in memory{why}"
    )


def loader_fix(advice: Sequence[str]) -> str:
    """Join advice clauses, best first, into the finding's one ``fix`` string."""
    clauses = [a for a in advice if a]
    if not clauses:
        return ""
    text = "; or ".join(clauses)
    return text[0].upper() + text[1:] + "."


# --------------------------------------------------------------------------------------------
# The rule


def _robust_share(per_step: list[dict[str, float]]) -> float:
    """Starved share of step time, leaving out the single worst step when there are 3 or more:
    one slow batch (a cold file cache, a hiccup of the machine) is not a data-loading problem,
    a wait that repeats is."""
    rows = sorted(per_step, key=lambda r: r["device_idle_while_waiting_ms"] / r["wall_ms"])
    if len(rows) >= 3:
        rows = rows[:-1]
    wall = sum(r["wall_ms"] for r in rows)
    return sum(r["device_idle_while_waiting_ms"] for r in rows) / wall if wall else 0.0


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    waits = ctx.phases.host.get("data_wait")
    if waits is None or not len(waits):
        result.add_not_judged(
            FINDING_ID,
            "data loading: no DataLoader iteration ranges in the profiled steps (the loop does "
            "not iterate a torch DataLoader there, or the batch was fetched outside them)",
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
    word = device_word(ctx.has_device)
    if starved_share < WARN_SHARE:
        result.add_ok(FINDING_ID, not_waiting_line(wait_share, ctx.has_device, starved_share))
        return result

    workers_hint = (
        "The iterator is _SingleProcessDataLoaderIter: the DataLoader runs with num_workers=0, so "
        "every batch is loaded and decoded on the training thread. "
        if single_process
        else ""
    )
    finding = Finding(
        id=FINDING_ID,
        category="dataloader",
        severity=severity_for_share(starved_share),
        title=starved_title(starved_share, starved_per_step, ctx.has_device),
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
        # A trace does not say how many cores or which trainer: the usual advice, both halves.
        fix=loader_fix(
            [workers_advice(DEFAULT_WORKERS, pin_memory=ctx.has_device), CACHE_LATENTS_ADVICE]
        ),
        detail=(
            f"{workers_hint}The profiled steps spent {ms(total_wait / ctx.n_steps)} per step "
            f"inside next(dataloader); the {word} had no work for "
            f"{ms(starved_per_step)} of it. With the batch prepared ahead of time that wait "
            "disappears (the saving is the idle time read off the trace). `diagnose run` "
            "measures the fixes on your data with an A/B (the dataloader probe)."
        ),
        source=f"trace:{RULE}",
    )
    result.findings.append(finding)
    return result
