"""Sync faults planted in a plain LoRA loop: their cost measured without the profiler against the
sync reading's estimate from a profiled trace of the same loop.

    python benchmarks/bench_syncs.py [--device cuda] [--size full|tiny] [--steps 20]
                                     [--faults none,adamw8bit,clipping,logging,forward-cpu]
    python benchmarks/bench_syncs.py --train FAULT [--steps N]   # the loop alone, to run under
                                                                  # diagnose profile -- ...

The loop is the one of the project's first GPU run: transformer blocks over patch tokens, a frozen
bf16 base with fp32 LoRA adapters under bf16 autocast, a DataLoader (num_workers=0) decoding small
JPEGs every step, torch AdamW (foreach) unless the fault replaces it. Faults: ``adamw8bit``
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
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAULTS = ("none", "adamw8bit", "clipping", "logging", "forward-cpu")
SIZES = {"full": (8, 1024, 8, 256, 8), "tiny": (2, 64, 2, 64, 4)}  # blocks, width, batch, px, imgs
PROFILED = 3


def _loop(fault: str, size: str, device: str, steps: int, trace: Path | None) -> list[float]:
    """Train ``steps`` timed steps (and 3 profiled ones into ``trace``); the timed seconds."""
    import numpy as np
    import torch
    from PIL import Image

    blocks, width, batch, pixels, images = SIZES[size]
    patch = 8
    dev = torch.device(device)
    folder = Path(tempfile.mkdtemp(prefix="bench-syncs-"))
    rng = np.random.default_rng(0)
    for i in range(images):
        array = rng.integers(0, 255, (pixels, pixels, 3), dtype=np.uint8)
        Image.fromarray(array).save(folder / f"{i}.jpg", quality=90)

    class Jpegs(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return images

        def __getitem__(self, index: int) -> torch.Tensor:
            data = io.BytesIO((folder / f"{index % images}.jpg").read_bytes())
            array = np.asarray(Image.open(data).convert("RGB"), dtype=np.float32) / 255.0
            return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    class Lora(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear, rank: int = 16) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.down = torch.nn.Linear(base.in_features, rank, bias=False)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False)
            torch.nn.init.zeros_(self.up.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.up(self.down(x))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.qkv = Lora(torch.nn.Linear(width, 3 * width))
            self.out = Lora(torch.nn.Linear(width, width))
            self.mlp_in = Lora(torch.nn.Linear(width, 4 * width))
            self.mlp_out = Lora(torch.nn.Linear(4 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            heads = max(width // 64, 1)
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
            attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + self.out(attn.transpose(1, 2).reshape(b, n, width))
            x = x + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(x))))
            if fault == "forward-cpu":
                x.detach()[0, 0, :4].cpu()
            return x

    embed = torch.nn.Conv2d(3, width, patch, stride=patch)
    model = torch.nn.ModuleDict(
        {"embed": embed, "blocks": torch.nn.ModuleList(Block() for _ in range(blocks))}
    )
    head = torch.nn.Linear(width, 3 * patch * patch)
    model.to(dev, torch.bfloat16).requires_grad_(False)
    head.to(dev, torch.bfloat16).requires_grad_(False)
    adapters = [m for m in model.modules() if isinstance(m, Lora)]
    trained = [p for m in adapters for p in (*m.down.parameters(), *m.up.parameters())]
    for param in trained:
        param.data = param.data.float()
        param.requires_grad_(True)
    if fault == "adamw8bit":
        import bitsandbytes

        optimizer: Any = bitsandbytes.optim.AdamW8bit(trained, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(trained, lr=1e-4)
    loader = torch.utils.data.DataLoader(Jpegs(), batch_size=batch, num_workers=0, pin_memory=True)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(images_: torch.Tensor) -> None:
        pixels_ = images_.to(dev, non_blocking=True)
        with autocast:
            x = model["embed"](pixels_.to(torch.bfloat16)).flatten(2).transpose(1, 2)
            for block in model["blocks"]:
                x = block(x)
            out = head(x)
            target = torch.nn.functional.unfold(pixels_, patch, stride=patch).transpose(1, 2)
            loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        if fault == "clipping":
            for p in trained:
                if p.grad is not None:
                    p.grad.norm().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fault == "logging":
            loss.item()

    def batches() -> Any:
        while True:
            yield from loader

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    source = batches()
    for _ in range(3):
        step(next(source))
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(next(source))
        sync()
        times.append(time.perf_counter() - start)
    if trace is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=PROFILED, repeat=1)
        with torch.profiler.profile(
            activities=activities, schedule=schedule, record_shapes=True
        ) as prof:
            for _ in range(PROFILED + 1):
                step(next(source))
                prof.step()
        sync()
        prof.export_chrome_trace(str(trace))
    shutil.rmtree(folder, ignore_errors=True)
    return times


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
        _loop(args.train, args.size, args.device, args.steps, None)
        return 0
    if args.one:
        print(json.dumps(_loop(args.one, args.size, args.device, args.steps, args.trace)))
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
