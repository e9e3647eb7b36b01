"""What ``diagnose profile``'s bootstrap costs the steps it does not profile (the bar: 2% of s/it).

    python benchmarks/bench_profile_overhead.py                  # 5 repetitions of each side
    python benchmarks/bench_profile_overhead.py --reps 9 --json out.json

A training loop (an MLP on one CPU thread, AdamW, a DataLoader) times each of its own steps and
writes the times out; the same script runs plain (side A) and through
:func:`diagnose.profile.launch.launch_profiled` (side B: the bootstrap in the process, the capture
timing and profiling its phases), alternately A, B, B, A, … so that drift of a busy machine lands
on both sides. Steps are read per window of the capture's phases:

- ``skipped``: the warm-up steps before the capture (one counter increment per step);
- ``timed``: the steps the capture times (autocast sampled at the first forward, the boundary
  work after each optimizer step): the steps whose times ``diagnose profile`` reports;
- ``after``: steps after the capture was written (each hook returns at its first test).

The probe and profiled steps are left out: profiling is meant to cost.

Two measurements:

1. End to end, the comparison the bar is about: per window and side, the median over runs of each
   run's median step and of its 10th percentile (a busy machine only adds time, so the low
   percentile is the steadier figure), with the spread between the plain runs as the noise floor.
   On a shared 2-core machine that floor is tens of percent, far above 2%: this table shows no
   gross slowdown, it cannot resolve 2%.
2. In one process, what the capture's hooks add to a step, in microseconds: a tiny real step
   (Linear(8, 8), backward, SGD) in alternating blocks with the capture's global optimizer hooks
   present and absent, the capture held in each phase. Adjacent blocks see the same machine, so
   the median of their differences is the cost; it is put against the end-to-end loop's step.

Times are the loop thread's CPU time (``time.thread_time``): time the thread spends descheduled is
nobody's overhead. Exit status 1 when the in-process cost of a timed step is over
``--max-overhead`` (2%) of the end-to-end loop's step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diagnose.profile.launch import CAPTURE_FILE, CaptureOptions, launch_profiled  # noqa: E402

LOOP = """
import json
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
torch.manual_seed(0)
steps, width, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model = torch.nn.Sequential(
    torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
    torch.nn.GELU(), torch.nn.Linear(width, 1),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = TensorDataset(torch.randn(256 * 16, width), torch.randn(256 * 16, 1))
loader = DataLoader(data, batch_size=16, shuffle=True)
times = []
step = 0
while step < steps:
    for x, y in loader:
        start, cpu = time.perf_counter(), time.thread_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append((time.perf_counter() - start, time.thread_time() - cpu))
        step += 1
        if step >= steps:
            break
with open(out, "w") as handle:
    json.dump(times, handle)
"""


@dataclass(frozen=True)
class Loop:
    """One training loop to measure: its size and the capture's phases in it."""

    name: str
    width: int
    steps: int
    options: CaptureOptions

    def windows(self) -> dict[str, tuple[int, int]]:
        """Step index ranges (0-based, end excluded) of each window, as the capture counts."""
        first_timed = max(self.options.skip_steps, 1)
        end_timed = first_timed + self.options.timed_steps
        after = self.options.steps_needed + 5  # a few steps of margin past the trace export
        return {
            "skipped": (1, first_timed),  # the first step warms up
            "timed": (first_timed, end_timed),
            "after": (after, self.steps),
        }


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _run(side: str, folder: Path, loop: Loop) -> list[float]:
    """The CPU seconds of each step of one run of ``loop`` (side A plain, B profiled)."""
    out = folder / f"times-{side}.json"
    command = [sys.executable, str(folder / "loop.py"), str(loop.steps), str(loop.width), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if side == "A":
        subprocess.run(command, check=True, env=env)
    else:
        capture = folder / "capture"
        result = launch_profiled(command, capture, loop.options, env=env)
        if result.returncode != 0 or not result.captures or not result.captures[0].complete:
            raise SystemExit(f"the profiled run failed: {result}")
        shutil.rmtree(capture)
    times = json.loads(out.read_text())
    out.unlink()
    return [float(cpu) for _wall, cpu in times]


def _measure(loop: Loop, reps: int, folder: Path) -> list[dict[str, Any]]:
    """Per window: each side's median step and 10th-percentile step, median over the runs."""
    windows = loop.windows()
    runs: dict[str, list[list[float]]] = {"A": [], "B": []}
    for rep in range(reps):
        for side in "AB" if rep % 2 == 0 else "BA":
            runs[side].append(_run(side, folder, loop))
        print(f"{loop.name}: repetition {rep + 1}/{reps} done", file=sys.stderr)
    rows = []
    for name, (start, end) in windows.items():
        row: dict[str, Any] = {"loop": loop.name, "window": name, "steps": [start, end]}
        for side in "AB":
            medians = [statistics.median(t[start:end]) for t in runs[side]]
            lows = [_percentile(t[start:end], 0.1) for t in runs[side]]
            row[f"{side}_median_s"] = statistics.median(medians)
            row[f"{side}_p10_s"] = statistics.median(lows)
            if side == "A":
                # How far apart the plain runs themselves are: the noise floor of this machine.
                row["A_spread"] = max(medians) / min(medians) - 1
        rows.append(row)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'loop':<6} {'window':<8} {'steps':>9} {'A ms':>8} {'B ms':>8} {'B/A-1':>8} "
        f"{'A p10 ms':>9} {'B p10 ms':>9} {'B-A p10':>9} {'B/A-1 p10':>10} {'A spread':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        start, end = r["steps"]
        a, b, a10, b10 = r["A_median_s"], r["B_median_s"], r["A_p10_s"], r["B_p10_s"]
        print(
            f"{r['loop']:<6} {r['window']:<8} {f'{start}-{end - 1}':>9} {a * 1e3:8.3f} "
            f"{b * 1e3:8.3f} {b / a - 1:+8.2%} {a10 * 1e3:9.3f} {b10 * 1e3:9.3f} "
            f"{(b10 - a10) * 1e6:7.1f}us {b10 / a10 - 1:+10.2%} {r['A_spread']:9.2%}"
        )


#: Capture settings that hold the capture in one phase for as long as the measurement runs.
_PHASES: dict[str, dict[str, str]] = {
    "skipped": {"SKIP_STEPS": str(10**9), "TIMED_STEPS": "0", "PROFILED_STEPS": "0"},
    "timed": {"SKIP_STEPS": "1", "TIMED_STEPS": str(10**9), "PROFILED_STEPS": "0"},
    # Complete after three steps (no profiler): every later step meets a finished capture.
    "after": {"SKIP_STEPS": "1", "TIMED_STEPS": "1", "PROFILED_STEPS": "0"},
}


def _hook_cost(phase: str, folder: Path, blocks: int, steps: int) -> dict[str, Any]:
    """In this process: a tiny real training step (Linear, backward, SGD) in alternating blocks
    with the capture's optimizer hooks present (B) and absent (A), the capture held in ``phase``.
    Adjacent blocks see the same machine, so their difference is the hooks' cost per step."""
    import importlib.util

    import torch
    from torch.optim import optimizer as optimizer_module

    pre = optimizer_module._global_optimizer_pre_hooks
    post = optimizer_module._global_optimizer_post_hooks
    pre.clear()
    post.clear()
    capture_dir = folder / f"inprocess-{phase}"
    capture_dir.mkdir()
    saved = dict(os.environ)
    os.environ["DIAGNOSE_PROFILE_DIR"] = str(capture_dir)
    for key, value in _PHASES[phase].items():
        os.environ[f"DIAGNOSE_PROFILE_{key}"] = value
    try:
        # A fresh copy of the capture module per phase: each has its own capture state.
        spec = importlib.util.spec_from_file_location(f"bench_capture_{phase}", CAPTURE_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module.on_import("torch.optim.optimizer", optimizer_module, time.perf_counter(), 0.0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    ours = (dict(pre), dict(post))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8)

    def run_block(hooked: bool) -> float:
        pre.clear()
        post.clear()
        if hooked:
            pre.update(ours[0])
            post.update(ours[1])
        start = time.thread_time()
        for _ in range(steps):
            model(x).sum().backward()
            optimizer.step()
        return (time.thread_time() - start) / steps

    for _ in range(5):  # the first steps start the capture and settle the phase
        run_block(True)
    differences, plain = [], []
    for block in range(blocks):
        order = (False, True) if block % 2 == 0 else (True, False)
        times = {hooked: run_block(hooked) for hooked in order}
        differences.append(times[True] - times[False])
        plain.append(times[False])
    pre.clear()
    post.clear()
    return {
        "phase": phase,
        "step_s": statistics.median(plain),
        "cost_s": statistics.median(differences),
        "cost_p25_s": _percentile(differences, 0.25),
        "cost_p75_s": _percentile(differences, 0.75),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="runs of each side (interleaved)")
    parser.add_argument("--width", type=int, default=512, help="the small loop's MLP width")
    parser.add_argument("--blocks", type=int, default=60, help="in-process block pairs")
    parser.add_argument("--max-overhead", type=float, default=0.02)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    loop = Loop("small", args.width, 400, CaptureOptions(20, 100, 3))
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as scratch:
        folder = Path(scratch)
        (folder / "loop.py").write_text(LOOP)
        rows = _measure(loop, args.reps, folder)
        costs = [_hook_cost(phase, folder, args.blocks, 200) for phase in _PHASES]

    print(f"\n{args.reps} runs a side, alternating; CPU seconds per step of the loop's own timer")
    _print(rows)
    step = next(r for r in rows if r["window"] == "timed")["A_p10_s"]
    print(
        f"\nIn one process, {args.blocks} pairs of 200-step blocks with and without the hooks "
        "(a Linear(8, 8) step with SGD);\nthe cost per step against the small loop's step "
        f"({step * 1e3:.3f} ms, its timed window's 10th percentile):"
    )
    header = f"{'phase':<8} {'tiny step':>10} {'cost/step':>10} {'IQR':>17} {'share':>8}"
    print(header)
    print("-" * len(header))
    for c in costs:
        print(
            f"{c['phase']:<8} {c['step_s'] * 1e6:8.1f}us {c['cost_s'] * 1e6:8.2f}us "
            f"{c['cost_p25_s'] * 1e6:7.2f}..{c['cost_p75_s'] * 1e6:6.2f}us "
            f"{c['cost_s'] / step:+8.3%}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "in_process": costs}, indent=1))
    share = next(c for c in costs if c["phase"] == "timed")["cost_s"] / step
    if share > args.max_overhead:
        print(f"the timed steps cost {share:.1%} more with the bootstrap")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
