"""`diagnose profile [options] -- CMD ...`: diagnose the user's own trainer, unmodified.

The command runs as is (its output passes through); a bootstrap in every Python process it starts
times and profiles a few of its optimizer steps (see ``diagnose.profile``). Once it has ended,
the captured trace goes through the same analysis as ``diagnose trace``, the environment probe and
the device's measured peak are added, and the same outputs as ``diagnose run`` are written.
The exit code is the command's own; see docs/profile.md for the cases without a step.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diagnose.commands import add_output_options
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.strict.options import add_strict_options, strict_options_of

if TYPE_CHECKING:
    from diagnose.profile.launch import RankCapture
    from diagnose.strict.violations import StrictLog

#: The capture folder inside --out while the command runs (removed when the outputs are written).
CAPTURE_FOLDER = ".diagnose-capture"


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _strict_exit(logs: list[StrictLog], command_exit: int) -> int:
    """A strict violation decides the exit code, whatever the command's own was."""
    from diagnose.strict.result import summary_line

    print(
        f"diagnose: {summary_line(logs)}; the command exited with code {command_exit}; "
        f"diagnose exits with {int(ExitCode.STRICT_VIOLATION)} (strict violation)",
        file=sys.stderr,
    )
    return int(ExitCode.STRICT_VIOLATION)


class ProfileCommand:
    name = "profile"
    help = (
        "run your own training command unmodified (-- python train.py ..., -- accelerate launch "
        "..., -- torchrun ...), capture a few of its steps and explain its s/it"
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        from diagnose.profile.launch import CaptureOptions

        d = CaptureOptions()
        parser.add_argument(
            "--skip-steps",
            type=_non_negative,
            default=d.skip_steps,
            metavar="N",
            help=f"optimizer steps left alone first: warm-up, compiling (default: {d.skip_steps})",
        )
        parser.add_argument(
            "--steps",
            type=_non_negative,
            default=d.timed_steps,
            metavar="N",
            help=f"steps timed without the profiler: the s/it (default: {d.timed_steps})",
        )
        parser.add_argument(
            "--profile-steps",
            type=_non_negative,
            default=d.profiled_steps,
            metavar="K",
            help=f"steps recorded by torch.profiler after them (default: {d.profiled_steps})",
        )
        parser.add_argument(
            "--stop-after",
            action="store_true",
            help="end the command once its steps are captured (default: it trains on to its end)",
        )
        parser.add_argument(
            "--no-stacks",
            action="store_true",
            help="do not sample the Python stacks of the profiled steps with py-spy (sampled "
            "when py-spy is installed)",
        )
        parser.add_argument(
            "--timeout",
            type=_positive_seconds,
            default=None,
            metavar="S",
            help="stop the command when no optimizer step has ended S seconds after its start",
        )
        add_strict_options(parser)
        add_output_options(parser)
        parser.add_argument(
            "command",
            nargs=argparse.REMAINDER,
            metavar="-- CMD",
            help="the training command, after --",
        )

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.output import created_files, default_out_dir, prepare_out_dir
        from diagnose.profile.finish import finish_profile
        from diagnose.profile.launch import CaptureOptions, launch_profiled
        from diagnose.strict.result import add_strict, read_logs, violation_count

        command = list(args.command)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            raise DiagnoseError(
                "diagnose profile: no command to run; put it after --, e.g. "
                "diagnose profile -- python train.py --config my.toml",
                ExitCode.USAGE,
            )
        from diagnose.sampling import find_py_spy

        strict = strict_options_of(args)
        options = CaptureOptions(
            skip_steps=args.skip_steps,
            timed_steps=args.steps,
            profiled_steps=args.profile_steps,
            stop_after=args.stop_after,
            py_spy="" if args.no_stacks else (find_py_spy() or ""),
            strict=strict,
        )
        out_dir = args.out if args.out is not None else default_out_dir("profile")
        capture_dir = out_dir / CAPTURE_FOLDER
        from diagnose.redact import redact_command

        with created_files() as written:
            prepare_out_dir(out_dir, force=args.force)
            shutil.rmtree(capture_dir, ignore_errors=True)  # a stale one of an interrupted profile
            print(
                f"diagnose: profiling `{redact_command(command)}`: {options.timed_steps} timed "
                f"and {options.profiled_steps} profiled step(s) after {options.skip_steps}"
                + (f"; strict: {strict.describe()}" if strict is not None else "")
                + "; its output follows",
                file=sys.stderr,
                flush=True,
            )

            def clean_up() -> None:
                """Leave nothing half-written and take nothing that was not ours: the capture
                folder, the files this profile wrote, the folders it made once empty. The
                command's own files in --out (it may write there too) stay."""
                shutil.rmtree(capture_dir, ignore_errors=True)
                written.remove()

            try:
                try:
                    result = launch_profiled(command, capture_dir, options, timeout_s=args.timeout)
                except OSError as exc:
                    raise DiagnoseError(
                        f"cannot start {command[0]}: {exc.strerror or exc}", ExitCode.BAD_INPUT
                    ) from None
                logs = read_logs(capture_dir) if strict is not None else []
                if not result.captures:
                    clean_up()
                    print(f"diagnose: {result.message}; nothing was written", file=sys.stderr)
                    if violation_count(logs):
                        return _strict_exit(logs, result.exit_code)
                    if result.timed_out or result.exit_code == 0:
                        return int(ExitCode.BAD_INPUT)
                    return result.exit_code
                # A strict violation stops the loop at its first step: its record (the violation,
                # where and why) is what the user came for, timed steps or not.
                if not any(c.timed_step_s for c in result.captures) and not violation_count(logs):
                    clean_up()
                    print(
                        f"diagnose: {_nothing_timed(result.captures, options.skip_steps)}; "
                        "nothing was written",
                        file=sys.stderr,
                    )
                    if result.exit_code != 0:
                        return result.exit_code
                    return int(ExitCode.NOTHING_CAPTURED)
                outputs = finish_profile(
                    result,
                    out_dir,
                    redact_paths=args.redact_paths,
                    amend=(
                        None if strict is None else lambda record: add_strict(record, strict, logs)
                    ),
                )
            except BaseException:
                clean_up()
                raise
        shutil.rmtree(capture_dir, ignore_errors=True)
        from diagnose.reports import terminal_summary

        print(terminal_summary(outputs.record))
        print(f"\nreport: {outputs.report_path}\nrecord: {outputs.record_path}")
        if violation_count(logs):
            return _strict_exit(logs, result.exit_code)
        if result.exit_code != 0:
            print(
                f"diagnose: {result.ending()}; diagnose exits with {result.exit_code} too",
                file=sys.stderr,
            )
        return result.exit_code


def _nothing_timed(captures: Sequence[RankCapture], skip_steps: int) -> str:
    """Why no step was timed, in the steps the command made, and the --skip-steps that would
    time some: the first half of them skipped as its warm-up."""
    seen = max(int(c.facts.get("steps_seen") or 0) for c in captures)
    suggested = seen // 2
    return (
        f"the command made {seen} optimizer step{'s' if seen != 1 else ''}, all within the "
        f"{skip_steps} that --skip-steps {skip_steps} skips as warm-up: none was timed; "
        f"pass --skip-steps {suggested} to time its last {seen - suggested}"
    )
