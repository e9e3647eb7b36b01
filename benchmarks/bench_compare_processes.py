"""What measuring each side in several processes would buy the CI gate, on recorded noise.

`diagnose run` times its steps in one process. Between two runs the recorded quiet noise
(fixtures/compare/noise.json) drifts by about +10% in streaks of whole runs, which no statistic on
one run can see (see that fixture's README). asv and pyperf answer such drift by spreading the
measurement over several processes. This script asks what that would buy before anyone builds it:
each side is k different recorded runs of m steps (k * m ~ 30, the default step count), a true
slowdown multiplies the current side, and three rules decide:

- pooled:   every step of a side pooled, the gate's own rule (`compare_samples`): treats steps of
            different processes as exchangeable.
- extremes: pooled, and also the fastest current process against the slowest baseline process
            (the rule `diagnose compare` uses for several baseline records).
- welch:    a one-sided Welch t-test on the log medians of the processes (the process is the unit),
            at 0.01, plus the same threshold reach as the gate.

Prints one table: A/A false alarms and the share of +10% slowdowns caught per k and rule.

    python benchmarks/bench_compare_processes.py [--trials 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from diagnose.gate import DEFAULT_SIGNIFICANCE, DEFAULT_THRESHOLD, compare_samples
from diagnose.record import Stats
from diagnose.reports.headline import NOISY_RELATIVE_SPREAD

NOISE = Path(__file__).resolve().parent.parent / "fixtures" / "compare" / "noise.json"
#: (processes per side, steps per process): about the default 30 steps a side in all.
LAYOUTS: tuple[tuple[int, int], ...] = ((1, 30), (3, 10), (5, 6), (8, 4))
SLOWDOWN = 0.10

Groups = list[list[float]]
Rule = Callable[[Groups, Groups], bool]


def quiet_runs(path: Path) -> list[list[float]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    runs = [[float(s["seconds"]) for s in run["samples"]] for run in data["runs"]]
    return [run for run in runs if Stats.of(run).relative_spread <= NOISY_RELATIVE_SPREAD]


def _gate(a: Sequence[float], b: Sequence[float]) -> bool:
    metric = compare_samples(
        a,
        b,
        key="step",
        kind="step",
        label="s/it",
        threshold=DEFAULT_THRESHOLD,
        significance=DEFAULT_SIGNIFICANCE,
    )
    return metric.verdict == "slower"


def pooled(base: Groups, current: Groups) -> bool:
    return _gate([x for g in base for x in g], [x for g in current for x in g])


def extremes(base: Groups, current: Groups) -> bool:
    if not pooled(base, current):
        return False
    slowest = max(base, key=statistics.median)
    fastest = min(current, key=statistics.median)
    return _gate(slowest, fastest)


def _t_quantile(q: float, df: int) -> float:
    """Student's t quantile (Cornish–Fisher expansion around the normal; good to ~1% for df>=4)."""
    z = statistics.NormalDist().inv_cdf(q)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def welch(base: Groups, current: Groups) -> bool:
    a = [math.log(statistics.median(g)) for g in base]
    b = [math.log(statistics.median(g)) for g in current]
    if len(a) < 2 or len(b) < 2:
        return False
    diff = statistics.mean(b) - statistics.mean(a)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    if se == 0:
        return diff >= math.log1p(DEFAULT_THRESHOLD)
    critical = _t_quantile(1 - DEFAULT_SIGNIFICANCE, len(a) + len(b) - 2)
    reaches = diff >= math.log1p(DEFAULT_THRESHOLD) or diff + critical * se >= math.log1p(
        DEFAULT_THRESHOLD
    )
    return diff / se > critical and reaches


RULES: dict[str, Rule] = {"pooled": pooled, "extremes": extremes, "welch": welch}


def rate(
    runs: list[list[float]], rule: Rule, k: int, m: int, slowdown: float, trials: int, seed: int
) -> float:
    rng = random.Random(seed)
    hits = 0
    for _ in range(trials):
        picked = rng.sample(runs, 2 * k)

        def segment(run: list[float]) -> list[float]:
            start = rng.randrange(len(run) - m + 1)
            return run[start : start + m]

        base = [segment(r) for r in picked[:k]]
        current = [[x * (1 + slowdown) for x in segment(r)] for r in picked[k:]]
        hits += rule(base, current)
    return hits / trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=400, help="pairs per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=Path, default=NOISE)
    args = parser.parse_args(argv)
    runs = quiet_runs(args.noise)
    started = time.perf_counter()
    print(
        f"{len(runs)} quiet recorded runs from {args.noise.name}; significance "
        f"{DEFAULT_SIGNIFICANCE}, threshold {DEFAULT_THRESHOLD:.0%}, {args.trials} pairs per cell"
    )
    print(f"{'processes':>9}  {'steps each':>10}  {'rule':<8}  {'A/A':>6}  {'+10% caught':>11}")
    for k, m in LAYOUTS:
        for name, rule in RULES.items():
            if k == 1 and name != "pooled":
                continue  # one process per side: the other rules need several
            alarms = rate(runs, rule, k, m, 0.0, args.trials, args.seed)
            caught = rate(runs, rule, k, m, SLOWDOWN, args.trials, args.seed)
            print(f"{k:>9}  {m:>10}  {name:<8}  {alarms:>6.1%}  {caught:>11.1%}")
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
