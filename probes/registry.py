"""The registry of probes: ``REGISTRY`` lists them in the order they run (importing it imports
every probe, and torch). ``diagnose run --skip NAME`` turns one off. The contract (Probe,
ProbeContext, the isolating runner) is in :mod:`diagnose.probes.base`.
"""

from __future__ import annotations

from diagnose.probes.attention.probe import AttentionProbe
from diagnose.probes.base import Probe
from diagnose.probes.dataloader.probe import DataLoaderProbe
from diagnose.probes.environment.probe import EnvironmentProbe
from diagnose.probes.optimizer.probe import OptimizerProbe
from diagnose.probes.precision.probe import PrecisionProbe
from diagnose.probes.quantization.probe import QuantizationProbe
from diagnose.probes.roofline.probe import RooflineProbe
from diagnose.probes.triton.probe import TritonProbe

#: Probes in run order. Each entry is an instance of a class that satisfies ``Probe``.
REGISTRY: tuple[Probe, ...] = (
    EnvironmentProbe(),
    PrecisionProbe(),
    AttentionProbe(),
    DataLoaderProbe(),
    OptimizerProbe(),
    QuantizationProbe(),
    RooflineProbe(),
    # In a run, only on a GPU: a CPU training step runs no Triton kernel, so the interpreter's
    # verdict would not explain the measured s/it (`diagnose triton` runs it on demand).
    TritonProbe(device_kinds=("cuda", "rocm")),
)


def probe_names() -> list[str]:
    return [p.name for p in REGISTRY]


__all__ = ["REGISTRY", "probe_names"]
