"""Command-line entry point: ``main(argv) -> int``; errors become one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

from diagnose import IMPORTED_AT, __version__, interrupts
from diagnose.commands import ArgumentParser, Command
from diagnose.errors import DiagnoseError, ExitCode


def all_commands() -> list[Command]:
    """Every subcommand, in the order ``diagnose --help`` lists them; each module is imported here,
    so the package of commands imports none of them."""
    from diagnose.commands.compare import CompareCommand
    from diagnose.commands.env import EnvCommand
    from diagnose.commands.presets import PresetsCommand
    from diagnose.commands.profile import ProfileCommand
    from diagnose.commands.report import ReportCommand
    from diagnose.commands.run import RunCommand
    from diagnose.commands.sweep import SweepCommand
    from diagnose.commands.trace import TraceCommand
    from diagnose.commands.triton import TritonCommand

    return [
        RunCommand(),
        ProfileCommand(),
        SweepCommand(),
        TraceCommand(),
        ReportCommand(),
        CompareCommand(),
        TritonCommand(),
        EnvCommand(),
        PresetsCommand(),
    ]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="diagnose",
        description="Explain the seconds per iteration of a diffusion-model LoRA training run.",
    )
    parser.add_argument("--version", action="version", version=f"diagnose {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in all_commands():
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            prog=f"diagnose {command.name}",
        )
        command.prepare_parser(sub)
        sub.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None, *, entered: float | None = None) -> int:
    """Run one command; ``entered``: when it began (:mod:`diagnose.entry`; default now)."""
    from diagnose.entry import mark_entry
    from diagnose.offline import hub_offline
    from diagnose.redact import redacted_terminal

    mark_entry(entered)

    # Terminal output is pasted into tickets as often as the report is attached: every line of
    # ours is redacted (a child's output, such as the trainer `diagnose profile` runs, is not ours
    # and goes to the terminal untouched). Nothing reaches the network: the hub's offline
    # switches are on before any library is imported.
    with redacted_terminal(), hub_offline():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if getattr(args, "handler", None) is None:
            parser.print_help(sys.stderr)
            return int(ExitCode.USAGE)
        return int(args.handler(args))
    except DiagnoseError as exc:
        print(f"diagnose: error: {exc.message}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt as exc:
        return _interrupted(interrupts.exit_code(exc))
    except BrokenPipeError:
        # The reader of our output went away (`diagnose compare ... | head`). Commands write
        # their files before printing, so nothing is lost; stdout is pointed at /dev/null so
        # the interpreter's final flush does not raise again.
        _to_devnull(sys.stdout)
        return int(ExitCode.BROKEN_PIPE)
    except Exception as exc:
        signal_first = interrupts.arrived()
        if signal_first is not None:
            return _interrupted(signal_first)
        if os.environ.get("DIAGNOSE_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        print(
            f"diagnose: internal error: {type(exc).__name__}: {first} "
            "(set DIAGNOSE_DEBUG=1 for the traceback, and please report it)",
            file=sys.stderr,
        )
        return int(ExitCode.INTERNAL_ERROR)


def _interrupted(code: ExitCode) -> int:
    what = "terminated (SIGTERM)" if code == ExitCode.TERMINATED else "interrupted"
    print(f"diagnose: {what}; nothing half-written was left behind", file=sys.stderr)
    return int(code)


def main_exit() -> None:
    """Console-script entry point."""
    interrupts.install()
    try:
        code = main(entered=IMPORTED_AT)
    except KeyboardInterrupt as exc:
        # A signal that lands while the first one's exit is on its way (leaving the terminal
        # redaction, the offline switches): the exit code is the signal's all the same, never a
        # death by SIGINT that a caller reads as "killed".
        code = int(interrupts.exit_code(exc))
    interrupts.ignore()
    sys.exit(_finish(code))


def _finish(code: int) -> int:
    """Flush the output and leave without tearing the interpreter down.

    Every file was written and closed before ``main`` returned, and the registered exit handlers
    (multiprocessing's, temporary folders' finalizers) still run here; what is skipped is the
    interpreter's module-by-module teardown, which with torch, diffusers and bitsandbytes loaded
    took seconds after the last line was printed. ``DIAGNOSE_SLOW_EXIT=1`` keeps the normal exit
    (but for a handled signal).
    """
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            _to_devnull(stream)
            code = code or int(ExitCode.BROKEN_PIPE)
        except (OSError, ValueError):
            pass  # a closed stream: nothing more can reach it
    interrupted = code in (int(ExitCode.INTERRUPTED), int(ExitCode.TERMINATED))
    if not interrupted and (os.environ.get("DIAGNOSE_SLOW_EXIT") or "torch" not in sys.modules):
        return code  # nothing heavy loaded: the normal exit is quick
    # After a handled Ctrl-C or SIGTERM, always this way: its exit code is decided, and the
    # interpreter's own exit was seen (the suite beside a busy process, 1 run in 4) to end such a
    # process by SIGINT instead of 130, with the outputs already cleaned up.
    atexit._run_exitfuncs()
    os._exit(code)


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: its reader is gone, and a later flush must not
    raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
