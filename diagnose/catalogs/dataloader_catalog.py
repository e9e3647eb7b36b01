"""What the project knows about data loading: finding ids, thresholds, wording, fixes, and the one
way the wait is measured.

The dataloader probe (``diagnose.probes.dataloader.probe``) and the trace rule
(``diagnose.trace.rules.dataloader``) both ask "does the loop wait for data?" under one check id,
``dataloader.gpu_starved``, and both answer it with :func:`bar_wait`: the ``data_wait`` phase as
the report's phase bar shows it, over the headline step. A record therefore never quotes one share
in a finding and another in the bar, whichever steps a source looked at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diagnose.catalogs import FindingSpec, carries_over, in_trainers, tiny_model_only
from diagnose.record import Basis, Finding, RunRecord, phase_bound, step_seconds
from diagnose.stats import AtLine, at_line
from diagnose.units import ms, pct, per_it
from diagnose.verdicts import borderline_at

GPU_STARVED = FindingSpec(
    "dataloader.gpu_starved",
    "dataloader",
    "the loop waits for the next batch while the GPU idles",
    ("probe", "trace"),
    phases=("data_wait",),
    probe_answer_stands=True,
    at_full_size=tiny_model_only(
        "the wait is measured against the tiny model's short step: the same loader leaves a "
        "larger share of a tiny step waiting than of the real model's"
    ),
)
SLOW_LOADER = FindingSpec(
    "dataloader.slow_loader",
    "dataloader",
    "the loop hardly waits, yet a loader change (cached latents, pre-decoded images, more "
    "workers) was measured clearly faster: the image work is paid inside the step",
    ("probe",),
    # What a loader change can shorten: the wait, the batch's copy, the per-step VAE encode.
    phases=("data_wait", "h2d", "encode"),
    at_full_size=tiny_model_only(
        "the loader's work is measured against the tiny model's short step; behind the real "
        "model's longer step it is a smaller share, and workers may hide it"
    ),
)
CORRUPT_IMAGES = FindingSpec(
    "dataloader.corrupt_images",
    "dataloader",
    "files of the data folder that could not be decoded",
    ("probe",),
    # A trainer stops or loops on such a file: worth a warning although it costs no time here.
    severity_without_saving="warn",
    at_full_size=carries_over("a property of the image files, whatever the model"),
)
SPECS = (GPU_STARVED, SLOW_LOADER, CORRUPT_IMAGES)

# Questions that cannot end in a finding, asked by the probe.
#: Files of the data folder that are neither images nor captions (skipped, said once).
SKIPPED_FILES_CHECK = "dataloader.skipped_files"
#: Which Python frames the loader spends its time in (py-spy).
HOT_FRAMES_CHECK = "dataloader.hot_frames"


def ab_check(variant_key: str) -> str:
    """The check id of one A/B variant that could not be measured."""
    return f"dataloader.ab_{variant_key}"


#: Share of the step spent waiting for data from which ``gpu_starved`` is raised (severity is the
#: one rule's in :mod:`diagnose.verdicts`).
STARVED_SHARE = 0.10
#: A loader change counts as clearly faster when the A/B is sure it saves at least this share of
#: the configured s/it (see the probe's ``measured_saving``).
MIN_MEASURED_GAIN = 0.05
#: Share of the step a clearly faster loader change must save for ``slow_loader`` to be raised.
SLOW_LOADER_SHARE = 0.10
#: Workers recommended when the trace cannot tell how many cores the machine has.
DEFAULT_WORKERS = 4
#: How many file names a finding lists (the counts are always complete).
MAX_LISTED_FILES = 10


# --------------------------------------------------------------------------------------------
# The one measurement of the wait


@dataclass(frozen=True)
class BarWait:
    """The data wait as the report's phase bar shows it."""

    #: Seconds per step in ``data_wait`` (median over the steps, scaled as the bar is).
    seconds: float
    #: The headline step (median s/it) the share is of.
    step: float

    @property
    def share(self) -> float:
        return self.seconds / self.step if self.step > 0 else 0.0


def bar_wait(record: RunRecord) -> BarWait | None:
    """``record.breakdown``'s data wait over the headline step; None without phases or steps.

    The same function for the probe (the run's timed steps) and the trace rule (the record the
    trace becomes), and the same bound :mod:`diagnose.verdicts` caps the saving at.
    """
    step = step_seconds(record)
    if step is None or not record.breakdown.seconds:
        return None
    seconds = phase_bound(record, ("data_wait",)) or 0.0
    return BarWait(min(seconds, step), step)


def wait_at_line(wait: BarWait, per_step_shares: Sequence[float]) -> AtLine:
    """The bar's wait share against :data:`STARVED_SHARE`, carrying the interval of the steps'
    own shares: a wait that sits at the line reads borderline, not starved one run and fine the
    next."""
    return at_line(wait.share, STARVED_SHARE, samples=per_step_shares)


# --------------------------------------------------------------------------------------------
# Wording


def device_word(has_device: bool) -> str:
    """What computes the step: the GPU, or on a CPU run the CPU itself."""
    return "GPU" if has_device else "CPU"


def starved_title(wait: BarWait, has_device: bool, steps: str = "each step") -> str:
    """``The training loop waits for data 35% of each step (310 ms/step) while the GPU idles``.

    ``steps`` names the steps the share is of: a trace rule inside ``diagnose run`` read "each
    profiled step", which may differ from the run's phase bar (measured on the timed steps)."""
    idle = "the GPU idles" if has_device else "compute stops"
    return (
        f"The training loop waits for data {pct(wait.share)} of {steps} "
        f"({ms(wait.seconds)}/step) while {idle}"
    )


def not_waiting_line(wait: BarWait, has_device: bool, idle_share: float | None = None) -> str:
    """The answer when the loop hardly waits: ``data loading: 2% of the step; the GPU is not
    waiting``. ``idle_share`` (a GPU trace: device idle while the host waits) is added when known.
    """
    who = "the GPU is" if has_device else "compute is"
    line = f"data loading: {pct(wait.share)} of the step; {who} not waiting"
    if idle_share is not None and has_device:
        line += f" (GPU idle while waiting: {pct(idle_share)})"
    return line


def no_clear_change_line(rows: Sequence[tuple[str, float]]) -> str:
    """The answer when no loader change was clearly faster: ``(label, median s/it)`` per row."""
    listed = "; ".join(f"{label} {median:.3f}" for label, median in rows)
    return f"data loading: no loader change measured clearly faster ({listed} s/it)"


def workers_advice(workers: int, pin_memory: bool) -> str:
    """Background workers, in torch's and the trainers' words (a clause, no final stop)."""
    pin = ", pin_memory=True" if pin_memory else ""
    trainers = in_trainers(
        kohya=f"--max_data_loader_n_workers {workers} --persistent_data_loader_workers",
        diffusers=f"--dataloader_num_workers {workers}",
        onetrainer=f"dataloader_threads {workers}",
        lightning=f"DataLoader(num_workers={workers}, persistent_workers=True) in "
        "train_dataloader() of the LightningDataModule (or the LightningModule)",
    )
    return (
        f"load batches in background workers: DataLoader(num_workers={workers}{pin}, "
        f"persistent_workers=True) ({trainers})"
    )


#: Cached latents, in the trainers' words (a clause, no final stop).
CACHE_LATENTS_ADVICE = (
    "cache the latents so no image is decoded or VAE-encoded per step ("
    + in_trainers(
        kohya="--cache_latents or --cache_latents_to_disk (kept between runs), which rule out "
        "--random_crop and --color_aug",
        diffusers="--cache_latents in the DreamBooth LoRA scripts that have it",
        onetrainer="latent caching on",
        ai_toolkit="cache_latents_to_disk: true in the dataset",
    )
    + ")"
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


#: The words of each loader change's advice a fix must not carry when the A/B measured that
#: change no faster than the loader as configured (diagnose.verdicts checks every record).
ADVICE_SETTING = {
    "workers": "DataLoader(num_workers=",
    "cached_latents": "cache the latents",
    "predecoded": "decode the images once",
}


def not_sure_advice(advice: str, label: str, median: float, configured: float) -> str:
    """Advice for a change the A/B measured faster, but not surely so: said with its numbers."""
    return (
        f"{advice} (the A/B's {label} ran {median:.3f} against {configured:.3f} s/it here, "
        "faster but not surely so on these steps)"
    )


def nothing_sure_fix(rows: Sequence[tuple[str, float]], configured: float) -> str:
    """The fix when every loader change measured here was no faster than the configured one:
    what was measured, and how to learn more, rather than a change the numbers contradict."""
    listed = "; ".join(f"{label} {median:.3f}" for label, median in rows)
    return (
        f"No loader change measured here was faster than the loader as configured "
        f"({configured:.3f} s/it; {listed} s/it): find what each batch costs in the frames the "
        "loader spends its time in (below), or rerun on an idle machine with more steps "
        "(--steps) to measure the changes again."
    )


def loader_fix(advice: Sequence[str]) -> str:
    """Advice clauses, best first, as one ``fix``: ``Cache the latents (…); or load batches …``."""
    clauses = [a for a in advice if a]
    if not clauses:
        return ""
    text = "; or ".join(clauses)
    return text[0].upper() + text[1:] + "."


def usual_fix(workers: int, pin_memory: bool) -> str:
    """The fix when nothing was measured: workers and cached latents, both halves."""
    return loader_fix([workers_advice(workers, pin_memory), CACHE_LATENTS_ADVICE])


# --------------------------------------------------------------------------------------------
# Builders: the one place each finding is made


def gpu_starved(
    wait: BarWait,
    has_device: bool,
    *,
    fix: str,
    detail: str,
    evidence: Mapping[str, Any],
    saving: float,
    basis: Basis,
    sure_saving: float | None = None,
    high_saving: float | None = None,
    measured_fix: tuple[str, float] | None = None,
    source: str = "",
    steps: str = "each step",
    reading: AtLine | None = None,
) -> Finding:
    """The loop waits for data ``wait.share`` of the step. ``measured_fix``: the label of the
    loader change the A/B measured clearly faster, and its saving per iteration. ``reading``:
    the wait against its line (:func:`wait_at_line`); a borderline one is said so. Without a
    sure saving the saving's interval is the wait's own."""
    title = starved_title(wait, has_device, steps)
    borderline = None
    if reading is not None:
        if reading.borderline:
            borderline = borderline_at(reading, "data wait", " of the step")
        if sure_saving is None and high_saving is None:
            sure_saving, high_saving = reading.low * wait.step, reading.high * wait.step
    if measured_fix is not None:
        label, seconds = measured_fix
        title += f"; {label}: measured {per_it(seconds)} faster"
        if saving is not None and seconds > saving * 1.05:
            # The fix removes more than the wait (cached latents skip the VAE encode too): the
            # finding's saving is the wait's part, said here so that the two numbers agree.
            title += f", {ms(saving)} of it the wait"
    return GPU_STARVED.build(
        title,
        fix=fix,
        evidence={
            "data_wait_seconds_per_step": wait.seconds,
            "data_wait_share_of_step": wait.share,
            "s_per_it": wait.step,
            "share_basis": "the data_wait phase of the phase bar over the median step",
            **(
                {"data_wait_share_interval": reading.share_interval()}
                if reading is not None
                else {}
            ),
            **evidence,
        },
        saving=saving,
        sure_saving=sure_saving,
        high_saving=high_saving,
        borderline=borderline,
        basis=basis,
        detail=detail,
        source=source,
    )


def slow_loader(
    label: str,
    saving: float,
    step: float,
    why: str,
    *,
    fix: str,
    detail: str,
    evidence: Mapping[str, Any],
    sure_saving: float | None = None,
    high_saving: float | None = None,
    reading: AtLine | None = None,
) -> Finding:
    """The loop hardly waits, yet the loader change ``label`` measured ``saving`` s/it faster
    (a share of the headline ``step``; ``reading``: that share against its line)."""
    return SLOW_LOADER.build(
        f"{label[0].upper() + label[1:]}: measured {per_it(saving)} faster "
        f"({pct(saving / step)} of the step); {why}",
        fix=fix,
        evidence=evidence,
        saving=saving,
        sure_saving=sure_saving,
        high_saving=high_saving,
        borderline=(
            borderline_at(reading, "measured saving", " of the step")
            if reading is not None and reading.borderline
            else None
        ),
        basis="measured",
        detail=detail,
    )


def corrupt_images(
    folder: str,
    corrupt: Sequence[str],
    reasons: Mapping[str, str],
    *,
    usable_images: int,
    skipped_non_images: int,
    skipped_examples: Sequence[str],
) -> Finding:
    """Image files the loader had to skip because they could not be decoded."""
    names = list(corrupt[:MAX_LISTED_FILES])
    more = len(corrupt) - len(names)
    listed = ", ".join(names) + (f" and {more} more" if more else "")
    count = len(corrupt)
    return CORRUPT_IMAGES.build(
        f"{count} image file{'s' if count != 1 else ''} in the data folder could not be "
        f"decoded and {'were' if count != 1 else 'was'} skipped: {listed}",
        evidence={
            "folder": folder,
            "corrupt": names,
            "corrupt_count": count,
            "reasons": {name: reasons.get(name, "") for name in names},
            "usable_images": usable_images,
            "skipped_non_images": skipped_non_images,
            "skipped_examples": list(skipped_examples),
        },
        fix=(
            "Re-export or remove the listed files (most trainers stop with an error, or loop "
            "on it, when they reach an image PIL cannot decode); diagnose never changes the "
            "folder."
        ),
        detail=(
            "Each file was opened, verified and decoded once when the folder was scanned; the "
            "reasons are the first line of PIL's error. The measurement used the "
            f"{usable_images} usable images."
        ),
    )


__all__ = [
    "ADVICE_SETTING",
    "CACHE_LATENTS_ADVICE",
    "CORRUPT_IMAGES",
    "DEFAULT_WORKERS",
    "GPU_STARVED",
    "HOT_FRAMES_CHECK",
    "MAX_LISTED_FILES",
    "MIN_MEASURED_GAIN",
    "SKIPPED_FILES_CHECK",
    "SLOW_LOADER",
    "SLOW_LOADER_SHARE",
    "SPECS",
    "STARVED_SHARE",
    "BarWait",
    "ab_check",
    "bar_wait",
    "corrupt_images",
    "device_word",
    "gpu_starved",
    "loader_fix",
    "no_clear_change_line",
    "not_sure_advice",
    "not_waiting_line",
    "nothing_sure_fix",
    "predecode_advice",
    "slow_loader",
    "starved_title",
    "usual_fix",
    "wait_at_line",
    "workers_advice",
]
