"""Where the wall time of a default `diagnose run` goes, stage by stage, in one table.

    python benchmarks/bench_run.py [--repeat N] [-- extra diagnose run options]

Runs `diagnose run` in fresh subprocesses (as a user would) and reads each record's
``wall_seconds``: start-up (imports), inventory, build, warm-up, timed and profiled steps, trace
analysis, each probe; "outputs" is the rest of the command's wall time (writing the record and the
report, printing, interpreter exit). It also prints the unprofiled and profiled s/it, their ratio
(the profiler's overhead) and the cores other processes took meanwhile: on a busy machine every
stage stretches, so read the load column before the seconds. Ratios are measured within one run
of this script: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diagnose.reports.headline import RUN_STAGES

#: The budget the default run aims for on a 2-core CPU (issue 16): idle, and with one busy process.
TARGET_IDLE_S = 30.0
TARGET_BUSY_S = 60.0


def one_run(extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        out = Path(tmp) / "run"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "diagnose", "run", "--out", str(out), "--no-progress", *extra],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        record = json.loads((out / "record.json").read_text())
    timing = record["timing"]
    stages: dict[str, float] = dict(record.get("wall_seconds") or {})
    stages["outputs"] = max(0.0, wall - sum(stages.values()))
    load = timing.get("host_load") or {}
    return {
        "wall": wall,
        "stages": stages,
        "s_per_it": timing["unprofiled"]["median"],
        "steps": timing["unprofiled"]["n"],
        "overhead": timing["profiled"]["median"] / timing["unprofiled"]["median"] - 1.0,
        "others_cores": load.get("others_cores"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="options passed to diagnose run (after --)")
    args = parser.parse_args()
    runs = [one_run(args.extra) for _ in range(args.repeat)]
    names = [s for s in RUN_STAGES if any(s in r["stages"] for r in runs)]
    names += sorted({k for r in runs for k in r["stages"] if k.startswith("probe ")})
    names.append("outputs")
    print(f"diagnose run {' '.join(args.extra) or '(defaults)'}: {args.repeat} runs, seconds")
    header = f"{'stage':<22}" + "".join(f"{f'run {i}':>10}" for i in range(1, len(runs) + 1))
    print(header + f"{'median':>10}")
    for name in names:
        values = [r["stages"].get(name, 0.0) for r in runs]
        cells = "".join(f"{v:>10.1f}" for v in values)
        print(f"{name:<22}{cells}{statistics.median(values):>10.1f}")
    for label, key, fmt in (
        ("wall (command)", "wall", "{:>10.1f}"),
        ("timed steps taken", "steps", "{:>10.0f}"),
        ("s/it (unprofiled)", "s_per_it", "{:>10.3f}"),
        ("profiler overhead", "overhead", "{:>+10.0%}"),
        ("others' cores", "others_cores", "{:>10.2f}"),
    ):
        values = [r[key] for r in runs]
        cells = "".join(fmt.format(v) if v is not None else f"{'—':>10}" for v in values)
        known = [v for v in values if v is not None]
        med = fmt.format(statistics.median(known)) if known else f"{'—':>10}"
        print(f"{label:<22}{cells}{med}")
    wall = statistics.median(r["wall"] for r in runs)
    busy = any((r["others_cores"] or 0.0) >= 0.5 for r in runs)
    target = TARGET_BUSY_S if busy else TARGET_IDLE_S
    print(
        f"\ntarget: a default run in {target:.0f} s on a 2-core CPU "
        f"({'another process was busy' if busy else 'idle'}) -> median {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
