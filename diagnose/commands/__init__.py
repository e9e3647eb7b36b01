"""The subcommands: one module per command behind the :class:`Command` protocol.

This module stays light (no torch import) so `diagnose --help` and `diagnose report` start fast;
each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from diagnose.errors import DiagnoseError, ExitCode


class Command(Protocol):
    name: str
    help: str

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and the USAGE exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise DiagnoseError(f"{self.prog}: {message} (see {self.prog} --help)", ExitCode.USAGE)


def comma_ints(text: str) -> list[int]:
    """An option value of comma-separated whole numbers (``512,1024``), for argparse ``type=``."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, like 512,1024; got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def all_commands() -> list[Command]:
    from diagnose.commands.compare import CompareCommand
    from diagnose.commands.env import EnvCommand
    from diagnose.commands.presets import PresetsCommand
    from diagnose.commands.report import ReportCommand
    from diagnose.commands.run import RunCommand
    from diagnose.commands.sweep import SweepCommand
    from diagnose.commands.trace import TraceCommand
    from diagnose.commands.triton import TritonCommand

    return [
        RunCommand(),
        SweepCommand(),
        TraceCommand(),
        ReportCommand(),
        CompareCommand(),
        TritonCommand(),
        EnvCommand(),
        PresetsCommand(),
    ]
