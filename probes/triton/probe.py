"""The ``triton`` probe: catch kernels that compile and run but compute the wrong answer.

If ``triton.jit`` runs, the result should be correct or the kernel should fail to compile; a
silent miscompile is the worst of both: training runs, the loss falls, and the model ships subtly
broken. On ROCm the Triton backend supports a subset of the language, and a Triton package that
does not match torch is a common cause. This probe runs a corpus of kernels typical of diffusion
and LoRA training (:mod:`diagnose.probes.triton.cases`) on the run's device and checks each
against a float64 CPU reference; it also checks that the installed Triton is the one torch
expects.

On a GPU the kernels are compiled for it in this process. Without one they run in Triton's
interpreter in a subprocess (which checks kernel logic, not a GPU compiler) and the
``torch.compile`` cases on inductor's CPU backend. The result says which mode ran.
"""

from __future__ import annotations

import getpass
import importlib
import importlib.metadata
import os
import re
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from diagnose.catalogs.triton_catalog import (
    COMPILE_ERROR,
    DRIFT,
    MISCOMPILE,
    VERSION_MISMATCH,
    compile_error_finding,
    drift_finding,
    miscompile_finding,
    seeds_label,
    version_mismatch_finding,
)
from diagnose.probes.base import ProbeContext, ProbeSkipped
from diagnose.record import ProbeResult

if TYPE_CHECKING:
    from diagnose.probes.triton.cases.check import CheckResult
    from diagnose.probes.triton.cases.runner import SuiteResult

#: Distributions that install the ``triton`` module (they overwrite one another).
TRITON_DISTRIBUTIONS: tuple[str, ...] = (
    "triton",
    "pytorch-triton-rocm",
    "pytorch-triton",
    "pytorch-triton-xpu",
    "triton-rocm",
)
_REQUIREMENT = re.compile(
    r"^\s*(?P<name>triton|pytorch-triton(?:-rocm|-xpu)?)\s*(?:\[[^\]]*\])?\s*"
    r"(?:==\s*(?P<version>[^\s;,]+))?"
)


@dataclass
class TritonEnvironment:
    """Which Triton is installed, which one torch expects, and where compiled kernels are kept."""

    torch_version: str = ""
    #: "cuda 12.8", "rocm 6.4.43482" or "cpu".
    torch_build: str = ""
    #: The Triton requirement in torch's metadata ("pytorch-triton-rocm==3.4.0; ..."), or "".
    torch_requirement: str = ""
    expected_package: str = ""
    expected_version: str = ""
    #: Installed distributions that provide the ``triton`` module: name -> version.
    installed: dict[str, str] = field(default_factory=dict)
    #: ``triton.__version__`` of the module that imports ("" if it does not).
    triton_version: str = ""
    import_error: str = ""
    import_traceback: str = ""
    cache_dir: str = ""
    inductor_cache_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("import_traceback")
        return data


def parse_torch_requirement(requirements: Sequence[str]) -> tuple[str, str, str]:
    """(requirement line, package, exact version) of the Triton torch's wheel pins, or blanks.

    CUDA wheels of torch require ``triton==X``, ROCm wheels ``pytorch-triton-rocm==X``, nightlies
    ``pytorch-triton==X``; CPU wheels require none. Optional extras ("; extra == ...") are skipped.
    """
    for line in requirements:
        if "extra ==" in line or "extra==" in line:
            continue
        match = _REQUIREMENT.match(line)
        if match:
            return line.strip(), match.group("name"), match.group("version") or ""
    return "", "", ""


def base_version(version: str) -> str:
    """ "3.4.0+gitf7888497" -> "3.4.0": local build tags do not make a different release."""
    return version.split("+", 1)[0].strip()


def collect_environment() -> TritonEnvironment:
    """Read versions from package metadata and import triton (recording a broken import)."""
    import torch

    env = TritonEnvironment(torch_version=torch.__version__)
    if torch.version.hip:
        env.torch_build = f"rocm {torch.version.hip}"
    elif torch.version.cuda:
        env.torch_build = f"cuda {torch.version.cuda}"
    else:
        env.torch_build = "cpu"
    try:
        requirements = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    env.torch_requirement, env.expected_package, env.expected_version = parse_torch_requirement(
        requirements
    )
    for name in TRITON_DISTRIBUTIONS:
        try:
            env.installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        triton = importlib.import_module("triton")
        env.triton_version = str(getattr(triton, "__version__", ""))
    except Exception as exc:  # a broken install raises anything: ImportError, OSError, ...
        env.import_error = f"{type(exc).__name__}: {str(exc).strip()}"
        env.import_traceback = traceback.format_exc()
    env.cache_dir = _triton_cache_dir()
    env.inductor_cache_dir = _inductor_cache_dir()
    return env


def _triton_cache_dir() -> str:
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def _inductor_cache_dir() -> str:
    # Inductor's own cache_dir() (and importing its runtime package) writes
    # TORCHINDUCTOR_CACHE_DIR into the environment; this is its default, read without side effects.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    safe_user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{safe_user}")


@dataclass(frozen=True)
class VersionProblem:
    message: str
    fix: str


def _rocm_index(torch_build: str) -> str:
    match = re.match(r"rocm (\d+)\.(\d+)", torch_build)
    return (
        f"https://download.pytorch.org/whl/rocm{match.group(1)}.{match.group(2)}"
        if match
        else "the ROCm index of download.pytorch.org your torch came from"
    )


def version_problems(env: TritonEnvironment) -> list[VersionProblem]:
    """Mismatches between the installed Triton and the torch beside it (pure)."""
    problems: list[VersionProblem] = []
    installed = env.installed
    rocm = env.torch_build.startswith("rocm")
    want = f"{env.expected_package}=={env.expected_version}" if env.expected_version else ""
    if rocm and "triton" in installed:
        reinstall = (
            f"pip uninstall -y triton pytorch-triton-rocm && pip install "
            f"{want or 'pytorch-triton-rocm'} --index-url {_rocm_index(env.torch_build)}"
        )
        if "pytorch-triton-rocm" in installed:
            problems.append(
                VersionProblem(
                    f"both triton {installed['triton']} and pytorch-triton-rocm "
                    f"{installed['pytorch-triton-rocm']} are installed beside ROCm torch "
                    f"{env.torch_version}: both write the same triton module, so its files are "
                    "a mix of the two",
                    reinstall,
                )
            )
        else:
            problems.append(
                VersionProblem(
                    f"the triton package from PyPI ({installed['triton']}: the build PyTorch "
                    f"pairs with its CUDA wheels) is installed beside ROCm torch "
                    f"{env.torch_version}, which expects {want or 'pytorch-triton-rocm'}",
                    reinstall,
                )
            )
    if env.torch_build.startswith("cuda") and "pytorch-triton-rocm" in installed:
        problems.append(
            VersionProblem(
                f"pytorch-triton-rocm {installed['pytorch-triton-rocm']} (Triton for AMD GPUs) "
                f"is installed beside CUDA torch {env.torch_version}",
                f"pip uninstall -y pytorch-triton-rocm triton && pip install {want or 'triton'}",
            )
        )
    if env.expected_version:
        provider = (
            env.expected_package if env.expected_package in installed else next(iter(installed), "")
        )
        have = installed.get(provider, "")
        if have and base_version(have) != base_version(env.expected_version):
            problems.append(
                VersionProblem(
                    f"torch {env.torch_version} was built with {want}, but {provider} {have} is "
                    "installed: inductor and the Triton runtime may disagree",
                    f"pip install {want}"
                    + (f" --index-url {_rocm_index(env.torch_build)}" if rocm else ""),
                )
            )
    if env.triton_version and installed:
        versions = {base_version(v) for v in installed.values()}
        if base_version(env.triton_version) not in versions:
            problems.append(
                VersionProblem(
                    f"the triton module reports version {env.triton_version} but the installed "
                    f"distributions say {', '.join(f'{k} {v}' for k, v in installed.items())}: "
                    "files from two installs are mixed",
                    "pip uninstall -y "
                    + " ".join(installed)
                    + f" && pip install {want or 'triton'}",
                )
            )
    return problems


# --- findings -----------------------------------------------------------------------------------


def _check_evidence(check: CheckResult) -> dict[str, Any]:
    return {
        "case": check.case,
        "kind": check.kind,
        "shape": dict(check.shape),
        "dtype": check.dtype,
        "output": check.output,
        "worst_ratio": check.worst_ratio,
        "pattern": check.pattern,
        "rel_l2": check.rel_l2,
        "max_abs": check.max_abs,
        "wrong_elements": check.wrong_elements,
        "numel": check.numel,
        "first_wrong_index": check.first_wrong_index,
        "expected": check.expected,
        "actual": check.actual,
        "bound": check.bound,
        "precision": check.precision,
        "mode": check.mode,
        "backend": check.backend,
        "run_seed": check.run_seed,
        "check_seed": check.seed,
        "message": check.message,
    }


def _where(suite: SuiteResult) -> str:
    if suite.mode == "interpreter":
        return "interpreter mode: kernel logic only"
    return f"compiled for {suite.arch or suite.device}, {suite.backend} backend"


def judge_suite(suite: SuiteResult, env: TritonEnvironment) -> ProbeResult:
    """Every question the probe asks, answered from one suite run and the installation (pure):
    wrong answers (``triton.miscompile``), kernels that do not build or run
    (``triton.compile_error``), and the Triton/torch pairing (``triton.version_mismatch``)."""
    result = ProbeResult(name="triton")
    # A case error is a bug of the check itself: it answers neither kernel question.
    ran = [c for c in suite.checks if c.verdict not in ("unsupported", "case_error")]
    passed = [c for c in suite.checks if c.verdict in ("pass", "drift")]
    expected = (env.expected_package, env.expected_version)
    mismatches = [c for c in suite.checks if c.verdict == "mismatch"]
    if mismatches:
        first = mismatches[0]
        evidence = _check_evidence(first)
        # The run's seed: `diagnose triton --seed N` draws the same inputs again.
        evidence["seed"] = first.run_seed
        evidence["seeds"] = list(suite.seeds)
        evidence["triton_version"] = env.triton_version
        evidence["failing_checks"] = [
            {
                "check": c.label,
                "seed": c.run_seed,
                "pattern": c.pattern,
                "worst_ratio": c.worst_ratio,
                "first_wrong_index": c.first_wrong_index,
            }
            for c in mismatches
        ]
        inductor = any(c.kind == "inductor" for c in mismatches)
        # Code that training runs: a GPU kernel, or inductor's output on any device.
        runs_in_training = any(c.mode == "device" or c.kind == "inductor" for c in mismatches)
        result.add_finding(
            miscompile_finding(
                wrong=len(mismatches),
                cases=sorted({c.case for c in mismatches}),
                patterns=[c.pattern for c in mismatches],
                where=_where(suite),
                runs_in_training=runs_in_training,
                interpreted=suite.mode == "interpreter",
                inductor=inductor,
                seed=first.run_seed,
                cache_dirs=[env.cache_dir, env.inductor_cache_dir if inductor else ""],
                expected_package=expected[0],
                expected_version=expected[1],
                first_failure=f"{first.label}: {first.message}",
                evidence=evidence,
            )
        )
    elif passed:
        result.add_ok(MISCOMPILE.id, _passed_line(suite))
    else:
        result.add_not_judged(MISCOMPILE.id, "kernel answers: no kernel check ran here")
    drifted = suite.drifted
    if drifted:
        result.add_finding(
            drift_finding(
                drifted=len(drifted),
                cases=sorted({c.case for c in drifted}),
                worst_ratio=max(c.worst_ratio or 0.0 for c in drifted),
                seeds=seeds_label(suite.seeds),
                rerun_seed=suite.seeds[-1] + 1,
                evidence={
                    "drifting_checks": [
                        {"check": c.label, "seed": c.run_seed, "message": c.message}
                        for c in drifted
                    ],
                    "seeds": list(suite.seeds),
                },
            )
        )
    elif passed:
        closest = max((c.worst_ratio or 0.0) for c in passed)
        result.add_ok(
            DRIFT.id,
            f"no answer drifted beyond its error bound (the passing ones came at most "
            f"{closest:.2g} of it; {seeds_label(suite.seeds)})",
        )
    errors = [c for c in suite.checks if c.verdict in ("compile_error", "launch_error")]
    if errors:
        result.add_finding(
            compile_error_finding(
                failed=len(errors),
                cases=sorted({c.case for c in errors}),
                cache_dir=env.cache_dir,
                expected_package=expected[0],
                expected_version=expected[1],
                first_message=errors[0].message,
                evidence={
                    "mode": suite.mode,
                    "backend": suite.backend,
                    "arch": suite.arch,
                    "triton_version": env.triton_version,
                    "failures": [
                        {"check": c.label, "verdict": c.verdict, "message": c.message}
                        for c in errors
                    ],
                },
            )
        )
    elif ran:
        unsupported = sum(1 for c in suite.checks if c.verdict == "unsupported")
        result.add_ok(
            COMPILE_ERROR.id,
            f"every one of {len(ran)} kernel checks compiled and launched ({_where(suite)})"
            + (f"; {unsupported} not supported in this mode" if unsupported else ""),
        )
    problems = version_problems(env)
    if problems:
        # One finding per id; the first problem is the root one.
        result.add_finding(
            version_mismatch_finding(
                problem=problems[0].message,
                fix=problems[0].fix,
                evidence={
                    "torch": env.torch_version,
                    "torch_build": env.torch_build,
                    "torch_requirement": env.torch_requirement,
                    "installed": dict(env.installed),
                    "triton_version": env.triton_version,
                },
            )
        )
    elif env.expected_version:
        result.add_ok(
            VERSION_MISMATCH.id,
            f"Triton {env.triton_version} is the version torch {env.torch_version} was built "
            f"with ({env.expected_package}=={env.expected_version})",
        )
    else:
        result.add_not_judged(
            VERSION_MISMATCH.id,
            f"Triton version: torch {env.torch_version or '(unknown)'} does not name the Triton "
            "it was built with",
        )
    return result


def _passed_line(suite: SuiteResult) -> str:
    """What passed, by kind: Triton kernels and torch.compile (inductor) checks; and how much of
    the corpus that was, when a time budget cut it short."""
    parts = []
    for kind in ("triton", "inductor"):
        passed = sum(1 for c in suite.checks if c.kind == kind and c.verdict == "pass")
        if not passed:
            continue
        if kind == "triton":
            parts.append(f"Triton: {passed} kernel checks passed ({_where(suite)})")
        else:
            backend = "C++ CPU backend" if suite.mode == "interpreter" else "Triton kernels"
            parts.append(f"torch.compile (inductor, {backend}): {passed} checks passed")
    if suite.planned > len(suite.checks):
        cases = len({c.case for c in suite.checks})
        parts.append(
            f"{len(suite.checks)} of {suite.planned} checks ({cases} case"
            f"{'' if cases == 1 else 's'}) ran within the probe's time budget; `diagnose triton` "
            "runs them all"
        )
    return "; ".join(parts)


def suite_data(suite: SuiteResult, env: TritonEnvironment) -> dict[str, Any]:
    """ProbeResult.data: where it ran, the environment, every check, time per case."""
    per_case: dict[str, dict[str, float | None]] = {}
    for check in suite.checks:
        entry = per_case.setdefault(
            check.case, {"first_call_seconds": None, "compile_seconds": None}
        )
        # Sums over the case's checks; None where nothing was measured (interpreted Triton
        # compiles nothing, so it has no compile time).
        for key in ("first_call_seconds", "compile_seconds"):
            value = getattr(check, key)
            if value is not None:
                entry[key] = (entry[key] or 0.0) + value
    data: dict[str, Any] = suite.to_dict()
    data["environment"] = env.to_dict()
    data["seconds_per_case"] = per_case
    data["mode_note"] = (
        "Triton's interpreter ran the kernels: this checks their logic, not the GPU compiler"
        if suite.mode == "interpreter"
        else f"kernels compiled by Triton's {suite.backend} backend for {suite.arch}"
    )
    data["not_supported"] = [
        {"check": c.label, "reason": c.message} for c in suite.checks if c.verdict == "unsupported"
    ]
    return data


# --- the probe ----------------------------------------------------------------------------------


class TritonProbe:
    """Runs the kernel corpus on the run's device and checks every answer."""

    name = "triton"
    description = (
        "runs Triton and torch.compile kernels typical of LoRA training on this device and checks "
        "each against a float64 CPU reference (silent miscompiles, Triton/torch mismatch)"
    )
    requires_packages: tuple[str, ...] = ("triton",)
    device_kinds: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        seed: int | None = None,
        sources: Sequence[str] | None = None,
        timeout_s: float = 900.0,
        device_kinds: Sequence[str] = (),
    ) -> None:
        #: None: the fixed default seed, so the same stack gives the same verdicts.
        self.seed = seed
        self.sources = tuple(sources) if sources is not None else None
        self.timeout_s = timeout_s
        self.device_kinds = tuple(device_kinds)

    def run(self, ctx: ProbeContext) -> ProbeResult:
        from diagnose.probes.triton.cases.runner import CORPUS, run_suite

        env = collect_environment()
        if env.import_error:
            result = judge_environment_only(env)
            result.status = "error"
            result.reason = f"triton is installed but does not import: {env.import_error}"
            result.traceback = env.import_traceback
            result.data = {"environment": env.to_dict()}
            return result
        suite = run_suite(
            self.sources or CORPUS,
            device=ctx.device,
            seed=self.seed,
            timeout_s=self.timeout_s,
            progress=ctx.progress,
            # On a GPU a cold stack compiles every kernel: within the run's budget the first
            # check of every case runs, and `diagnose triton` runs the whole corpus.
            deadline=ctx.deadline,
        )
        if not suite.ran:
            reasons = sorted({c.message for c in suite.checks})
            raise ProbeSkipped(f"no kernel check can run here: {'; '.join(reasons)}")
        result = judge_suite(suite, env)
        result.data = suite_data(suite, env)
        return result


def judge_environment_only(env: TritonEnvironment) -> ProbeResult:
    """The version question alone, when no kernel could run: the kernel questions are not
    judged."""
    from diagnose.probes.triton.cases.runner import SuiteResult

    return judge_suite(SuiteResult("interpreter", "", "", "", 0, []), env)
