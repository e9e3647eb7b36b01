"""Records built by hand for the tests: one builder, so every test's record is made the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diagnose.record import Breakdown, Mode, RunRecord, StepSample, Timing, new_record


def timed_record(
    steps: Sequence[float],
    *,
    phases: dict[str, float] | None = None,
    mode: Mode = "run",
    **timing: Any,
) -> RunRecord:
    """A record whose timed steps took ``steps`` seconds each (summarised as a run summarises
    them), with the phase bar ``phases`` when given; ``timing``: other :class:`Timing` fields
    (``host_load=...``)."""
    record = new_record(mode)
    record.timing = Timing(
        samples=[StepSample(index=i, seconds=s) for i, s in enumerate(steps)], **timing
    )
    record.timing.summarize()
    if phases is not None:
        record.breakdown = Breakdown(seconds=dict(phases))
    return record
