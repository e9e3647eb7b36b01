"""What the project knows about how the device is kept busy: finding ids, thresholds, wording,
fixes.

The trace rule :mod:`diagnose.trace.rules.launch` measures the device's wait for the host and
builds its finding here; severity is graded from the saving by :mod:`diagnose.verdicts`.
"""

from __future__ import annotations

import re
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Finding
from diagnose.stats import at_line
from diagnose.units import ms, pct

LAUNCH_BOUND = FindingSpec(
    "compute.launch_bound",
    "compute",
    "inside the steps the device sits idle waiting for the host (not for data, not in a sync): "
    "kernel launch overhead or host work between kernels",
    ("trace",),
    host_bound=True,
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
SYNC_IN_STEP = FindingSpec(
    "compute.sync_in_step",
    "compute",
    "outside the optimizer's step the host blocks until the GPU drains (`.item()`, `.cpu()`, "
    "`nonzero`, a synchronize: a blocking runtime call) and the GPU idles until the host "
    "launches again",
    ("trace",),
    at_full_size=carries_over("where the training loop reads device values is the code's"),
)
SPECS = (LAUNCH_BOUND, COMPILED_DURING_STEPS, SYNC_IN_STEP)

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
    wait_less_profiler_seconds: float | None = None,
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
    launches_per_step: float,
    profiler_us_per_launch: float,
    unprofiled_known: bool,
    capped: bool,
    evidence: dict[str, Any],
    source: str,
) -> Finding:
    """The device waits ``wait_seconds`` per step (``share`` of it) for the host.

    ``launch_bound``: the wait is mostly short gaps (launch overhead), else long host stalls.
    Counts and seconds are per step. ``unprofiled_known``: the gaps had the profiler's
    ``profiler_us_per_launch`` taken out and the step is the unprofiled one; else they are the
    profiled steps' and the finding says how much of them the profiler may be, and
    ``wait_less_profiler_seconds`` is what is left of them with the part a profiled launch is
    expected to carry (:data:`PROFILER_US_PER_LAUNCH`) taken out of each: the saving, the whole
    wait its upper end. ``capped``: the gaps added up to more than the step less the
    device's busy time and the idle other causes explain, and the wait is that ceiling."""
    caveat = ""
    saving: float | None = (
        wait_seconds if wait_less_profiler_seconds is None else wait_less_profiler_seconds
    )
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
    steps_said = "unprofiled step" if unprofiled_known else "profiled step"
    if launch_bound:
        title = (
            f"The GPU waits for kernel launches {pct(share)} of each {steps_said} "
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
            f"The GPU waits for the host {pct(share)} of each {steps_said} ({long_gaps:.0f} long "
            f"gap(s)/step, the largest {largest_gap_ms or 0:.1f} ms while the host ran "
            f"{activity})"
        )
        detail = (
            f"The device sat idle in gaps of {LONG_GAP_US / 1000:.0f} ms or more for "
            f"{ms(long_seconds)} per step while the host was neither waiting for data nor "
            "synchronising: it was running code that queues no device work."
        )
        fix = _STALL_FIX
    detail += " " + _profiler_said(
        launches_per_step,
        profiler_us_per_launch,
        unprofiled_known,
        wait_seconds,
        wait_less_profiler_seconds,
    )
    if capped:
        detail += (
            " The gaps add up to more than the step less the GPU's busy time and the idle that "
            "data, syncs and the allocator explain: the wait is that ceiling, which no fix of "
            "the host's pace can beat."
        )
    what = "the whole wait" if wait_less_profiler_seconds is None else "that rest"
    detail += (
        f" The saving is {what}; severity is judged on the part the usual fixes recover "
        f"(about {RECOVERABLE:.0%})."
    )
    return LAUNCH_BOUND.build(
        title,
        fix=fix,
        evidence=evidence,
        saving=saving,
        sure_saving=None if saving is None else saving * RECOVERABLE,
        high_saving=(
            None if saving is None or wait_less_profiler_seconds is None else wait_seconds
        ),
        basis="trace",
        detail=detail + caveat,
        source=source,
    )


def launch_wait_undecided(
    share: float, share_less_profiler: float, launches: float, gaps: float, us_per_launch: float
) -> str:
    """The launch question left open on a trace alone: the profiled steps' wait for the host is
    over the line that raises the finding, and what is left of it with the profiler's expected
    part taken out is under it."""
    return (
        f"launch overhead: the GPU waits for the host {pct(share)} of each profiled step "
        f"({gaps:.0f} short gaps a step), but the profiler adds host time to each of its "
        f"{launches:.0f} launches a step (kernels, copies, memsets; about {us_per_launch:.0f} µs "
        f"each as measured on an H200): less that, {pct(share_less_profiler)} would be left, "
        f"under the {RAISE_SHARE:.0%} line. Whether the host's pace costs anything is judged "
        "without the profiler: diagnose profile -- your training command"
    )


def _profiler_said(
    launches: float,
    us_per_launch: float,
    unprofiled_known: bool,
    wait_seconds: float,
    wait_less_profiler_seconds: float | None = None,
) -> str:
    """What the profiler did to the gaps: taken out (measured), or how much it may be and what
    is left with its expected part taken out."""
    if unprofiled_known:
        return (
            f"Read on the unprofiled step: the profiler's host time per launch ({us_per_launch:.0f}"
            f" µs, the profiled step less the unprofiled one over {launches:.0f} launches a step) "
            "was taken out of every gap first."
        )
    inflation = launches * PROFILER_US_PER_LAUNCH / 1e6
    part = f" ({pct(min(inflation / wait_seconds, 1.0))} of this wait)" if wait_seconds else ""
    rest = (
        ""
        if wait_less_profiler_seconds is None
        else f" With that much taken out of every gap, {ms(wait_less_profiler_seconds)} a step "
        f"is left (the whole {ms(wait_seconds)} if the profiler added nothing)."
    )
    return (
        "Read on the profiled steps: the profiler adds host time to every launch (about "
        f"{PROFILER_US_PER_LAUNCH:.0f} µs each as measured on an H200), so with "
        f"{launches:.0f} launches a step (kernels, copies, memsets) up to {ms(inflation)}{part} "
        "may be the profiler's own."
        f"{rest} Timed without it (diagnose run, diagnose profile), the profiler's part is "
        "measured and taken out."
    )


__all__ = [
    "LAUNCH_BOUND",
    "LONG_GAP_US",
    "RAISE_SHARE",
    "RECOVERABLE",
    "SPECS",
    "launch_bound_finding",
    "launch_wait_undecided",
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


# --------------------------------------------------------------------------------------------
# Host-device synchronisation anywhere in the step (the optimizer's own step is worded by
# diagnose.catalogs.optimizer_catalog; what a sync is and what it costs is known here)

#: Runtime calls that block the host until the device has finished the work they wait for.
BLOCKING_SYNC_CALL = re.compile(
    r"^(cuda|hip)(Device|Stream|Event|Ctx)Synchronize$|^cu(Ctx|Stream|Event)Synchronize$"
)
#: Synchronous copies: the call returns when the copy is done (ROCm reads a device scalar with
#: hipMemcpyWithStream).
BLOCKING_COPY_CALL = re.compile(
    r"^(cuda|hip)Memcpy(2D|3D|Peer|ToSymbol|FromSymbol|DtoH|HtoD|DtoD|WithStream)?$"
    r"|^cuMemcpy(DtoH|HtoD|DtoD|Peer|2D|3D)?(_v2)?$"
)
#: Asynchronous copies: they block only when the copy goes device-to-host into pageable memory
#: (the call returns after the copy ended), which the trace shows by the copy's times.
ASYNC_COPY_CALL = re.compile(r"^(cuda|hip)Memcpy(2D|3D|Peer)?Async$|^cuMemcpy\w*Async(_v2)?$")


def is_blocking_call(name: str) -> bool:
    """Whether a runtime call always blocks the host (a synchronize, a synchronous copy)."""
    return bool(BLOCKING_SYNC_CALL.match(name) or BLOCKING_COPY_CALL.match(name))


#: Host time the profiler adds to each launch on a GPU (CUPTI or roctracer callbacks and the op
#: records around them), measured on an H200 (torch 2.11, record_shapes) from profiled against
#: unprofiled steps of the same loop. Used when the unprofiled step is not known (a trace alone):
#: to say how much of the host gaps may be the profiler's, and to take that much out of every gap
#: and of the step for the saving; a measured one replaces it.
PROFILER_US_PER_LAUNCH = 30.0
#: What a wait that blocks on work in flight adds to an unprofiled step beyond what the profiled
#: trace shows of it. The profiled host reaches each wait after the device has drained, so the
#: call returns at once; without the profiler the host reaches it while the work it just launched
#: still runs, and pays the device's completion and its own wake-up. Measured on an H200: 96 such
#: waits a step cost 16 ms (norms read by .item()) and 19 ms (AdamW8bit) without the profiler,
#: where their profiled steps show about 7 ms.
UNPROFILED_WAIT_US = 100.0
#: Syncs per step from which a wait is a pattern in the code (one per tensor, per layer), not a
#: single read: the title counts them and the fix targets the loop that makes them.
MANY_SYNCS_PER_STEP = 10

#: Where in the step a sync sits: how the page says it, and what to do there. Keys are the
#: places the trace reading attributes syncs to (diagnose.trace.sync_reading).
SYNC_PLACES: dict[str, str] = {
    "clipping": "reading gradient norms on the host before optimizer.step() (gradient clipping "
    "or norm logging)",
    "logging": "reading the loss or a metric on the host (logging)",
    "before_step": "between the backward and optimizer.step()",
    "after_step": "after optimizer.step()",
    "h2d": "from pageable memory (the copy blocks until done)",
    "forward": "in the forward",
    "backward": "in the backward",
    "dataloader": "inside the DataLoader's __next__",
    "labelled": "in a range the code labels",
    "elsewhere": "elsewhere in the step",
}
_SYNC_FIXES: dict[str, str] = {
    "clipping": in_trainers(
        "Keep the norms on the device: torch.nn.utils.clip_grad_norm_(params, max_norm) clips "
        "without reading them (foreach on by default); to log the total norm, keep the tensor "
        "it returns and read it every N steps, not one .item() per parameter",
        kohya="--max_grad_norm clips on the device; drop per-parameter norm logging",
        diffusers="accelerator.clip_grad_norm_(...) and log its result every N steps",
        lightning="Trainer(gradient_clip_val=...) instead of clipping in a hook",
    ),
    "logging": in_trainers(
        "Read logged values every N steps, not every step: accumulate them on the device "
        "(total += loss.detach()) and call .item() once per logging interval",
        lightning="self.log(..., on_step=False, on_epoch=True), or log_every_n_steps",
    ),
    "h2d": in_trainers(
        "Copy the batch without blocking: pin it (DataLoader(pin_memory=True)) and move it with "
        ".to(device, non_blocking=True)",
        lightning="DataLoader(pin_memory=True); Lightning moves the batch non-blocking itself",
    ),
    "forward": (
        "Keep the forward on the device: replace .item(), .cpu(), .tolist() and tensors in "
        "Python conditions with tensor ops, and data-dependent shapes (nonzero, masked_select, "
        "boolean indexing) with fixed-size ones (torch.where, masks)"
    ),
    "backward": (
        "A custom autograd function or a hook reads a device value during the backward: keep "
        "it on the device"
    ),
    "dataloader": (
        "Keep the dataset and collate_fn on the CPU (no device tensors in workers or collate); "
        "move the batch in the loop with .to(device, non_blocking=True) from pinned memory"
    ),
}
_SYNC_FIX_ANYWHERE = (
    "Find what reads a device value on the host there (.item(), .cpu(), .tolist(), print, a "
    "tensor in an if, torch.cuda.synchronize()) and keep it on the device or do it every N "
    "steps; torch.cuda.set_sync_debug_mode('warn') prints the stack of each one"
)


def sync_fix(place: str) -> str:
    """What to do about syncs at ``place`` (a key of :data:`SYNC_PLACES`)."""
    return _SYNC_FIXES.get(place, _SYNC_FIX_ANYWHERE)


def sync_cost_detail(
    *, read_off_seconds: float, waits: float, wait_us: float, unprofiled_known: bool
) -> str:
    """How a sync finding's cost was reached, the same for every place (the optimizer's too)."""
    basis = (
        "the profiled steps' host gaps less the profiler's measured per-launch overhead"
        if unprofiled_known
        else "the profiled steps as they are (the unprofiled step is not known here)"
    )
    return (
        "Cost: from each wait to the device's next work, the host was blocked or the device "
        f"idle: {ms(read_off_seconds)} per step on {basis}, a lower bound. Without the profiler "
        f"each of the {waits:.0f} waits per step that blocks on work still running also pays "
        f"the device's completion and the host's wake-up (about {wait_us:.0f} µs each as "
        "measured on an H200), added to the estimate."
    )


def sync_cost_said(
    *, estimate_seconds: float, read_off_seconds: float, share: float | None, unprofiled_known: bool
) -> str:
    """A sync finding's cost in its title, saying which steps it is on."""
    if unprofiled_known:
        of = f", {pct(share)} of it" if share is not None else ""
        return f"≈{ms(estimate_seconds)} per unprofiled step{of}"
    return (
        f"≈{ms(estimate_seconds)} per step without the profiler (estimated; the profiled steps "
        f"show {ms(read_off_seconds)}, a lower bound)"
    )


def sync_elsewhere_finding(
    *,
    syncs_per_step: float,
    what: str,
    place: str,
    where: str,
    estimate_seconds: float,
    read_off_seconds: float,
    waits: float,
    share: float | None,
    unprofiled_known: bool,
    evidence: dict[str, Any],
    source: str,
) -> Finding:
    """``compute.sync_in_step``: ``syncs_per_step`` syncs (``what``: ".item()", ".cpu()"...) at
    ``place`` (``where`` names the op, module or range) cost ``estimate_seconds`` per unprofiled
    step."""
    many = at_line(syncs_per_step, MANY_SYNCS_PER_STEP).above
    title = (
        f"{syncs_per_step:.0f} {what} per step {SYNC_PLACES.get(place, place)}"
        + (f" ({where})" if where else "")
        + (" make" if syncs_per_step >= 1.5 else " makes")
        + " the host wait for the GPU: "
        + sync_cost_said(
            estimate_seconds=estimate_seconds,
            read_off_seconds=read_off_seconds,
            share=share,
            unprofiled_known=unprofiled_known,
        )
    )
    detail = (
        "Each wait stops the host until the GPU has drained its queue; the GPU then idles until "
        "the host launches again"
        + (", once per tensor or layer of the loop that makes them" if many else "")
        + ". "
        + sync_cost_detail(
            read_off_seconds=read_off_seconds,
            waits=waits,
            wait_us=UNPROFILED_WAIT_US,
            unprofiled_known=unprofiled_known,
        )
    )
    return SYNC_IN_STEP.build(
        title,
        fix=sync_fix(place),
        evidence=evidence,
        saving=estimate_seconds,
        basis="estimated",
        detail=detail,
        source=source,
    )


__all__ += [
    "ASYNC_COPY_CALL",
    "BLOCKING_COPY_CALL",
    "BLOCKING_SYNC_CALL",
    "MANY_SYNCS_PER_STEP",
    "PROFILER_US_PER_LAUNCH",
    "SYNC_IN_STEP",
    "SYNC_PLACES",
    "UNPROFILED_WAIT_US",
    "is_blocking_call",
    "sync_cost_detail",
    "sync_cost_said",
    "sync_elsewhere_finding",
    "sync_fix",
]
