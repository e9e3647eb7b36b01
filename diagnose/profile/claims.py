"""What the user's command line says its training does, in the trainers' own flags, to hold
against what its steps really ran ("claimed vs actual").

Only the precision is read today: it is the claim that most often silently fails to apply (a
launcher flag the script ignores, a config key overridden by a preset, a Lightning precision
that falls back). Flags are matched as trainers spell them; a command that names no precision
makes no claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Options whose value names the precision: accelerate / diffusers examples / kohya sd-scripts /
#: SimpleTuner (``--mixed_precision``), Lightning's CLI and OneTrainer-style configs
#: (``--precision``, ``--trainer.precision``).
_VALUED = ("--mixed_precision", "--mixed-precision", "--precision", "--trainer.precision")
#: Switches that claim a precision by their presence: transformers' Trainer (``--bf16``,
#: ``--fp16``) and kohya's whole-model casts (``--full_bf16``, ``--full_fp16``).
_SWITCHES = {
    "--bf16": "bf16",
    "--fp16": "fp16",
    "--full_bf16": "bf16",
    "--full_fp16": "fp16",
}


@dataclass(frozen=True)
class PrecisionClaim:
    """The precision the command asks for: ``dtype`` is "bf16", "fp16" or "fp32"."""

    dtype: str
    #: The words on the command line that say so, as typed (``--mixed_precision bf16``).
    said: str


def _dtype_of(value: str) -> str | None:
    """bf16 / fp16 / fp32 from a precision value as trainers write it, else None."""
    text = value.strip().strip("'\"").lower()
    if not text:
        return None
    if "bf16" in text or "bfloat16" in text:
        return "bf16"
    if text in {"no", "fp32", "32", "32-true", "float32", "full"}:
        return "fp32"
    if "fp16" in text or text in {"16", "16-mixed", "16-true", "half", "float16"}:
        return "fp16"
    return None


def precision_claim(argv: Sequence[str]) -> PrecisionClaim | None:
    """The last precision the command line names (later flags override earlier ones, as
    argparse reads them), or None."""
    claim: PrecisionClaim | None = None
    words = list(argv)
    for index, word in enumerate(words):
        name, equals, inline = word.partition("=")
        if name in _VALUED:
            value = inline if equals else (words[index + 1] if index + 1 < len(words) else "")
            dtype = _dtype_of(value)
            if dtype is not None:
                said = word if equals else f"{word} {value}"
                claim = PrecisionClaim(dtype, said)
        elif word in _SWITCHES:
            claim = PrecisionClaim(_SWITCHES[word], word)
    return claim


__all__ = ["PrecisionClaim", "precision_claim"]
