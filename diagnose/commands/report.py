"""`diagnose report RECORD`: re-render a saved record (no torch work, no GPU needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diagnose.errors import ExitCode
from diagnose.record_io import load_record


class ReportCommand:
    name = "report"
    help = "re-render the HTML report of a saved record.json (or a run folder)"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("record", type=Path, help="record.json, or the folder holding it")
        parser.add_argument(
            "-o",
            "--out",
            type=Path,
            metavar="FILE",
            help="HTML file to write (default: report.html beside the record, rendered again "
            "in place when it is a report diagnose wrote)",
        )
        parser.add_argument("--force", action="store_true", help="overwrite an existing FILE")

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.output import (
            RECORD_NAME,
            REPORT_NAME,
            check_writable_file,
            refuse_outputs_over_inputs,
        )
        from diagnose.record_io import left_out_notes
        from diagnose.reports import is_own_report, terminal_summary, write_html

        record = load_record(args.record)
        folder = args.record if args.record.is_dir() else args.record.parent
        out = args.out if args.out is not None else folder / REPORT_NAME
        source = args.record / RECORD_NAME if args.record.is_dir() else args.record
        refuse_outputs_over_inputs([out], [source])
        # The report beside the record is derived from it: rendered again in place. A file the
        # user made there (not a page diagnose wrote), or any existing -o FILE, needs --force.
        derived = args.out is None and is_own_report(out)
        check_writable_file(out, force=args.force or derived, option="--out")
        write_html(record, out)
        print(terminal_summary(record))
        # Step samples with impossible times were left out on loading: the headline alone would
        # not say why it has fewer steps (or none).
        for note in left_out_notes(record):
            print(f"note: {note}")
        print(f"\nreport: {out}")
        return int(ExitCode.OK)
