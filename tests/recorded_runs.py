"""The compare fixtures as the comparison's tests read them: the real records and the per-step
times recorded from same-config runs of the tiny workload on this CPU (see the fixture README).
"""

from __future__ import annotations

import copy
import json
import math
import random

from diagnose.record import RunRecord, Stats, StepSample
from diagnose.record_io import load_record
from tests.conftest import FIXTURES

COMPARE = FIXTURES / "compare"


def load(name: str) -> RunRecord:
    return load_record(COMPARE / name)


def noise_runs() -> list[list[float]]:
    """Per-step s/it of same-config runs, recorded on this 2-core box (see the fixture README)."""
    data = json.loads((COMPARE / "noise.json").read_text(encoding="utf-8"))
    return [[s["seconds"] for s in run["samples"]] for run in data["runs"]]


def with_samples(
    record: RunRecord, seconds: list[float], phases: list[dict[str, float]] | None = None
) -> RunRecord:
    """A copy of a real record whose unprofiled steps are replaced by ``seconds``."""
    out = copy.deepcopy(record)
    out.timing.samples = [
        StepSample(index=i, seconds=s, phases=(phases[i] if phases else {}))
        for i, s in enumerate(seconds)
    ]
    out.timing.summarize()
    return out


def lognormal(rng: random.Random, n: int, median: float, sigma: float) -> list[float]:
    return [median * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def quiet_runs() -> list[list[float]]:
    """The recorded runs the report would not flag as noisy (IQR at most 10% of the median)."""
    from diagnose.reports.headline import NOISY_RELATIVE_SPREAD

    return [r for r in noise_runs() if Stats.of(r).relative_spread <= NOISY_RELATIVE_SPREAD]
