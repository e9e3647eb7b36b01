"""What importing or probing a library printed or warned, kept as short text in the inventory
(one-line errors, trimmed output, warnings recorded under Python's default filters)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

#: Longest error or printed text kept per package (the start says what went wrong).
MAX_ERROR_CHARS = 500
MAX_PRINTED_CHARS = 2000


def _one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _trim_printed(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    joined = "\n".join(lines)
    return joined if len(joined) <= MAX_PRINTED_CHARS else joined[: MAX_PRINTED_CHARS - 1] + "…"


def _exception_text(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record warnings under Python's default filters, whatever the caller set (pytest, -W):
    keep what a user running diagnose would see, not every DeprecationWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (
            DeprecationWarning,
            PendingDeprecationWarning,
            ImportWarning,
            ResourceWarning,
        ):
            warnings.simplefilter("ignore", category)
        yield caught


def _format_warnings(caught: Iterable[warnings.WarningMessage]) -> str:
    lines = (f"{w.category.__name__}: {w.message}" for w in caught)
    return "\n".join(dict.fromkeys(lines))  # each distinct warning once, in order
