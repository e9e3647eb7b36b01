"""The precision a run claims, and who claims it, learned in the trainer's own process.

The claim is the run's, not the op's: once a run asked for bf16, an op computed in fp32 under a
local ``torch.autocast(enabled=False)`` is the silent upcast strict mode is for. It is learned,
first source wins:

1. ``--expect bf16``: a loop that casts its model by hand says so on diagnose's command line;
2. the trainer's setting, read in its process: Lightning's ``Trainer(precision=...)`` (its trainer
   found on the stack at the first optimizer step), accelerate's ``mixed_precision`` (its state,
   and ``accelerate launch --mixed_precision`` in the environment);
3. the first ``torch.autocast`` entered with bf16/fp16, named by the code that entered it
   (Lightning's precision plugin, accelerate, or the user's line).

``torch.autocast.__enter__`` is wrapped from strict mode's start (the first optimizer's
construction, before any step) until a claim is known (one Python call per autocast entry, nothing
after), so a claim made in the first, unwatched step is known when the watched steps begin.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from diagnose.precision_policy import requested_low_dtype
from diagnose.strict.frames import describe_frame, user_frame
from diagnose.strict.violations import Claim
from diagnose.torch_compat import autocast_request

_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_TORCH_NAME = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
#: How far up the stack the trainer's objects are looked for.
_MAX_FRAMES = 64


def expected_claim(expect: str) -> Claim | None:
    """The claim of ``--expect`` (a hand-cast loop), or None."""
    if not expect:
        return None
    return Claim(expect, f"--expect {expect} (the loop casts its model by hand)", hand_cast=True)


def run_claim(precision: str) -> Claim | None:
    """The claim of ``diagnose run --precision`` (bf16-full casts the model by hand)."""
    dtype = requested_low_dtype(precision)
    if dtype is None:
        return None
    said = f"diagnose run --precision {precision}"
    return Claim(dtype, said, hand_cast=precision.endswith("-full"))


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "").split(".", 1)[0]


def _lightning_precision(frame: FrameType | None) -> str:
    """The ``precision`` of the Lightning trainer driving the code at ``frame`` ("bf16-mixed"),
    read off the first Lightning object on the stack that holds it (the trainer, its strategy or
    its precision plugin); "" when there is none."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return ""
        if _package(frame) in ("lightning", "pytorch_lightning"):
            owner = frame.f_locals.get("self")
            for holder in (owner, getattr(owner, "trainer", None)):
                plugin = getattr(holder, "precision_plugin", None)
                for candidate in (plugin, owner):
                    precision = getattr(candidate, "precision", None)
                    if isinstance(precision, str) and precision:
                        return precision
        frame = frame.f_back
    return ""


def _dtype_of(flag: str, value: str) -> str | None:
    """bf16/fp16 from a trainer's precision value, as the command-line claims read it."""
    from diagnose.profile.claims import precision_claim

    claim = precision_claim([flag, value])
    return claim.dtype if claim is not None and claim.dtype in ("bf16", "fp16") else None


def lightning_claim(frame: FrameType | None) -> Claim | None:
    """``Trainer(precision="bf16-mixed")`` (or ``"bf16-true"``: a hand cast) of the Lightning
    trainer on the stack at ``frame``."""
    precision = _lightning_precision(frame)
    dtype = _dtype_of("--precision", precision) if precision else None
    if dtype is None:
        return None
    return Claim(
        dtype,
        f'Lightning Trainer(precision="{precision}")',
        trainer="lightning",
        hand_cast=precision.endswith("-true"),
    )


def _accelerate_words(dtype: str) -> str:
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return f"accelerate launch --mixed_precision {dtype}"
    return f'accelerate Accelerator(mixed_precision="{dtype}")'


def accelerate_claim() -> Claim | None:
    """accelerate's ``mixed_precision`` when an ``Accelerator`` was made in this process."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    value = shared.get("_mixed_precision") if isinstance(shared, dict) else None
    dtype = _dtype_of("--mixed_precision", str(value)) if value else None
    if dtype is None:
        return None
    return Claim(dtype, _accelerate_words(dtype), trainer="diffusers")


def autocast_claim(dtype: str, device: str, frame: FrameType | None) -> Claim:
    """The claim of an autocast entered at ``frame``, named by who entered it."""
    lightning = lightning_claim(frame)
    if lightning is not None:
        return lightning
    scan = frame
    for _ in range(_MAX_FRAMES):
        if scan is None:
            break
        if _package(scan) == "accelerate":
            return Claim(dtype, _accelerate_words(dtype), trainer="diffusers")
        scan = scan.f_back
    where = describe_frame(user_frame(frame))
    said = f'torch.autocast("{device}", dtype={_TORCH_NAME[dtype]})'
    return Claim(dtype, f"{said} at {where}" if where else said)


class AutocastWatch:
    """Wraps ``torch.autocast.__enter__`` until the first low-precision autocast is entered."""

    def __init__(self, on_claim: Callable[[Claim], None]) -> None:
        self._on_claim = on_claim
        self._original: Callable[[Any], Any] | None = None

    def start(self) -> None:
        from torch.amp.autocast_mode import autocast

        if self._original is not None:
            return
        original: Callable[[Any], Any] = autocast.__enter__
        self._original = original
        watch = self

        def __enter__(context: Any) -> Any:
            entered = original(context)
            try:
                enabled, fast_dtype, device = autocast_request(context)
                dtype = _LOW.get(fast_dtype) if enabled and fast_dtype is not None else None
                if dtype is not None:
                    watch.stop()
                    watch._on_claim(autocast_claim(dtype, device, sys._getframe(1)))
            except Exception:  # never into the user's program
                pass
            return entered

        __enter__.__wrapped__ = original  # type: ignore[attr-defined]
        autocast.__enter__ = __enter__  # type: ignore[method-assign]

    def stop(self) -> None:
        from torch.amp.autocast_mode import autocast

        original, self._original = self._original, None
        if original is not None and getattr(autocast.__enter__, "__wrapped__", None) is original:
            autocast.__enter__ = original  # type: ignore[method-assign,assignment]


__all__ = [
    "AutocastWatch",
    "accelerate_claim",
    "autocast_claim",
    "expected_claim",
    "lightning_claim",
    "run_claim",
]
