"""The subcommands: one module per command behind the :class:`Command` protocol, and what their
parsers share (:mod:`diagnose.cli` lists them).

This module stays light (no torch import) so `diagnose --help` and `diagnose report` start fast;
each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
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


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--out, --force and --redact-paths, as the commands that write a record and a report
    take them."""
    parser.add_argument("--out", type=Path, metavar="DIR", help="output folder (default: new)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out folder")
    parser.add_argument(
        "--redact-paths",
        action="store_true",
        help="also replace your home folder and user name in the outputs (secrets always are)",
    )
