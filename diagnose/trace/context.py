"""Everything the passive rules read about one trace, computed once."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt

from diagnose.record import Breakdown
from diagnose.trace.breakdown import PhaseModel, StepBreakdown
from diagnose.trace.device import DeviceSummary
from diagnose.trace.intervals import Intervals
from diagnose.trace.kernels import KernelLabels, KernelTables, in_steps_mask
from diagnose.trace.modules import ModuleScopes, module_scopes
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.steps import StepSet
from diagnose.trace.structure import Structure

#: Evidence key of a finding whose saving a rule already put on the unprofiled steps (it knew the
#: unprofiled step): the record's scaling of trace savings to that step leaves it as it is.
SAVING_ON_UNPROFILED_STEPS = "saving_on_unprofiled_steps"


_Reading = TypeVar("_Reading")


@dataclass
class TraceContext:
    trace: ParsedTrace
    structure: Structure
    device: DeviceSummary
    steps: StepSet
    #: Union of activity on the primary device.
    busy: Intervals
    has_device: bool
    kernels: KernelLabels
    kernel_tables: KernelTables
    phases: PhaseModel
    per_step: list[StepBreakdown]
    breakdown: Breakdown
    #: The median step timed without the profiler, when the caller measured one (``diagnose
    #: run``, ``diagnose profile``): rules then judge on the unprofiled basis.
    unprofiled_step_seconds: float | None = None
    _inclusive: npt.NDArray[np.float64] | None = field(default=None, repr=False)
    _modules: ModuleScopes | None = field(default=None, repr=False)
    _launches: npt.NDArray[np.float64] | None = field(default=None, repr=False)
    #: Readings several rules share, each made once (:meth:`read_once`).
    _readings: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def n_steps(self) -> int:
        return max(len(self.steps.steps), 1)

    @property
    def wall_seconds(self) -> float:
        """Summed wall time of the analysed steps."""
        return sum(s.wall_seconds for s in self.steps.steps)

    @property
    def is_training(self) -> bool:
        """Whether the trace has autograd (backward) work."""
        return bool(self.structure.in_backward.any())

    def step_of(self, ts: npt.NDArray[np.float64]) -> npt.NDArray[np.intp]:
        return in_steps_mask(ts, self.steps)

    def op_name(self, index: int) -> str:
        return self.trace.names[int(self.trace.host.name[index])]

    def host_ids(self, names: set[str] | frozenset[str]) -> npt.NDArray[np.int32]:
        """Name-table ids of the given host names that occur in this trace."""
        ids = [i for i, n in enumerate(self.trace.names) if n in names]
        return np.asarray(ids, dtype=np.int32)

    def modules(self) -> ModuleScopes:
        """The trace's module ranges (text encoder, VAE, denoiser...), built on first use."""
        if self._modules is None:
            self._modules = module_scopes(self.trace, self.structure)
        return self._modules

    def launch_times(self) -> npt.NDArray[np.float64]:
        """When each device activity of the analysed steps on the primary device was launched
        (sorted, microseconds; activities whose launch is not in the trace are left out)."""
        if self._launches is None:
            device = self.trace.device
            launched = (self.structure.device_runtime >= 0) & (
                device.device == self.device.primary_device
            )
            times = self.structure.launch_ts[launched]
            self._launches = np.sort(times[self.step_of(times) >= 0])
        return self._launches

    def profiler_us_per_launch(self) -> float:
        """The profiler's host time per launch, (profiled - unprofiled step) / launches per step,
        in µs; 0 when the unprofiled step is not known (trace-only) or not shorter."""
        unprofiled = self.unprofiled_step_seconds
        if unprofiled is None or not self.steps.steps:
            return 0.0
        profiled = statistics.median(s.wall_seconds for s in self.steps.steps)
        per_step = self.launch_times().size / self.n_steps
        if per_step <= 0 or profiled <= unprofiled:
            return 0.0
        return (profiled - unprofiled) / per_step * 1e6

    @property
    def step_seconds(self) -> float:
        """The step a saving is a share of: the unprofiled median when known, else the profiled
        steps' median."""
        if self.unprofiled_step_seconds is not None:
            return self.unprofiled_step_seconds
        if not self.steps.steps:
            return 0.0
        return statistics.median(s.wall_seconds for s in self.steps.steps)

    def read_once(self, key: str, read: Callable[[TraceContext], _Reading]) -> _Reading:
        """``read(self)``, made once per context: a reading several rules share (the syncs of
        :func:`diagnose.trace.sync_reading.syncs_of`, the collectives of
        :func:`diagnose.distributed.collectives.communication_of`)."""
        if key not in self._readings:
            self._readings[key] = read(self)
        return cast(_Reading, self._readings[key])

    def inclusive_device_time(self) -> npt.NDArray[np.float64]:
        """Per host range: microseconds of device work launched by it or by its descendants."""
        if self._inclusive is not None:
            return self._inclusive
        host = self.trace.host
        total = np.zeros(len(host), dtype=np.float64)
        launched = self.structure.device_op >= 0
        np.add.at(total, self.structure.device_op[launched], self.trace.device.dur[launched])
        depth = self.structure.depth
        parent = self.structure.parent
        if len(host):
            for level in range(int(depth.max()), 0, -1):
                at_level = np.flatnonzero(depth == level)
                np.add.at(total, parent[at_level], total[at_level])
        self._inclusive = total
        return total

    def op_cost(self) -> npt.NDArray[np.float64]:
        """Per host range, the time that matters: device time on GPU traces, CPU time otherwise."""
        return self.inclusive_device_time() if self.has_device else self.trace.host.dur
