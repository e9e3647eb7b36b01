"""`diagnose compare BASELINE [BASELINE ...] CURRENT`: the CI gate on saved records (no torch,
no GPU). Several baselines (the last green runs) let the gate see the runner's run-to-run drift.

Exit codes: 0 no regression, 6 regression (ExitCode.REGRESSION), 9 a gated metric could not be
judged (ExitCode.INCONCLUSIVE), 3 bad or mismatched records,
4 an output file exists (without --force), 2 a bad command line.

The gate's options are defined by :func:`add_gate_options` so that `diagnose run --baseline`
offers the same ones; :func:`apply_gate` is the whole gate for a caller holding both records.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate import (
    DEFAULT_FAIL_ON,
    DEFAULT_SIGNIFICANCE,
    DEFAULT_THRESHOLD,
    FAIL_ON_CHOICES,
    CompareOptions,
    Comparison,
    compare_records,
    gate_exit_code,
    parse_fail_on,
)
from diagnose.record import RunRecord
from diagnose.record_io import load_record

GATE_OPTION_DESTS: tuple[str, ...] = (
    "threshold",
    "significance",
    "fail_on",
    "allow_different",
    "junit",
    "markdown",
)


def parse_threshold(text: str) -> float:
    """Parse "10%" or "0.10" as 0.10; refuse a bare 10 (10% or 1000%?)."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100
        else:
            value = float(raw)
            if value >= 1:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is ambiguous: write a percentage (10%) or a fraction (0.10)"
                )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a percentage like 10% or 0.10, got {text!r}"
        ) from None
    if not 0 < value < 10:
        raise argparse.ArgumentTypeError(f"threshold {text!r} must be above 0")
    return value


def _significance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a p-value like 0.01, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"significance {text!r} must be between 0 and 1")
    return value


def _fail_on(text: str) -> frozenset[str]:
    try:
        return parse_fail_on(text)
    except DiagnoseError as exc:
        raise argparse.ArgumentTypeError(exc.message.removeprefix("--fail-on ")) from None


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    """The gate's options, shared by `diagnose compare` and `diagnose run --baseline`.

    Adds (dest): --threshold (threshold: float), --significance (significance: float),
    --fail-on (fail_on: frozenset[str]), --allow-different (allow_different: bool),
    --junit (junit: Path | None), --markdown (markdown: Path | None). Output files are refused
    when they exist unless the command's own --force is given.
    """
    gate = parser.add_argument_group("regression gate")
    gate.add_argument(
        "--threshold",
        type=parse_threshold,
        default=DEFAULT_THRESHOLD,
        metavar="PCT",
        help="the slowdown to catch, e.g. 10%% or 0.10 (default: 10%%); a regression is a "
        "statistically significant change whose median ratio or confidence interval reaches it",
    )
    gate.add_argument(
        "--significance",
        type=_significance,
        default=DEFAULT_SIGNIFICANCE,
        metavar="P",
        help=f"Mann-Whitney p-value below which a change is real (default: {DEFAULT_SIGNIFICANCE})",
    )
    gate.add_argument(
        "--fail-on",
        type=_fail_on,
        default=DEFAULT_FAIL_ON,
        metavar="WHAT[,WHAT...]",
        help=f"what fails the job: {', '.join(FAIL_ON_CHOICES)} "
        f"(default: {','.join(sorted(DEFAULT_FAIL_ON))})",
    )
    gate.add_argument(
        "--allow-different",
        action="store_true",
        help="compare records of different devices or configs (said loudly in every output)",
    )
    gate.add_argument("--junit", type=Path, metavar="FILE", help="write JUnit XML for CI")
    gate.add_argument(
        "--markdown", type=Path, metavar="FILE", help="write markdown (job summary, PR comment)"
    )


def gate_options_from_args(args: argparse.Namespace) -> CompareOptions:
    """The CompareOptions that the parsed gate options ask for."""
    return CompareOptions(
        threshold=args.threshold,
        significance=args.significance,
        fail_on=frozenset(args.fail_on),
        allow_different=args.allow_different,
    )


def check_gate_outputs(args: argparse.Namespace, *, force: bool) -> None:
    """Refuse existing --junit/--markdown files before any work (ExitCode.OUTPUT_EXISTS)."""
    from diagnose.output import check_writable_file

    for option, path in (("--junit", args.junit), ("--markdown", args.markdown)):
        if path is not None:
            check_writable_file(path, force=force, option=option)


@dataclass(frozen=True)
class GateOutcome:
    exit_code: int
    comparison: Comparison


def apply_gate(
    baselines: Sequence[RunRecord],
    current: RunRecord,
    args: argparse.Namespace,
    *,
    labels: Sequence[str] = (),
) -> GateOutcome:
    """Compare and write --junit/--markdown; return the exit code and the comparison.

    ``labels``: one per baseline, then the current record's (see compare_records). Files are
    written before anything is printed (:func:`print_gate`), so a closed terminal pipe loses
    none. Raises DiagnoseError(BAD_INPUT) on records that are not comparable (unless
    --allow-different). Call :func:`check_gate_outputs` first, before any long work, so an
    existing output file is refused early.
    """
    from diagnose.output import write_text_atomic
    from diagnose.redact import make_redactor
    from diagnose.reports.gate_outputs import compare_junit, compare_markdown

    options = gate_options_from_args(args)
    # The labels are paths, which people name after what they hold; the records were redacted
    # when they were read or made. The files are CI artefacts, shown in public job summaries.
    redactor = make_redactor()
    labels = [redactor.text(label) for label in labels]
    comparison = compare_records(baselines, current, options, labels=labels)
    if args.junit is not None:
        write_text_atomic(args.junit, redactor.text(compare_junit(comparison)))
    if args.markdown is not None:
        write_text_atomic(args.markdown, redactor.text(compare_markdown(comparison)))
    return GateOutcome(exit_code=gate_exit_code(comparison), comparison=comparison)


def print_gate(
    outcome: GateOutcome,
    args: argparse.Namespace,
    *,
    stream: TextIO | None = None,
    color: bool | None = None,
) -> None:
    """The gate's table, then the paths of the files :func:`apply_gate` wrote."""
    from diagnose.reports.gate_outputs import compare_table

    out = stream if stream is not None else sys.stdout
    use_color = color if color is not None else out.isatty()
    print(compare_table(outcome.comparison, color=use_color), file=out)
    if args.junit is not None:
        print(f"junit: {args.junit}", file=out)
    if args.markdown is not None:
        print(f"markdown: {args.markdown}", file=out)


class CompareCommand:
    name = "compare"
    help = "compare saved records: fail (exit 6) on a real slow-down or a new finding"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "baseline",
            type=Path,
            nargs="+",
            help="the baseline record.json or run folder; give several (e.g. the last green "
            "runs) to let the gate see the runner's run-to-run drift",
        )
        parser.add_argument(
            "current", type=Path, help="the current record.json or run folder (the last path)"
        )
        add_gate_options(parser)
        output = parser.add_argument_group("output")
        output.add_argument(
            "--html",
            type=Path,
            metavar="FILE",
            help="write the CURRENT record's HTML report with the comparison in it",
        )
        output.add_argument("--force", action="store_true", help="overwrite existing output files")

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.output import check_writable_file, write_text_atomic
        from diagnose.reports import render_html

        check_gate_outputs(args, force=args.force)
        if args.html is not None:
            check_writable_file(args.html, force=args.force, option="--html")
        outputs = [p for p in (args.junit, args.markdown, args.html) if p is not None]
        _refuse_duplicate_outputs(outputs)
        refuse_outputs_over_inputs(outputs, [*args.baseline, args.current])
        baselines = [load_record(path) for path in args.baseline]
        current = load_record(args.current)
        labels = [record_label(path) for path in (*args.baseline, args.current)]
        outcome = apply_gate(baselines, current, args, labels=labels)
        if args.html is not None:
            write_text_atomic(args.html, render_html(current, comparison=outcome.comparison))
        print_gate(outcome, args)
        if args.html is not None:
            print(f"report: {args.html}")
        return outcome.exit_code


def record_label(path: Path) -> str:
    """How the outputs name a record given as a file or a run folder."""
    return str(path / "record.json") if path.is_dir() else str(path)


def refuse_outputs_over_inputs(outputs: Sequence[Path], records: Sequence[Path]) -> None:
    """An output written over a record it compares would destroy that record, --force or not."""
    from diagnose.output import refuse_outputs_over_inputs as refuse

    refuse(outputs, [Path(record_label(path)) for path in records], "a record being compared")


def _refuse_duplicate_outputs(paths: Sequence[Path]) -> None:
    seen: set[Path] = set()
    for path in paths:
        try:
            resolved = path.resolve()
        except RuntimeError:  # a symlink loop: replaced, as any symlink, when written
            resolved = path.absolute()
        if resolved in seen:
            raise DiagnoseError(f"{path}: named for two outputs", ExitCode.USAGE)
        seen.add(resolved)
