"""Where the checks run: compiled on the GPU in this process, or in Triton's interpreter elsewhere.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated, so the interpreter runs in a
subprocess (:mod:`diagnose.probes.triton.cases.worker`) with the variable set there only; this
process's environment is never touched. The worker reports each check as one JSON line, so a
kernel that kills it (an out-of-bounds access in the interpreter can) costs only that check:
the worker is restarted after it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diagnose.catalogs.triton_catalog import seeds_label
from diagnose.probes.budgets import budget_spent
from diagnose.probes.triton.cases.api import CheckEnv, Mode, shape_label
from diagnose.probes.triton.cases.check import (
    FAILING,
    VERDICTS,
    CheckResult,
    RunState,
    plan_checks,
    run_checks,
    run_seeds,
)
from diagnose.probes.triton.cases.loading import CaseLoadError, load_cases, validate_source

#: The built-in corpus, in run order.
CORPUS: tuple[str, ...] = tuple(
    f"diagnose.probes.triton.cases.{name}"
    for name in ("elementwise", "softmax", "norms", "matmul", "attention", "atomics", "inductor")
)
WORKER_MODULE = "diagnose.probes.triton.cases.worker"
#: A worker that dies this many times gives up on the remaining checks.
MAX_WORKER_RESTARTS = 5


@dataclass
class SuiteResult:
    """Every check of one run, and where and how it ran."""

    mode: Mode
    #: Triton's backend: "cuda", "hip" or "interpreter".
    backend: str
    arch: str
    device: str
    #: The first run seed (``--seed``); ``seeds`` are all of them (``--seeds N``).
    seed: int
    sources: list[str]
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    #: Checks planned for the passes that started, when a time budget cut the last one short
    #: (0: none was cut).
    planned: int = 0

    def __post_init__(self) -> None:
        if not self.seeds:
            self.seeds = [self.seed]

    def counts(self) -> dict[str, int]:
        counted = Counter(c.verdict for c in self.checks)
        return {verdict: counted.get(verdict, 0) for verdict in VERDICTS}

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.verdict in FAILING]

    @property
    def drifted(self) -> list[CheckResult]:
        return [c for c in self.checks if c.verdict == "drift"]

    @property
    def ran(self) -> int:
        """Checks that ran to a verdict on the numbers or on a build/launch failure."""
        return sum(1 for c in self.checks if c.verdict != "unsupported")

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "backend": self.backend,
            "arch": self.arch,
            "device": self.device,
            "seed": self.seed,
            "seeds": list(self.seeds),
            "sources": list(self.sources),
            "seconds": self.seconds,
            "counts": self.counts(),
            "notes": list(self.notes),
            "planned": self.planned,
            "checks": [c.to_dict() for c in self.checks],
        }


def jsonable(value: Any) -> Any:
    """Replace NaN and infinities (not valid JSON) by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def interpreter_forced() -> bool:
    """Whether the user's environment already turns Triton's interpreter on."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def device_target(device: torch.device) -> tuple[str, str]:
    """Triton's backend ("cuda"/"hip") and arch ("sm_90", "gfx1100") for a GPU device."""
    try:
        from triton.runtime import driver

        with torch.cuda.device(device):
            target = driver.active.get_current_target()
        arch = target.arch
        if target.backend == "cuda" and isinstance(arch, int):
            return "cuda", f"sm_{arch}"
        return str(target.backend), str(arch)
    except Exception:
        backend = "hip" if torch.version.hip else "cuda"
        if backend == "hip":
            name = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
            return backend, str(name).split(":", 1)[0]
        major, minor = torch.cuda.get_device_capability(device)
        return backend, f"sm_{major}{minor}"


def budget_notes(
    checks: int,
    planned: int,
    seeds: Sequence[int],
    ran: Sequence[int],
    timeout_s: float,
    probe_budget: bool,
) -> list[str]:
    """What a device run left out for time: the checks of its last pass and the seeds it did not
    start, with the budget that stopped it (``probe_budget``: a probe's deadline had passed,
    else ``timeout_s``, ``diagnose triton --timeout``'s)."""
    notes = []
    if planned > checks:
        notes.append(
            f"{checks} of {planned} checks run: the time budget ran out (each pass runs every "
            "case's first check before any second one)"
        )
    if len(ran) < len(seeds):
        budget = "the probe's time budget" if probe_budget else f"the {timeout_s:g} s time budget"
        notes.append(
            f"{seeds_label(seeds[len(ran) :])} not run: {budget} was spent after "
            f"{len(ran)} of {len(seeds)} seeds"
        )
    return notes


def run_suite(
    sources: Sequence[str],
    *,
    device: torch.device,
    seed: int | None = None,
    seeds: int = 1,
    timeout_s: float = 900.0,
    progress: Callable[[str], None] | None = None,
    deadline: float | None = None,
) -> SuiteResult:
    """Run every check of ``sources`` (module names or .py files holding ``CASES``), once per
    seed: ``seeds`` seeds from ``seed`` (default: the fixed default seed) on.

    A GPU device runs them compiled, in this process; any other runs them in Triton's
    interpreter in a subprocess (and the inductor cases on inductor's CPU backend). Raises
    CaseLoadError for a source that does not give cases.

    ``deadline`` (``time.perf_counter()``; a probe's time budget, on a GPU): no check starts
    once it has passed, past the first, even within the first seed's pass; the pass's order
    has then judged every case's first check before any second one.
    """
    sources = [validate_source(s) for s in sources]
    all_seeds = run_seeds(seed, seeds)
    start = time.perf_counter()
    if device.type == "cuda" and not interpreter_forced():
        backend, arch = device_target(device)
        suite = SuiteResult("device", backend, arch, str(device), all_seeds[0], sources)
        suite.checks, ran, planned = _run_in_process(
            sources, device, backend, arch, all_seeds, progress, timeout_s, deadline
        )
        if planned > len(suite.checks):
            suite.planned = planned
        probe_budget = budget_spent(deadline)
        suite.notes.extend(
            budget_notes(len(suite.checks), planned, all_seeds, ran, timeout_s, probe_budget)
        )
        all_seeds = ran
    else:
        suite = SuiteResult("interpreter", "interpreter", "", "cpu", all_seeds[0], sources)
        if device.type == "cuda":
            suite.notes.append(
                "TRITON_INTERPRET is set in this environment: the kernels ran in Triton's "
                "interpreter on the CPU, not compiled for the GPU"
            )
        suite.checks, notes = _run_in_worker(sources, all_seeds, timeout_s, progress)
        suite.notes.extend(notes)
    suite.seeds = all_seeds
    suite.seconds = time.perf_counter() - start
    return suite


def _run_in_process(
    sources: Sequence[str],
    device: torch.device,
    backend: str,
    arch: str,
    seeds: Sequence[int],
    progress: Callable[[str], None] | None,
    timeout_s: float,
    deadline: float | None = None,
) -> tuple[list[CheckResult], list[int], int]:
    """The checks of every seed, seed by seed, the seeds whose pass started, and the checks
    those passes planned: no seed starts once ``timeout_s`` is spent (the first always runs),
    so a cut run has whole passes; past ``deadline`` (:func:`run_suite`) no check starts at all,
    past the first, and the pass it cut is the last."""
    cases = [case for source in sources for case in load_cases(source)]
    env = CheckEnv("device", backend, arch, device)
    per_seed = len(plan_checks(cases, "device", seeds[:1]))
    total = per_seed * len(seeds)
    seeds_deadline = time.monotonic() + timeout_s
    state = RunState()
    results: list[CheckResult] = []
    ran: list[int] = []

    def stop() -> bool:
        return budget_spent(deadline)

    for number, seed in enumerate(seeds):
        if ran and (time.monotonic() >= seeds_deadline or stop()):
            break

        def on_start(check: Any, done: int = number * per_seed) -> None:
            if progress is not None:
                progress(f"triton check {done + check.index + 1}/{total}: {check.label}")

        checks = run_checks(cases, env, [seed], on_start=on_start, state=state, stop=stop)
        results += checks
        ran.append(seed)
        if len(checks) < per_seed:
            break  # the budget cut this pass short
    return results, ran, per_seed * len(ran)


@dataclass
class _WorkerLog:
    """What a worker wrote, read back from its JSON-lines file."""

    plan: list[dict[str, Any]] = field(default_factory=list)
    results: dict[int, CheckResult] = field(default_factory=dict)
    in_flight: int | None = None
    done: bool = False
    load_error: str = ""


def _read_events(path: Path, log: _WorkerLog) -> None:
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        kind = event.get("event")
        if kind == "plan":
            log.plan = event["checks"]
        elif kind == "start":
            log.in_flight = int(event["index"])
        elif kind == "result":
            log.results[int(event["index"])] = CheckResult.from_dict(event["result"])
            log.in_flight = None
        elif kind == "done":
            log.done = True
        elif kind == "load_error":
            log.load_error = str(event["message"])


def _planned_result(entry: dict[str, Any], message: str) -> CheckResult:
    return CheckResult(
        case=entry["case"],
        kind=entry["kind"],
        shape=dict(entry["shape"]),
        dtype=entry["dtype"],
        verdict="launch_error",
        mode="interpreter",
        backend="interpreter" if entry["kind"] == "triton" else "inductor-cpp",
        message=message,
        run_seed=int(entry["run_seed"]),
    )


def _death_message(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the interpreter process died ({name}) while running this check"
    return f"the interpreter process exited with status {returncode} while running this check"


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _run_in_worker(
    sources: Sequence[str],
    seeds: Sequence[int],
    timeout_s: float,
    progress: Callable[[str], None] | None,
) -> tuple[list[CheckResult], list[str]]:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    log = _WorkerLog()
    notes: list[str] = []
    deadline = time.monotonic() + timeout_s
    start_index = 0
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="diagnose-triton-") as tmp:
        folder = Path(tmp)
        while True:
            events = folder / f"events-{restarts}.jsonl"
            stderr_path = folder / f"stderr-{restarts}.txt"
            spec = folder / f"spec-{restarts}.json"
            spec.write_text(
                json.dumps(
                    {
                        "sources": list(sources),
                        "seeds": list(seeds),
                        "start": start_index,
                        "events": str(events),
                    }
                ),
                encoding="utf-8",
            )
            attempt = _WorkerLog(plan=log.plan)
            timed_out = False
            with open(stderr_path, "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, str(spec)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=stderr,
                    stderr=stderr,
                )
                while True:
                    try:
                        proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if progress is not None:
                        _read_events(events, attempt)
                        done = len(log.results) + len(attempt.results)
                        total = len(attempt.plan) or "?"
                        progress(f"triton checks (interpreter) {done}/{total}")
                    if time.monotonic() > deadline:
                        proc.kill()
                        proc.wait()
                        timed_out = True
                        break
            _read_events(events, attempt)
            if attempt.load_error:
                raise CaseLoadError(attempt.load_error)
            log.plan = attempt.plan or log.plan
            log.results.update(attempt.results)
            if attempt.done and not timed_out:
                break
            if not log.plan:
                raise RuntimeError(
                    f"the Triton interpreter worker failed before planning any check "
                    f"(exit status {proc.returncode}): {_tail(stderr_path)}"
                )
            failed_at = attempt.in_flight
            if failed_at is not None:
                why = (
                    f"timed out after {timeout_s:.0f} s"
                    if timed_out
                    else _death_message(proc.returncode)
                )
                log.results[failed_at] = _planned_result(log.plan[failed_at], why)
                tail = _tail(stderr_path, 2)
                notes.append(
                    f"{log.plan[failed_at]['case']}: {why}" + (f" ({tail})" if tail else "")
                )
            if timed_out or failed_at is None or restarts >= MAX_WORKER_RESTARTS:
                reason = (
                    "the time budget was spent"
                    if timed_out
                    else f"the interpreter process died {restarts + 1} times"
                    if failed_at is not None
                    else f"the interpreter process stopped: {_tail(stderr_path)}"
                )
                for index, entry in enumerate(log.plan):
                    if index not in log.results:
                        log.results[index] = _planned_result(entry, f"not run: {reason}")
                break
            restarts += 1
            start_index = failed_at + 1
    return [log.results[i] for i in sorted(log.results)], notes


# --- the verdict table ------------------------------------------------------------------------

_VERDICT_LABELS = {
    "pass": "pass",
    "drift": "drift",
    "mismatch": "MISMATCH",
    "compile_error": "COMPILE ERROR",
    "launch_error": "LAUNCH ERROR",
    "unsupported": "not supported here",
    "case_error": "CASE ERROR",
}


def _ratio(value: float | None) -> str:
    """err/bound with two significant digits: the same stack prints the same text."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "inf"
    return f"{value:.2g}"


def verdict_table(checks: Sequence[CheckResult]) -> str:
    """A plain-text table, one row per case, shape and dtype (its seeds counted together), and
    the details of every check that did not pass below it."""
    header = ("case", "dtype", "shape", "verdict", "err/bound", "first wrong")
    groups: dict[tuple[str, str, str], list[CheckResult]] = {}
    for check in checks:
        groups.setdefault((check.case, check.dtype, shape_label(check.shape)), []).append(check)
    several = any(len(group) > 1 for group in groups.values())
    rows = [header]
    for (case, dtype, shape), group in groups.items():
        counted = Counter(c.verdict for c in group)
        verdicts = [v for v in VERDICTS if counted[v]]
        if several:
            label = ", ".join(f"{counted[v]} {_VERDICT_LABELS[v]}" for v in verdicts)
        else:
            label = _VERDICT_LABELS[verdicts[0]]
        ratios = [c.worst_ratio for c in group if c.worst_ratio is not None]
        wrong = next((c for c in group if c.verdict in ("mismatch", "drift")), None)
        first = "-"
        if wrong is not None and wrong.first_wrong_index is not None:
            first = str(tuple(wrong.first_wrong_index))
        rows.append((case, dtype, shape, label, _ratio(max(ratios) if ratios else None), first))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    details = [
        f"  {check.label}" + (f" seed {check.run_seed}" if several else "") + f": {check.message}"
        for check in checks
        if check.verdict != "pass" and check.message
    ]
    if details:
        lines += ["", "details:", *details]
    return "\n".join(lines)


def summary_line(suite: SuiteResult) -> str:
    """The counts of each verdict, where it ran and the seeds: the same stack prints the same."""
    counts = suite.counts()
    parts = [f"{counts[v]} {_VERDICT_LABELS[v]}" for v in VERDICTS if counts[v]]
    where = (
        "Triton's interpreter: kernel logic only, not the GPU compiler"
        if suite.mode == "interpreter"
        else f"compiled for {suite.arch or suite.device} ({suite.backend} backend)"
    )
    counted = ", ".join(parts) or "none"
    return f"{len(suite.checks)} checks: {counted} — {where}; {seeds_label(suite.seeds)}"


def drift_line(suite: SuiteResult) -> str:
    """What the drifting checks mean, and how to see whether they repeat ("" when none did)."""
    drifted = suite.drifted
    if not drifted:
        return ""
    worst = max((c.worst_ratio or 0.0) for c in drifted)
    cases = ", ".join(sorted({c.case for c in drifted}))
    rerun = suite.seeds[-1] + 1
    return (
        f"{len(drifted)} check(s) went beyond their error bound, by at most {worst:.2g}× it, "
        f"without a pattern ({cases}): within what a correct kernel might show on a rare input. "
        f"Rerun with another seed (`diagnose triton --seed {rerun}`) to see whether it repeats."
    )
