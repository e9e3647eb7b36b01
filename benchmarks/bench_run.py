"""Wall time of the default `diagnose run` and the profiler's overhead, in one table.

    python benchmarks/bench_run.py [--repeat N] [-- extra diagnose run options]

Runs `diagnose run` in fresh subprocesses (as a user would), reads each record, and prints the
wall time of the whole command, the unprofiled and profiled s/it medians and their ratio (the
profiler overhead). Ratios are measured within one run of this script: these machines are noisy.
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


def one_run(extra: list[str]) -> dict[str, float]:
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
    unprofiled = timing["unprofiled"]["median"]
    profiled = timing["profiled"]["median"]
    probes = sum(p["duration_seconds"] for p in record["probes"])
    return {
        "wall_s": wall,
        "s_per_it": unprofiled,
        "profiled_s_per_it": profiled,
        "overhead": profiled / unprofiled - 1.0,
        "probes_s": probes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="options passed to diagnose run (after --)")
    args = parser.parse_args()
    rows = [one_run(args.extra) for _ in range(args.repeat)]
    cols = ["wall_s", "s_per_it", "profiled_s_per_it", "overhead", "probes_s"]
    print(f"diagnose run {' '.join(args.extra) or '(defaults)'}: {args.repeat} runs")
    print(f"{'run':>4} " + " ".join(f"{c:>18}" for c in cols))
    for i, row in enumerate(rows, 1):
        print(f"{i:>4} " + " ".join(f"{row[c]:>18.4f}" for c in cols))
    med = {c: statistics.median(r[c] for r in rows) for c in cols}
    print(f"{'med':>4} " + " ".join(f"{med[c]:>18.4f}" for c in cols))
    print(f"\ntarget: default run under 60 s wall on a 2-core CPU -> {med['wall_s']:.1f} s")
    print(f"profiler overhead (profiled / unprofiled s/it - 1): {med['overhead']:+.1%}")


if __name__ == "__main__":
    main()
