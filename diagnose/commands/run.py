"""`diagnose run`: a real LoRA training step, measured, profiled, probed and reported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from diagnose.commands import comma_ints
from diagnose.config import (
    ATTENTIONS,
    MAX_TIMED_STEPS,
    MIN_BUDGETED_STEPS,
    OPTIMIZERS,
    PRECISIONS,
    PRESETS,
    SIZES,
    STRATEGIES,
    TIMED_STEPS_BUDGET_S,
    RunConfig,
)
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.quantized_base import BASE_KINDS
from diagnose.record_io import load_record
from diagnose.strict.options import add_strict_options, strict_options_of

if TYPE_CHECKING:
    from diagnose.finish import Progress, RunOutputs
    from diagnose.strict.options import StrictOptions


def _str_list(text: str) -> list[str]:
    return [part for part in text.replace(" ", "").split(",") if part]


def config_of(args: argparse.Namespace) -> RunConfig:
    """The run a `diagnose run` command line asks for (not yet validated)."""
    return RunConfig(
        preset=args.preset,
        size=args.size,
        model_dir=args.model_dir,
        device=args.device,
        precision=args.precision,
        optimizer=args.optimizer,
        base=args.base,
        text_encoder_base=args.text_encoder_base,
        batch=args.batch,
        resolution=args.resolution,
        rank=args.rank,
        alpha=args.alpha,
        target_modules=args.target_modules,
        grad_checkpointing=args.grad_checkpointing,
        workers=args.workers,
        attention=args.attention,
        steps=args.steps,
        warmup=args.warmup,
        profiled_steps=args.profiled_steps,
        cache_latents=args.cache_latents,
        cache_text_embeddings=args.cache_text_embeddings,
        data_dir=args.data_dir,
        learning_rate=args.learning_rate,
        seed=args.seed,
        skip_probes=args.skip,
        nproc=args.nproc,
        strategy=args.strategy,
    )


class RunCommand:
    name = "run"
    help = "run a real LoRA training step under the profiler and explain its s/it"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        d = RunConfig()
        model = parser.add_argument_group("model")
        model.add_argument(
            "--preset",
            choices=PRESETS,
            help="architecture to train "
            "(default: sdxl on a GPU, sd15 when VRAM is short or on a CPU)",
        )
        model.add_argument(
            "--size",
            choices=SIZES,
            help="full = the real configuration; tiny = same architecture, shrunk "
            "(default: full on a GPU, tiny on a CPU)",
        )
        model.add_argument(
            "--model", dest="model_dir", metavar="DIR", help="a local diffusers model folder"
        )
        train = parser.add_argument_group("training settings")
        train.add_argument(
            "--device", default=d.device, help="auto, cpu, cuda, cuda:N (default: auto)"
        )
        train.add_argument("--precision", choices=PRECISIONS, default=d.precision)
        train.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
        train.add_argument(
            "--base",
            choices=BASE_KINDS,
            help="how the frozen denoiser's linear layers are stored: bf16/fp16/fp32, "
            "nf4/fp4/int8 (bitsandbytes) or fp8 (float8, upcast per layer) (default: the "
            "precision's dtype)",
        )
        train.add_argument(
            "--text-encoder-base",
            choices=BASE_KINDS,
            help="the same for the text encoder(s) (default: as --base)",
        )
        train.add_argument("--batch", type=int, default=d.batch)
        train.add_argument(
            "--resolution",
            type=comma_ints,
            metavar="PX[,PX...]",
            help="resolution buckets, e.g. 512,1024 (default: the preset's)",
        )
        train.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
        train.add_argument("--alpha", type=float, help="LoRA alpha (default: the rank)")
        train.add_argument(
            "--target-modules",
            type=_str_list,
            metavar="NAME[,NAME...]",
            help="modules the adapter wraps (default: the attention projections)",
        )
        train.add_argument("--grad-checkpointing", action="store_true")
        train.add_argument("--workers", type=int, default=d.workers, help="DataLoader workers")
        train.add_argument("--attention", choices=ATTENTIONS, default=d.attention)
        train.add_argument("--lr", dest="learning_rate", type=float, default=d.learning_rate)
        train.add_argument("--seed", type=int, default=d.seed)
        train.add_argument(
            "--cache-latents", action="store_true", help="encode images once, before timing"
        )
        train.add_argument(
            "--cache-text-embeddings",
            action="store_true",
            help="encode captions once, before timing",
        )
        train.add_argument(
            "--data",
            dest="data_dir",
            metavar="DIR",
            help="your image folder (default: generated photos)",
        )
        distributed = parser.add_argument_group("distributed (torch.distributed)")
        distributed.add_argument(
            "--nproc",
            type=int,
            default=d.nproc,
            metavar="N",
            help="run N ranks, one process each: one per GPU (NCCL/RCCL), or N CPU processes "
            "(gloo); the record holds every rank (default: 1, no torch.distributed)",
        )
        distributed.add_argument(
            "--strategy",
            choices=STRATEGIES,
            default=d.strategy,
            help="how the ranks share the denoiser with --nproc > 1: DistributedDataParallel or "
            "FSDP (default: ddp)",
        )
        measure = parser.add_argument_group("measurement")
        measure.add_argument(
            "--steps",
            type=int,
            default=d.steps,
            help=f"timed steps, exactly (default: up to {MAX_TIMED_STEPS}, ending after "
            f"{TIMED_STEPS_BUDGET_S:g} s once {MIN_BUDGETED_STEPS} ran; pass --steps "
            f"{MAX_TIMED_STEPS} for records a CI gate compares)",
        )
        measure.add_argument(
            "--warmup", type=int, default=d.warmup, help="warm-up steps (not counted)"
        )
        measure.add_argument(
            "--profiled-steps", type=int, default=d.profiled_steps, help="steps under the profiler"
        )
        measure.add_argument(
            "--skip", action="append", default=[], metavar="PROBE", help="turn a probe off"
        )
        add_strict_options(parser, own_workload=True)
        output = parser.add_argument_group("output")
        output.add_argument("--out", type=Path, metavar="DIR", help="output folder (default: new)")
        output.add_argument(
            "--force",
            action="store_true",
            help="write into a non-empty --out folder; run a full-size model on a CPU",
        )
        output.add_argument(
            "--redact-paths",
            action="store_true",
            help="also replace your home folder and user name in the outputs (secrets always are)",
        )
        output.add_argument("--no-progress", action="store_true", help="no progress line")
        output.add_argument(
            "--verbose",
            action="store_true",
            help="show what libraries printed and warned while the run ran (kept off the "
            "terminal otherwise; secrets masked)",
        )
        from diagnose.commands.compare import add_gate_options

        output.add_argument(
            "--baseline",
            type=Path,
            action="append",
            metavar="RECORD",
            help="compare with a saved record (file or run folder); exit 6 on a regression; "
            "repeat it to give several baselines (the last green runs: the gate then sees the "
            "runner's run-to-run drift)",
        )
        add_gate_options(parser)

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.output import default_out_dir, prepare_out_dir
        from diagnose.probes.registry import probe_names
        from diagnose.progress import ProgressLine
        from diagnose.reports import terminal_summary

        config = config_of(args)
        config.validate()
        unknown = sorted(set(args.skip) - set(probe_names()))
        if unknown:
            known = ", ".join(probe_names()) or "none"
            raise DiagnoseError(
                f"--skip {unknown[0]}: no such probe (probes: {known})", ExitCode.USAGE
            )
        if config.model_dir is not None and not Path(config.model_dir).is_dir():
            raise DiagnoseError(f"--model {config.model_dir}: no such folder", ExitCode.BAD_INPUT)
        if config.data_dir is not None and not Path(config.data_dir).is_dir():
            raise DiagnoseError(f"--data {config.data_dir}: no such folder", ExitCode.BAD_INPUT)

        baselines = []
        if args.baseline:
            from diagnose.commands.compare import (
                check_gate_outputs,
                record_label,
                refuse_outputs_over_inputs,
            )

            # Before the long run: a bad baseline or an existing --junit file fails fast.
            baselines = [load_record(path) for path in args.baseline]
            check_gate_outputs(args, force=args.force)
            gate_outputs = [p for p in (args.junit, args.markdown) if p is not None]
            refuse_outputs_over_inputs(gate_outputs, args.baseline)
            if args.out is not None:
                from diagnose.output import RECORD_NAME

                overwritten = (args.out / RECORD_NAME).resolve()
                for path in args.baseline:
                    if Path(record_label(path)).resolve() == overwritten:
                        raise DiagnoseError(
                            f"--baseline {path} is the record this run writes into --out "
                            f"{args.out}; choose another --out",
                            ExitCode.USAGE,
                        )
        out_dir = args.out if args.out is not None else default_out_dir("run")
        from diagnose.output import created_files
        from diagnose.quiet import library_output

        with created_files() as written:
            prepare_out_dir(out_dir, force=args.force)
            try:
                # Libraries print and warn on import and on first use (deprecations, kernel-hub
                # fallbacks, profiler chatter): kept off the terminal, where diagnose's own
                # lines and one-line errors are what the user reads; --verbose shows them after
                # the run.
                with (
                    ProgressLine(enabled=False if args.no_progress else None) as progress,
                    library_output() as printed,
                ):
                    outputs = measure_run(
                        config,
                        out_dir,
                        force=args.force,
                        redact_paths=args.redact_paths,
                        progress=progress,
                        strict=strict_options_of(args),
                    )
            except BaseException:
                # A run that did not finish leaves nothing half-written (a trace without its
                # record would read as a whole run, and would block a rerun into the folder),
                # and removes nothing it did not write.
                written.remove()
                raise
        outcome = None
        refused: DiagnoseError | None = None
        if baselines:
            from diagnose.commands.compare import apply_gate, record_label
            from diagnose.reports import write_html

            # The record and report are saved first, so a refused comparison loses no
            # measurement; the gate's files are written before anything is printed.
            labels = [*map(record_label, args.baseline), str(outputs.record_path)]
            try:
                outcome = apply_gate(baselines, outputs.record, args, labels=labels)
            except DiagnoseError as exc:
                refused = exc  # said after the run's own summary, and in the report
                write_html(outputs.record, outputs.report_path, not_compared=exc.message)
            else:
                write_html(outputs.record, outputs.report_path, comparison=outcome.comparison)
        print(terminal_summary(outputs.record, color=sys.stdout.isatty()))
        if printed.lines:
            if args.verbose:
                sys.stderr.write(printed.masked() + "\n")
            else:
                count = len(printed.lines)
                print(
                    f"\nlibraries printed or warned {count} line{'s' if count != 1 else ''} "
                    "during the run (--verbose shows them)"
                )
        print(f"\nreport: {outputs.report_path}\nrecord: {outputs.record_path}")
        if outputs.trace_path is not None:
            print(f"trace:  {outputs.trace_path} (open it in Perfetto or chrome://tracing)")
        if refused is not None:
            raise refused
        from diagnose.strict.result import has_violations

        if has_violations(outputs.record):
            print("diagnose: --strict found a violation (see above); exit 8", file=sys.stderr)
            return int(ExitCode.STRICT_VIOLATION)
        if outcome is None:
            return int(ExitCode.OK)
        from diagnose.commands.compare import print_gate

        print()
        print_gate(outcome, args)
        return int(outcome.exit_code)


def measure_run(
    config: RunConfig,
    out_dir: Path,
    *,
    force: bool = False,
    redact_paths: bool = False,
    progress: Progress | None = None,
    strict: StrictOptions | None = None,
) -> RunOutputs:
    """``diagnose run``'s measurement into ``out_dir``: one process, or ``--nproc N`` ranks (one
    record for the run either way)."""
    from diagnose.run import execute_run, prepare_run

    prepared = prepare_run(config, force=force)
    if prepared.config.nproc == 1:
        return execute_run(
            config,
            out_dir,
            redact_paths=redact_paths,
            progress=progress,
            strict=strict,
            prepared=prepared,
        )
    from diagnose.distributed.run_ranks import execute_distributed
    from diagnose.probes.registry import REGISTRY

    return execute_distributed(
        prepared.config,
        out_dir,
        device=prepared.device,
        device_info=prepared.device_info,
        redact_paths=redact_paths,
        probes=REGISTRY,
        say=progress or (lambda message: None),
    )
