"""Sync faults planted in a plain LoRA loop: their cost measured without the profiler against the
sync reading's estimate from a profiled trace of the same loop.

    python benchmarks/bench_syncs.py [--device cuda] [--size full|tiny] [--steps 20]
                                     [--faults none,adamw8bit,clipping,logging,forward-cpu]
    python benchmarks/bench_syncs.py --train FAULT [--steps N]   # the loop alone, to run under
                                                                  # diagnose profile -- ...

The loop is :func:`planted_faults.train` (the project's first GPU run's loop: transformer blocks
over patch tokens, a frozen bf16 base with fp32 LoRA adapters under bf16 autocast, torch AdamW
fused unless the fault replaces it). Faults: ``adamw8bit``
(bitsandbytes' optimizer, a device synchronize per parameter), ``clipping`` (each gradient's norm
read with .item() before the step), ``logging`` (loss.item() after the step), ``forward-cpu`` (a
.cpu() in every block's forward). Each fault runs in its own process: ``--steps`` steps timed
without the profiler (the device synchronised at the end of each), then 3 profiled. The table:
each fault's median step, its cost against ``none`` (measured), and the trace's estimate of its
syncs, trace-only and with the unprofiled step given (target: within 30% of the measured cost).
Exit status 0; 2 on misuse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from planted_faults import SIZES, train

FAULTS = ("none", "adamw8bit", "clipping", "logging", "forward-cpu")


def _measure(fault: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    trace = folder / f"{fault}.json"
    command = [
        sys.executable,
        __file__,
        "--one",
        fault,
        "--size",
        args.size,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--trace",
        str(trace),
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {"fault": fault, "step": statistics.median(times), "trace": trace}


def _estimates(trace: Path, unprofiled: float | None) -> float:
    from diagnose.trace.analysis import analyze_trace

    analysis = analyze_trace(trace, unprofiled_step_seconds=unprofiled)
    reading = analysis.rule_data.get("syncs") or {}
    return float(reading.get("estimate_seconds_per_step") or 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--train", choices=FAULTS, help="train the loop alone (no own timing)")
    parser.add_argument("--one", choices=FAULTS, help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if args.steps < 1 or any(f not in FAULTS for f in faults) or "none" not in faults:
        parser.print_usage(sys.stderr)
        return 2
    if args.train:
        train(args.train, args.size, args.device, args.steps, None)
        return 0
    if args.one:
        print(json.dumps(train(args.one, args.size, args.device, args.steps, args.trace)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_measure(f, args, Path(tmp)) for f in faults]
        base = next(r["step"] for r in rows if r["fault"] == "none")
        print(f"{'fault':<12} {'ms/it':>8} {'cost':>8} {'trace-only':>11} {'unprofiled':>11}")
        for row in rows:
            cost = row["step"] - base
            alone = _estimates(row["trace"], None)
            known = _estimates(row["trace"], row["step"])
            print(
                f"{row['fault']:<12} {row['step'] * 1e3:8.2f} {cost * 1e3:8.2f} "
                f"{alone * 1e3:11.2f} {known * 1e3:11.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
