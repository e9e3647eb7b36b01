"""The A/B of the loader fixes on the real training step.

The configured loader again, more workers (persistent, pinned on a GPU), images decoded once
(pre-decoded tensors), and cached latents (what trainers' ``--cache_latents`` does): each built
with ``make_loader`` and stepped with ``workload.step``. The steps run without updating the
weights (:func:`diagnose.workload.untouched.steps_without_update`: the optimizer's own time is the
same in every variant, so leaving it out changes no difference), and the workload's config,
loader and state are put back after each variant; every loader made here is closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from diagnose import contention
from diagnose.probes.budgets import budget_spent
from diagnose.record import Stats
from diagnose.stats import SAVING_SIGNIFICANCE, minimum_samples
from diagnose.timing import PhaseTimer
from diagnose.workload.bucket_sampler import BucketBatchSampler, SampleKey
from diagnose.workload.data import ImageFolderDataset, PreparedData, Sample, make_loader
from diagnose.workload.image_files import load_image
from diagnose.workload.untouched import steps_without_update

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

#: Warm-up steps per A/B variant (the first batch of a fresh loader pays for starting workers).
WARMUP_STEPS = 1
#: Timed steps per A/B variant: as many as the budget allows within these bounds. The least is
#: the fewest steps a side for which the U test can be sure of a saving at all.
MIN_TIMED_STEPS = minimum_samples(SAVING_SIGNIFICANCE)
MAX_TIMED_STEPS = max(5, MIN_TIMED_STEPS)
#: A variant whose steps run past this many times its share of the budget (a machine busy with
#: something else, a step far slower than the run's) stops after :data:`CAPPED_TIMED_STEPS`
#: (too few to call it clearly faster: it is reported, not judged).
VARIANT_OVERRUN_FACTOR = 2.0
CAPPED_TIMED_STEPS = 2
#: Most workers the A/B tries (more rarely helps a LoRA-sized folder, and each one is a process).
MAX_WORKERS = 8

#: The phases a loader change can shorten: the wait for the batch, its copy to the device, and
#: the VAE/text encode (cached latents). Forward, backward and optimizer are the same in every
#: variant, so a saving larger than what these phases lost is noise, not the fix.
INPUT_PHASES: tuple[str, ...] = ("data_wait", "h2d", "encode")

VariantKey = Literal["configured", "workers", "predecoded", "cached_latents"]
VARIANT_KEYS: tuple[VariantKey, ...] = ("configured", "workers", "predecoded", "cached_latents")
#: What a variant's loader hands the step: images decoded per step, decoded-once tensors, or no
#: pixels at all (latents come from the cache).
Source = Literal["decode", "predecoded", "latents"]
#: The phases the loader itself costs the step: the wait for the batch and its copy.
LOADER_PHASES: tuple[str, ...] = ("data_wait", "h2d")
#: The phases each fix can shorten: more workers and decoded-once images take the decode off the
#: step (the loader's phases); cached latents the VAE/text encode as well.
SHORTENS: dict[VariantKey, tuple[str, ...]] = {
    "configured": (),
    "workers": LOADER_PHASES,
    "predecoded": LOADER_PHASES,
    "cached_latents": INPUT_PHASES,
}


@dataclass(frozen=True)
class Unreachable:
    """A fix left out of the A/B: the phases it can shorten cost less than a saving must be."""

    key: VariantKey
    label: str
    #: Seconds per step of those phases in the run's own steps, and the s/it they are a share of.
    phase_seconds: float
    s_per_it: float
    least_share: float

    def text(self) -> str:
        phases = " + ".join(SHORTENS[self.key])
        return (
            f"A/B {self.label}: not measured. It can shorten only {phases}, which took "
            f"{self.phase_seconds * 1e3:.1f} ms of the {self.s_per_it * 1e3:.0f} ms step "
            f"({self.phase_seconds / self.s_per_it:.1%}), less than the "
            f"{self.least_share:.0%} a loader fix must save to count"
        )


def cannot_hold_saving(seconds: float | None, s_per_it: float | None, least_share: float) -> bool:
    """Whether phases that cost ``seconds`` of an ``s_per_it`` step are too small to hold the
    least saving that counts (False when either is unknown)."""
    return (
        seconds is not None
        and s_per_it is not None
        and s_per_it > 0
        and seconds < least_share * s_per_it
    )


def split_reachable(
    variants: Sequence[Variant],
    phase_seconds: Callable[[Sequence[str]], float | None],
    s_per_it: float | None,
    least_share: float,
) -> tuple[list[Variant], list[Unreachable]]:
    """The variants worth timing, and those whose phases cannot hold a saving that counts.

    A fix saves at most what its phases cost (the verdict caps every saving so), so timing one
    whose phases are below the least saving cannot change the verdict: it only spends steps.
    When no fix is left, the configured loader is not timed either.
    """
    if not s_per_it or s_per_it <= 0:
        return list(variants), []
    keep: list[Variant] = []
    left_out: list[Unreachable] = []
    for variant in variants:
        seconds = phase_seconds(SHORTENS[variant.key]) if variant.key != "configured" else None
        if seconds is not None and cannot_hold_saving(seconds, s_per_it, least_share):
            left_out.append(Unreachable(variant.key, variant.label, seconds, s_per_it, least_share))
        else:
            keep.append(variant)
    if all(v.key == "configured" for v in keep):
        keep = []
    return keep, left_out


# --------------------------------------------------------------------------------------------
# 3. The A/B of the real step


@dataclass(frozen=True)
class Variant:
    key: VariantKey
    label: str
    workers: int
    pin_memory: bool
    source: Source


@dataclass
class VariantRow:
    """One variant's measured steps."""

    key: str
    label: str
    workers: int
    pin_memory: bool
    persistent_workers: bool
    source: str
    seconds: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    #: Seconds of the :data:`INPUT_PHASES` together, per timed step.
    input_seconds: list[float] = field(default_factory=list)
    warmup_seconds: list[float] = field(default_factory=list)
    #: data_wait of the first step of a fresh loader (starting workers, filling the queue).
    first_batch_seconds: float | None = None
    #: One-off work before the steps (decoding the images once, encoding latents), not in s/it.
    setup_seconds: float = 0.0
    #: Whether the variant stopped before its planned steps because it ran past its time share.
    stopped_early: bool = False
    #: Whether what stopped it was the probe's time budget (then the A/B is not sure, and says so).
    stopped_by_budget: bool = False
    error: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.seconds)

    @property
    def wait_stats(self) -> Stats:
        return Stats.of(self.data_wait)

    @property
    def input_stats(self) -> Stats:
        return Stats.of(self.input_seconds)

    def to_dict(self) -> dict[str, Any]:
        stats, wait = self.stats, self.wait_stats
        return {
            "key": self.key,
            "label": self.label,
            "num_workers": self.workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "source": self.source,
            "s_per_it_median": stats.median if stats.n else None,
            "s_per_it_q1": stats.q1 if stats.n else None,
            "s_per_it_q3": stats.q3 if stats.n else None,
            "data_wait_median": wait.median if wait.n else None,
            "input_phases_median": self.input_stats.median if self.input_stats.n else None,
            "steps": stats.n,
            "samples": [round(s, 4) for s in self.seconds],
            "data_wait_samples": [round(s, 4) for s in self.data_wait],
            "first_batch_seconds": self.first_batch_seconds,
            "setup_seconds": round(self.setup_seconds, 3),
            "stopped_early": self.stopped_early,
            "stopped_by_budget": self.stopped_by_budget,
            "error": self.error,
        }


def variant_label(key: VariantKey, workers: int, pin_memory: bool, cached: bool) -> str:
    if key == "configured":
        extras = [f"num_workers={workers}"]
        if pin_memory:
            extras.append("pin_memory")
        if cached:
            extras.append("cached latents")
        return f"as configured ({', '.join(extras)})"
    if key == "workers":
        return f"{workers} workers (persistent{', pin_memory' if pin_memory else ''})"
    if key == "predecoded":
        return "images decoded once (tensors kept)"
    return "cached latents"


def plan_variants(
    *,
    workers: int,
    pin_memory: bool,
    decodes_images: bool,
    cache_latents: bool,
    cores: int,
    allowed: Sequence[str] = VARIANT_KEYS,
) -> list[Variant]:
    """The A/B: the configured loader, and each fix that changes something here.

    Only one thing changes per variant: more workers keep the per-step decode; the two caches
    keep the configured workers.
    """
    source: Source = "latents" if cache_latents else ("decode" if decodes_images else "latents")
    variants = [
        Variant(
            "configured",
            variant_label("configured", workers, pin_memory, cache_latents),
            workers,
            pin_memory,
            source,
        )
    ]
    more = min(cores, MAX_WORKERS)
    if source == "decode" and more > workers:
        variants.append(
            Variant(
                "workers",
                variant_label("workers", more, pin_memory, False),
                more,
                pin_memory,
                "decode",
            )
        )
    if source == "decode":
        variants.append(
            Variant(
                "predecoded",
                variant_label("predecoded", workers, pin_memory, False),
                workers,
                pin_memory,
                "predecoded",
            )
        )
    if not cache_latents:
        variants.append(
            Variant(
                "cached_latents",
                variant_label("cached_latents", workers, pin_memory, True),
                workers,
                pin_memory,
                "latents",
            )
        )
    return [v for v in variants if v.key == "configured" or v.key in allowed]


def plan_timed_steps(s_per_it: float | None, variants: int, budget: float) -> int:
    """Timed steps per variant so the A/B stays near ``budget`` seconds at the run's s/it."""
    if not s_per_it or s_per_it <= 0 or variants <= 0:
        return MIN_TIMED_STEPS
    per_variant = budget / variants / s_per_it - WARMUP_STEPS
    return int(max(MIN_TIMED_STEPS, min(MAX_TIMED_STEPS, per_variant)))


def planned_items(buckets: Sequence[int], batch: int, seed: int, n_batches: int) -> list[int]:
    """Dataset items of the first ``n_batches`` batches a fresh loader yields (any workers)."""
    sampler = BucketBatchSampler(buckets, batch, seed)
    items: set[int] = set()
    produced = epoch = 0
    while produced < n_batches:
        for keys in sampler.plan_epoch(epoch):
            items.update(key.item for key in keys)
            produced += 1
            if produced >= n_batches:
                break
        epoch += 1
    return sorted(items)


class PredecodedDataset(ImageFolderDataset):
    """The run's items with their pixels decoded once: what an in-memory image cache does.

    Items that were not decoded ahead (none, when the A/B stays within the planned batches) fall
    back to decoding. The flip is applied to the tensor, as a cheap per-step augmentation.
    """

    def __init__(self, base: ImageFolderDataset, pixels: dict[int, torch.Tensor]) -> None:
        super().__init__(base.paths, base.captions, base.buckets)
        self.pixels = pixels

    def __getitem__(self, key: int | SampleKey) -> Sample:
        index, flip = (key.item, key.flip) if isinstance(key, SampleKey) else (int(key), False)
        cached = self.pixels.get(index)
        if cached is None:
            return super().__getitem__(key)
        pixels = cached.flip(-1) if flip else cached.clone()
        return Sample(pixels, self.captions[index], self.paths[index])


def _subset(data: PreparedData, items: Sequence[int]) -> PreparedData:
    dataset = data.dataset
    subset = ImageFolderDataset(
        [dataset.paths[i] for i in items],
        [dataset.captions[i] for i in items],
        [dataset.buckets[i] for i in items],
    )
    return PreparedData(data.info, subset, data.entries)  # no temp_dir: removes nothing


class _Batches:
    """Endless batches from one loader; ``close()`` stops its workers."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.iterator: Iterator[Any] | None = None

    def next(self) -> Any:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:
            self.iterator = iter(self.loader)  # a new epoch (persistent workers are reused)
            return next(self.iterator)

    def close(self) -> None:
        # The same private hook Workload.close() uses: persistent workers otherwise live on
        # until the loader is garbage-collected.
        shutdown = getattr(self.iterator, "_shutdown_workers", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self.iterator = None


def time_steps(
    workload: Any,
    loader: DataLoader[Any],
    row: VariantRow,
    *,
    steps: int,
    warmup: int,
    sync: Callable[[], None],
    max_seconds: float | None = None,
    deadline: float | None = None,
) -> None:
    """Step ``workload`` on batches of ``loader``; fill ``row`` with the timed samples.

    Past ``max_seconds`` (warm-up included), or once the probe's ``deadline`` has passed, the
    variant stops once it has :data:`CAPPED_TIMED_STEPS` timed steps, and says so.
    """
    batches = _Batches(loader)
    timer = PhaseTimer(sync)
    contention.mark_rounds()
    began = time.perf_counter()
    try:
        for index in range(warmup + steps):
            if len(row.seconds) >= CAPPED_TIMED_STEPS and budget_spent(deadline):
                row.stopped_early = row.stopped_by_budget = True
                break
            if (
                max_seconds is not None
                and len(row.seconds) >= CAPPED_TIMED_STEPS
                and time.perf_counter() - began > max_seconds
            ):
                row.stopped_early = True
                break
            timer.reset()
            sync()
            start = time.perf_counter()
            with timer.phase("data_wait"):
                batch = batches.next()
            workload.step(batch, timer)
            sync()
            seconds = time.perf_counter() - start
            if index == 0:
                row.first_batch_seconds = timer.seconds["data_wait"]
            if index < warmup:
                row.warmup_seconds.append(seconds)
            else:
                row.seconds.append(seconds)
                row.data_wait.append(timer.seconds["data_wait"])
                row.input_seconds.append(sum(timer.seconds.get(p, 0.0) for p in INPUT_PHASES))
    finally:
        batches.close()


def _run_variant(
    workload: Any,
    variant: Variant,
    *,
    steps: int,
    warmup: int,
    sync: Callable[[], None],
    max_seconds: float | None = None,
    deadline: float | None = None,
) -> VariantRow:
    config = workload.config
    data: PreparedData = workload.data
    row = VariantRow(
        key=variant.key,
        label=variant.label,
        workers=variant.workers,
        pin_memory=variant.pin_memory,
        persistent_workers=variant.workers > 0,
        source=variant.source,
    )
    items = planned_items(data.dataset.buckets, config.batch, config.seed, warmup + steps)
    if variant.source == "latents" and not config.cache_latents:
        # Encode the latents of exactly the items these steps will see, through the workload's
        # own cache (as --cache_latents does), then step a loader that reads no image.
        started = time.perf_counter()
        workload.config = dataclasses.replace(config, cache_latents=True)
        workload.loader = make_loader(_subset(data, items), config.batch, 0, False, config.seed)
        workload.prepare_caches()
        row.setup_seconds = time.perf_counter() - started
        loader = make_loader(
            data, config.batch, variant.workers, variant.pin_memory, config.seed, decode=False
        )
    elif variant.source == "latents":
        loader = make_loader(
            data, config.batch, variant.workers, variant.pin_memory, config.seed, decode=False
        )
    elif variant.source == "predecoded":
        started = time.perf_counter()
        dataset = data.dataset
        pixels = {i: load_image(dataset.paths[i], dataset.buckets[i]) for i in items}
        cached = PreparedData(data.info, PredecodedDataset(dataset, pixels), data.entries)
        row.setup_seconds = time.perf_counter() - started
        loader = make_loader(cached, config.batch, variant.workers, variant.pin_memory, config.seed)
    else:
        loader = make_loader(data, config.batch, variant.workers, variant.pin_memory, config.seed)
    time_steps(
        workload,
        loader,
        row,
        steps=steps,
        warmup=warmup,
        sync=sync,
        max_seconds=max_seconds,
        deadline=deadline,
    )
    return row


def run_ab(
    workload: Any,
    variants: Sequence[Variant],
    *,
    steps: int,
    warmup: int = WARMUP_STEPS,
    sync: Callable[[], None],
    progress: Callable[[str], None] = lambda message: None,
    max_seconds_per_variant: float | None = None,
    deadline: float | None = None,
) -> list[VariantRow]:
    """Measure each variant; the workload is put back as it was whatever happens. Past the
    probe's ``deadline`` each variant takes its fewest steps (:func:`time_steps`)."""
    state = workload.snapshot()
    rows: list[VariantRow] = []
    try:
        with steps_without_update(workload):
            for number, variant in enumerate(variants, start=1):
                progress(f"dataloader: A/B {number}/{len(variants)}: {variant.label}")
                try:
                    rows.append(
                        _run_variant(
                            workload,
                            variant,
                            steps=steps,
                            warmup=warmup,
                            sync=sync,
                            max_seconds=max_seconds_per_variant,
                            deadline=deadline,
                        )
                    )
                except Exception as exc:  # one variant failing (e.g. workers refused) is a row
                    rows.append(_failed_row(variant, exc))
                finally:
                    # Each variant starts from the configured loader and draws the same noise.
                    workload.config, workload.loader = state.config, state.loader
                    if state.generator_state is not None:
                        workload.noise_generator.set_state(state.generator_state)
    finally:
        state.restore()
    return rows


def _failed_row(variant: Variant, exc: Exception) -> VariantRow:
    first = (str(exc).strip().splitlines() or [""])[0]
    return VariantRow(
        key=variant.key,
        label=variant.label,
        workers=variant.workers,
        pin_memory=variant.pin_memory,
        persistent_workers=variant.workers > 0,
        source=variant.source,
        error=f"{type(exc).__name__}: {first}".rstrip(": "),
    )


__all__ = [
    "CAPPED_TIMED_STEPS",
    "INPUT_PHASES",
    "MAX_TIMED_STEPS",
    "MAX_WORKERS",
    "MIN_TIMED_STEPS",
    "VARIANT_KEYS",
    "VARIANT_OVERRUN_FACTOR",
    "WARMUP_STEPS",
    "PredecodedDataset",
    "Source",
    "Variant",
    "VariantKey",
    "VariantRow",
    "plan_timed_steps",
    "plan_variants",
    "planned_items",
    "run_ab",
    "time_steps",
    "variant_label",
]
