"""Is the Triton judge calibrated? Its false-alarm rate on correct devices and its catch rate on
planted wrong kernels.

    python benchmarks/bench_triton_judge.py                     # 200 seeds (a few minutes)
    python benchmarks/bench_triton_judge.py --seeds 20          # quicker
    python benchmarks/bench_triton_judge.py --gpu-seeds 3       # the GPU-only shapes too (slow)

False alarms: every case of the built-in corpus, at every dtype and shape the interpreter runs,
computed by an emulated correct device (``diagnose.probes.triton.cases.emulate``: fp32 arithmetic,
reductions and dots in a random order and block size, tensor-core accumulators and stores that
truncate or round, approximate exp2/rsqrt, flash attention's running max, casts a compiler may
fuse away) and
judged against the reference, for each backend model: NVIDIA (tl.dot's TF32, truncated), MI300
(xf32, rounding unknown), and the interpreter (fp32). Each seed draws the inputs the harness would,
and another correct device. A correct device must pass every time: any drift or mismatch is a
false alarm. The GPU-only shapes (up to a million elements an output) are slower; ``--gpu-seeds``
runs them with fewer seeds.

Catch rate: the planted wrong kernels of ``fixtures/triton/wrong_kernels.py`` (a masking bug, an
off-by-one block, a wrong scale, swapped strides, an unmasked tail, a dropped block, a never-written
tail and element, a wrong reduction axis, a partial write, a precision loss) and their correct twins
in ``good_kernels.py``, run for real in Triton's interpreter, once per seed: every wrong one must be
a mismatch, every twin a pass.

Prints one row per case and dtype (checks, verdicts, the worst error/bound seen, and the median
bound as a share of the output's RMS: the smallest wrong answer a check can see), then the rates.
Exit status 1 when a correct device drew a drift or mismatch, or a planted kernel was not caught.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diagnose.probes.triton.cases.api import CheckEnv, TritonCase, dtype_name, shape_label
from diagnose.probes.triton.cases.check import check_seed
from diagnose.probes.triton.cases.emulate import judge_emulated
from diagnose.probes.triton.cases.judge import element_bounds
from diagnose.probes.triton.cases.reference import reference_of
from diagnose.probes.triton.cases.runner import CORPUS, run_suite

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures" / "triton"

#: The backends whose tl.dot treats fp32 operands differently.
BACKENDS = {
    "cuda sm_90 (tf32, truncated)": CheckEnv("device", "cuda", "sm_90", torch.device("cpu")),
    "hip gfx942 (xf32)": CheckEnv("device", "hip", "gfx942", torch.device("cpu")),
    "interpreter (fp32)": CheckEnv("interpreter", "interpreter", "", torch.device("cpu")),
}


@dataclass
class Tally:
    verdicts: Counter[str] = field(default_factory=Counter)
    worst: float = 0.0
    resolution: list[float] = field(default_factory=list)


def _cases() -> list[TritonCase]:
    return [case for module in CORPUS for case in importlib.import_module(module).CASES]


def _dtypes(case: TritonCase, env: CheckEnv) -> list[torch.dtype]:
    dtypes = list(case.dtypes)
    if env.mode == "device":
        dtypes += [d for d in case.gpu_dtypes if d not in dtypes]
    return dtypes


def _declared(case: TritonCase, shape: dict[str, int], dtype: torch.dtype, env: CheckEnv) -> str:
    inputs = case.make_inputs(shape, dtype, torch.Generator().manual_seed(1))
    return reference_of(case, inputs, dtype, env)[1]


def _resolution(
    case: TritonCase, shape: dict[str, int], dtype: torch.dtype, env: CheckEnv
) -> float:
    """The median over outputs of mean(bound) / rms(reference), for seed 1."""
    inputs = case.make_inputs(
        shape, dtype, torch.Generator().manual_seed(check_seed(1, case.name, shape, dtype))
    )
    expected, _ = reference_of(case, inputs, dtype, env)
    specs = case.outputs_for(shape, dtype) if case.outputs_for else {}
    shares = []
    for name, want in expected.items():
        if not want.value.is_floating_point():
            continue
        rms = float(want.value.norm()) / max(1, want.value.numel()) ** 0.5
        out_dtype = specs[name].dtype or dtype if name in specs else dtype
        if rms > 0:
            shares.append(float(element_bounds(out_dtype, want).mean()) / rms)
    return statistics.median(shares) if shares else 0.0


def false_alarms(seeds: int, gpu_seeds: int) -> dict[tuple[str, ...], Tally]:
    """Emulated correct devices, judged: (backend, case, dtype, shapes) -> tally."""
    tallies: dict[tuple[str, ...], Tally] = {}
    baseline = next(iter(BACKENDS.values()))
    for backend, env in BACKENDS.items():
        for case in _cases():
            for dtype in _dtypes(case, env):
                if case.unsupported is not None and case.unsupported(env, dtype):
                    continue
                runs = [(dict(s), seeds, "interpreter") for s in case.shapes]
                if gpu_seeds and env.mode == "device":
                    runs += [(dict(s), gpu_seeds, "GPU") for s in case.gpu_shapes]
                for shape, count, kind in runs:
                    if env is not baseline and _declared(case, shape, dtype, env) == _declared(
                        case, shape, dtype, baseline
                    ):
                        continue  # the same reference as on the first backend: judged there
                    tally = tallies.setdefault(
                        (backend, case.name, dtype_name(dtype), f"{kind} shapes"), Tally()
                    )
                    tally.resolution.append(_resolution(case, shape, dtype, env))
                    for seed in range(1, count + 1):
                        for judged in judge_emulated(case, shape, dtype, env, seed):
                            tally.verdicts[judged.verdict] += 1
                            tally.worst = max(tally.worst, judged.worst_ratio)
                            if judged.verdict != "pass":
                                print(
                                    f"  FALSE ALARM {backend} {case.name} {dtype_name(dtype)} "
                                    f"{shape_label(shape)} seed {seed}: {judged.detail}",
                                    file=sys.stderr,
                                )
    return tallies


def planted(seeds: int) -> tuple[list[tuple[str, Counter[str]]], list[tuple[str, Counter[str]]]]:
    """The wrong kernels and their twins in the interpreter: per case, its verdicts."""

    def run(source: Path) -> list[tuple[str, Counter[str]]]:
        suite = run_suite([str(source)], device=torch.device("cpu"), seed=1, seeds=seeds)
        per_case: dict[str, Counter[str]] = {}
        for check in suite.checks:
            label = f"{check.case} [{check.dtype}, {shape_label(check.shape)}]"
            per_case.setdefault(label, Counter())[check.verdict] += 1
            if check.verdict == "mismatch":
                per_case[label][f"pattern:{check.pattern}"] += 1
        return list(per_case.items())

    return run(FIXTURES / "wrong_kernels.py"), run(FIXTURES / "good_kernels.py")


def _table(rows: Iterable[tuple[str, ...]]) -> str:
    rows = list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per check (default 200)")
    parser.add_argument(
        "--gpu-seeds", type=int, default=0, help="seeds for the GPU-only shapes (default 0: skip)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()

    tallies = false_alarms(args.seeds, args.gpu_seeds)
    rows = [("backend", "case", "dtype", "shapes", "outputs", "drift", "mismatch", "worst",
             "bound/rms")]  # fmt: skip
    for (backend, case, dtype, shapes), tally in tallies.items():
        rows.append(
            (
                backend,
                case,
                dtype,
                shapes,
                str(sum(tally.verdicts.values())),
                str(tally.verdicts["drift"]),
                str(tally.verdicts["mismatch"]),
                f"{tally.worst:.2g}",
                f"{statistics.median(tally.resolution):.1e}",
            )
        )
    print("Correct devices (emulated), judged against the references:")
    print(_table(rows))
    judged = sum(sum(t.verdicts.values()) for t in tallies.values())
    alarms = sum(t.verdicts["drift"] + t.verdicts["mismatch"] for t in tallies.values())
    worst = max(t.worst for t in tallies.values())

    wrong, good = planted(args.seeds)
    print("\nPlanted wrong kernels (Triton's interpreter), one check per seed:")
    print(
        _table(
            [("case", "checks", "mismatch", "patterns")]
            + [
                (
                    label,
                    str(sum(v for k, v in c.items() if not k.startswith("pattern:"))),
                    str(c["mismatch"]),
                    ", ".join(k.removeprefix("pattern:") for k in c if k.startswith("pattern:")),
                )
                for label, c in wrong
            ]
        )
    )
    planted_checks = sum(
        sum(v for k, v in c.items() if not k.startswith("pattern:")) for _, c in wrong
    )
    caught = sum(c["mismatch"] for _, c in wrong)
    twin_checks = sum(sum(c.values()) for _, c in good)
    twin_alarms = twin_checks - sum(c["pass"] for _, c in good)

    print(
        f"\nfalse alarms: {alarms} of {judged} emulated correct outputs "
        f"({alarms / max(1, judged):.2%}; worst error/bound {worst:.2g}), "
        f"{twin_alarms} of {twin_checks} interpreted correct twins"
    )
    print(
        f"catch rate: {caught} of {planted_checks} planted wrong-kernel checks "
        f"({caught / max(1, planted_checks):.2%}); {args.seeds} seeds; "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 0 if alarms == 0 and twin_alarms == 0 and caught == planted_checks else 1


if __name__ == "__main__":
    sys.exit(main())
