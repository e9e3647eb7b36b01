"""What ``diagnose run``, ``run --nproc`` and ``diagnose profile`` share once the steps are
measured: one finding per question, the record settled and redacted, the record and the report
written, and the run's own trace redacted with ``--redact-paths``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from diagnose.catalogs import specs
from diagnose.output import RECORD_NAME, REPORT_NAME
from diagnose.record import Finding, RunRecord
from diagnose.redact import redact_record
from diagnose.verdicts import settle

Progress = Callable[[str], None]


@dataclass
class RunOutputs:
    record: RunRecord
    record_path: Path
    report_path: Path
    trace_path: Path | None


def merge_findings(groups: Sequence[Sequence[Finding]]) -> list[Finding]:
    """One finding per id: when a probe and a trace rule report the same id, keep the one whose
    saving was measured (then the larger saving)."""
    from diagnose.verdicts import from_trace

    probe_first = {s.id for s in specs() if s.probe_answer_stands}
    basis_rank = {"measured": 0, "estimated": 1, "trace": 2, "none": 3}

    def key(finding: Finding) -> tuple[int, int, float]:
        # A question whose probe answer stands keeps the probe's finding over the trace rule's.
        set_aside = int(finding.id in probe_first and from_trace(finding.source))
        basis = basis_rank.get(finding.saving_basis, 9)
        return set_aside, basis, -(finding.est_seconds_saved_per_it or 0)

    best: dict[str, Finding] = {}
    for group in groups:
        for finding in group:
            current = best.get(finding.id)
            if current is None or key(finding) < key(current):
                best[finding.id] = finding
    return list(best.values())


def redact_own_trace(trace_path: Path, record: RunRecord) -> Path | None:
    """--redact-paths covers the trace this run wrote too (Kineto stores the host name in it).
    A trace that cannot be rewritten is removed rather than left unredacted."""
    from diagnose.redact import redact_trace_file, redactor_for

    try:
        redact_trace_file(trace_path, redactor_for(True))
    except Exception as exc:
        trace_path.unlink(missing_ok=True)
        record.trace_path = ""
        record.notes.append(
            f"The profiler trace was removed: --redact-paths could not rewrite it "
            f"({type(exc).__name__}: {exc})."
        )
        return None
    return trace_path


def finish_run(
    record: RunRecord, out_dir: Path, saved_trace: Path | None, *, redact_paths: bool, say: Progress
) -> RunOutputs:
    """Hand the probes' findings to the record, redact it, write the record and the report."""
    from diagnose.reports import save_record_and_report
    from diagnose.roofline.utilisation import settle_utilisation

    # The record keeps one ranked list: probe results hand their findings over to it.
    record.findings = merge_findings([p.findings for p in record.probes])
    settle(record, specs())
    settle_utilisation(record)
    for result in record.probes:
        result.findings = []
    # Records and reports get attached to public tickets: no secret leaves this process.
    record = redact_record(record, redact_paths=redact_paths)
    record_path = out_dir / RECORD_NAME
    report_path = out_dir / REPORT_NAME
    say("writing the record and the report")
    record = save_record_and_report(record, record_path, report_path)
    return RunOutputs(
        record=record,
        record_path=record_path,
        report_path=report_path,
        trace_path=saved_trace,
    )


__all__ = ["Progress", "RunOutputs", "finish_run", "merge_findings", "redact_own_trace"]
