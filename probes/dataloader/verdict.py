"""The dataloader probe's verdict (pure: numbers in, findings and checks out).

Two questions, each under its catalog id with one answer:

- ``dataloader.gpu_starved``: does the loop wait for data? Judged on the share the phase bar shows
  (:class:`~diagnose.probes.dataloader.facts.WaitSummary`), the same one the trace rule judges;
- ``dataloader.slow_loader``: when it hardly waits, was a loader change still measured clearly
  faster (the image work is paid inside the step, typically the per-step VAE encode)?

A loader change is clearly faster when the U test of its steps against the configured loader's is
sure it saves at least :data:`MIN_MEASURED_GAIN` of the configured s/it
(:func:`diagnose.stats.clearly_faster`); severity is left to :mod:`diagnose.verdicts`, graded on
the part of the saving the A/B is sure of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose.catalogs.dataloader_catalog import (
    ADVICE_SETTING,
    CACHE_LATENTS_ADVICE,
    GPU_STARVED,
    MIN_MEASURED_GAIN,
    SLOW_LOADER,
    SLOW_LOADER_SHARE,
    gpu_starved,
    loader_fix,
    no_clear_change_line,
    not_sure_advice,
    not_waiting_line,
    nothing_sure_fix,
    predecode_advice,
    slow_loader,
    wait_at_line,
    workers_advice,
)
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.probes.dataloader.ab import MAX_WORKERS, WARMUP_STEPS, VariantRow
from diagnose.probes.dataloader.facts import LoaderConfig, WaitSummary
from diagnose.probes.dataloader.frames import HotFrames
from diagnose.record import Finding, Outcome
from diagnose.stats import at_line, clearly_faster, saving_interval
from diagnose.units import ms, pct
from diagnose.verdicts import NO_FASTER_KEY


@dataclass(frozen=True)
class Saving:
    """What one loader change saves per iteration: the median difference (bounded by what the
    changed phases lost), the part of it the A/B is sure of, and its interval's high end."""

    seconds: float
    sure: float
    high: float


def removable_seconds(configured: VariantRow, candidate: VariantRow) -> float | None:
    """Median input-phase seconds the candidate saved against the configured loader."""
    if not (configured.input_stats.n and candidate.input_stats.n):
        return None
    return float(configured.input_stats.median - candidate.input_stats.median)


def measured_saving(
    configured: VariantRow, candidate: VariantRow, bound: float | None = None
) -> Saving | None:
    """The candidate's saving when the A/B is sure it is clearly faster; else None.

    The saving never exceeds what the changed phases (wait, copy, encode) lost against the
    configured loader, nor ``bound`` (what they cost in the run's own steps): a configured step
    slowed by something else (a busy machine) must not pass for a loader fix.
    """
    base = configured.stats
    if not base.n or base.median <= 0 or not candidate.stats.n:
        return None
    least = MIN_MEASURED_GAIN * base.median
    if not clearly_faster(candidate.seconds, configured.seconds, min_saving=least):
        return None
    seconds = base.median - candidate.stats.median
    interval = saving_interval(candidate.seconds, configured.seconds) or (seconds, seconds)
    high = max(seconds, interval[1])
    for cap in (removable_seconds(configured, candidate), bound):
        if cap is not None:
            seconds = min(seconds, max(0.0, cap))
            high = min(high, max(0.0, cap))
    if seconds < least:
        return None
    return Saving(seconds, min(seconds, max(0.0, interval[0])), max(seconds, high))


@dataclass
class Verdict:
    findings: list[Finding]
    #: (check id, outcome, text) of every answer that is not a finding.
    checks: list[tuple[str, Outcome, str]] = field(default_factory=list)
    #: key -> clear saving in s/it (None: not clearly faster).
    savings: dict[str, float | None] = field(default_factory=dict)
    best: str | None = None


def _advice(row: VariantRow, facts: dict[str, Any]) -> str:
    if row.key == "workers":
        return workers_advice(row.workers, row.pin_memory)
    if row.key == "cached_latents":
        return CACHE_LATENTS_ADVICE
    if row.key == "predecoded":
        buckets = [b for b in facts.get("buckets_px") or [] if b]
        return predecode_advice(
            facts.get("pixels_decoded_per_pixel_trained"), max(buckets) if buckets else None
        )
    return ""


def _ab_sentence(rows: Sequence[VariantRow]) -> str:
    measured = [r for r in rows if r.stats.n]
    if not measured:
        return ""
    parts = [f"{r.label} {r.stats.median:.3f} s/it ({r.stats.n} steps)" for r in measured]
    return f"Measured A/B (timed steps after {WARMUP_STEPS} warm-up): " + "; ".join(parts) + "."


def judge(
    wait: WaitSummary | None,
    rows: Sequence[VariantRow],
    *,
    has_device: bool,
    loader: LoaderConfig,
    cores: int,
    facts: dict[str, Any],
    frames: HotFrames | None,
    run_input_seconds: float | None = None,
) -> Verdict:
    """Findings and checks from the run's wait and the A/B.

    ``run_input_seconds`` is what the input phases cost in the run's own timed steps: a fix can
    save no more than that, however slow the probe's A/B steps were.
    """
    configured = next((r for r in rows if r.key == "configured" and r.stats.n), None)
    measured: dict[str, Saving] = {}
    if configured is not None:
        for row in rows:
            if row.key != "configured" and row.stats.n:
                saving = measured_saving(configured, row, run_input_seconds)
                if saving is not None:
                    measured[row.key] = saving
    savings: dict[str, float | None] = {
        r.key: (measured[r.key].seconds if r.key in measured else None)
        for r in rows
        if r.key != "configured" and r.stats.n
    }
    ranked = sorted((r for r in rows if r.key in measured), key=lambda r: -measured[r.key].seconds)
    best = ranked[0] if ranked else None
    best_key = best.key if best is not None else None
    if wait is None:
        return Verdict(
            [],
            [(GPU_STARVED.id, "not_judged", "data wait: the run recorded no timed step")],
            savings,
            best_key,
        )

    ab = _ab_sentence(rows)
    evidence: dict[str, Any] = {
        "timed_steps": wait.steps,
        "per_step": wait.per_step,
        "first_batch_seconds": wait.first_batch_seconds,
        "dataloader": dataclasses.asdict(loader),
        "usable_cores": cores,
        "dataset": facts,
        "ab": [r.to_dict() for r in rows],
        "hot_frames": (
            [dataclasses.asdict(f) for f in frames.profile.top_frames[:5]]
            if frames is not None and frames.profile is not None
            else []
        ),
        "hot_frames_missing": (
            frames.reason if frames is not None and not frames.available else ""
        ),
    }
    advice = [_advice(r, facts) for r in ranked]
    bar = wait.bar
    reading = wait_at_line(bar, [row["share"] for row in wait.per_step])

    if not reading.below:
        detail = _starved_detail(loader, bar.seconds, frames, facts, has_device, cores, ab, best)
        workers_row = next((r for r in rows if r.key == "workers" and r.stats.n), None)
        if workers_row is not None and "workers" not in measured:
            detail += f" {workers_row.label[0].upper() + workers_row.label[1:]}: no clear gain" + (
                f" (on a CPU the workers take the {cores} cores the step computes on)."
                if not has_device
                else "."
            )
        if best is None and any(r.stopped_by_budget for r in rows):
            detail += f" The A/B of the loader changes was cut short: {BUDGET_STOPPED}."
        if best is not None:
            found = measured[best.key]
            # What the fix saves of the wait: the rest of its gain (the encode it also removes)
            # is not the wait's.
            wait_saving = min(found.seconds, bar.seconds)
            finding = gpu_starved(
                bar,
                has_device,
                fix=loader_fix(advice),
                detail=detail,
                evidence=evidence,
                saving=wait_saving,
                sure_saving=min(found.sure, wait_saving),
                high_saving=min(found.high, reading.high * bar.step),
                basis="measured",
                measured_fix=(best.label, found.seconds),
                reading=reading,
            )
        else:
            no_faster = _no_faster(rows, configured)
            if no_faster:
                evidence[NO_FASTER_KEY] = {
                    r.label: ADVICE_SETTING[r.key] for r in no_faster if r.key in ADVICE_SETTING
                }
            finding = gpu_starved(
                bar,
                has_device,
                fix=_unmeasured_fix(rows, configured, no_faster, cores, has_device),
                detail=detail,
                evidence=evidence,
                saving=bar.seconds,
                basis="estimated",
                reading=reading,
            )
        return Verdict([finding], [], savings, best_key)

    not_waiting: tuple[str, Outcome, str] = (
        GPU_STARVED.id,
        "ok",
        not_waiting_line(bar, has_device),
    )
    best_saving = measured[best.key] if best is not None else None
    gain = (
        at_line(
            best_saving.seconds / bar.step,
            SLOW_LOADER_SHARE,
            interval=_shares(best_saving, bar.step),
        )
        if best_saving is not None
        else None
    )
    if best is not None and best_saving is not None and gain is not None and not gain.below:
        found = best_saving
        encode = wait.phases.get("encode")
        why = (
            "the step decodes and VAE-encodes its images every time"
            + (f" (encode phase {ms(encode)}/step)" if encode else "")
            if best.key == "cached_latents"
            else "the per-step image work costs more than the wait shows"
        )
        finding = slow_loader(
            best.label,
            found.seconds,
            bar.step,
            why,
            fix=loader_fix(advice),
            detail=(
                f"The loop waits only {pct(bar.share)} of the step for batches, but the input "
                "pipeline still costs time inside the step: "
                + (
                    "decoding, resizing and VAE-encoding the same images again every epoch. "
                    if best.key == "cached_latents"
                    else ""
                )
                + ab
            ),
            evidence={"s_per_it": bar.step, "data_wait_share_of_step": bar.share, **evidence},
            sure_saving=found.sure,
            high_saving=found.high,
            reading=gain,
        )
        return Verdict([finding], [not_waiting], savings, best_key)

    checks: list[tuple[str, Outcome, str]] = [not_waiting]
    tried = [r for r in rows if r.key != "configured" and r.stats.n]
    if tried and configured is not None:
        line = no_clear_change_line([(r.label, r.stats.median) for r in [configured, *tried]])
        if any(r.stopped_by_budget for r in [configured, *tried]):
            checks.append((SLOW_LOADER.id, "not_judged", f"{line}, but {BUDGET_STOPPED}"))
        else:
            checks.append((SLOW_LOADER.id, "ok", line))
    return Verdict([], checks, savings, best_key)


def _no_faster(rows: Sequence[VariantRow], configured: VariantRow | None) -> list[VariantRow]:
    """The changes the A/B measured no faster than the configured loader (median not below)."""
    if configured is None:
        return []
    base = configured.stats.median
    return [r for r in rows if r.key != "configured" and r.stats.n and r.stats.median >= base]


def _unmeasured_fix(
    rows: Sequence[VariantRow],
    configured: VariantRow | None,
    no_faster: Sequence[VariantRow],
    cores: int,
    has_device: bool,
) -> str:
    """The fix when no change was clearly faster: the usual advice, less what the A/B measured
    no faster (a fix must not say what its evidence contradicts), and with its numbers what it
    measured faster but not surely so."""
    measured = {r.key: r for r in rows if r.key != "configured" and r.stats.n}
    skipped = {r.key for r in no_faster}
    advice: list[str] = []
    for key, text in (
        ("workers", workers_advice(max(2, min(cores, MAX_WORKERS)), has_device)),
        ("cached_latents", CACHE_LATENTS_ADVICE),
    ):
        if key in skipped:
            continue
        row = measured.get(key)
        if row is not None and configured is not None:
            text = not_sure_advice(text, row.label, row.stats.median, configured.stats.median)
        advice.append(text)
    if advice or configured is None:
        return loader_fix(advice)
    return nothing_sure_fix([(r.label, r.stats.median) for r in no_faster], configured.stats.median)


def _shares(saving: Saving, step: float) -> tuple[float, float]:
    """A saving's interval as shares of ``step``."""
    return saving.sure / step, saving.high / step


def _starved_detail(
    loader: LoaderConfig,
    wait_seconds: float,
    frames: HotFrames | None,
    facts: dict[str, Any],
    has_device: bool,
    cores: int,
    ab: str,
    best: VariantRow | None,
) -> str:
    parts: list[str] = []
    if loader.num_workers == 0:
        parts.append(
            "The DataLoader runs with num_workers=0: every batch is read, decoded and resized "
            "on the training thread, between two steps."
        )
    else:
        parts.append(
            f"The DataLoader's {loader.num_workers} workers do not keep up with the step "
            f"({cores} usable cores)."
        )
    hot = frames.headline() if frames is not None and frames.available else ""
    if hot:
        parts.append(f"Sampled with py-spy, the loader spends its time in {hot}.")
    alone = frames.seconds_per_batch if frames is not None else None
    if alone is not None:
        parts.append(
            f"Run alone, without the training step, the loader needs {ms(alone)} per batch."
        )
    if "pixel_ratio_note" in facts:
        parts.append(f"The images are large: {facts['pixel_ratio_note']}.")
    if not has_device:
        parts.append(
            "On this CPU run the device is the CPU itself: no training compute runs while the "
            "batch is loaded, so the whole wait is lost."
        )
    if ab:
        parts.append(ab)
    if best is None:
        parts.append(
            f"No change was clearly faster in the A/B, so the saving is estimated as the wait "
            f"itself ({ms(wait_seconds)}/step)."
        )
    return " ".join(parts)


__all__ = ["Saving", "Verdict", "judge", "measured_saving", "removable_seconds"]
