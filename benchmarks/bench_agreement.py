"""Agreement of verdicts: the same config run N times, the share of runs that give the same advice.

    python benchmarks/bench_agreement.py [--runs N] [--configs default,math,adamw8bit,bigpng,zimage]
                                         [--keep DIR] [--timeout S] [-- extra diagnose run options]

A diagnosis is only useful if a rerun gives the same advice. Each config is run ``--runs`` times
(default 20: at least 95% agreement means 19 of 20) as ``diagnose run ... --out TMP --force`` in a
fresh subprocess, as a
user runs it; the configs are interleaved run by run (default, math, ..., default, math, ...) so
that drift of the machine's load hits every config alike. From each ``record.json`` it reads the
set of finding ids of severity warn or critical (the advice a reader acts on), the s/it the report
leads with, and the machine's load from other work while the steps ran (``timing.host_load``, when
the record has it; read defensively, older records lack it).

Configs:

  default    the default run
  math       ``--attention math``
  adamw8bit  ``--optimizer adamw8bit``
  bigpng     ``--data DIR``: a folder of large random-noise PNGs (2048x2048, each with a caption
             sidecar ``.txt``), generated once per invocation into a temporary folder
  zimage     ``--preset zimage --base nf4``: the Z-Image stand-in on a 4-bit base

Prints one table, one row per config: runs (and how many failed), the modal set of warn/critical
ids, the share of all runs that gave exactly that set (a failed run counts as disagreeing), the
ids that flipped (``+id``: raised where the modal set lacks it, ``-id``: missing where it has it)
and in how many runs, s/it median and spread over the runs (min-max, and that range over the
median), the median wall time of one run, and the median load from other processes (cores other
processes took, of the cores the run could use; ``-`` where the record does not say). Failed
runs are listed below the table with their exit code and last line of output. The target is at
least 95% agreement on an idle machine.

Below the table, per config, every finding any run raised at warn or critical or as borderline:
its deciding value (the share of the step its saving is, or for the data wait the wait's share
of the step) as median [min-max] over the runs, against its line, and in how many runs it was
warn/critical, borderline, lower or absent; and for each id that flipped, the cause as the runs
show it: its value straddling its line across runs, borderline runs, or a busy machine in the
runs where it flipped. The header names the CPU and whether it computes bf16 natively (AVX-512
BF16, AMX): a value near its line on one CPU may sit far from it on another.

Exit status: 0 whatever the runs did (a failed run is a row of the table, not an error of this
script); 2 when the script itself is misused (an unknown config, ``--runs`` below 1, ``--keep``
naming a file). Imports no torch: the runs are subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from diagnose.record_io import record_from_dict

#: The settings each config adds to ``diagnose run``; ``{data}`` is the big-PNG folder.
CONFIGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "math": ("--attention", "math"),
    "adamw8bit": ("--optimizer", "adamw8bit"),
    "bigpng": ("--data", "{data}"),
    "zimage": ("--preset", "zimage", "--base", "nf4"),
}
ADVICE = ("warn", "critical")
TARGET = 0.95
#: The big-PNG folder: this many images of this side, random noise (PNG cannot compress it, so
#: every file is as large to read and decode as a real photo of that size).
PNG_COUNT = 8
PNG_SIDE = 2048


@dataclass(frozen=True)
class Decided:
    """How one finding stood in one run: its severity, whether it was borderline, and the value
    it was judged on (its saving's share of the step) with that value's interval."""

    severity: str
    borderline: bool
    share: float | None
    low: float | None = None
    high: float | None = None

    @property
    def held_back(self) -> bool:
        """Borderline at its own line, so shown as info: a warning can be borderline too, at
        the critical line above it, and still be raised."""
        return self.borderline and self.severity not in ADVICE


#: The line each deciding value is held against (the warn line of the one severity rule).
LINE = 0.10
#: Findings judged on a value other than their saving, and that value's name.
WAIT_FINDING = "dataloader.gpu_starved"


@dataclass
class RunOutcome:
    """What one ``diagnose run`` subprocess gave."""

    config: str
    index: int
    wall_s: float
    returncode: int | None  # None: killed at the timeout
    advice: frozenset[str] | None = None  # None: no readable record
    s_per_it: float | None = None
    others_cores: float | None = None
    cpus: int | None = None
    #: Per finding id this run raised: what decided it (see :class:`Decided`).
    decided: dict[str, Decided] = field(default_factory=dict)
    #: The data wait's share of the step (the phase bar's), the value gpu_starved is judged on.
    wait_share: float | None = None
    #: Windows (the timed steps, each probe) in which other work competed for the cores.
    busy_windows: list[str] = field(default_factory=list)
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.advice is not None


@dataclass
class Row:
    config: str
    outcomes: list[RunOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if not o.ok]

    def modal(self) -> tuple[frozenset[str] | None, int]:
        """The set of advice ids most runs gave (the first seen on a tie), and how many gave it."""
        sets = [o.advice for o in self.outcomes if o.ok and o.advice is not None]
        if not sets:
            return None, 0
        counts = Counter(sets)
        best = max(counts.values())
        chosen = next(s for s in sets if counts[s] == best)
        return chosen, best

    def flips(self) -> dict[str, int]:
        """Per id that differs from the modal set: in how many successful runs it did."""
        modal, _ = self.modal()
        found: Counter[str] = Counter()
        if modal is None:
            return {}
        for outcome in self.outcomes:
            if outcome.advice is None or not outcome.ok:
                continue
            for extra in outcome.advice - modal:
                found[f"+{extra}"] += 1
            for missing in modal - outcome.advice:
                found[f"-{missing}"] += 1
        return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


# --------------------------------------------------------------------------------------------
# Inputs


def write_big_pngs(folder: Path, count: int = PNG_COUNT, side: int = PNG_SIDE) -> None:
    """``count`` random-noise RGB PNGs of ``side`` x ``side`` pixels, each with a caption."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for number in range(count):
        image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
        path = folder / f"noise_{number:03d}.png"
        image.save(path, "PNG", compress_level=1)
        path.with_suffix(".txt").write_text(f"random noise, number {number}\n", encoding="utf-8")


def command(config: str, out: Path, data: Path | None, extra: Sequence[str]) -> list[str]:
    settings = [s.format(data=data) for s in CONFIGS[config]]
    return [
        sys.executable,
        "-m",
        "diagnose",
        "run",
        "--out",
        str(out),
        "--force",
        "--no-progress",
        *settings,
        *extra,
    ]


# --------------------------------------------------------------------------------------------
# Reading a record


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def host_load(timing: Mapping[str, Any]) -> tuple[float | None, int | None]:
    """Cores other processes took while the steps ran, and the cores the run could use; None
    where the record does not say (records written before ``timing.host_load`` existed)."""
    load = timing.get("host_load")
    if not isinstance(load, Mapping):
        return None, None
    others = _number(load.get("others_cores"))
    cpus = _number(load.get("cpus"))
    return others, int(cpus) if cpus else None


def read_outcome(outcome: RunOutcome, folder: Path) -> None:
    """Fill ``outcome`` from the run folder's record.json (or say why it could not be read)."""
    path = folder / "record.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        outcome.problem = outcome.problem or f"no readable record.json: {type(exc).__name__}"
        return
    findings = data.get("findings") if isinstance(data, Mapping) else None
    if not isinstance(findings, list):
        outcome.problem = outcome.problem or "record.json has no findings list"
        return
    outcome.advice = frozenset(
        str(f.get("id", "?"))
        for f in findings
        if isinstance(f, Mapping) and f.get("severity") in ADVICE
    )
    timing = data.get("timing")
    if isinstance(timing, Mapping):
        outcome.s_per_it = s_per_it(data)
        outcome.others_cores, outcome.cpus = host_load(timing)
    step = outcome.s_per_it
    for f in findings:
        if isinstance(f, Mapping):
            outcome.decided[str(f.get("id", "?"))] = decided(f, step)
    outcome.busy_windows = busy_windows(data)
    breakdown = data.get("breakdown")
    seconds = breakdown.get("seconds") if isinstance(breakdown, Mapping) else None
    wait = _number(seconds.get("data_wait")) if isinstance(seconds, Mapping) else None
    if wait is not None and step:
        outcome.wait_share = min(wait, step) / step


def busy_windows(data: Mapping[str, Any]) -> list[str]:
    """The record's timed windows other work competed in: "steps" and each probe's name."""
    windows: list[tuple[str, Any]] = []
    timing = data.get("timing")
    if isinstance(timing, Mapping):
        windows.append(("steps", timing.get("host_load")))
    probes = data.get("probes")
    for probe in probes if isinstance(probes, list) else []:
        if isinstance(probe, Mapping):
            windows.append((str(probe.get("name", "?")), probe.get("host_load")))
    return [
        name
        for name, load in windows
        if isinstance(load, Mapping) and (_number(load.get("competing_share")) or 0.0) > 0
    ]


def decided(finding: Mapping[str, Any], step: float | None) -> Decided:
    """What one recorded finding was judged on: its saving's share of ``step`` and the interval
    from its sure saving to its high end (read defensively: older records lack the fields)."""

    def share(key: str) -> float | None:
        value = _number(finding.get(key))
        return value / step if value is not None and step else None

    return Decided(
        severity=str(finding.get("severity", "?")),
        borderline=isinstance(finding.get("borderline"), Mapping),
        share=share("est_seconds_saved_per_it"),
        low=share("sure_seconds_saved_per_it"),
        high=share("high_seconds_saved_per_it"),
    )


def s_per_it(data: Mapping[str, Any]) -> float | None:
    """The s/it the report leads with (with resolution buckets, the bucket mix's), by the
    record's own definition; the unprofiled median when the record cannot be loaded."""
    try:
        value: float = record_from_dict(data).timing.per_iteration
        return value if value == value else None  # NaN: no steps
    except Exception:  # an old or newer record: fall back to the raw field
        unprofiled = data.get("timing", {}).get("unprofiled")
        return _number(unprofiled.get("median")) if isinstance(unprofiled, Mapping) else None


# --------------------------------------------------------------------------------------------
# Running


def run_one(
    config: str,
    index: int,
    out: Path,
    data: Path | None,
    extra: Sequence[str],
    timeout: float,
) -> RunOutcome:
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command(config, out, data, extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        wall = time.perf_counter() - started
        return RunOutcome(config, index, wall, None, problem=f"killed after {timeout:.0f} s")
    wall = time.perf_counter() - started
    outcome = RunOutcome(config, index, wall, done.returncode)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        outcome.problem = lines[-1][:160] if lines else "no output"
    read_outcome(outcome, out)
    return outcome


def _ids(ids: frozenset[str] | None) -> str:
    if ids is None:
        return "(no run succeeded)"
    return ", ".join(sorted(ids)) or "(none)"


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    low, high = min(values), max(values)
    relative = f" ({(high - low) / median:.0%})" if median > 0 and len(values) > 1 else ""
    return f"{median:.3f} [{low:.3f}-{high:.3f}]{relative}"


def _load(outcomes: Sequence[RunOutcome]) -> str:
    others = [o.others_cores for o in outcomes if o.others_cores is not None]
    if not others:
        return "-"
    cpus = {o.cpus for o in outcomes if o.cpus}
    of = f"/{cpus.pop()}" if len(cpus) == 1 else ""
    return f"{statistics.median(others):.2f}{of} [max {max(others):.2f}]"


def print_table(rows: Sequence[Row]) -> None:
    header = (
        f"{'config':<10} {'runs':>12} {'agree':>6}  {'s/it median [min-max] (range)':<32} "
        f"{'wall/run':>8}  {'others cores':<18} modal warn/critical ids | flipped (runs)"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        total = len(row.outcomes)
        modal, agreeing = row.modal()
        share = agreeing / total if total else 0.0
        runs = f"{total}" + (f" ({len(row.failed)} failed)" if row.failed else "")
        speeds = [o.s_per_it for o in row.outcomes if o.ok and o.s_per_it is not None]
        wall = statistics.median(o.wall_s for o in row.outcomes) if row.outcomes else 0.0
        flips = row.flips()
        flipped = ", ".join(f"{i} ({n})" for i, n in flips.items()) or "none"
        print(
            f"{row.config:<10} {runs:>12} {share:>6.0%}  {_spread(speeds):<32} "
            f"{wall:>7.0f}s  {_load(row.outcomes):<18} {_ids(modal)} | {flipped}"
        )
    failures = [o for row in rows for o in row.failed]
    if failures:
        print("\nfailed runs (each counts as disagreeing):")
        for o in failures:
            code = "timeout" if o.returncode is None else f"exit {o.returncode}"
            print(f"  {o.config} run {o.index}: {code}: {o.problem}")
    met = [r.config for r in rows if r.outcomes and r.modal()[1] / len(r.outcomes) >= TARGET]
    print(
        f"\ntarget: >= {TARGET:.0%} of runs agree on an idle machine -> met by "
        f"{', '.join(met) or 'none'} of {', '.join(r.config for r in rows)}"
    )
    for row in rows:
        lines = deciding_lines(row)
        if lines:
            print(f"\n{row.config}: the deciding values (line {LINE:.0%} of the step)")
            for line in lines:
                print(f"  {line}")


def _shares(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return (
        f"{statistics.median(values):.1%} [{min(values):.1%}-{max(values):.1%}]"
        if len(values) > 1
        else f"{values[0]:.1%}"
    )


def deciding_lines(row: Row) -> list[str]:
    """Per finding any run raised at warn/critical or as borderline: its deciding value's spread
    over the runs and how it was judged; for an id that flipped, what made it flip."""
    ok = [o for o in row.outcomes if o.ok]
    ids = sorted(
        {i for o in ok for i, d in o.decided.items() if d.borderline or d.severity in ADVICE}
    )
    flips = {key[1:] for key in row.flips()}
    out: list[str] = []
    for finding_id in ids:
        values = [v for o in ok if (v := _value(o, finding_id)) is not None]
        judged = [o.decided.get(finding_id) for o in ok]
        raised = [d for d in judged if d is not None and d.severity in ADVICE]
        upper = sum(d.borderline for d in raised)
        border = sum(d is not None and d.held_back for d in judged)
        lower = sum(d is not None and d.severity not in ADVICE and not d.borderline for d in judged)
        absent = sum(d is None for d in judged)
        text = (
            f"{finding_id}: {_shares(values)} over {len(values)} runs; warn/critical in "
            f"{len(raised)}{f' ({upper} at the critical line)' if upper else ''}, "
            f"borderline in {border}, info in {lower}, absent in {absent}"
        )
        if finding_id in flips:
            text += f" -- flipped: {_flip_cause(ok, finding_id, values)}"
        out.append(text)
    return out


def _value(outcome: RunOutcome, finding_id: str) -> float | None:
    """The value a finding is judged on in a run (the data wait's share even where the wait
    was not raised, so the runs below its line count too)."""
    if finding_id == WAIT_FINDING:
        return outcome.wait_share
    found = outcome.decided.get(finding_id)
    return found.share if found is not None else None


def _flip_cause(outcomes: Sequence[RunOutcome], finding_id: str, values: Sequence[float]) -> str:
    causes: list[str] = []
    if values and min(values) < LINE <= max(values):
        causes.append(f"its value straddles the {LINE:.0%} line across the runs")
    border = sum(
        1 for o in outcomes if (d := o.decided.get(finding_id)) is not None and d.held_back
    )
    if border:
        causes.append(f"its interval straddled the line (borderline) in {border} runs")
    raised = [o for o in outcomes if finding_id in (o.advice or frozenset())]
    quiet = [o for o in outcomes if finding_id not in (o.advice or frozenset())]
    busy = [o for o in outcomes if o.busy_windows]
    if busy:
        where = sorted({w for o in busy for w in o.busy_windows})
        causes.append(
            f"other work competed for the cores (while {', '.join(where)} ran) in "
            f"{sum(bool(o.busy_windows) for o in raised)} of the {len(raised)} runs that raised "
            f"it and {sum(bool(o.busy_windows) for o in quiet)} of the {len(quiet)} that did not"
        )
    return "; ".join(causes) or "none of the runs' numbers explain it (see --keep)"


def cpu_description() -> str:
    """The CPU the runs measured on, and whether it computes bf16 natively."""
    name, flags = platform.processor() or platform.machine(), set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    native = [
        label
        for flag, label in (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX"))
        if flag in flags
    ]
    bf16 = (
        f"native bf16 ({', '.join(native)})"
        if native
        else "no native bf16 (no AVX-512 BF16 or AMX)"
    )
    return f"{name}; {bf16}" if flags else name


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="configs: " + ", ".join(CONFIGS),
    )
    parser.add_argument("--runs", type=int, default=20, help="runs of each config (default 20)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)",
    )
    parser.add_argument(
        "--keep", type=Path, help="keep every run's folder under DIR/<config>-<n> (default: none)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200.0, help="seconds before a run is killed"
    )
    parser.add_argument("extra", nargs="*", help="options passed to every diagnose run (after --)")
    args = parser.parse_args(argv)
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_names if c not in CONFIGS]
    if unknown or not args.config_names:
        parser.error(f"unknown config(s) {', '.join(unknown) or '(none given)'}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.keep is not None and args.keep.exists() and not args.keep.is_dir():
        parser.error(f"--keep {args.keep} is a file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs: list[str] = args.config_names
    scratch = Path(tempfile.mkdtemp(prefix="bench-agreement-"))
    keep: Path | None = args.keep
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    try:
        data: Path | None = None
        if "bigpng" in configs:
            data = scratch / "bigpng"
            write_big_pngs(data)
        rows = {config: Row(config) for config in configs}
        started = time.perf_counter()
        print(
            f"{args.runs} run(s) of {', '.join(configs)}, interleaved; "
            f"{os.cpu_count()} logical cores; {cpu_description()}"
            + (f"; extra options: {' '.join(args.extra)}" if args.extra else ""),
            flush=True,
        )
        for index in range(1, args.runs + 1):
            for config in configs:
                out = (keep or scratch) / f"{config}-{index}"
                outcome = run_one(config, index, out, data, args.extra, args.timeout)
                rows[config].outcomes.append(outcome)
                status = "ok" if outcome.ok else f"FAILED ({outcome.problem})"
                print(
                    f"  run {index}/{args.runs} {config}: {outcome.wall_s:.0f} s, {status}",
                    file=sys.stderr,
                    flush=True,
                )
        print()
        print_table(list(rows.values()))
        print(f"({time.perf_counter() - started:.0f} s in all)", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
