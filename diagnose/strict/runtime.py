"""Strict mode inside each process of ``diagnose profile --strict -- CMD``.

``diagnose profile``'s capture (``diagnose/profile/capture.py``) imports this module in every
process of the command once ``torch.optim`` has been imported there, when ``--strict`` was given
(the options travel in ``DIAGNOSE_STRICT``), and tells it when the capture's window of steps
opens and closes. The rest it sees for itself:

- from the start, the claim (:mod:`diagnose.strict.claims`: ``--expect``, then the autocast
  entered in the first step);
- at the end of the first optimizer step, the trainer's own setting (Lightning's trainer on the
  stack, accelerate's state), and, with ``--strict-window all``, the checks are installed for
  every step from there on; with ``capture``, for the capture's steps only;
- each optimizer step reached with the checks installed is counted as a watched step;
- a forked child (a DataLoader worker) carries none of it;
- the log is written to ``strict-<pid>.json`` in the capture folder at the first violation (fail
  mode), when the capture's window closes and when the process ends.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Mapping
from typing import Any

from diagnose.strict.claims import accelerate_claim, expected_claim, lightning_claim
from diagnose.strict.mode import RANK_EXPECT, RANK_TRAINER, StrictSession
from diagnose.strict.options import StrictOptions
from diagnose.strict.violations import LOG_PREFIX, LOG_SUFFIX
from diagnose.trainers import trainer_in_packages


class ProcessStrict:
    """Strict mode of one process of the profiled command."""

    def __init__(self, options: StrictOptions, directory: str) -> None:
        self.options = options
        self.pid = os.getpid()
        self.session = StrictSession(
            options,
            claim=expected_claim(options.expect),
            claim_rank=RANK_EXPECT,
            log_path=os.path.join(directory, f"{LOG_PREFIX}{self.pid}{LOG_SUFFIX}"),
        )
        self.stepped = False
        self._hooks: list[Any] = []

    def start(self) -> None:
        import torch.optim.optimizer as optimizer

        self.session.begin()
        self._hooks = [
            optimizer.register_optimizer_step_pre_hook(self._step_reached),
            optimizer.register_optimizer_step_post_hook(self._step_ended),
        ]
        atexit.register(self.at_exit)
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    # -- events ---------------------------------------------------------------------------

    def _step_reached(self, optimizer: object, args: object, kwargs: object) -> None:
        if os.getpid() == self.pid:
            self.session.step_reached()

    def _step_ended(self, optimizer: object, args: object, kwargs: object) -> None:
        if os.getpid() != self.pid:
            return
        try:
            if not self.stepped:
                self._first_step()
            else:
                self.session.step_ended()
        except Exception as exc:
            self.session.fail(f"strict mode at an optimizer step: {type(exc).__name__}: {exc}")

    def _first_step(self) -> None:
        self.stepped = True
        session = self.session
        session.trainer = trainer_in_packages(sys.modules) or ""
        trainer = lightning_claim(sys._getframe(1)) or accelerate_claim()
        session.set_claim(trainer, RANK_TRAINER)
        session.log.rank = _rank()
        if self.options.window == "all":
            session.install()
        session.write()

    def capture_started(self) -> None:
        """The capture's timed steps begin (``--strict-window capture`` installs here)."""
        if self.options.window == "capture" and os.getpid() == self.pid:
            self.session.install()

    def capture_ended(self) -> None:
        """The capture is written: the window closes; the log is written either way."""
        if os.getpid() != self.pid:
            return
        if self.options.window == "capture":
            self.session.uninstall()
        self.session.write()

    def at_exit(self) -> None:
        if os.getpid() != self.pid or not self.stepped:
            return
        self.session.uninstall()
        self.session.write()

    def _after_fork_in_child(self) -> None:
        # A DataLoader worker must not judge its collation or write the parent's log.
        self.session.stopped = True
        self.session.log_path = ""


def _rank() -> int:
    for name in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def start(environ: Mapping[str, str], directory: str) -> ProcessStrict | None:
    """Strict mode for this process when the parent asked for it (None otherwise)."""
    options = StrictOptions.from_env(environ)
    if options is None:
        return None
    process = ProcessStrict(options, directory)
    process.start()
    return process


__all__ = ["ProcessStrict", "start"]
