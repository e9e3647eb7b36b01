"""The settings of one `diagnose run`: what the user would set in their trainer.

Light module (no torch import): the CLI validates options and the record stores them as a dict.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from diagnose.errors import DiagnoseError, ExitCode
from diagnose.quantized_base import BASE_KINDS, QUANTIZED_KINDS

Precision = Literal["fp32", "fp16", "bf16-mixed", "bf16-full"]
OptimizerName = Literal["adamw", "adamw8bit", "adafactor"]
Attention = Literal["auto", "flash", "efficient", "cudnn", "math", "xformers"]
Size = Literal["tiny", "full"]
Strategy = Literal["ddp", "fsdp"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
SIZES: tuple[str, ...] = get_args(Size)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
#: Model presets: the architectures LoRA users train. Configs live in diagnose/workload/configs/.
PRESETS: tuple[str, ...] = ("sd15", "sdxl", "zimage", "flux", "sd3")
#: The most timed steps a run takes when --steps is not given. 30 because the CI gate (diagnose
#: compare) needs them: on recorded quiet-runner noise it catches a 10% slowdown in >= 99% of
#: trials at 30 steps a side, ~96% at 20 and ~50% at 8 (benchmarks/bench_compare_gate.py).
MAX_TIMED_STEPS = 30
#: Without --steps, the timed steps also end once they have taken this many seconds and at least
#: MIN_BUDGETED_STEPS ran: a fast step takes all MAX_TIMED_STEPS within it, while a slow one (a CPU
#: smoke test, a full-size model on a small GPU) stops at a median that holds instead of spending
#: the run's time on samples no verdict needs. Records a CI gate compares pass --steps.
TIMED_STEPS_BUDGET_S = 5.0
#: The fewest timed steps a budget may end with: enough for a median and a spread that hold.
MIN_BUDGETED_STEPS = 10
#: --device values that name no single GPU: what --nproc > 1 accepts (rank r uses GPU r).
_WHOLE_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "rocm", "hip")


@dataclass
class RunConfig:
    """Everything that decides what `diagnose run` measures. Stored verbatim in the record."""

    #: None means: chosen from the device (full SDXL on a GPU, SD1.5 when VRAM is short,
    #: tiny SD1.5 on a CPU). Resolved before the run starts; the record holds the resolved value.
    preset: str | None = None
    size: Size | None = None
    #: A local diffusers model folder (offline) instead of a preset.
    model_dir: str | None = None
    #: "auto", "cpu", "cuda", "cuda:1" ...
    device: str = "auto"
    precision: Precision = "bf16-mixed"
    optimizer: OptimizerName = "adamw"
    #: How the frozen denoiser's linear layers are stored (diagnose.quantized_base): None = in
    #: the precision's weight dtype; nf4/fp4/int8 (bitsandbytes) or fp8 store them quantized.
    base: str | None = None
    #: The same for the text encoder(s); None = as ``base``.
    text_encoder_base: str | None = None
    batch: int = 1
    #: Resolution buckets in pixels (square). Steps cycle through them. None = preset default.
    resolution: list[int] | None = None
    rank: int = 16
    #: LoRA alpha; None = same as rank (scale 1.0).
    alpha: float | None = None
    #: Module name patterns the adapter wraps; None = the preset's attention projections.
    target_modules: list[str] | None = None
    grad_checkpointing: bool = False
    #: DataLoader workers.
    workers: int = 0
    attention: Attention = "auto"
    #: Timed steps (unprofiled), after the warm-up; None = budgeted (:meth:`timed_step_plan`).
    steps: int | None = None
    warmup: int = 2
    #: Steps captured by the profiler (after the timed steps).
    profiled_steps: int = 2
    cache_latents: bool = False
    cache_text_embeddings: bool = False
    #: The user's image folder; None = generated high-resolution images in a temporary folder.
    data_dir: str | None = None
    learning_rate: float = 1e-4
    seed: int = 0
    #: Probes turned off with --skip.
    skip_probes: list[str] = field(default_factory=list)
    #: Processes (ranks) under torch.distributed: one per GPU, or N CPU processes with gloo.
    #: 1 = the ordinary single-process run.
    nproc: int = 1
    #: How the ranks share the denoiser when nproc > 1: DistributedDataParallel or FSDP.
    strategy: Strategy = "ddp"

    def validate(self) -> None:
        """Raise DiagnoseError(USAGE) on a value no run could use."""

        def bad(message: str) -> DiagnoseError:
            return DiagnoseError(message, ExitCode.USAGE)

        if self.preset is not None and self.preset not in PRESETS:
            raise bad(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.size is not None and self.size not in SIZES:
            raise bad(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        if self.precision not in PRECISIONS:
            raise bad(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise bad(
                f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        for name in ("base", "text_encoder_base"):
            value = getattr(self, name)
            if value is not None and value not in BASE_KINDS:
                raise bad(
                    f"unknown --{name.replace('_', '-')} {value!r}; choose one of "
                    f"{', '.join(BASE_KINDS)}"
                )
        if self.nproc > 1 and self.strategy == "fsdp" and self.base in QUANTIZED_KINDS:
            raise bad(
                f"--base {self.base} with --strategy fsdp: FSDP shards the base's parameters, "
                "which a quantized layer keeps packed; use --strategy ddp"
            )
        if self.attention not in ATTENTIONS:
            raise bad(
                f"unknown attention {self.attention!r}; choose one of {', '.join(ATTENTIONS)}"
            )
        for name in ("batch", "rank", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise bad(f"--{name} must be at least 1")
        for name in ("workers", "warmup", "profiled_steps"):
            if getattr(self, name) < 0:
                raise bad(f"--{name.replace('_', '-')} must not be negative")
        if self.resolution is not None:
            if not self.resolution:
                raise bad("--resolution needs at least one value")
            for r in self.resolution:
                if r < 64 or r % 8:
                    raise bad(f"resolution {r} must be a multiple of 8 and at least 64")
        if self.alpha is not None and self.alpha <= 0:
            raise bad("--alpha must be positive")
        if self.learning_rate <= 0:
            raise bad("--lr must be positive")
        if self.nproc < 1:
            raise bad("--nproc must be at least 1")
        if self.strategy not in STRATEGIES:
            raise bad(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.nproc > 1 and self.device.strip().lower() not in _WHOLE_DEVICES:
            raise bad(
                f"--nproc {self.nproc} runs one process per GPU from the first one, so --device "
                f"must be auto, cpu or cuda (not {self.device}); choose the GPUs with "
                "CUDA_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES on ROCm)"
            )

    def command_line(self) -> str:
        """The `diagnose run` command that repeats this configuration (defaults left out)."""
        default = RunConfig()
        flags = {
            "preset": "--preset",
            "size": "--size",
            "model_dir": "--model",
            "device": "--device",
            "precision": "--precision",
            "optimizer": "--optimizer",
            "base": "--base",
            "text_encoder_base": "--text-encoder-base",
            "batch": "--batch",
            "resolution": "--resolution",
            "rank": "--rank",
            "alpha": "--alpha",
            "target_modules": "--target-modules",
            "grad_checkpointing": "--grad-checkpointing",
            "workers": "--workers",
            "attention": "--attention",
            "steps": "--steps",
            "warmup": "--warmup",
            "profiled_steps": "--profiled-steps",
            "cache_latents": "--cache-latents",
            "cache_text_embeddings": "--cache-text-embeddings",
            "data_dir": "--data",
            "learning_rate": "--lr",
            "seed": "--seed",
            "nproc": "--nproc",
            "strategy": "--strategy",
        }
        parts = ["diagnose", "run"]
        for name, flag in flags.items():
            value = getattr(self, name)
            if value == getattr(default, name) or value is None:
                continue
            if isinstance(value, bool):
                parts.append(flag)
            elif isinstance(value, list):
                parts += [flag, ",".join(map(str, value))]
            else:
                parts += [flag, str(value)]
        for probe in self.skip_probes:
            parts += ["--skip", probe]
        return shlex.join(parts)

    def timed_step_plan(self) -> tuple[int, float | None]:
        """(the most timed steps, the seconds after which they may end early or None).

        An explicit --steps is taken exactly: a CI gate compares records of equal sample counts.
        Ranks of one job must take the same number of steps (their collectives pair up), so a
        multi-rank run takes them all too.
        """
        if self.steps is not None:
            return self.steps, None
        if self.nproc > 1:
            return MAX_TIMED_STEPS, None
        return MAX_TIMED_STEPS, TIMED_STEPS_BUDGET_S

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
