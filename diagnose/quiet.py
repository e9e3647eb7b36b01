"""Keep native libraries' chatter off the user's terminal.

Kineto writes lines like ``USDT:... profiler_start`` straight to file descriptor 2 each time the
profiler starts or stops; Python-level redirection cannot catch them.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

#: Lines from native code that carry no information for the user.
_CHATTER = re.compile(r"^(USDT:.*profiler_(start|stop)|.*ActivityProfilerController.*|STAGE:.*)$")


@contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Capture fd 2 for the duration; afterwards re-emit what was not known chatter."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a fd
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines() if line and not _CHATTER.match(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
