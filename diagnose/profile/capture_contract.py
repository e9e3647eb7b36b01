"""What the parent side of ``diagnose profile`` and the capture in the user's processes agree on.

The environment variables the parent (:mod:`diagnose.profile.launch`) sets for every process of
the command, the settings the capture reads from them, the files it writes in the capture folder
and their schema and statuses. The parent imports it as ``diagnose.profile.capture_contract``;
inside the user's processes ``capture.py`` loads it by path from beside itself (their Python may
not have ``diagnose``), so it imports nothing from ``diagnose`` and nothing heavy.

Files in the capture folder (``DIAGNOSE_PROFILE_DIR``):

- ``process-<pid>.json``: every process that imported torch (launchers and DataLoader workers
  too): argv, the optimizers it built, whether it stepped, a failure of the bootstrap. Not a rank.
- ``rank<R>.capture.json`` (``rank<R>-pid<pid>`` when two processes claim rank R): created when
  the process's first step ends (``status: running``), rewritten atomically after each timed step
  (so a process killed later keeps them) and at the end with the facts.
- ``rank<R>.pt.trace.json.gz``: the Kineto trace of the profiled steps.
- ``rank<R>.pyspy.txt``: py-spy's stacks of the probe and profiled steps, when the parent named a
  py-spy (``DIAGNOSE_PROFILE_PY_SPY``; see ``stack_sampler.py``).
- ``strict-<pid>.json``: strict mode's log (``--strict``: ``DIAGNOSE_STRICT``), written by
  ``diagnose.strict.runtime``, which the capture starts at the first optimizer's construction and
  tells when the capture's window opens and closes.

The bootstrap (``bootstrap/sitecustomize.py``) names ``DIAGNOSE_PROFILE_DIR``,
``DIAGNOSE_PROFILE_CAPTURE`` and the process file itself, without loading this file at start-up;
a test keeps them equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: Environment variables the parent sets for every process of the command.
ENV_DIR = "DIAGNOSE_PROFILE_DIR"
ENV_CAPTURE = "DIAGNOSE_PROFILE_CAPTURE"
ENV_SKIP_STEPS = "DIAGNOSE_PROFILE_SKIP_STEPS"
ENV_TIMED_STEPS = "DIAGNOSE_PROFILE_TIMED_STEPS"
ENV_PROFILED_STEPS = "DIAGNOSE_PROFILE_PROFILED_STEPS"
ENV_STOP_AFTER = "DIAGNOSE_PROFILE_STOP_AFTER"
#: The py-spy executable that samples the profiled steps' Python stacks (unset: none).
ENV_PY_SPY = "DIAGNOSE_PROFILE_PY_SPY"
#: ``--strict``: its options, and where the diagnose package's modules are for a Python that
#: lacks it (its folder first; as diagnose.strict.options.ENV_OPTIONS and ENV_PACKAGE, a test keeps
#: them equal).
ENV_STRICT = "DIAGNOSE_STRICT"
ENV_STRICT_PACKAGE = "DIAGNOSE_STRICT_PACKAGE"

FACTS_SUFFIX = ".capture.json"
TRACE_SUFFIX = ".pt.trace.json.gz"
#: py-spy's collapsed stacks of the probe and profiled steps (``--format raw``).
STACKS_SUFFIX = ".pyspy.txt"
PROCESS_PREFIX = "process-"
SCHEMA_VERSION = 1

STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"


@dataclass(frozen=True)
class Settings:
    """What to capture, read from the environment the parent set."""

    directory: str
    skip_steps: int = 5
    timed_steps: int = 10
    profiled_steps: int = 3
    stop_after: bool = False
    py_spy: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings | None:
        directory = environ.get(ENV_DIR)
        if not directory:
            return None

        def count(name: str, default: int) -> int:
            try:
                return max(0, int(environ.get(name, "")))
            except ValueError:
                return default

        profiled = count(ENV_PROFILED_STEPS, cls.profiled_steps)
        world = count("WORLD_SIZE", 1)
        if profiled:
            # Enough that the waits between ranks have a jitter to be held against.
            profiled = max(profiled, steps_to_name_a_straggler(world))
        return cls(
            directory=directory,
            skip_steps=count(ENV_SKIP_STEPS, cls.skip_steps),
            timed_steps=count(ENV_TIMED_STEPS, cls.timed_steps),
            profiled_steps=profiled,
            stop_after=environ.get(ENV_STOP_AFTER, "") in {"1", "true", "yes"},
            py_spy=environ.get(ENV_PY_SPY, ""),
        )


#: As diagnose.catalogs.distributed_catalog.STRAGGLER_STEPS (this module imports nothing of
#: diagnose's: it runs in the user's processes); a test keeps the two equal.
_STRAGGLER_STEPS = 3


def steps_to_name_a_straggler(world_size: int) -> int:
    """As the catalog's function of that name: the fewest profiled steps a straggler among
    ``world_size`` ranks can be named from."""
    return _STRAGGLER_STEPS if world_size > 1 else 1


__all__ = [
    "ENV_CAPTURE",
    "ENV_DIR",
    "ENV_PROFILED_STEPS",
    "ENV_PY_SPY",
    "ENV_SKIP_STEPS",
    "ENV_STOP_AFTER",
    "ENV_STRICT",
    "ENV_STRICT_PACKAGE",
    "ENV_TIMED_STEPS",
    "FACTS_SUFFIX",
    "PROCESS_PREFIX",
    "SCHEMA_VERSION",
    "STACKS_SUFFIX",
    "STATUS_COMPLETE",
    "STATUS_RUNNING",
    "TRACE_SUFFIX",
    "Settings",
    "steps_to_name_a_straggler",
]
