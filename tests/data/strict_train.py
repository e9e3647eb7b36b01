"""A small training loop for the strict-mode tests: an MLP with one attention block, AdamW, a few
steps on the CPU, in one of the ways users ask for bf16, with one fault planted or none.

    python strict_train.py [--cast autocast|hand|accelerate] [--plant fp32|math|dropout]
                           [--steps N]

--cast autocast    torch.autocast("cpu", dtype=torch.bfloat16) around the forward (default)
--cast hand        the model and its inputs cast to bf16 by hand, no autocast (--expect bf16)
--cast accelerate  an Accelerator whose mixed precision comes from `accelerate launch
                   --mixed_precision bf16`, the model prepared by it
--plant fp32       the block's projection leaves the run's precision: autocast off and its input
                   cast up with .float() (hand cast: its weights kept in fp32)
--plant math       attention forced onto SDPA's math backend (sdpa_kernel(SDPBackend.MATH))
--plant dropout    attention with dropout, which no fused CPU kernel takes
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WIDTH, HEADS = 64, 4

parser = argparse.ArgumentParser()
parser.add_argument("--cast", choices=("autocast", "hand", "accelerate"), default="autocast")
parser.add_argument("--plant", choices=("fp32", "math", "dropout"), default="")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        dropout = 0.1 if args.plant == "dropout" else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return out.transpose(1, 2).reshape(batch, length, WIDTH)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if args.plant == "fp32" and args.cast == "hand":
            return self.proj(x.float()).to(x.dtype)  # the planted fp32 block (hand cast)
        if args.plant == "fp32":
            with torch.autocast("cpu", enabled=False):
                return self.proj(x.float())  # the planted fp32 block (autocast)
        return self.proj(x)


model = torch.nn.Sequential(
    torch.nn.Linear(WIDTH, WIDTH),
    Attention(),
    torch.nn.GELU(),
    Block(),
    torch.nn.Linear(WIDTH, WIDTH),
)
if args.cast == "hand":
    model.to(torch.bfloat16)
    if args.plant == "fp32":
        model[3].float()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accelerator = None
if args.cast == "accelerate":
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
forced = sdpa_kernel(SDPBackend.MATH) if args.plant == "math" else contextlib.nullcontext()
with forced:
    for _ in range(args.steps):
        x = torch.randn(4, 16, WIDTH)
        if args.cast == "hand":
            x = x.to(torch.bfloat16)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.cast == "autocast")
        with autocast:
            loss = model(x).float().pow(2).mean()
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
print("trained", args.steps)
