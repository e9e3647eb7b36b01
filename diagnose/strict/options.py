"""What ``--strict`` asks for, as the command line says it and as the trainer's processes read it.

``--strict precision[,attention][,warn]`` names the checks (both when none is named) and whether
the first violation stops the run (the default) or every violation is only recorded (``warn``).
``--strict-window`` says which steps are watched, ``--strict-allow`` accepts known upcasts by op
or module glob, ``--expect`` gives the precision of a loop that casts by hand (no autocast, no
trainer setting to read it from). Torch-free: the parent reads it before any torch import.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from diagnose.errors import DiagnoseError, ExitCode

Check = Literal["precision", "attention"]
Mode = Literal["fail", "warn"]
Window = Literal["all", "capture"]

CHECKS: tuple[Check, ...] = ("precision", "attention")
MODES: tuple[Mode, ...] = ("fail", "warn")
WINDOWS: tuple[Window, ...] = ("all", "capture")
#: ``--expect`` values: the low precision a hand-cast loop computes in.
EXPECTED_DTYPES: tuple[str, ...] = ("bf16", "fp16")

#: The environment variable that carries the options into every process of the command.
ENV_OPTIONS = "DIAGNOSE_STRICT"
#: Where the ``diagnose`` package's modules are (os.pathsep-separated, its own folder first), for a
#: process whose Python does not have it installed.
ENV_PACKAGE = "DIAGNOSE_STRICT_PACKAGE"


@dataclass(frozen=True)
class StrictOptions:
    """The strict checks of one run."""

    checks: tuple[Check, ...] = CHECKS
    mode: Mode = "fail"
    window: Window = "all"
    #: Op names or module-path globs whose violations are accepted (``--strict-allow``).
    allow: tuple[str, ...] = ()
    #: The low precision a hand-cast loop claims (``--expect bf16``), or "".
    expect: str = ""

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks:
            raise ValueError(f"unknown strict checks: {unknown or 'none'}")
        if self.mode not in MODES or self.window not in WINDOWS:
            raise ValueError(f"bad strict mode {self.mode!r} or window {self.window!r}")
        if self.expect and self.expect not in EXPECTED_DTYPES:
            raise ValueError(f"bad expected precision {self.expect!r}")

    def allowed_by(self, op: str, module: str) -> str | None:
        """The ``--strict-allow`` pattern that accepts a violation of ``op`` in ``module``: an op
        name (``addmm``, ``aten.addmm``, a glob of them) or a module path glob (``vae.*``)."""
        names = {op, f"aten.{op}", f"aten::{op}"}
        for pattern in self.allow:
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                return pattern
            if module and fnmatch.fnmatchcase(module, pattern):
                return pattern
        return None

    def to_dict(self) -> dict[str, object]:
        return {
            "checks": list(self.checks),
            "mode": self.mode,
            "window": self.window,
            "allow": list(self.allow),
            "expect": self.expect,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> StrictOptions:
        checks = data.get("checks") or CHECKS
        allow = data.get("allow") or ()
        return cls(
            checks=tuple(str(c) for c in checks) if isinstance(checks, (list, tuple)) else CHECKS,  # type: ignore[misc]
            mode=str(data.get("mode") or "fail"),  # type: ignore[arg-type]
            window=str(data.get("window") or "all"),  # type: ignore[arg-type]
            allow=tuple(str(a) for a in allow) if isinstance(allow, (list, tuple)) else (),
            expect=str(data.get("expect") or ""),
        )

    def to_env(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> StrictOptions | None:
        """The options the parent set, or None when strict mode is off (or unreadable)."""
        text = environ.get(ENV_OPTIONS)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls.from_dict(data) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        """``precision and attention, stop at the first violation, every watched step``."""
        how = "stop at the first violation" if self.mode == "fail" else "record and go on"
        steps = "every step after the first" if self.window == "all" else "the capture's steps"
        return f"{' and '.join(self.checks)}; {how}; {steps}"


def parse_strict(text: str) -> tuple[tuple[Check, ...], Mode]:
    """``--strict`` value → (checks, mode): words from precision, attention, warn, fail."""
    checks: list[Check] = []
    mode: Mode = "fail"
    words = [w for w in text.replace(" ", "").lower().split(",") if w]
    for word in words:
        if word in CHECKS:
            if word not in checks:
                checks.append(word)  # type: ignore[arg-type]
        elif word in MODES:
            mode = word  # type: ignore[assignment]
        else:
            raise argparse.ArgumentTypeError(
                f"--strict takes {', '.join((*CHECKS, *MODES))} separated by commas; got {word!r}"
            )
    if not words:
        raise argparse.ArgumentTypeError("--strict needs a value, e.g. precision,attention")
    return tuple(checks) or CHECKS, mode


def add_strict_options(parser: argparse.ArgumentParser, *, own_workload: bool = False) -> None:
    """--strict, --strict-window, --strict-allow and --expect, as `profile` takes them;
    ``own_workload`` (`diagnose run`): --strict and --strict-allow only, since diagnose's own step
    knows its precision and watches every step it measures."""
    group = parser.add_argument_group("strict mode (a silent upcast or fallback stops the run)")
    group.add_argument(
        "--strict",
        type=parse_strict,
        metavar="CHECKS",
        help="check every matmul/conv/attention op of the watched steps: precision (fp32 where "
        "the run asked for bf16/fp16), attention (SDPA's math path or a hand-written attention "
        "where a fused kernel runs); add 'warn' to record every violation and go on instead of "
        "stopping at the first (e.g. --strict precision,attention,warn)",
    )
    if not own_workload:
        group.add_argument(
            "--strict-window",
            choices=WINDOWS,
            default="all",
            help="the steps watched: all (every step after the first) or capture (the timed and "
            "profiled steps only) (default: all)",
        )
    group.add_argument(
        "--strict-allow",
        action="append",
        default=[],
        metavar="OP|MODULE_GLOB",
        help="accept violations of this op (addmm, convolution) or in modules matching this glob "
        "(vae.*, *.ff.net.2); repeatable; written into the record",
    )
    if not own_workload:
        group.add_argument(
            "--expect",
            choices=EXPECTED_DTYPES,
            help="the precision a loop that casts its model by hand computes in (no autocast, "
            "no trainer setting to read it from); used by --strict",
        )


def strict_options_of(args: argparse.Namespace) -> StrictOptions | None:
    """The options of a parsed command line, or None without ``--strict``."""
    strict = getattr(args, "strict", None)
    if strict is None:
        if getattr(args, "expect", None) or getattr(args, "strict_allow", None):
            raise DiagnoseError(
                "--expect and --strict-allow only apply with --strict (e.g. --strict precision)",
                ExitCode.USAGE,
            )
        return None
    checks, mode = strict
    return StrictOptions(
        checks=checks,
        mode=mode,
        window=getattr(args, "strict_window", None) or "all",
        allow=tuple(args.strict_allow or ()),
        expect=getattr(args, "expect", None) or "",
    )


__all__ = [
    "CHECKS",
    "ENV_OPTIONS",
    "ENV_PACKAGE",
    "EXPECTED_DTYPES",
    "MODES",
    "WINDOWS",
    "Check",
    "Mode",
    "StrictOptions",
    "Window",
    "add_strict_options",
    "parse_strict",
    "strict_options_of",
]
