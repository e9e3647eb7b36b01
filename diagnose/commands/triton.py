"""`diagnose triton`: check that Triton kernels compute the right answer on this machine.

Runs the built-in corpus, or the user's own cases (``--cases MODULE_OR_FILE``: a module with a
``CASES`` list of ``diagnose.probes.triton.cases.TritonCase``), prints one verdict per case, shape
and dtype (pass, drift or mismatch, or a build/launch failure), and exits 0 when none fails (drift
is reported, not a failure), :data:`CHECKS_FAILED` when any does. The inputs come from a fixed
seed unless asked otherwise, so the same stack gives the same verdicts every time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diagnose.catalogs.triton_catalog import DEFAULT_SEED
from diagnose.errors import DiagnoseError, ExitCode

#: Exit code when a check fails (a wrong answer, or a kernel that does not build or run).
#: Proposed as ExitCode.CHECK_FAILED: REGRESSION (6) means "worse than a baseline", and a wrong
#: answer is not a comparison with anything.
CHECKS_FAILED = ExitCode.CHECK_FAILED


class TritonCommand:
    name = "triton"
    help = (
        "check Triton / torch.compile kernels against a float64 CPU reference on this device "
        "(the built-in corpus, or your own with --cases)"
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--cases",
            action="append",
            metavar="MODULE_OR_FILE",
            help="a .py file or importable module with a CASES list of TritonCase "
            "(repeatable; default: the built-in corpus)",
        )
        parser.add_argument(
            "--corpus",
            action="store_true",
            help="run the built-in corpus as well as the --cases",
        )
        parser.add_argument(
            "--device",
            default="auto",
            help="auto, cpu, cuda, cuda:N (cpu: Triton's interpreter, kernel logic only)",
        )
        parser.add_argument(
            "--seed",
            type=int,
            help=f"seed of the random inputs (default {DEFAULT_SEED}, the same every run; printed)",
        )
        parser.add_argument(
            "--seeds",
            type=int,
            default=1,
            metavar="N",
            help="run every check with N seeds, from --seed on (default 1)",
        )
        parser.add_argument(
            "--json", type=Path, metavar="FILE", help="also write every verdict to FILE as JSON"
        )
        parser.add_argument(
            "--force", action="store_true", help="overwrite an existing --json FILE"
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=900.0,
            metavar="SECONDS",
            help="give up on the interpreter run after this long; on a GPU, start no "
            "further seed after it (default 900)",
        )

    def run(self, args: argparse.Namespace) -> int:
        import importlib.util

        from diagnose.device import select_device
        from diagnose.output import check_writable_file, write_text_atomic
        from diagnose.probes.triton.cases.loading import CaseLoadError
        from diagnose.probes.triton.cases.runner import (
            CORPUS,
            drift_line,
            jsonable,
            run_suite,
            summary_line,
            verdict_table,
        )
        from diagnose.probes.triton.probe import collect_environment, version_problems
        from diagnose.progress import ProgressLine

        if args.timeout <= 0:
            raise DiagnoseError("--timeout must be positive", ExitCode.USAGE)
        if args.seeds < 1:
            raise DiagnoseError("--seeds must be at least 1", ExitCode.USAGE)
        if args.json is not None:
            check_writable_file(args.json, force=args.force, option="--json")
        sources = list(args.cases or [])
        if not sources or args.corpus:
            sources = list(CORPUS) + sources
        if importlib.util.find_spec("triton") is None:
            raise DiagnoseError(
                "triton is not installed: pip install triton (NVIDIA) or pytorch-triton-rocm "
                "from the ROCm index (AMD)",
                ExitCode.UNSUPPORTED,
            )
        env = collect_environment()
        if env.import_error:
            raise DiagnoseError(
                f"triton is installed but does not import: {env.import_error.splitlines()[0]}",
                ExitCode.UNSUPPORTED,
            )
        device = select_device(args.device)
        try:
            with ProgressLine() as progress:
                suite = run_suite(
                    sources,
                    device=device,
                    seed=args.seed,
                    seeds=args.seeds,
                    timeout_s=args.timeout,
                    progress=progress,
                )
        except CaseLoadError as exc:
            raise DiagnoseError(str(exc), ExitCode.BAD_INPUT) from None

        print(verdict_table(suite.checks))
        print()
        for note in suite.notes:
            print(f"note: {note}")
        for problem in version_problems(env):
            print(f"warning: {problem.message}; fix: {problem.fix}")
        drift = drift_line(suite)
        if drift:
            print(f"info: {drift}")
        print(summary_line(suite))
        print(f"({suite.seconds:.1f} s)")
        if args.json is not None:
            document = suite.to_dict()
            document["environment"] = env.to_dict()
            text = json.dumps(jsonable(document), indent=2, sort_keys=True, allow_nan=False)
            write_text_atomic(args.json, text + "\n")
        if suite.failed:
            return CHECKS_FAILED
        if not suite.ran:
            print("diagnose: no check could run on this machine", file=sys.stderr)
            return int(ExitCode.UNSUPPORTED)
        return int(ExitCode.OK)
