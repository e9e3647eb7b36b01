"""The triton probe's parts: the harness (the plan of checks, the seeds, the exception classes,
loading case modules, the device mode's budget), the environment checks and the findings, on
hand-made cases and results. The probe and the command end to end are ``test_triton_probe.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from diagnose.probes.triton.cases import CheckResult, TritonCase, load_cases
from diagnose.probes.triton.cases.check import (
    DEFAULT_SEED,
    check_seed,
    inductor_cpu_unavailable,
    plan_checks,
    run_seeds,
)
from diagnose.probes.triton.cases.failures import classify_exception, is_fatal_device_error
from diagnose.probes.triton.cases.loading import CaseLoadError
from diagnose.probes.triton.cases.runner import SuiteResult
from diagnose.probes.triton.probe import (
    TritonEnvironment,
    judge_suite,
    parse_torch_requirement,
    version_problems,
)
from tests.conftest import ok_lines, unjudged_lines

pytest.importorskip("triton", reason="the triton package is not installed")


# --- harness pieces -------------------------------------------------------------------------------


def test_plan_adds_gpu_shapes_and_dtypes_only_on_a_device() -> None:
    from diagnose.probes.triton.cases.inductor import CASES as INDUCTOR

    lora = INDUCTOR[0]
    interpreted = plan_checks([lora], "interpreter")
    compiled = plan_checks([lora], "device")
    assert {p.dtype for p in interpreted} == {torch.float32}
    assert {p.dtype for p in compiled} == {torch.float32, torch.float16, torch.bfloat16}
    assert len(compiled) == 3 * (len(lora.shapes) + len(lora.gpu_shapes))
    assert [p.index for p in compiled] == list(range(len(compiled)))
    # Several seeds: whole passes over the cases, one seed after the other.
    seeded = plan_checks([lora], "device", [5, 6])
    assert [p.run_seed for p in seeded] == [5] * len(compiled) + [6] * len(compiled)
    assert [p.index for p in seeded] == list(range(2 * len(compiled)))


def test_seeds_are_fixed_by_default_and_stable_per_check() -> None:
    assert run_seeds(None) == [DEFAULT_SEED]
    assert run_seeds(7, 3) == [7, 8, 9]
    shape = {"n": 10}
    assert check_seed(7, "axpy", shape, torch.float16) == check_seed(
        7, "axpy", shape, torch.float16
    )
    assert check_seed(7, "axpy", shape, torch.float16) != check_seed(
        8, "axpy", shape, torch.float16
    )
    assert check_seed(7, "axpy", shape, torch.float16) != check_seed(
        7, "axpy", shape, torch.float32
    )


def test_exceptions_are_classified() -> None:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    verdict, message = classify_exception(
        OutOfResources(98304, 65536, "shared memory"), "device", "triton"
    )
    assert verdict == "unsupported" and "shared memory" in message
    compile_error = CompilationError("src", object(), "unsupported dtype for tl.dot")  # type: ignore[arg-type]
    assert classify_exception(compile_error, "device", "triton") == (
        "compile_error",
        "CompilationError: unsupported dtype for tl.dot",
    )
    assert classify_exception(NotImplementedError("x"), "interpreter", "triton")[0] == "unsupported"
    assert classify_exception(RuntimeError("Triton Error [CUDA]: boom"), "device", "triton")[0] == (
        "launch_error"
    )
    assert is_fatal_device_error(
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert not is_fatal_device_error("RuntimeError: out of memory")


def test_inductor_without_a_cxx_compiler_is_not_supported_here() -> None:
    reason = inductor_cpu_unavailable(("no-such-compiler-for-diagnose",))
    assert reason is not None and "no-such-compiler-for-diagnose" in reason
    assert inductor_cpu_unavailable(("sh",)) is None  # any executable found on PATH counts


def test_load_cases_errors_are_one_line(tmp_path: Path) -> None:
    no_cases = tmp_path / "no_cases.py"
    no_cases.write_text("X = 1\n")
    wrong_type = tmp_path / "wrong_type.py"
    wrong_type.write_text("CASES = [1, 2]\n")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('broken on purpose')\n")
    expected = {
        no_cases: "defines no CASES list",
        wrong_type: "CASES must be a list of TritonCase",
        raising: "RuntimeError: broken on purpose",
        tmp_path / "missing.py": "no such file",
    }
    for path, text in expected.items():
        with pytest.raises(CaseLoadError, match=text) as info:
            load_cases(str(path))
        assert "\n" not in str(info.value)
    with pytest.raises(CaseLoadError, match="no such module"):
        load_cases("no_such_module_for_diagnose_tests")


def test_user_case_module_loads_from_a_file(tmp_path: Path) -> None:
    module = tmp_path / "user_cases.py"
    module.write_text(
        textwrap.dedent(
            """
            from diagnose.probes.triton.cases import TritonCase, random_tensor
            CASES = [TritonCase(
                name="eager_double",
                make_inputs=lambda shape, dtype, gen: {"x": random_tensor((3,), dtype, gen)},
                launch=lambda inputs, outputs: {"out": 2 * inputs["x"]},
                reference=lambda inputs: {"out": 2 * inputs["x"]},
                shapes=[{"n": 3}],
            )]
            """
        )
    )
    [case] = load_cases(str(module))
    assert isinstance(case, TritonCase) and case.name == "eager_double"


_EAGER_CASES = textwrap.dedent(
    """
    from diagnose.probes.triton.cases import OutputSpec, TritonCase, random_tensor

    def fault(inputs, outputs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def fill(inputs, outputs):
        outputs["out"].copy_(inputs["x"] * 3)

    def inputs(shape, dtype, gen):
        return {"x": random_tensor((shape["n"],), dtype, gen)}

    def case(name, launch):
        return TritonCase(
            name=name, make_inputs=inputs, launch=launch,
            reference=lambda i: {"out": i["x"] * 3},
            outputs_for=lambda shape, dtype: {"out": OutputSpec((shape["n"],))},
            shapes=[{"n": 5}], gpu_shapes=[{"n": 7}],
        )

    CASES = [case("fine", fill), case("faults", fault), case("after", fill)]
    """
)


def test_device_mode_times_the_compile_and_stops_after_a_fault(tmp_path: Path) -> None:
    """The in-process (GPU) path, on plain torch ops: no GPU needed to follow its logic."""
    from diagnose.probes.triton.cases.runner import _run_in_process

    module = tmp_path / "eager_cases.py"
    module.write_text(_EAGER_CASES)
    checks, ran, planned = _run_in_process(
        [str(module)], torch.device("cpu"), "cuda", "sm_90", [1], None, 900.0
    )
    assert ran == [1] and planned == len(checks)
    # Every case's first check, then the rest (gpu_shapes run in device mode).
    assert [(c.case, c.shape["n"], c.verdict) for c in checks] == [
        ("fine", 5, "pass"),
        ("faults", 5, "launch_error"),
        ("after", 5, "launch_error"),
        ("fine", 7, "launch_error"),
        ("faults", 7, "launch_error"),
        ("after", 7, "launch_error"),
    ]
    assert checks[0].compile_seconds is not None and checks[0].mode == "device"
    assert "illegal memory access" in checks[1].message
    assert all(c.message.startswith("not run: the GPU faulted in faults") for c in checks[2:])


_TWO_FINE_CASES = _EAGER_CASES.replace(
    'CASES = [case("fine", fill), case("faults", fault), case("after", fill)]',
    'CASES = [case("fine", fill), case("also", fill)]',
)


def test_device_mode_starts_no_seed_past_its_time_budget(tmp_path: Path) -> None:
    """Seed by seed: whole passes, the first seed always, none started once the budget is spent;
    a check compiled under an earlier seed is not timed as compiling again."""
    from diagnose.probes.triton.cases.runner import _run_in_process

    module = tmp_path / "eager_cases.py"
    module.write_text(_TWO_FINE_CASES)
    args = ([str(module)], torch.device("cpu"), "cuda", "sm_90", [1, 2, 3], None)
    spent, ran, planned = _run_in_process(*args, 0.0)
    assert ran == [1] and {c.run_seed for c in spent} == {1} and len(spent) == planned == 4
    whole, ran, planned = _run_in_process(*args, 900.0)
    assert ran == [1, 2, 3] and len(whole) == planned == 12
    assert all(c.verdict == "pass" for c in whole)
    assert all((c.compile_seconds is None) == (c.run_seed != 1) for c in whole)


def test_a_probe_budget_that_runs_out_stops_within_the_pass_and_says_how_much_ran(
    tmp_path: Path,
) -> None:
    """The run's Triton probe on a GPU holds to its time budget check by check: once it has
    passed, no check starts (the first always does), and the pass's order has judged every
    case's first check before any second one. What passed says how much of the corpus that was;
    with the budget left, every check runs and nothing is said of it."""
    import time

    from diagnose.probes.triton.cases.runner import _run_in_process

    module = tmp_path / "eager_cases.py"
    module.write_text(_TWO_FINE_CASES)
    args = ([str(module)], torch.device("cpu"), "cuda", "sm_90", [1], None, 900.0)
    spent = time.perf_counter()
    checks, ran, planned = _run_in_process(*args, spent)
    assert ran == [1] and planned == 4 and [c.case for c in checks] == ["fine"]
    suite = SuiteResult("device", "cuda", "sm_90", "cuda:0", 1, [str(module)], planned=planned)
    suite.checks = checks
    [line] = [x for x in ok_lines(judge_suite(suite, TritonEnvironment())) if "time budget" in x]
    assert "1 of 4 checks (1 case) ran within the probe's time budget" in line
    assert "`diagnose triton` runs them all" in line
    whole, ran, planned = _run_in_process(*args, time.perf_counter() + 3600)
    assert planned == len(whole) == 4 and [c.case for c in whole[:2]] == ["fine", "also"]
    suite = SuiteResult("device", "cuda", "sm_90", "cuda:0", 1, [str(module)])
    suite.checks = whole
    assert not any("time budget" in x for x in ok_lines(judge_suite(suite, TritonEnvironment())))


def test_seeds_left_out_name_the_budget_that_stopped_them() -> None:
    """A device run says what it left out for time and which budget did it: the probe's deadline,
    or ``diagnose triton --timeout``'s seconds; nothing when everything ran."""
    from diagnose.probes.triton.cases.runner import budget_notes

    by_probe = budget_notes(3, 8, [1, 2, 3], [1], 900.0, probe_budget=True)
    assert by_probe[0].startswith("3 of 8 checks run: the time budget ran out")
    assert by_probe[1] == "seeds 2–3 not run: the probe's time budget was spent after 1 of 3 seeds"
    by_timeout = budget_notes(8, 8, [1, 2, 3], [1, 2], 120.0, probe_budget=False)
    assert by_timeout == ["seed 3 not run: the 120 s time budget was spent after 2 of 3 seeds"]
    assert budget_notes(8, 8, [1, 2], [1, 2], 120.0, probe_budget=True) == []


# --- environment ----------------------------------------------------------------------------------


def test_torch_requirement_is_parsed() -> None:
    cuda = [
        "filelock",
        'triton==3.4.0; platform_system == "Linux" and platform_machine == "x86_64"',
    ]
    assert parse_torch_requirement(cuda)[1:] == ("triton", "3.4.0")
    rocm = ['pytorch-triton-rocm==3.4.0+gitf7888497; platform_system == "Linux"']
    assert parse_torch_requirement(rocm)[1:] == ("pytorch-triton-rocm", "3.4.0+gitf7888497")
    cpu = ["filelock", 'opt-einsum>=3.3; extra == "opt-einsum"']
    assert parse_torch_requirement(cpu) == ("", "", "")


def _rocm_env(**installed: str) -> TritonEnvironment:
    return TritonEnvironment(
        torch_version="2.9.0+rocm6.4",
        torch_build="rocm 6.4.43482",
        expected_package="pytorch-triton-rocm",
        expected_version="3.5.0",
        installed=installed,
        triton_version="3.5.0",
    )


def test_cuda_triton_beside_rocm_torch_is_a_mismatch() -> None:
    [problem] = version_problems(_rocm_env(triton="3.5.0"))
    assert "PyPI" in problem.message and "pytorch-triton-rocm" in problem.message
    assert "download.pytorch.org/whl/rocm6.4" in problem.fix
    both = version_problems(_rocm_env(**{"triton": "3.5.0", "pytorch-triton-rocm": "3.5.0"}))
    assert "both" in both[0].message
    # The clean twin: the ROCm build torch expects.
    assert version_problems(_rocm_env(**{"pytorch-triton-rocm": "3.5.0+gitabc"})) == []


def test_version_other_than_torch_expects_is_a_mismatch() -> None:
    env = TritonEnvironment(
        torch_version="2.8.0+cu128",
        torch_build="cuda 12.8",
        expected_package="triton",
        expected_version="3.4.0",
        installed={"triton": "3.5.1"},
        triton_version="3.5.1",
    )
    [problem] = version_problems(env)
    assert "3.4.0" in problem.message and problem.fix == "pip install triton==3.4.0"
    no_kernels = SuiteResult("device", "cuda", "sm_89", "cuda:0", 1, [])
    findings = judge_suite(no_kernels, env).findings
    assert [f.id for f in findings] == ["triton.version_mismatch"]
    assert findings[0].severity == "warn" and findings[0].category == "triton"
    env.installed = {"triton": "3.4.0"}
    env.triton_version = "3.4.0"
    assert version_problems(env) == []
    judged = judge_suite(no_kernels, env)
    assert [c.id for c in judged.checks if c.outcome == "ok"] == ["triton.version_mismatch"]
    assert any("was built with" in line for line in ok_lines(judged))
    # No kernel ran: the kernel questions are not judged, not answered "fine".
    assert {c.id for c in judged.checks if c.outcome == "not_judged"} == {"triton.miscompile"}


# --- the findings ---------------------------------------------------------------------------------


def _check(
    verdict: str,
    *,
    case: str = "softmax",
    kind: str = "triton",
    mode: str = "device",
    message: str = "",
) -> CheckResult:
    return CheckResult(
        case=case,
        kind=kind,
        shape={"rows": 5, "cols": 77},
        dtype="float16",
        verdict=verdict,  # type: ignore[arg-type]
        mode=mode,
        backend="hip",
        worst_ratio=3e4 if verdict == "mismatch" else 1.5 if verdict == "drift" else 0.2,
        pattern="tail" if verdict == "mismatch" else "isolated" if verdict == "drift" else "",
        rel_l2=0.5 if verdict == "mismatch" else 1e-4,
        first_wrong_index=[0, 76] if verdict in ("mismatch", "drift") else None,
        message=message,
        run_seed=42,
    )


def test_a_device_mismatch_is_a_critical_miscompile() -> None:
    suite = SuiteResult("device", "hip", "gfx1100", "cuda:0", 42, [])
    suite.checks = [_check("pass"), _check("mismatch", message="out: 5 of 385 wrong")]
    result = judge_suite(suite, TritonEnvironment(triton_version="3.5.0"))
    [finding] = result.findings
    assert finding.id == "triton.miscompile" and finding.severity == "critical"
    assert "the tail wrong" in finding.title  # what kind of wrongness
    [drift_line] = [c.text for c in result.checks if c.id == "triton.numeric_drift"]
    assert drift_line.startswith("no answer drifted") and "0.2 of it" in drift_line
    assert finding.evidence["first_wrong_index"] == [0, 76]
    assert finding.evidence["mode"] == "device" and finding.evidence["seed"] == 42
    assert finding.evidence["case"] == "softmax" and finding.evidence["dtype"] == "float16"
    assert "--seed 42" in finding.fix
    # Every check compiled and launched; the versions could not be judged without torch's pin.
    assert [c.id for c in result.checks if c.outcome == "ok"] == [
        "triton.numeric_drift",
        "triton.compile_error",
    ]
    assert [c.id for c in result.checks if c.outcome == "not_judged"] == ["triton.version_mismatch"]


def test_compile_and_launch_errors_are_warnings() -> None:
    suite = SuiteResult("device", "hip", "gfx1100", "cuda:0", 1, [])
    suite.checks = [_check("compile_error", message="CompilationError: x"), _check("launch_error")]
    [finding] = judge_suite(suite, TritonEnvironment()).findings
    assert finding.id == "triton.compile_error" and finding.severity == "warn"
    assert len(finding.evidence["failures"]) == 2


def test_drift_is_an_info_finding_with_a_rerun_and_no_failure() -> None:
    suite = SuiteResult("device", "cuda", "sm_90", "cuda:0", 42, [])
    suite.checks = [_check("pass"), _check("drift", message="out: 2 isolated elements")]
    assert suite.failed == []  # drift is not a failure: `diagnose triton` exits 0
    result = judge_suite(suite, TritonEnvironment(triton_version="3.6.0"))
    [finding] = result.findings
    assert finding.id == "triton.numeric_drift" and finding.severity == "info"
    assert "1.5×" in finding.title and "--seed 43" in finding.fix
    # The answers were not wrong: the miscompile question is answered "fine".
    assert any(c.id == "triton.miscompile" and c.outcome == "ok" for c in result.checks)


def test_all_passing_gives_a_checked_ok_line_and_no_finding() -> None:
    suite = SuiteResult("interpreter", "interpreter", "", "cpu", 1, [])
    suite.checks = [_check("pass", mode="interpreter") for _ in range(23)] + [
        _check("unsupported", mode="interpreter")
    ]
    result = judge_suite(suite, TritonEnvironment())
    assert result.findings == []
    [passed] = [c for c in result.checks if c.id == "triton.miscompile"]
    assert passed.outcome == "ok"
    assert passed.text == "Triton: 23 kernel checks passed (interpreter mode: kernel logic only)"
    assert any("1 not supported" in line for line in ok_lines(result))
    assert unjudged_lines(result) and all("Triton version" in x for x in unjudged_lines(result))
