"""What ``--strict`` costs a watched step, and the interposition layers it was chosen among.

    python benchmarks/bench_strict_overhead.py                 # 5 rounds of 4 steps per side
    python benchmarks/bench_strict_overhead.py --rounds 9 --json out.json

One real training step, in this process on one CPU thread: the diffusers UNet of the LoRA tests
(a tiny ``UNet2DConditionModel``: convolutions, attention, a few thousand aten ops per step)
under bf16 autocast, backward, AdamW. Each round runs every side once, in a shuffled order (drift
of a busy machine lands on all of them), and times a few steps with the thread's CPU time
(``time.thread_time``: time spent descheduled is nobody's overhead):

- ``plain``: nothing installed;
- ``outside the window``: a strict session made and its claim learned, not installed — what the
  steps outside ``--strict-window`` pay (nothing but the one-off autocast watch);
- ``function mode``: an empty ``TorchFunctionMode``: the cheapest layer that can raise at a call,
  but it sees Python-level torch calls only (before autocast casts, no ops inside composites, no
  backward): not enough for strict mode, listed for scale;
- ``dispatch mode``: an empty ``TorchDispatchMode``: the floor of any check that sees every aten
  op with the dtypes that ran;
- ``strict``: ``--strict precision,attention`` installed (the dispatch mode with its checks, the
  SDPA wrapper).

Prints the median step per side over the rounds, its ratio to ``plain``, and the aten ops and
Python-level calls per step (so the cost can be read per op). A torch.profiler trace, the third
way to see every op, cannot raise at the op (its events are read after the step), so it is not a
candidate. Exit status 0; 2 on misuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diagnose.strict import StrictOptions  # noqa: E402
from diagnose.strict.mode import RANK_EXPECT, StrictSession  # noqa: E402
from diagnose.strict.violations import Claim  # noqa: E402
from diagnose.torch_compat import TorchDispatchMode as DispatchModeBase  # noqa: E402


class _CountingDispatch(DispatchModeBase):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _CountingFunction(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    latents, t, text = torch.randn(2, 4, 16, 16), torch.tensor([1, 2]), torch.randn(2, 8, 64)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = unet(latents, t, encoder_hidden_states=text).sample
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return unet, optimizer, step


def _strict() -> StrictSession:
    claim = Claim("bf16", "the benchmark's autocast")
    return StrictSession(StrictOptions(mode="warn"), claim=claim, claim_rank=RANK_EXPECT)


@contextlib.contextmanager
def _installed(session: StrictSession) -> Iterator[None]:
    session.install()
    try:
        yield
    finally:
        session.uninstall()


def _sides() -> dict[str, Callable[[], contextlib.AbstractContextManager[Any]]]:
    idle = _strict()
    idle.begin()
    return {
        "plain": contextlib.nullcontext,
        "outside the window": contextlib.nullcontext,  # made above, never installed
        "function mode": _CountingFunction,
        "dispatch mode": _CountingDispatch,
        "strict": lambda: _installed(_strict()),
    }


def _timed(
    step: Callable[[], None], context: contextlib.AbstractContextManager[Any], n: int
) -> float:
    with context:
        step()  # one step to settle (first-call caches)
        start = time.thread_time()
        for _ in range(n):
            step()
        return (time.thread_time() - start) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per side per round")
    parser.add_argument("--json", type=Path, help="write the samples here too")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    torch.set_num_threads(1)
    _, _, step = _model()
    for _ in range(2):
        step()
    sides = _sides()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for round_index in range(args.rounds):
        random.Random(round_index).shuffle(order)
        for name in order:
            samples[name].append(_timed(step, sides[name](), args.steps))
    dispatch, function = _CountingDispatch(), _CountingFunction()
    with dispatch:
        step()
    with function:
        step()
    plain = statistics.median(samples["plain"])
    print(
        f"torch {torch.__version__}, one CPU thread; {dispatch.ops} aten ops and "
        f"{function.calls} Python-level torch calls per step"
    )
    print(f"{'side':<20} {'median ms/step':>15} {'vs plain':>9} {'µs per aten op':>15}")
    for name, values in samples.items():
        median = statistics.median(values)
        per_op = (median - plain) / dispatch.ops * 1e6
        print(f"{name:<20} {median * 1e3:>15.1f} {median / plain:>8.2f}x {per_op:>15.2f}")
    if args.json is not None:
        payload = {"ops_per_step": dispatch.ops, "calls_per_step": function.calls, **samples}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
