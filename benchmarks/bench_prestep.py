"""Where a full-size GPU run's time goes before its first step, measured on the CPU.

    python benchmarks/bench_prestep.py [--configs sdxl,zimage-nf4] [--repeat 2]

For each seed configuration at full size (SDXL bf16-mixed AdamW8bit; Z-Image on an NF4 base with
an NF4 text encoder at 512/1024 px) one fresh process times, as ``diagnose run`` meets them on a
GPU: start-up (importing what the run imports), the configuration resolved for an H200, whether
the weights fit, said before building (from the presets' shipped counts), the inventory, the model
built on the meta device (the denoiser, VAE and text encoders from their configs), and the probes'
set-up that needs no device (the Triton corpus's float64 references at its GPU shapes, one seed).
Each process runs ``--repeat`` times in a row, with a cache folder of the benchmark's own: the
first pays what a cold machine pays, the later ones what the user's cache keeps (the weights fit's
line, the references). Prints one table, seconds per stage: ``to step`` sums the stages a run
goes through before its first step (all but the references, which its Triton probe meets after
the steps), ``all`` every stage, ``cpu to step`` the process's CPU seconds before the first step
(steadier than wall time on a shared machine). Every stage runs with the hub's offline switches
on, as every diagnose command does. Exit status 0; 2 on misuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The seed configurations of the GPU check, as diagnose run's options.
CONFIGS: dict[str, dict[str, Any]] = {
    "sdxl": {"preset": "sdxl", "precision": "bf16-mixed", "optimizer": "adamw8bit"},
    "zimage-nf4": {
        "preset": "zimage",
        "precision": "bf16-mixed",
        "optimizer": "adamw8bit",
        "base": "nf4",
        "text_encoder_base": "nf4",
        "resolution": [512, 1024],
    },
}
#: An H200's memory, as the fit is judged on the GPU.
H200_BYTES = int(139.8 * 2**30)
STAGES = ("start-up", "resolve", "weights fit", "inventory", "build (meta)", "triton references")
#: The stages after the first step in a run (its Triton probe's set-up).
AFTER_STEPS = ("triton references",)
#: The process's CPU seconds over the stages before the first step: what a busy machine's load
#: stretches less than the wall time (reading files still waits on the disk).
CPU_TO_STEP = "cpu to step"


def _one(name: str) -> dict[str, float]:
    """The stages of one configuration, in this (fresh) process."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    cpu_started = time.process_time()
    import torch

    import diagnose.run as run
    from diagnose.config import RunConfig

    seconds["start-up"] = time.perf_counter() - started

    def timed(stage: str, work: Any) -> Any:
        begun = time.perf_counter()
        value = work()
        seconds[stage] = time.perf_counter() - begun
        return value

    config = RunConfig(size="full", device="cuda", **CONFIGS[name])
    config = timed("resolve", lambda: run.resolve_config(config, "cuda", H200_BYTES))
    timed("weights fit", lambda: run.fit_before_running(config, "cuda", H200_BYTES))
    from diagnose.inventory import collect_inventory

    timed("inventory", lambda: collect_inventory("cuda"))

    def build() -> None:
        from diagnose.workload.models import (
            build_denoiser,
            build_text_encoder,
            build_vae,
            construct_on,
        )
        from diagnose.workload.presets import load_preset

        spec = load_preset(config.preset or "sdxl", "full")
        with construct_on(torch.device("meta"), torch.bfloat16):
            build_denoiser(spec)
            build_vae(spec)
            for encoder in spec.text_encoders:
                build_text_encoder(encoder)

    timed("build (meta)", build)
    seconds[CPU_TO_STEP] = time.process_time() - cpu_started

    def references() -> None:
        from diagnose.probes.triton.cases.api import CheckEnv
        from diagnose.probes.triton.cases.check import check_seed, plan_checks
        from diagnose.probes.triton.cases.loading import load_cases
        from diagnose.probes.triton.cases.reference_cache import cached_reference
        from diagnose.probes.triton.cases.runner import CORPUS

        # The references a GPU run computes on its CPU: the corpus at its GPU shapes, as judged
        # for an H200 (the device itself is never touched).
        env = CheckEnv("device", "cuda", "sm_90", torch.device("cuda"))
        cases = [case for source in CORPUS for case in load_cases(source)]
        for check in plan_checks(cases, "device", [1]):
            if check.case.unsupported is not None and check.case.unsupported(env, check.dtype):
                continue
            seed = check_seed(check.run_seed, check.case.name, check.shape, check.dtype)
            inputs = check.case.make_inputs(
                check.shape, check.dtype, torch.Generator().manual_seed(seed)
            )
            cached_reference(check.case, inputs, check.dtype, env, shape=check.shape, seed=seed)

    timed("triton references", references)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        from diagnose.offline import hub_offline

        with hub_offline():  # as every diagnose command runs: no library reaches for the hub
            print(json.dumps(_one(args.one)))
        return 0
    names = [n for n in args.configs.split(",") if n]
    if not names or any(n not in CONFIGS for n in names) or args.repeat < 1:
        parser.print_usage(sys.stderr)
        return 2
    # A cache folder of the benchmark's own: the first run of each configuration is a cold
    # machine's, the later ones what the cache keeps.
    cache = tempfile.mkdtemp(prefix="bench-prestep-cache-")
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    header = (
        f"{'config':<12} {'run':>3} "
        + " ".join(f"{s:>18}" for s in STAGES)
        + f" {'to step':>8} {'all':>7} {CPU_TO_STEP:>12}"
    )
    print(header)
    for name in names:
        for attempt in range(1, args.repeat + 1):
            done = subprocess.run(
                [sys.executable, __file__, "--one", name],
                capture_output=True,
                text=True,
                check=True,
                timeout=1800,
                env=env,
            )
            stages = json.loads(done.stdout.strip().splitlines()[-1])
            cpu = stages.pop(CPU_TO_STEP)
            cells = " ".join(f"{stages.get(s, float('nan')):18.2f}" for s in STAGES)
            to_step = sum(v for s, v in stages.items() if s not in AFTER_STEPS)
            print(
                f"{name:<12} {attempt:>3} {cells} {to_step:8.2f} {sum(stages.values()):7.2f} "
                f"{cpu:12.2f}",
                flush=True,
            )
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
