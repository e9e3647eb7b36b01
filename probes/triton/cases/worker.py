"""The interpreter worker: ``python -m diagnose.probes.triton.cases.worker SPEC.json``.

Started by :mod:`diagnose.probes.triton.cases.runner` with ``TRITON_INTERPRET=1`` in its
environment, so the kernels it imports are decorated for Triton's interpreter. It writes one JSON
line per event to the file the spec names: ``plan`` (every check), ``start``/``result`` per check,
``done``, or ``load_error``. Lines are flushed at once so a crash loses only the check in flight.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO


def _emit(stream: TextIO, **event: Any) -> None:
    stream.write(json.dumps(event) + "\n")
    stream.flush()


def main(argv: Sequence[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    with open(spec["events"], "a", encoding="utf-8") as events:
        # Imported here, after the process started with TRITON_INTERPRET=1 set.
        import torch

        from diagnose.probes.triton.cases.api import CheckEnv, dtype_name
        from diagnose.probes.triton.cases.check import plan_checks, run_checks
        from diagnose.probes.triton.cases.loading import CaseLoadError, load_cases

        try:
            cases = [case for source in spec["sources"] for case in load_cases(source)]
        except CaseLoadError as exc:
            _emit(events, event="load_error", message=str(exc))
            return 3
        seeds = [int(s) for s in spec["seeds"]]
        plan = plan_checks(cases, "interpreter", seeds)
        _emit(
            events,
            event="plan",
            checks=[
                {
                    "case": p.case.name,
                    "kind": p.case.kind,
                    "shape": dict(p.shape),
                    "dtype": dtype_name(p.dtype),
                    "run_seed": p.run_seed,
                }
                for p in plan
            ],
        )
        env = CheckEnv("interpreter", "interpreter", "", torch.device("cpu"))
        run_checks(
            cases,
            env,
            seeds,
            start=int(spec["start"]),
            on_start=lambda check: _emit(events, event="start", index=check.index),
            on_result=lambda check, result: _emit(
                events, event="result", index=check.index, result=result.to_dict()
            ),
        )
        _emit(events, event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
