"""When the command began: its start-up (imports, argument parsing) is timed from there.

Not from the process's creation time: ``bash -c 'pip install ... && diagnose run'`` execs diagnose
in the process bash started, whose age holds everything bash did before (the run once said
"start-up 101 s"). The ``diagnose`` command's entry is the import of the package, the first
thing its process does once the interpreter is up (the interpreter's own start, tens of
milliseconds, is before it); ``main()`` called from Python marks its own call.
"""

from __future__ import annotations

import time

from diagnose import IMPORTED_AT

_entered: float | None = None


def mark_entry(at: float | None = None) -> None:
    """The command begins now (or at ``at``, a :func:`time.perf_counter` reading)."""
    global _entered
    _entered = time.perf_counter() if at is None else at


def seconds_since_entry() -> float:
    """Wall time since the command began (since the package's import when none was marked)."""
    return max(0.0, time.perf_counter() - (IMPORTED_AT if _entered is None else _entered))


__all__ = ["mark_entry", "seconds_since_entry"]
