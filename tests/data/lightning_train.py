"""A small PyTorch Lightning trainer for the tests: Trainer(precision="bf16-mixed") on the CPU,
AdamW, a DataLoader, and switches for what the tests plant or vary.

    python lightning_train.py [--steps N] [--accumulate N] [--manual] [--upcast]
                              [--precision P] [--profile-dir DIR] [--plain]
    python lightning_train.py --variants DIR   # each of VARIANTS into DIR/<name>, one process

--manual      manual optimization (the LightningModule steps the optimizer itself, no closure);
              by default Lightning's automatic optimization steps with a closure
--upcast      the middle block runs in fp32 (autocast off, inputs cast up): the planted fault
--profile-dir Lightning's PyTorchProfiler (shapes recorded) writes a Chrome trace there
--plain       the same model, data and optimizer in a plain loop under torch.profiler, with
              prof.step() per optimizer step (a reference for the optimizer's update)
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 256
#: The runs the tests compare, by name: their options. One process runs them all with
#: ``--variants`` (Lightning's import is most of a small run's time).
VARIANTS: dict[str, list[str]] = {
    "closure": [],
    "manual": ["--manual"],
    "accumulate": ["--accumulate", "2"],
    "upcast": ["--upcast"],
    "plain": ["--plain"],
}


def build_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH),
        torch.nn.SiLU(),
        torch.nn.Linear(2 * WIDTH, 2 * WIDTH),
        torch.nn.SiLU(),
        torch.nn.Linear(2 * WIDTH, WIDTH),
    )


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(4096, WIDTH, generator=generator)), batch_size=64)


def loss_of(net: torch.nn.Module, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    first, act, middle, act2, last = net
    h = act(first(x))
    if upcast:
        # The planted fault: a block that leaves autocast and computes in fp32.
        with torch.autocast("cpu", enabled=False):
            h = act2(middle(h.float()))
    else:
        h = act2(middle(h))
    return (last(h).float() - x.float()).pow(2).mean()


def optimizer_of(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)


def run_lightning(args: argparse.Namespace) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_net()
            self.automatic_optimization = not args.manual

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor | None:
            loss = loss_of(self.net, batch[0], args.upcast)
            if args.manual:
                optimizer = self.optimizers()
                self.manual_backward(loss / args.accumulate)
                if (index + 1) % args.accumulate == 0:
                    optimizer.step()
                    optimizer.zero_grad()
                return None
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_of(self.net)

    profiler = None
    batches = args.steps * args.accumulate
    if args.profile_dir:
        from lightning.pytorch.profilers import PyTorchProfiler

        profiler = PyTorchProfiler(
            dirpath=args.profile_dir,
            filename="lightning",
            export_to_chrome=True,
            record_shapes=True,
            schedule=torch.profiler.schedule(wait=1, warmup=2, active=batches - 4),
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        precision=args.precision,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        profiler=profiler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), loader())


def run_plain(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule

    net = build_net()
    optimizer = optimizer_of(net)
    batches = iter(loader())
    steps = args.steps
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=1, warmup=2, active=steps - 3),
    ) as prof:
        for _ in range(steps):
            for _ in range(args.accumulate):
                (x,) = next(batches)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(net, x, args.upcast)
                (loss / args.accumulate).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    prof.export_chrome_trace(os.path.join(args.profile_dir, "plain.pt.trace.json"))


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.variants:
        for name, options in VARIANTS.items():
            folder = os.path.join(args.variants, name)
            os.makedirs(folder, exist_ok=True)
            _train(parser.parse_args([*options, "--profile-dir", folder]))
    else:
        _train(args)
    print("trained")


def _train(args: argparse.Namespace) -> None:
    if args.plain:
        run_plain(args)
    else:
        run_lightning(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--upcast", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--profile-dir", default="")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--variants", default="")
    return parser


if __name__ == "__main__":
    main()
