"""`diagnose trace FILE|DIR ...`: explain the step time of profiler traces from any trainer.

One file is one process's trace. A folder (or several files) is one trace per rank of a
distributed run: the ranks are read in parallel and compared (see ``diagnose.distributed``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from diagnose.catalogs import specs
from diagnose.commands import add_output_options
from diagnose.errors import DiagnoseError, ExitCode

if TYPE_CHECKING:
    from diagnose.trace.parallel_read import SecondReader


class TraceCommand:
    name = "trace"
    help = "analyse a PyTorch profiler trace (Kineto JSON, .json or .json.gz) from any trainer"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "traces",
            type=Path,
            nargs="+",
            metavar="TRACE",
            help="a trace file, or a folder (or several files) of one run's rank traces",
        )
        parser.add_argument(
            "--jobs",
            type=int,
            metavar="N",
            help="rank traces read at once, one process each (default: the CPU count)",
        )
        add_output_options(parser)

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.trace.reader import read_ahead

        if args.jobs is not None and args.jobs < 1:
            raise DiagnoseError("--jobs must be at least 1", ExitCode.USAGE)
        # One trace file: a second process starts reading it now, while the analysis is imported.
        named = args.traces[0] if len(args.traces) == 1 else None
        ahead = read_ahead(named.resolve()) if named is not None and named.is_file() else None
        try:
            return self._run(args, ahead)
        finally:
            if ahead is not None:
                ahead.stop()

    def _run(self, args: argparse.Namespace, ahead: SecondReader | None) -> int:
        from diagnose.distributed.ranks import (
            compare_ranks,
            comparison_record,
            read_ranks,
            trace_files,
        )
        from diagnose.output import (
            RECORD_NAME,
            REPORT_NAME,
            default_out_dir,
            prepare_out_dir,
            refuse_outputs_over_inputs,
        )
        from diagnose.redact import redact_record
        from diagnose.reports import save_record_and_report, terminal_summary
        from diagnose.trace.analysis import analysis_to_record, analyze_trace
        from diagnose.trace.reader import exclusion_note
        from diagnose.verdicts import settle

        # Parse first: a bad trace must not leave an output folder behind.
        files = trace_files(args.traces)
        out_dir = args.out if args.out is not None else default_out_dir("trace")
        refuse_outputs_over_inputs([out_dir / RECORD_NAME, out_dir / REPORT_NAME], files)
        if len(files) == 1:
            trace_path = files[0]
            analysis = analyze_trace(trace_path, ahead=ahead)
            record = analysis_to_record(analysis, trace_path)
            analysed = [("", analysis)]
        else:
            ranks, notes = read_ranks(files, jobs=args.jobs)
            comparison = compare_ranks(ranks)
            comparison.notes.extend(notes)
            record = comparison_record(comparison)
            analysed = [(f"{rank.path.name}: ", rank.analysis) for rank in ranks]
        # Events with impossible times (negative, NaN, 1e308) were left out by the reader: say so
        # in the report's notes and on the terminal, one line per trace.
        left_out = [
            prefix + note
            for prefix, analysis in analysed
            if (note := exclusion_note(analysis.metadata.get("events") or {}))
        ]
        record.notes.extend(left_out)
        settle(record, specs())
        # Records and reports get attached to public tickets: no secret leaves this process.
        record = redact_record(record, redact_paths=args.redact_paths)
        prepare_out_dir(out_dir, force=args.force)
        record_path = out_dir / RECORD_NAME
        report_path = out_dir / REPORT_NAME
        record = save_record_and_report(record, record_path, report_path)
        print(terminal_summary(record))
        for note in left_out:
            print(f"note: {note}")
        print(f"\nreport: {report_path}\nrecord: {record_path}")
        return int(ExitCode.OK)
