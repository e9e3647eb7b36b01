"""The harness: run each case on seeded inputs, judge it against its reference, give a verdict.

Pure parts (:func:`classify_exception`, :func:`plan_checks`, the judge in :mod:`~.judge`) are kept
apart from the launching so they can be tested on plain tensors.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from diagnose.catalogs.triton_catalog import DEFAULT_SEED
from diagnose.probes.triton.cases.api import (
    CheckEnv,
    Mode,
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    dtype_name,
    shape_label,
)
from diagnose.probes.triton.cases.failures import (
    classify_exception,
    first_line,
    is_fatal_device_error,
)
from diagnose.probes.triton.cases.judge import OutputJudgement, judge_output
from diagnose.probes.triton.cases.reference_cache import cached_reference

#: pass: every element within its bound. drift: beyond it but within a stated factor, or a handful
#: of isolated elements (:mod:`~.judge`): reported, not a failure. mismatch: wrong numbers (a
#: pattern, far beyond the bound, NaN where the reference is finite, a write outside the output).
#: compile_error / launch_error: the kernel failed to build / to run. unsupported: cannot run here
#: (reason given). case_error: the case itself broke (its input generator or reference raised).
Verdict = Literal[
    "pass", "drift", "mismatch", "compile_error", "launch_error", "unsupported", "case_error"
]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
#: Verdicts that mean "this check failed" (the exit code of `diagnose triton`).
FAILING: frozenset[str] = frozenset({"mismatch", "compile_error", "launch_error", "case_error"})


def run_seeds(seed: int | None, count: int = 1) -> list[int]:
    """The run seeds of ``count`` runs from ``seed`` (default :data:`DEFAULT_SEED`) on."""
    first = DEFAULT_SEED if seed is None else seed
    return [first + i for i in range(max(1, count))]


# --- results ------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """The verdict on one case at one shape, dtype and seed. JSON-serialisable via ``to_dict``."""

    case: str
    kind: str
    shape: dict[str, int]
    dtype: str
    verdict: Verdict
    mode: str
    backend: str
    #: The output the numbers are about: the one that decided the verdict, else the one that came
    #: nearest its bound.
    output: str = ""
    #: How the reference was made: the rounding steps it declared, or "generic <format> bound".
    precision: str = ""
    #: The largest |out − ref| / bound over the output's elements (above 1: beyond the bound).
    worst_ratio: float | None = None
    #: What kind of wrongness (judge.OutputJudgement.pattern), "" when it passed.
    pattern: str = ""
    rel_l2: float | None = None
    max_abs: float | None = None
    #: Elements beyond their bound.
    wrong_elements: int | None = None
    numel: int | None = None
    #: Index (in the output's shape) of the first element beyond its bound, row-major, or None.
    first_wrong_index: list[int] | None = None
    expected: float | None = None
    actual: float | None = None
    #: The bound at that element.
    bound: float | None = None
    message: str = ""
    #: The first launch, synchronised: includes the compile (or, interpreted, the whole run).
    first_call_seconds: float | None = None
    #: First launch minus a second one: the compile time (None for interpreted Triton).
    compile_seconds: float | None = None
    #: The run's seed (``diagnose triton --seed N`` draws the same inputs again).
    run_seed: int = DEFAULT_SEED
    #: The seed of this check's own inputs, derived from the run seed.
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.case} [{self.dtype}, {shape_label(self.shape)}]"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# --- planning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedCheck:
    index: int
    case: TritonCase
    shape: Shape
    dtype: torch.dtype
    run_seed: int = DEFAULT_SEED

    @property
    def label(self) -> str:
        return f"{self.case.name} [{dtype_name(self.dtype)}, {shape_label(self.shape)}]"


def plan_checks(
    cases: Sequence[TritonCase], mode: Mode, seeds: Sequence[int] = (DEFAULT_SEED,)
) -> list[PlannedCheck]:
    """Every (seed, case, dtype, shape) to run, in a fixed order: the same cases and seeds give
    the same indices. Seed by seed, so a run cut short has whole passes over the cases; within a
    seed, every case's first check (its first dtype at its first shape) comes before any case's
    second, so a pass cut short by a time budget has still compiled and judged every kernel."""
    planned: list[PlannedCheck] = []
    for run_seed in seeds:
        combos = [
            [(dtype, shape) for dtype in _dtypes(case, mode) for shape in _shapes(case, mode)]
            for case in cases
        ]
        order = [(case, combo[0]) for case, combo in zip(cases, combos, strict=True) if combo]
        order += [
            (case, one) for case, combo in zip(cases, combos, strict=True) for one in combo[1:]
        ]
        for case, (dtype, shape) in order:
            planned.append(PlannedCheck(len(planned), case, dict(shape), dtype, run_seed))
    return planned


def _shapes(case: TritonCase, mode: Mode) -> list[Shape]:
    return list(case.shapes) + (list(case.gpu_shapes) if mode == "device" else [])


def _dtypes(case: TritonCase, mode: Mode) -> list[torch.dtype]:
    dtypes = list(case.dtypes)
    if mode == "device":
        dtypes += [d for d in case.gpu_dtypes if d not in dtypes]
    return dtypes


def check_seed(run_seed: int, case: str, shape: Shape, dtype: torch.dtype) -> int:
    """A per-check seed: stable for a run seed, independent of which other checks run."""
    key = f"{run_seed}:{case}:{shape_label(shape)}:{dtype_name(dtype)}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


# --- inductor on the CPU ------------------------------------------------------------------------


def inductor_cpu_unavailable(candidates: Sequence[str | None] | None = None) -> str | None:
    """Why inductor's CPU backend cannot build here (no C++ compiler), or None if it can."""
    if candidates is None:
        from diagnose.torch_compat import inductor_cxx_compilers

        candidates = inductor_cxx_compilers()
    names = [c for c in candidates if c]
    if any(shutil.which(name) for name in names):
        return None
    return (
        f"inductor's CPU backend needs a C++ compiler and none of {', '.join(names) or 'g++'} "
        "is on PATH (install g++, or set CXX)"
    )


# --- running ------------------------------------------------------------------------------------


@dataclass
class RunState:
    """What one sequence of checks carries from one check to the next."""

    #: Set after a fault that leaves the GPU context unusable: later checks are not run.
    fatal: str = ""
    inductor_reason: str | None = field(default=None)
    inductor_checked: bool = False
    #: Checks (case, dtype, shape) launched under an earlier seed: compiled, not timed again.
    seen: set[str] = field(default_factory=set)


#: Poisoned elements around every output buffer: a write that lands there went outside the output
#: (an unmasked tail, a wrong offset). A multiple of 16 bytes, so alignment is unchanged.
GUARD_ELEMENTS = 64


@dataclass
class _Buffer:
    """An output buffer: the output view inside a guarded allocation."""

    whole: torch.Tensor
    numel: int

    def outside_writes(self) -> int:
        guards = torch.cat([self.whole[:GUARD_ELEMENTS], self.whole[GUARD_ELEMENTS + self.numel :]])
        poison = _poison(guards.dtype)
        if guards.dtype.is_floating_point:
            return int((~torch.isnan(guards)).sum())
        return int((guards != poison).sum())


def _poison(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    # No NaN for integers: the most negative value is as unlikely a correct answer.
    return torch.iinfo(dtype).min if dtype != torch.bool else True


def _allocate(
    specs: Mapping[str, OutputSpec], dtype: torch.dtype, device: torch.device
) -> tuple[Tensors, dict[str, _Buffer]]:
    outputs: Tensors = {}
    buffers: dict[str, _Buffer] = {}
    for name, spec in specs.items():
        out_dtype = spec.dtype or dtype
        numel = math.prod(spec.shape)
        whole = torch.full(
            (numel + 2 * GUARD_ELEMENTS,), _poison(out_dtype), dtype=out_dtype, device=device
        )
        view = whole[GUARD_ELEMENTS : GUARD_ELEMENTS + numel].view(spec.shape)
        if spec.fill == "zero":
            view.zero_()
        outputs[name] = view
        buffers[name] = _Buffer(whole, numel)
    return outputs, buffers


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Triton launches on the current device: make it the check's one."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        yield


@dataclass
class _Launched:
    results: Tensors
    buffers: dict[str, _Buffer]
    seconds: float


def _launch(check: PlannedCheck, inputs: Tensors, env: CheckEnv) -> _Launched:
    case = check.case
    specs = case.outputs_for(check.shape, check.dtype) if case.outputs_for else {}
    device_inputs = {k: v.to(env.device, copy=True) for k, v in inputs.items()}
    outputs, buffers = _allocate(specs, check.dtype, env.device)
    with _on_device(env.device):
        start = time.perf_counter()
        returned = case.launch(device_inputs, outputs)
        _synchronize(env.device)
        seconds = time.perf_counter() - start
    results = dict(outputs)
    if returned is not None:
        results.update(returned)
    return _Launched(results, buffers, seconds)


_SEVERITY = {"pass": 0, "drift": 1, "mismatch": 2}


def _decisive(judgements: Sequence[OutputJudgement]) -> OutputJudgement:
    """The output that decides the check: the worst verdict, then the largest excess."""
    return max(judgements, key=lambda j: (_SEVERITY[j.verdict], j.worst_ratio))


def run_check(check: PlannedCheck, env: CheckEnv, state: RunState) -> CheckResult:
    """Run one planned check; every failure becomes a verdict, never an exception."""
    case = check.case
    seed = check_seed(check.run_seed, case.name, check.shape, check.dtype)
    result = CheckResult(
        case=case.name,
        kind=case.kind,
        shape=dict(check.shape),
        dtype=dtype_name(check.dtype),
        verdict="pass",
        mode=env.mode,
        backend=env.backend if case.kind == "triton" else _inductor_backend(env),
        run_seed=check.run_seed,
        seed=seed,
    )

    def verdict(kind: Verdict, message: str) -> CheckResult:
        result.verdict = kind
        result.message = message
        return result

    if state.fatal:
        return verdict("launch_error", f"not run: {state.fatal}")
    reason = case.unsupported(env, check.dtype) if case.unsupported is not None else None
    if reason is None and case.kind == "inductor" and env.device.type == "cpu":
        if not state.inductor_checked:
            state.inductor_reason = inductor_cpu_unavailable()
            state.inductor_checked = True
        reason = state.inductor_reason
    if reason:
        return verdict("unsupported", reason)

    generator = torch.Generator().manual_seed(seed)
    try:
        inputs = case.make_inputs(check.shape, check.dtype, generator)
    except Exception as exc:
        return verdict("case_error", f"make_inputs raised {first_line(exc)}")
    zero_inputs = [k for k, v in inputs.items() if v.is_floating_point() and not bool(v.any())]
    if zero_inputs:
        return verdict("case_error", f"input(s) {', '.join(zero_inputs)} are all zeros")

    try:
        launched = _launch(check, inputs, env)
        result.first_call_seconds = launched.seconds
        first_of_seeds = check.label not in state.seen
        state.seen.add(check.label)
        if first_of_seeds and (env.mode == "device" or case.kind == "inductor"):
            # A second launch of the now-compiled code: the difference is the compile time.
            # (Interpreted Triton compiles nothing, and interpreting twice would only cost.)
            steady = _launch(check, inputs, env).seconds
            result.compile_seconds = max(0.0, launched.seconds - steady)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        kind, message = classify_exception(exc, env.mode, case.kind)
        if env.mode == "device" and is_fatal_device_error(message):
            state.fatal = f"the GPU faulted in {check.label} ({message}); the context is unusable"
        return verdict(kind, message)

    try:
        expected, result.precision = cached_reference(
            case, inputs, check.dtype, env, shape=check.shape, seed=seed
        )
    except Exception as exc:
        return verdict("case_error", f"reference raised {first_line(exc)}")
    results = launched.results
    missing = [name for name in expected if name not in results]
    if missing:
        return verdict("case_error", f"the launch produced no output named {', '.join(missing)}")
    broken = [
        n
        for n, t in expected.items()
        if t.value.is_floating_point() and not bool(t.value.isfinite().all())
    ]
    if broken:
        return verdict("case_error", f"the reference has NaN or Inf in {', '.join(broken)}")
    if not expected:
        return verdict("case_error", "the reference returned no outputs")

    judgements = [
        judge_output(
            name,
            results[name],
            want,
            launched.buffers[name].outside_writes() if name in launched.buffers else 0,
        )
        for name, want in expected.items()
    ]
    judged = _decisive(judgements)
    result.output = judged.name
    result.worst_ratio = judged.worst_ratio
    result.pattern = judged.pattern
    result.rel_l2 = judged.rel_l2
    result.max_abs = judged.max_abs
    result.wrong_elements = judged.beyond
    result.numel = judged.numel
    result.first_wrong_index = judged.first_index
    result.expected = judged.expected
    result.actual = judged.actual
    result.bound = judged.bound
    if judged.verdict == "pass":
        return result
    return verdict(judged.verdict, _verdict_message(judged, check, env))


def _verdict_message(judged: OutputJudgement, check: PlannedCheck, env: CheckEnv) -> str:
    text = f"{judged.name}: {judged.detail}"
    where = judged.first_index
    if where is not None and judged.expected is not None and judged.actual is not None:
        bound = f" ± {judged.bound:.2g}" if judged.bound is not None else ""
        text += (
            f"; first at {tuple(where)} (expected {judged.expected:.6g}{bound}, got "
            f"{judged.actual:.6g})"
        )
    if math.isfinite(judged.rel_l2):
        text += f"; rel_l2 {judged.rel_l2:.3g}"
    if (
        judged.verdict == "mismatch"
        and env.mode == "interpreter"
        and check.case.kind == "triton"
        and check.dtype == torch.bfloat16
    ):
        # triton-lang/triton#11584, #4972: the interpreter keeps bf16 as raw uint16 bits.
        text += (
            "; note: Triton's interpreter does not do arithmetic on bfloat16 values (cast to "
            "float32 in the kernel), so check this one on a GPU"
        )
    return text


def _inductor_backend(env: CheckEnv) -> str:
    if env.device.type == "cpu":
        return "inductor-cpp"
    return f"inductor-triton-{env.backend}"


def run_checks(
    cases: Sequence[TritonCase],
    env: CheckEnv,
    seeds: Sequence[int],
    *,
    start: int = 0,
    on_start: Callable[[PlannedCheck], None] | None = None,
    on_result: Callable[[PlannedCheck, CheckResult], None] | None = None,
    state: RunState | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[CheckResult]:
    """Run the planned checks from index ``start`` on, in order; ``state`` carries over from an
    earlier call (the checks it compiled). ``stop``: asked before every check after the first;
    once it says so, no further check starts (a time budget that ran out)."""
    state = state if state is not None else RunState()
    results: list[CheckResult] = []
    for check in plan_checks(cases, env.mode, seeds)[start:]:
        if results and stop is not None and stop():
            break
        if on_start is not None:
            on_start(check)
        result = run_check(check, env, state)
        if on_result is not None:
            on_result(check, result)
        results.append(result)
    return results
