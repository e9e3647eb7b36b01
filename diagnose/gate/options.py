"""How the gate decides: the ``--fail-on`` criteria, the default threshold, significance and
phase floor, and :class:`CompareOptions` that carries them into every output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from diagnose.errors import DiagnoseError, ExitCode

#: What can fail the job (``--fail-on``). ``kernel`` (a kernel class slower) and ``mfu`` are
#: stricter extras; ``inconclusive`` (a gated metric could not be judged) ends the job with its
#: own exit code, and a ``--fail-on`` without it lets such a metric pass.
FailOn = Literal[
    "slower", "phase", "new-critical", "new-warn", "memory", "kernel", "mfu", "inconclusive"
]

FAIL_ON_CHOICES: tuple[str, ...] = get_args(FailOn)
DEFAULT_FAIL_ON: frozenset[str] = frozenset({"slower", "new-critical", "inconclusive"})
#: The relative change a metric must exceed to count (10%: CodSpeed's default, asv's 1.1 factor).
DEFAULT_THRESHOLD = 0.10
#: The Mann–Whitney p-value below which a change counts as real. With the default 8 steps per
#: run, 0.01 is reachable (the exact test's smallest two-sided p at 8 vs 8 is 1.6e-4, at 5 vs 5 it
#: is 7.9e-3), while asv's 0.002 would need 7 steps on each side before anything could fail.
DEFAULT_SIGNIFICANCE = 0.01
#: A phase or kernel-class change must be at least this share of the baseline step time.
DEFAULT_PHASE_FLOOR = 0.02


@dataclass(frozen=True)
class CompareOptions:
    """How the gate decides. ``fail_on`` is carried so every output can say what failed the job."""

    threshold: float = DEFAULT_THRESHOLD
    significance: float = DEFAULT_SIGNIFICANCE
    phase_floor: float = DEFAULT_PHASE_FLOOR
    fail_on: frozenset[str] = DEFAULT_FAIL_ON
    #: Compare records of different devices or configs (every output then says so loudly).
    allow_different: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 10:
            raise DiagnoseError(f"threshold {self.threshold} must be above 0", ExitCode.USAGE)
        if not 0 < self.significance < 1:
            raise DiagnoseError(
                f"significance {self.significance} must be between 0 and 1", ExitCode.USAGE
            )
        if not 0 <= self.phase_floor < 1:
            raise DiagnoseError(
                f"phase floor {self.phase_floor} must be between 0 and 1", ExitCode.USAGE
            )
        unknown = sorted(set(self.fail_on) - set(FAIL_ON_CHOICES))
        if unknown:
            raise DiagnoseError(
                f"--fail-on {unknown[0]}: unknown; choose from {', '.join(FAIL_ON_CHOICES)}",
                ExitCode.USAGE,
            )
