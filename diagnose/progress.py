"""Progress on stderr during long work (a status line, or a bar of points done); silent when
stderr is not a terminal (CI, pipes). The one tqdm wrapper: every command's progress is this."""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import TextIO, TypeVar

_Progress = TypeVar("_Progress", bound="ProgressLine")


class ProgressLine:
    """Shows the current stage and the elapsed time, rewritten in place (tqdm's status bar); with
    ``total``, a bar of that many items in ``bar_format`` (none when ``total`` is 0)."""

    def __init__(
        self,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        *,
        total: int | None = None,
        bar_format: str = "{desc} [{elapsed}]",
    ) -> None:
        self._own_stream: TextIO | None = None
        if stream is None:
            stream = sys.stderr
            if enabled is not False and stream.isatty():
                # A handle of our own on the terminal: native-output capture (diagnose.quiet)
                # swaps file descriptor 2 while the profiler runs, and the line must stay visible.
                self._own_stream = os.fdopen(os.dup(stream.fileno()), "w", buffering=1)
                stream = self._own_stream
        self._stream = stream
        self.enabled = (self._stream.isatty() if enabled is None else enabled) and total != 0
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                file=self._stream,
                bar_format=bar_format,
                leave=False,
                dynamic_ncols=True,
            )

    def __call__(self, message: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"diagnose: {message}")
            self._bar.update(0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._own_stream is not None:
            self._own_stream.close()
            self._own_stream = None

    def __enter__(self: _Progress) -> _Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
