"""What the project knows about how the device is kept busy: finding ids, thresholds, wording,
fixes.

The trace rule :mod:`diagnose.trace.rules.launch` measures the device's wait for the host and
builds its finding here; severity is graded from the saving by :mod:`diagnose.verdicts`.
"""

from __future__ import annotations

from typing import Any

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Finding
from diagnose.trace.rules import ms, pct

LAUNCH_BOUND = FindingSpec(
    "compute.launch_bound",
    "compute",
    "inside the steps the device sits idle waiting for the host (not for data, not in a sync): "
    "kernel launch overhead or host work between kernels",
    ("trace",),
    # Only without step markers is there no per-step saving: the trace window may hold setup, so
    # the finding is indicative and never more than a warning.
    severity_without_saving="warn",
    at_full_size=tiny_model_only(
        "a tiny model's kernels are short, so launch overhead shows; the real model's longer "
        "kernels hide it"
    ),
)
COMPILED_DURING_STEPS = FindingSpec(
    "compute.compiled_during_steps",
    "compute",
    "torch.compile compiled code while the steps were timed: recompiles (changing shapes, guards "
    "that fail), so the s/it holds compilation",
    ("probe",),
    severity_without_saving="warn",
    at_full_size=carries_over(
        "what makes dynamo recompile (shapes, guards, graph breaks) is the code's, at any size"
    ),
)
SPECS = (LAUNCH_BOUND, COMPILED_DURING_STEPS)

#: A finding is raised when the device waits for the host for at least this share of the step.
RAISE_SHARE = 0.25
#: A gap at least this long (µs) is a host stall, not the cost of launching the next kernel.
LONG_GAP_US = 1000.0
#: The part of the wait the usual fixes (graphs, compile, bigger batch, host work moved out)
#: recover: severity is graded on it, the whole wait is the saving's upper end.
RECOVERABLE = 0.5

_LAUNCH_FIX = in_trainers(
    "Cut launch overhead: torch.compile the model (fuses small kernels; "
    'mode="reduce-overhead" adds CUDA/HIP graphs), raise the batch size, use fused or foreach '
    "optimizers (torch.optim.AdamW(fused=True)), keep .item() and logging out of the step",
    kohya="--train_batch_size, --optimizer_type AdamW with fused=True in --optimizer_args",
    diffusers="--train_batch_size, --dataloader_num_workers, torch.compile(unet)",
)
_STALL_FIX = in_trainers(
    "Move host work out of the step: precompute or cache inputs, log and save checkpoints less "
    "often, avoid per-step Python preprocessing; torch.compile's warm-up belongs before the "
    "profiled steps. py-spy shows the Python that runs in the gaps",
    kohya="--cache_latents --cache_text_encoder_outputs",
    diffusers="precompute the text embeddings and latents once",
    onetrainer="latent caching on",
)


def launch_bound_finding(
    *,
    share: float,
    wait_seconds: float,
    launch_bound: bool,
    short_gaps: float,
    short_seconds: float,
    long_gaps: float,
    long_seconds: float,
    kernels_per_step: float,
    median_short_gap_us: float | None,
    median_kernel_us: float | None,
    largest_gap_ms: float | None,
    largest_gap_activity: str,
    steps: int,
    whole_trace: bool,
    evidence: dict[str, Any],
    source: str,
) -> Finding:
    """The device waits ``wait_seconds`` per step (``share`` of it) for the host.

    ``launch_bound``: the wait is mostly short gaps (launch overhead), else long host stalls.
    Counts and seconds are per step."""
    caveat = ""
    saving: float | None = wait_seconds
    if not launch_bound and steps < 2:
        caveat += (
            " With a single profiled step a stall that repeats every step cannot be told from "
            "one-off warm-up; profile several steady-state steps."
        )
    if whole_trace:
        # Without step markers the window includes setup (context creation, compile, autotune):
        # the per-iteration saving cannot be said.
        saving = None
        caveat += (
            " The trace has no step markers, so the window may include setup (context "
            "creation, compilation, autotuning); profile a few steady-state steps with "
            "torch.profiler.schedule and prof.step() for a per-step number."
        )
    if launch_bound:
        title = (
            f"The GPU waits for kernel launches {pct(share)} of each step "
            f"({short_gaps:.0f} gaps/step, median {median_short_gap_us or 0:.0f} µs; "
            f"{kernels_per_step:.0f} kernels/step"
            + (f", median {median_kernel_us:.0f} µs" if median_kernel_us is not None else "")
            + ")"
        )
        detail = (
            f"The device ran out of queued work {short_gaps:.0f} times per step for a short "
            f"while ({ms(short_seconds)} per step): the host issues kernels more slowly than the "
            "device runs them (small batch, many tiny ops, Python dispatch)."
        )
        fix = _LAUNCH_FIX
    else:
        activity = largest_gap_activity or "no op (Python code)"
        title = (
            f"The GPU waits for the host {pct(share)} of each step ({long_gaps:.0f} long "
            f"gap(s)/step, the largest {largest_gap_ms or 0:.1f} ms while the host ran "
            f"{activity})"
        )
        detail = (
            f"The device sat idle in gaps of {LONG_GAP_US / 1000:.0f} ms or more for "
            f"{ms(long_seconds)} per step while the host was neither waiting for data nor "
            "synchronising: it was running code that queues no device work."
        )
        fix = _STALL_FIX
    detail += (
        " The saving is the whole wait read off the trace; severity is judged on the part the "
        f"usual fixes recover (about {RECOVERABLE:.0%})."
    )
    return LAUNCH_BOUND.build(
        title,
        fix=fix,
        evidence=evidence,
        saving=saving,
        sure_saving=None if saving is None else saving * RECOVERABLE,
        basis="trace",
        detail=detail + caveat,
        source=source,
    )


__all__ = [
    "LAUNCH_BOUND",
    "LONG_GAP_US",
    "RAISE_SHARE",
    "RECOVERABLE",
    "SPECS",
    "launch_bound_finding",
]


_RECOMPILE_FIX = in_trainers(
    "Find what recompiles with TORCH_LOGS=recompiles (it names the failing guard). For changing "
    "input shapes mark the varying dimension dynamic (torch._dynamo.mark_dynamic, or "
    "torch.compile(dynamic=True)), or bucket inputs to a few fixed shapes; for a guard on a "
    "Python value (a step counter, a flag) make it a tensor or move it out of the compiled code; "
    "a warm-up that is still compiling needs more steps skipped (diagnose profile --skip-steps)",
    kohya="with --torch_compile, keep bucketing (--enable_bucket) to few resolutions",
    diffusers="with torch.compile(unet), use a fixed --resolution and no random crops of new sizes",
)


def compiled_during_steps_finding(
    *,
    frames: int,
    graphs: int,
    timed_steps: int,
    graph_breaks: dict[str, int],
    evidence: dict[str, Any],
    source: str,
) -> Finding:
    """torch.compile compiled ``frames`` frames (``graphs`` new graphs) during the timed steps."""
    per_step = frames / timed_steps if timed_steps else 0.0
    breaks = sum(graph_breaks.values())
    title = (
        f"torch.compile compiled {frames} frame(s) during the {timed_steps} timed steps "
        f"({per_step:.1f} per step): the s/it includes compilation"
    )
    detail = (
        f"Dynamo's counters went up by {frames} compiled frame(s) and {graphs} new graph(s) "
        f"between the first and the last timed step"
        + (f", with {breaks} graph break(s)" if breaks else "")
        + ". Compiling takes from tenths of a second to minutes a frame, so a step that compiles "
        "is far slower than one that does not: with a recompile in every step the s/it is "
        "mostly compilation; with a few, the median hides them but the run still pays them. "
        "How much it costs is not measured here (the compiling steps cannot be timed without "
        "compiling)."
    )
    return COMPILED_DURING_STEPS.build(
        title, fix=_RECOMPILE_FIX, evidence=evidence, detail=detail, source=source
    )
