"""`diagnose trace FILE`: explain the step time of a profiler trace from any trainer."""

from __future__ import annotations

import argparse
from pathlib import Path

from diagnose.errors import ExitCode


class TraceCommand:
    name = "trace"
    help = "analyse a PyTorch profiler trace (Kineto JSON, .json or .json.gz) from any trainer"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("trace", type=Path, help="the trace file")
        parser.add_argument("--out", type=Path, metavar="DIR", help="output folder (default: new)")
        parser.add_argument(
            "--force", action="store_true", help="write into a non-empty --out folder"
        )
        parser.add_argument(
            "--redact-paths",
            action="store_true",
            help="also replace your home folder and user name in the outputs (secrets always are)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.output import RECORD_NAME, REPORT_NAME, default_out_dir, prepare_out_dir
        from diagnose.redact import redact_record
        from diagnose.reports import terminal_summary, write_html
        from diagnose.trace import analysis_to_record, analyze_trace

        trace_path: Path = args.trace.resolve()
        # Parse first: a bad trace must not leave an output folder behind.
        analysis = analyze_trace(trace_path)
        # Records and reports get attached to public tickets: no secret leaves this process.
        record = redact_record(
            analysis_to_record(analysis, trace_path), redact_paths=args.redact_paths
        )
        out_dir = args.out if args.out is not None else default_out_dir("trace")
        prepare_out_dir(out_dir, force=args.force)
        record_path = out_dir / RECORD_NAME
        report_path = out_dir / REPORT_NAME
        record.save(record_path)
        write_html(record, report_path)
        print(terminal_summary(record))
        print(f"\nreport: {report_path}\nrecord: {record_path}")
        return int(ExitCode.OK)
