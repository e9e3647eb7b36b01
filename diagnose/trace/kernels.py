"""Kernel classes for NVIDIA and AMD kernel names, and the per-class and per-kernel tables.

Classes are decided from the kernel name (cuBLAS/cuBLASLt/CUTLASS/Tensile/hipBLASLt GEMMs,
cuDNN/MIOpen/CK convolutions, FlashAttention/AOTriton/CK/xFormers/cuDNN attention, ...), refined
by the operator that launched it: a GEMM kernel launched by a convolution op (MIOpen and CK run
convolutions as batched GEMMs) is a convolution. A name that matches nothing lands in ``other``
and is listed, never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from diagnose.trace.intervals import EMPTY, subtract, union, union_of
from diagnose.trace.kernel_classes import COUNTED_ONCE_PRECEDENCE, KERNEL_CLASSES, classify_kernel
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.steps import StepSet
from diagnose.trace.structure import Structure

_CONV_OP = re.compile(r"conv(?!ert)", re.IGNORECASE)


def short_kernel_name(name: str, limit: int = 120) -> str:
    """A readable name: no ``void`` prefix, template arguments and parameters cut to ``limit``."""
    text = name[5:] if name.startswith("void ") else name
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class KernelLabels:
    """Per device activity: class index into :data:`KERNEL_CLASSES`."""

    classes: npt.NDArray[np.int8]

    def class_of(self, index: int) -> str:
        return KERNEL_CLASSES[int(self.classes[index])]


def label_kernels(trace: ParsedTrace, structure: Structure) -> KernelLabels:
    device = trace.device
    if not len(device):
        return KernelLabels(np.empty(0, dtype=np.int8))
    class_index = {c: i for i, c in enumerate(KERNEL_CLASSES)}
    # Classify each distinct (name, kind) once.
    keys = device.name.astype(np.int64) * 4 + device.kind
    unique, inverse = np.unique(keys, return_inverse=True)
    per_unique = np.array(
        [class_index[classify_kernel(trace.names[int(k) // 4], int(k) % 4)] for k in unique],
        dtype=np.int8,
    )
    classes = per_unique[inverse.reshape(-1)]
    # GEMMs launched by a convolution op are the convolution (MIOpen/CK/cuDNN implicit GEMM).
    gemm = np.flatnonzero((classes == class_index["gemm"]) & (structure.device_op >= 0))
    if gemm.size:
        ops = structure.device_op[gemm]
        roots = structure.root_op[ops]
        name_ids = np.unique(
            np.concatenate([trace.host.name[ops], trace.host.name[roots[roots >= 0]]])
        )
        conv_ids = np.array(
            [i for i in name_ids.tolist() if _CONV_OP.search(trace.names[i])], dtype=np.int32
        )
        if conv_ids.size:
            by_op = np.isin(trace.host.name[ops], conv_ids)
            by_root = (roots >= 0) & np.isin(trace.host.name[np.maximum(roots, 0)], conv_ids)
            classes[gemm[by_op | by_root]] = class_index["conv"]
    return KernelLabels(classes)


@dataclass
class KernelClassStat:
    """Device time of one kernel class."""

    name: str
    #: Device seconds per step (summed kernel durations; overlapping streams both count).
    seconds_per_step: float
    total_seconds: float
    calls: int
    #: Share of all summed kernel time in the steps.
    share: float
    #: The most expensive kernels of this class (shortened names).
    examples: list[str] = field(default_factory=list)
    #: Device seconds per step counted once: the instants this class holds the device, where
    #: classes overlap the first in ``COUNTED_ONCE_PRECEDENCE``; the classes add up to the busy
    #: time.
    once_seconds_per_step: float = 0.0
    #: Share of the device-busy time in the steps.
    once_share: float = 0.0


@dataclass
class KernelStat:
    name: str
    kernel_class: str
    calls: int
    total_seconds: float
    mean_us: float
    seconds_per_step: float
    share: float


@dataclass
class KernelTables:
    classes: list[KernelClassStat]
    top: list[KernelStat]
    #: Every kernel name classed "other", with its total seconds, most expensive first.
    unclassified: list[tuple[str, float]]
    #: Summed kernel seconds per class per step (one dict per step).
    summed_per_step: list[dict[str, float]]
    #: Device seconds per class per step counted once (one dict per step): they add up to the
    #: step's busy time.
    once_per_step: list[dict[str, float]]


def in_steps_mask(ts: npt.NDArray[np.float64], steps: StepSet) -> npt.NDArray[np.intp]:
    """For each timestamp, the index of the step window it falls in, or -1."""
    starts = np.array([s.start_us for s in steps.steps])
    ends = np.array([s.end_us for s in steps.steps])
    if not starts.size:
        return np.full(ts.shape, -1, dtype=np.intp)
    idx = np.searchsorted(starts, ts, side="right") - 1
    safe = np.maximum(idx, 0)
    inside = (idx >= 0) & (ts < ends[safe])
    return np.where(inside, idx, -1)


def kernel_tables(
    trace: ParsedTrace,
    labels: KernelLabels,
    steps: StepSet,
    primary_device: int,
    top_n: int = 25,
) -> KernelTables:
    device = trace.device
    n_steps = max(len(steps.steps), 1)
    empty_per_step: list[dict[str, float]] = [{} for _ in steps.steps]
    if not len(device) or primary_device < 0:
        return KernelTables([], [], [], empty_per_step, empty_per_step)
    step_of = in_steps_mask(device.ts, steps)
    selected = np.flatnonzero((step_of >= 0) & (device.device == primary_device))
    if not selected.size:
        return KernelTables([], [], [], empty_per_step, empty_per_step)
    dur_s = device.dur[selected] / 1e6
    classes = labels.classes[selected]
    total_time = float(dur_s.sum()) or 1.0

    # Per kernel name.
    names = device.name[selected]
    unique_names, inverse = np.unique(names, return_inverse=True)
    name_time = np.bincount(inverse, weights=dur_s)
    name_calls = np.bincount(inverse)
    name_class = np.zeros(unique_names.size, dtype=np.int8)
    name_class[inverse] = (
        classes  # a name keeps one class (conv refinement is per name+op; last wins)
    )
    order = np.argsort(-name_time, kind="stable")
    once_per_step = counted_once(trace, labels, steps, primary_device)
    once_totals = {c: sum(d.get(c, 0.0) for d in once_per_step) for c in KERNEL_CLASSES}
    busy_total = sum(once_totals.values()) or 1.0

    class_stats: list[KernelClassStat] = []
    for ci, cls in enumerate(KERNEL_CLASSES):
        mask = classes == ci
        if not mask.any():
            continue
        seconds = float(dur_s[mask].sum())
        examples = [
            short_kernel_name(trace.names[int(unique_names[k])], 80)
            for k in order.tolist()
            if name_class[k] == ci
        ][:3]
        class_stats.append(
            KernelClassStat(
                name=cls,
                seconds_per_step=seconds / n_steps,
                total_seconds=seconds,
                calls=int(mask.sum()),
                share=seconds / total_time,
                examples=examples,
                once_seconds_per_step=once_totals[cls] / n_steps,
                once_share=once_totals[cls] / busy_total,
            )
        )
    class_stats.sort(key=lambda c: (-c.total_seconds, KERNEL_CLASSES.index(c.name)))

    top = [
        KernelStat(
            name=trace.names[int(unique_names[k])],
            kernel_class=KERNEL_CLASSES[int(name_class[k])],
            calls=int(name_calls[k]),
            total_seconds=float(name_time[k]),
            mean_us=float(name_time[k]) / int(name_calls[k]) * 1e6,
            seconds_per_step=float(name_time[k]) / n_steps,
            share=float(name_time[k]) / total_time,
        )
        for k in order[:top_n].tolist()
    ]
    other = KERNEL_CLASSES.index("other")
    unclassified = [
        (trace.names[int(unique_names[k])], float(name_time[k]))
        for k in order.tolist()
        if name_class[k] == other
    ]

    n_classes = len(KERNEL_CLASSES)
    cells = step_of[selected].astype(np.int64) * n_classes + classes
    sums = np.bincount(cells, weights=dur_s, minlength=len(steps.steps) * n_classes)
    grid = sums.reshape(len(steps.steps), n_classes)
    summed_per_step = [
        {KERNEL_CLASSES[i]: float(v) for i, v in enumerate(row.tolist()) if v > 0} for row in grid
    ]
    return KernelTables(class_stats, top, unclassified, summed_per_step, once_per_step)


def counted_once(
    trace: ParsedTrace, labels: KernelLabels, steps: StepSet, primary_device: int
) -> list[dict[str, float]]:
    """Per step, the device seconds of each class counted once: every instant the device is busy
    goes to one class, the first of ``COUNTED_ONCE_PRECEDENCE`` running then. Kernels that cross
    a step's edge count for the part inside it."""
    device = trace.device
    per_step: list[dict[str, float]] = [{} for _ in steps.steps]
    on_device = device.device == primary_device
    covered = EMPTY
    for cls in COUNTED_ONCE_PRECEDENCE:
        mask = on_device & (labels.classes == KERNEL_CLASSES.index(cls))
        if not mask.any():
            continue
        starts = device.ts[mask]
        running = union(starts, starts + device.dur[mask])
        held = subtract(running, covered)
        covered = union_of([covered, running])
        for seconds, step in zip(per_step, steps.steps, strict=True):
            micros = held.clip(step.start_us, step.end_us).total
            if micros > 0:
                seconds[cls] = micros / 1e6
    return per_step
