"""Exit codes and the one error class that carries them.

Every user-facing failure becomes a :class:`DiagnoseError`; the CLI prints its message on one line
and exits with its code, never with a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes, documented in docs/exit-codes.md."""

    OK = 0
    #: Something inside diagnose broke (a bug): the message says what.
    INTERNAL_ERROR = 1
    #: Bad command line: unknown option, bad value.
    USAGE = 2
    #: Bad input: a record, trace, model or data folder that cannot be used.
    BAD_INPUT = 3
    #: The output folder exists and is not empty, and --force was not given.
    OUTPUT_EXISTS = 4
    #: The requested run cannot be done on this machine (no such device, a full-size model on a CPU
    #: without --force, a missing required package); for `diagnose sweep`, some points failed,
    #: ran out of memory or timed out.
    UNSUPPORTED = 5
    #: A comparison found a regression (`diagnose compare`, `diagnose run --baseline`).
    REGRESSION = 6
    #: A correctness check failed (`diagnose triton`: a kernel computed a wrong answer).
    CHECK_FAILED = 7
    #: ``--strict``: an op left the precision or the fused attention path the run asked for.
    STRICT_VIOLATION = 8
    #: A comparison could not judge a metric it gates (too few steps, too much spread, a change
    #: the machine's load could explain): neither a pass nor a regression.
    INCONCLUSIVE = 9
    #: `diagnose profile`: the command stepped its optimizer, but too few times for any step to
    #: be timed (all within --skip-steps); nothing was written.
    NOTHING_CAPTURED = 10
    #: Interrupted by the user (Ctrl-C).
    INTERRUPTED = 130
    #: Stopped by SIGTERM (a job scheduler's cancel, ``kill``): 128 + SIGTERM.
    TERMINATED = 143
    #: The reader of the terminal output closed it early (`| head`); files were written first.
    #: 128 + SIGPIPE, what a shell reports for a writer stopped by a closed pipe.
    BROKEN_PIPE = 141


class DiagnoseError(Exception):
    """An error meant for the user: one line of text and the exit code to leave with."""

    def __init__(self, message: str, code: ExitCode = ExitCode.BAD_INPUT) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


def first_line(text: str | BaseException, limit: int | None = 300) -> str:
    """The first line of ``text`` (a message, a warning; an exception's message, else its type's
    name), stripped, at most ``limit`` characters: what a one-line error, a probe's reason or a
    report row shows of it."""
    if isinstance(text, BaseException):
        text = str(text).strip() or type(text).__name__
    line = (text.strip().splitlines() or [""])[0].strip()
    return line if limit is None else line[:limit]
