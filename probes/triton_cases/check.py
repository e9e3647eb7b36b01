"""The harness: run each case on fresh inputs, compare with a float64 CPU reference, give a verdict.

Pure parts (tolerances, :func:`compare`, :func:`classify_exception`, :func:`plan_checks`) are kept
apart from the launching so the tolerance logic can be tested on plain tensors.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import shutil
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from diagnose.probes.triton_cases.api import (
    CheckEnv,
    Mode,
    OutputSpec,
    Shape,
    Tensors,
    TritonCase,
    dtype_name,
    shape_label,
)

#: pass: within tolerance. mismatch: wrong numbers (or an element never written).
#: compile_error / launch_error: the kernel failed to build / to run. unsupported: cannot run here
#: (reason given). case_error: the case itself broke (its input generator or reference raised).
Verdict = Literal["pass", "mismatch", "compile_error", "launch_error", "unsupported", "case_error"]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
#: Verdicts that mean "this check failed" (the exit code of `diagnose triton`).
FAILING: frozenset[str] = frozenset({"mismatch", "compile_error", "launch_error", "case_error"})


# --- tolerances ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """Limits on the error of one output against its float64 reference.

    ``rel_l2`` bounds ‖out − ref‖/‖ref‖. Each element must also satisfy
    |out − ref| ≤ atol·rms(ref) + rtol·|ref|: the absolute part is relative to the reference's
    RMS because a matmul's error scales with the size of the whole row, not of the element (an
    output near zero has the same absolute error as a large one).
    """

    name: str
    rel_l2: float
    rtol: float
    atol: float


#: The numbers come from the unit roundoff u of the format the result is rounded to (or the
#: operands are multiplied in) and stay a few times above what correct kernels show, far below
#: what a miscompile gives (errors of order 1, or NaN).
TOLERANCES: dict[str, Tolerance] = {
    # Reductions in fp32 show ~1e-7; even the GPU's approximate exp/rsqrt stay near 2^-22.
    "fp32": Tolerance("fp32", rel_l2=1e-5, rtol=1e-4, atol=1e-5),
    # tf32 keeps 10 mantissa bits (u = 2^-11 ≈ 4.9e-4): a tl.dot shows ‖err‖/‖ref‖ ≈ 3e-4 with
    # round-to-nearest and up to ~8e-4 where the operands are truncated.
    "tf32": Tolerance("tf32", rel_l2=2e-3, rtol=2e-2, atol=5e-3),
    # fp16 output rounding is u = 2^-11; attention also rounds P to fp16 before P·V.
    "fp16": Tolerance("fp16", rel_l2=2e-3, rtol=5e-3, atol=2e-3),
    # bf16 keeps 8 bits (u = 2^-8 ≈ 3.9e-3): a correct kernel shows 1e-3 to 4e-3.
    "bf16": Tolerance("bf16", rel_l2=1e-2, rtol=3e-2, atol=2e-2),
    "fp64": Tolerance("fp64", rel_l2=1e-10, rtol=1e-9, atol=1e-10),
    # Integer and boolean outputs must match exactly.
    "exact": Tolerance("exact", rel_l2=0.0, rtol=0.0, atol=0.0),
}

_DEFAULT_TOLERANCE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


def tolerance_name(case: TritonCase, dtype: torch.dtype, env: CheckEnv) -> str:
    """The tolerance a check is judged by: the case's override, else the dtype's default."""
    if dtype in case.tolerance_overrides:
        return str(case.tolerance_overrides[dtype])
    if (
        case.kind == "inductor"
        and dtype == torch.float32
        and env.mode == "device"
        and (
            torch.backends.cuda.matmul.allow_tf32
            or torch.get_float32_matmul_precision() != "highest"
        )
    ):
        # The user (or their trainer) allowed TF32: inductor's matmuls use it, rightly.
        return "tf32"
    return _DEFAULT_TOLERANCE.get(dtype, "exact")


@dataclass
class Comparison:
    """How one output compares with its reference."""

    ok: bool
    rel_l2: float
    max_abs: float
    #: max |out − ref| / max(|ref|, rms(ref)): relative error that does not blow up near zero.
    max_rel: float
    wrong_elements: int
    numel: int
    #: Index (in the output's shape) of the first wrong element in row-major order, or None.
    first_wrong_index: list[int] | None = None
    expected: float | None = None
    actual: float | None = None
    message: str = ""


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare ``out`` with ``ref`` (any device/dtype) under ``tol``. NaN or Inf never passes."""
    got = out.detach().to("cpu", torch.float64)
    want = ref.detach().to("cpu", torch.float64)
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(
            ok=False,
            rel_l2=math.inf,
            max_abs=math.inf,
            max_rel=math.inf,
            wrong_elements=want.numel(),
            numel=want.numel(),
            message=f"output shape {tuple(got.shape)} != expected {tuple(want.shape)}",
        )
    numel = want.numel()
    if numel == 0:
        return Comparison(ok=True, rel_l2=0.0, max_abs=0.0, max_rel=0.0, wrong_elements=0, numel=0)
    nonfinite = ~torch.isfinite(got)
    diff = (got - want).abs()
    ref_norm = float(want.norm())
    rms = ref_norm / math.sqrt(numel)
    if bool(nonfinite.any()):
        rel_l2 = max_abs = max_rel = math.inf
    else:
        diff_norm = float(diff.norm())
        rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
        max_abs = float(diff.max())
        floor = want.abs().clamp_min(rms if rms > 0 else 1e-300)
        max_rel = float((diff / floor).max())
    bound = tol.atol * rms + tol.rtol * want.abs()
    bad = nonfinite | (diff > bound)
    wrong = int(bad.sum())
    ok = wrong == 0 and rel_l2 <= tol.rel_l2
    first: list[int] | None = None
    if wrong:
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        first = _unravel(flat, tuple(want.shape))
    elif not ok:
        # Within the element bounds but over the norm limit: point at the largest error.
        first = _unravel(int(diff.reshape(-1).argmax()), tuple(want.shape))
    expected = actual = None
    if first is not None:
        expected = float(want[tuple(first)]) if first else float(want)
        actual = float(got[tuple(first)]) if first else float(got)
    return Comparison(
        ok=ok,
        rel_l2=rel_l2,
        max_abs=max_abs,
        max_rel=max_rel,
        wrong_elements=wrong,
        numel=numel,
        first_wrong_index=first,
        expected=expected,
        actual=actual,
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return list(reversed(index))


# --- results ------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """The verdict on one case at one shape and dtype. JSON-serialisable through ``to_dict``."""

    case: str
    kind: str
    shape: dict[str, int]
    dtype: str
    verdict: Verdict
    mode: str
    backend: str
    #: The output the numbers are about: the first failing one, else the one with the largest error.
    output: str = ""
    tolerance: str = ""
    rel_l2: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    wrong_elements: int | None = None
    numel: int | None = None
    first_wrong_index: list[int] | None = None
    expected: float | None = None
    actual: float | None = None
    message: str = ""
    #: The first launch, synchronised: includes the compile (or, interpreted, the whole run).
    first_call_seconds: float | None = None
    #: First launch minus a second one: the compile time (None for interpreted Triton).
    compile_seconds: float | None = None
    #: The seed of this check's inputs (reproduce with the run seed, or look here).
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

    @property
    def label(self) -> str:
        return f"{self.case.name} [{dtype_name(self.dtype)}, {shape_label(self.shape)}]"


def plan_checks(cases: Sequence[TritonCase], mode: Mode) -> list[PlannedCheck]:
    """Every (case, dtype, shape) to run, in a fixed order: the same cases give the same indices."""
    planned: list[PlannedCheck] = []
    for case in cases:
        shapes = list(case.shapes) + (list(case.gpu_shapes) if mode == "device" else [])
        dtypes = list(case.dtypes)
        if mode == "device":
            dtypes += [d for d in case.gpu_dtypes if d not in dtypes]
        for dtype in dtypes:
            for shape in shapes:
                planned.append(PlannedCheck(len(planned), case, dict(shape), dtype))
    return planned


def check_seed(run_seed: int, case: str, shape: Shape, dtype: torch.dtype) -> int:
    """A per-check seed: stable for a run seed, independent of which other checks run."""
    key = f"{run_seed}:{case}:{shape_label(shape)}:{dtype_name(dtype)}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


# --- errors -------------------------------------------------------------------------------------

#: Messages after which a GPU context is unusable: every later launch in the process would fail.
_FATAL_DEVICE_ERRORS = (
    "illegal memory access",
    "illegal address",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "memory access fault",
    "device-side assert",
    "hiperrorillegaladdress",
    "hiperrorlaunchfailure",
)
_COMPILE_ERROR_TYPES = {
    "CompilationError",
    "CompileTimeAssertionFailure",
    "UnsupportedLanguageConstruct",
    "PTXASError",
    "BackendCompilerFailed",
    "InductorError",
    "LoweringException",
    "CppCompileError",
    "CUDACompileError",
}
#: The interpreter's stand-ins for tl.static_assert / tl.device_assert at compile time.
_STATIC_ASSERTS = {"_new_static_assert", "static_assert"}
_COMPILER_PATHS = (
    "/triton/compiler/",
    "/triton/language/",
    # The backends' compiler.py, not their driver.py: the driver launches.
    "/triton/backends/nvidia/compiler.py",
    "/triton/backends/amd/compiler.py",
)


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, at most 500 characters."""
    detail = getattr(exc, "error_message", None)
    if "CompilationError" in _type_names(exc) and isinstance(detail, str) and detail.strip():
        # Triton's message starts with the source excerpt; the reason is its error_message.
        text = detail.strip()
    else:
        text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    message = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return message[:500]


def _type_names(exc: BaseException) -> set[str]:
    return {klass.__name__ for klass in type(exc).__mro__}


def classify_exception(exc: BaseException, mode: Mode, kind: str) -> tuple[Verdict, str]:
    """Which verdict an exception raised by a launch means, and the one-line message."""
    if "InterpreterError" in _type_names(exc) and exc.__cause__ is not None:
        # The interpreter wraps what the kernel raised; judge that.
        exc = exc.__cause__
    message = first_line(exc)
    names = _type_names(exc)
    if "OutOfResources" in names:
        return "unsupported", f"needs more on-chip resources than this device has: {message}"
    if "InvalidCxxCompiler" in names:
        return "unsupported", f"inductor's CPU backend has no C++ compiler: {message}"
    if mode == "interpreter" and "NotImplementedError" in names:
        return "unsupported", f"Triton's interpreter does not implement this: {message}"
    if names & _COMPILE_ERROR_TYPES:
        return "compile_error", message
    frames = traceback.extract_tb(exc.__traceback__)
    # The innermost frame decides: raised by the compiler (or, interpreted, by the language's
    # semantic checks or a static_assert, which the compiler would reject) or while running.
    if frames:
        innermost = frames[-1]
        path = innermost.filename.replace("\\", "/")
        if any(part in path for part in _COMPILER_PATHS) or innermost.name in _STATIC_ASSERTS:
            return "compile_error", message
    return "launch_error", message


def is_fatal_device_error(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _FATAL_DEVICE_ERRORS)


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


def _allocate(specs: Mapping[str, OutputSpec], dtype: torch.dtype, device: torch.device) -> Tensors:
    buffers: Tensors = {}
    for name, spec in specs.items():
        out_dtype = spec.dtype or dtype
        if spec.fill == "zero":
            buffers[name] = torch.zeros(spec.shape, dtype=out_dtype, device=device)
        elif out_dtype.is_floating_point or out_dtype.is_complex:
            buffers[name] = torch.full(spec.shape, math.nan, dtype=out_dtype, device=device)
        else:
            # No NaN for integers: the most negative value is as unlikely a correct answer.
            low = torch.iinfo(out_dtype).min if out_dtype != torch.bool else True
            buffers[name] = torch.full(spec.shape, low, dtype=out_dtype, device=device)
    return buffers


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Triton launches on the current device: make it the check's one."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        yield


def _launch(check: PlannedCheck, inputs: Tensors, env: CheckEnv) -> tuple[Tensors, float]:
    case = check.case
    specs = case.outputs_for(check.shape, check.dtype) if case.outputs_for else {}
    device_inputs = {k: v.to(env.device, copy=True) for k, v in inputs.items()}
    outputs = _allocate(specs, check.dtype, env.device)
    with _on_device(env.device):
        start = time.perf_counter()
        returned = case.launch(device_inputs, outputs)
        _synchronize(env.device)
        seconds = time.perf_counter() - start
    results = dict(outputs)
    if returned is not None:
        results.update(returned)
    return results, seconds


def _float64_copy(tensors: Tensors) -> Tensors:
    return {
        k: v.detach().to("cpu", torch.float64, copy=True) if v.is_floating_point() else v.clone()
        for k, v in tensors.items()
    }


def run_check(check: PlannedCheck, env: CheckEnv, run_seed: int, state: RunState) -> CheckResult:
    """Run one planned check; every failure becomes a verdict, never an exception."""
    case = check.case
    seed = check_seed(run_seed, case.name, check.shape, check.dtype)
    result = CheckResult(
        case=case.name,
        kind=case.kind,
        shape=dict(check.shape),
        dtype=dtype_name(check.dtype),
        verdict="pass",
        mode=env.mode,
        backend=env.backend if case.kind == "triton" else _inductor_backend(env),
        tolerance=tolerance_name(case, check.dtype, env),
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
        results, result.first_call_seconds = _launch(check, inputs, env)
        if env.mode == "device" or case.kind == "inductor":
            # A second launch of the now-compiled code: the difference is the compile time.
            # (Interpreted Triton compiles nothing, and interpreting twice would only cost.)
            _, steady = _launch(check, inputs, env)
            result.compile_seconds = max(0.0, result.first_call_seconds - steady)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        kind, message = classify_exception(exc, env.mode, case.kind)
        if env.mode == "device" and is_fatal_device_error(message):
            state.fatal = f"the GPU faulted in {check.label} ({message}); the context is unusable"
        return verdict(kind, message)

    try:
        expected = dict(case.reference(_float64_copy(inputs)))
    except Exception as exc:
        return verdict("case_error", f"reference raised {first_line(exc)}")
    missing = [name for name in expected if name not in results]
    if missing:
        return verdict("case_error", f"the launch produced no output named {', '.join(missing)}")

    broken = [
        n for n, t in expected.items() if t.is_floating_point() and not bool(t.isfinite().all())
    ]
    if broken:
        return verdict("case_error", f"the reference has NaN or Inf in {', '.join(broken)}")

    worst: tuple[str, Comparison] | None = None
    for name, want in expected.items():
        got = results[name]
        tol = TOLERANCES[result.tolerance if got.is_floating_point() else "exact"]
        comparison = compare(got, want, tol)
        if not comparison.ok:
            worst = (name, comparison)
            break
        if worst is None or comparison.rel_l2 > worst[1].rel_l2:
            worst = (name, comparison)
    if worst is None:
        return verdict("case_error", "the reference returned no outputs")
    name, comparison = worst
    result.output = name
    result.rel_l2 = comparison.rel_l2
    result.max_abs = comparison.max_abs
    result.max_rel = comparison.max_rel
    result.wrong_elements = comparison.wrong_elements
    result.numel = comparison.numel
    result.first_wrong_index = comparison.first_wrong_index
    result.expected = comparison.expected
    result.actual = comparison.actual
    if comparison.ok:
        return result
    return verdict(
        "mismatch",
        comparison.message or _mismatch_message(name, comparison, result.tolerance, check, env),
    )


def _mismatch_message(
    name: str, comparison: Comparison, tol_name: str, check: PlannedCheck, env: CheckEnv
) -> str:
    where = comparison.first_wrong_index
    if comparison.wrong_elements:
        text = f"{name}: {comparison.wrong_elements} of {comparison.numel} elements wrong"
        at = "first at"
    else:
        # Every element within its own bound, but the error as a whole is too large.
        text = f"{name}: ‖err‖/‖ref‖ over the {tol_name} limit"
        at = "largest error at"
    if where is not None and comparison.expected is not None and comparison.actual is not None:
        text += (
            f", {at} {tuple(where)} (expected {comparison.expected:.6g}, got "
            f"{comparison.actual:.6g})"
        )
    text += f"; rel_l2 {comparison.rel_l2:.3g}"
    if env.mode == "interpreter" and check.case.kind == "triton" and check.dtype == torch.bfloat16:
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
    seed: int,
    *,
    start: int = 0,
    on_start: Callable[[PlannedCheck], None] | None = None,
    on_result: Callable[[PlannedCheck, CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run the planned checks from index ``start`` on, in order."""
    state = RunState()
    results = []
    for check in plan_checks(cases, env.mode)[start:]:
        if on_start is not None:
            on_start(check)
        result = run_check(check, env, seed, state)
        if on_result is not None:
            on_result(check, result)
        results.append(result)
    return results


# --- loading user cases -------------------------------------------------------------------------


class CaseLoadError(Exception):
    """A MODULE_OR_FILE that does not give a list of TritonCase (the message is one line)."""


def looks_like_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source or "\\" in source


def validate_source(source: str) -> str:
    """Check a MODULE_OR_FILE without importing it; return it normalised (files made absolute)."""
    if looks_like_file(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise CaseLoadError(f"{source}: no such file")
        if path.suffix != ".py":
            raise CaseLoadError(f"{source}: not a Python file")
        return str(path.resolve())
    try:
        with _cwd_importable():
            spec = importlib.util.find_spec(source)
    except (ImportError, ValueError) as exc:
        raise CaseLoadError(f"{source}: cannot find the module ({first_line(exc)})") from None
    if spec is None:
        raise CaseLoadError(f"{source}: no such module or file")
    return source


@contextmanager
def _cwd_importable() -> Iterator[None]:
    """Modules in the current folder import, as with ``python -m`` (the worker runs that way)."""
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_cases(source: str) -> list[TritonCase]:
    """Import MODULE_OR_FILE and return its module-level ``CASES`` list."""
    source = validate_source(source)
    try:
        if looks_like_file(source):
            module = _import_file(Path(source))
        else:
            with _cwd_importable():
                module = importlib.import_module(source)
    except CaseLoadError:
        raise
    except Exception as exc:
        raise CaseLoadError(f"{source}: importing it raised {first_line(exc)}") from None
    cases = getattr(module, "CASES", None)
    if cases is None:
        raise CaseLoadError(f"{source}: defines no CASES list")
    if not isinstance(cases, (list, tuple)) or not all(isinstance(c, TritonCase) for c in cases):
        raise CaseLoadError(f"{source}: CASES must be a list of TritonCase")
    if not cases:
        raise CaseLoadError(f"{source}: CASES is empty")
    return list(cases)


def _import_file(path: Path) -> Any:
    name = f"_diagnose_cases_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaseLoadError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # Like running a script: the file's folder is importable while it loads (its own helpers).
    folder = str(path.parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
