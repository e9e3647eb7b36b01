"""The optimizer a LoRA trainer makes over the adapter's parameters (``--optimizer``)."""

from __future__ import annotations

from typing import Any

import torch

from diagnose.errors import DiagnoseError, ExitCode, first_line


def build_optimizer(
    name: str, params: list[torch.nn.Parameter], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer a trainer would make for ``--optimizer name``."""
    if name == "adamw":
        if device.type == "cuda":  # CUDA and ROCm: one fused kernel for all LoRA tensors
            try:
                return torch.optim.AdamW(params, lr=lr, fused=True)
            except (RuntimeError, ValueError):
                pass  # a dtype/device the fused kernel does not take: foreach below
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except Exception as exc:  # ImportError, or a broken build raising anything at import
            raise DiagnoseError(
                f"--optimizer adamw8bit needs bitsandbytes ({first_line(exc, limit=None)}); "
                "install it: pip install bitsandbytes",
                ExitCode.UNSUPPORTED,
            ) from None
        adamw8bit: Any = getattr(bitsandbytes.optim, "AdamW8bit")  # noqa: B009 - untyped package
        optimizer: torch.optim.Optimizer = adamw8bit(params, lr=lr)
        return optimizer
    if name == "adafactor":
        from transformers.optimization import Adafactor

        adafactor: Any = Adafactor  # untyped constructor
        # Fixed learning rate, as kohya's and OneTrainer's LoRA presets set it.
        fixed: torch.optim.Optimizer = adafactor(
            params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
        return fixed
    raise DiagnoseError(f"unknown optimizer {name!r}", ExitCode.USAGE)


__all__ = ["build_optimizer"]
