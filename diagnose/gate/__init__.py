"""The CI gate: compare two RunRecords and say, per metric, faster / same / slower / inconclusive.

Pure functions of two saved records (no torch, no GPU, no files): the command and the renderers
only read the :class:`Comparison` this package returns. One concern per module:

- :mod:`~diagnose.gate.options`: what can fail the job and the defaults (:class:`CompareOptions`);
- :mod:`~diagnose.gate.metrics`: one metric and its verdict; how a timing metric is judged on
  its per-step samples (Mann–Whitney U, the ratio's interval, the threshold) is explained there;
- :mod:`~diagnose.gate.record_metrics`: the metrics two records yield (s/it, phases, peak memory,
  device time per kernel class);
- :mod:`~diagnose.gate.comparability`: the differences that refuse a comparison, and the
  environment changes that are only listed;
- :mod:`~diagnose.gate.finding_changes`: new, gone and re-graded findings;
- :mod:`~diagnose.gate.comparison`: :func:`compare_records` and :class:`Comparison`;
- :mod:`~diagnose.gate.failures`: which ``--fail-on`` criteria fired, and the exit code.

The statistics themselves are in :mod:`diagnose.stats`.
"""

from __future__ import annotations

from diagnose.gate.comparability import (
    COMPARED_CONFIG_KEYS,
    environment_changes,
    record_differences,
)
from diagnose.gate.comparison import Comparison, RecordSide, baseline_name, compare_records
from diagnose.gate.failures import (
    GateFailure,
    gate_exit_code,
    gate_failures,
    gate_status,
    parse_fail_on,
)
from diagnose.gate.finding_changes import FindingChange, diff_findings
from diagnose.gate.metrics import MetricComparison, compare_runs, compare_samples
from diagnose.gate.options import (
    DEFAULT_FAIL_ON,
    DEFAULT_PHASE_FLOOR,
    DEFAULT_SIGNIFICANCE,
    DEFAULT_THRESHOLD,
    FAIL_ON_CHOICES,
    CompareOptions,
)

__all__ = [
    "COMPARED_CONFIG_KEYS",
    "DEFAULT_FAIL_ON",
    "DEFAULT_PHASE_FLOOR",
    "DEFAULT_SIGNIFICANCE",
    "DEFAULT_THRESHOLD",
    "FAIL_ON_CHOICES",
    "CompareOptions",
    "Comparison",
    "FindingChange",
    "GateFailure",
    "MetricComparison",
    "RecordSide",
    "baseline_name",
    "compare_records",
    "compare_runs",
    "compare_samples",
    "diff_findings",
    "environment_changes",
    "gate_exit_code",
    "gate_failures",
    "gate_status",
    "parse_fail_on",
    "record_differences",
]
