"""Phases of a Lightning run against a plain loop's: is the optimizer phase the update alone?

    python benchmarks/bench_lightning_phases.py [--rounds N] [--steps N]

Issue 24: Lightning's automatic optimization runs the forward and the backward inside
``optimizer.step(closure)``, and the phases must still say what ran. Each round trains the same
model, data and AdamW three ways, one process after another (interleaved, so drift of the
machine's load hits all three alike): Lightning with automatic optimization (a closure),
Lightning with manual optimization, and a plain PyTorch loop. Each is traced by its own profiler
(tests/data/lightning_train.py) and read by ``diagnose.trace``.

Prints one table, one row per way: the median step, the sum of the phases over the step (target:
within 5% of it), the forward + backward share, the optimizer phase, and its ratio to the plain
loop's optimizer phase of the same round (target: within 20%), as the median over the rounds with
its range. Needs ``lightning`` (``pip install lightning``). Exit status 0; 2 on misuse.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from diagnose.trace.analysis import analyze_trace

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "lightning_train.py"
WAYS: dict[str, list[str]] = {
    "Lightning, closure": [],
    "Lightning, manual": ["--manual"],
    "plain loop": ["--plain"],
}


def _traced(folder: Path, options: list[str], steps: int) -> dict[str, float]:
    folder.mkdir(parents=True)
    command = [sys.executable, str(SCRIPT), "--profile-dir", str(folder), "--steps", str(steps)]
    subprocess.run([*command, *options], check=True, capture_output=True, timeout=600)
    (trace,) = folder.glob("*.json")
    analysis = analyze_trace(trace)
    walls = sorted(s.wall_seconds for s in analysis.steps)
    seconds = analysis.breakdown.seconds
    return {
        "step": walls[len(walls) // 2],
        "phases": sum(seconds.values()),
        "forward_backward": seconds.get("forward", 0.0) + seconds.get("backward", 0.0),
        "optimizer": seconds.get("optimizer", 0.0),
    }


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–" + (
        f"{format(max(values), fmt)})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 6:
        parser.error("--rounds must be at least 1 and --steps at least 6")
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for index, (way, options) in enumerate(WAYS.items()):
                folder = Path(scratch) / f"{round_index}-{index}"
                rows[way].append(_traced(folder, options, args.steps))
    plain = rows["plain loop"]
    print(
        f"{'way':<20} {'step ms':>16} {'phases/step':>20} {'fwd+bwd share':>20} "
        f"{'optimizer ms':>18} {'÷ plain optimizer':>22}"
    )
    for way, measured in rows.items():
        ratio = [m["optimizer"] / p["optimizer"] for m, p in zip(measured, plain, strict=True)]
        print(
            f"{way:<20} {_spread([m['step'] * 1e3 for m in measured], '.1f'):>16} "
            f"{_spread([m['phases'] / m['step'] for m in measured], '.3f'):>20} "
            f"{_spread([m['forward_backward'] / m['step'] for m in measured], '.0%'):>20} "
            f"{_spread([m['optimizer'] * 1e3 for m in measured], '.2f'):>18} "
            f"{_spread(ratio, '.2f'):>22}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
