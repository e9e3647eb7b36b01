"""The triton probe: planted wrong kernels fire, correct twins stay quiet, verdicts repeat.

Without a GPU everything runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1; this
process's environment must stay untouched, which the conftest guard checks after each test).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from diagnose.cli import all_commands, main
from diagnose.commands import ArgumentParser
from diagnose.commands.triton import CHECKS_FAILED, TritonCommand
from diagnose.config import RunConfig
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.probes.base import Probe, ProbeContext, run_probe
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
from diagnose.probes.triton.cases.runner import SuiteResult, verdict_table
from diagnose.probes.triton.probe import (
    TritonEnvironment,
    TritonProbe,
    judge_suite,
    parse_torch_requirement,
    version_problems,
)
from diagnose.record import DeviceInfo, new_record
from diagnose.record_io import record_from_dict
from tests.conftest import FIXTURES, REPO_ROOT, ok_lines, unjudged_lines

pytest.importorskip("triton", reason="the triton package is not installed")

TRITON_FIXTURES = FIXTURES / "triton"


def _cli(argv: Sequence[str]) -> int:
    """``diagnose.cli.main``, or the command on a local parser while it is not registered yet."""
    if any(command.name == "triton" for command in all_commands()):
        return main(list(argv))
    command = TritonCommand()
    parser = ArgumentParser(prog="diagnose triton")
    command.prepare_parser(parser)
    try:
        return command.run(parser.parse_args(list(argv[1:])))
    except DiagnoseError as exc:
        print(f"diagnose: error: {exc.message}", file=sys.stderr)
        return int(exc.code)


def _cpu_ctx() -> ProbeContext:
    return ProbeContext(
        config=RunConfig(),
        device=torch.device("cpu"),
        device_info=DeviceInfo(kind="cpu"),
        record=new_record("run"),
    )


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
    checks, ran = _run_in_process(
        [str(module)], torch.device("cpu"), "cuda", "sm_90", [1], None, 900.0
    )
    assert ran == [1]
    assert [(c.case, c.shape["n"], c.verdict) for c in checks] == [
        ("fine", 5, "pass"),
        ("fine", 7, "pass"),  # gpu_shapes run in device mode
        ("faults", 5, "launch_error"),
        ("faults", 7, "launch_error"),
        ("after", 5, "launch_error"),
        ("after", 7, "launch_error"),
    ]
    assert checks[0].compile_seconds is not None and checks[0].mode == "device"
    assert "illegal memory access" in checks[2].message
    assert checks[3].message.startswith("not run: the GPU faulted in faults")


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
    spent, ran = _run_in_process(*args, 0.0)
    assert ran == [1] and {c.run_seed for c in spent} == {1} and len(spent) == 4
    whole, ran = _run_in_process(*args, 900.0)
    assert ran == [1, 2, 3] and len(whole) == 12
    assert all(c.verdict == "pass" for c in whole)
    assert all((c.compile_seconds is None) == (c.run_seed != 1) for c in whole)


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


# --- end to end through the CLI (interpreter subprocess) ------------------------------------------

#: wrong_kernels.py: the case and the first element it gets wrong.
_PLANTED = {
    "off_by_one_mask": [999],  # mask `offsets < n - 1`: the last element is never written
    "missing_tail": [768],  # grid n // BLOCK: the partial block 768..999 never runs
    "wrong_reduction_axis": [0],  # column sums stored as row sums
    "partial_write": [0, 64],  # program_id(1) ignored: columns 64.. never written
}
#: The rest of wrong_kernels.py and the kind of wrongness the judge must name.
_PLANTED_PATTERNS = {
    "off_by_one_mask": "nonfinite",
    "missing_tail": "nonfinite",
    "partial_write": "nonfinite",
    "half_precision": "everywhere",  # every element written, fp16-sized errors in fp32
    "masking_bug": "everywhere",  # padding lanes load 0.0, not -inf: every row's sum is off
    "off_by_one_block": "everywhere",  # each program reads the next block
    "wrong_scale": "everywhere",  # exp2 of the logits without log2(e)
    "swapped_strides": "everywhere",
    "unmasked_tail": "outside",  # the last block stores past the end
    "dropped_block": "everywhere",  # the K loop skips its last block
}


def test_planted_wrong_kernels_are_mismatches_at_the_right_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "verdicts.json"
    code = _cli(
        [
            "triton",
            "--cases",
            str(TRITON_FIXTURES / "wrong_kernels.py"),
            "--seed",
            "3",
            "--seeds",
            "2",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == CHECKS_FAILED
    document = json.loads(out.read_text())
    assert document["mode"] == "interpreter" and document["seeds"] == [3, 4]
    checks = document["checks"]
    # Every planted kernel is a mismatch on every seed, and the judge says what kind.
    assert len(checks) == 2 * len(_PLANTED_PATTERNS | _PLANTED)
    assert {c["verdict"] for c in checks} == {"mismatch"}
    for check in checks:
        expected = _PLANTED_PATTERNS.get(check["case"])
        if expected is not None:
            assert check["pattern"] == expected, check
        if check["case"] in _PLANTED:
            assert check["first_wrong_index"] == _PLANTED[check["case"]], check
    half = next(c for c in checks if c["case"] == "half_precision")
    # Precision loss: every element written, fp16-sized errors, thousands of times fp32's bound.
    assert 1e-5 < half["rel_l2"] < 1e-3 and half["worst_ratio"] > 100
    assert "MISMATCH" in printed and "interpreter" in printed and "(999,)" in printed
    assert "writes outside the output" in printed

    # The same results as findings: interpreted Triton is not what training runs, hence "warn".
    suite = SuiteResult("interpreter", "interpreter", "", "cpu", 3, [], seeds=[3, 4])
    suite.checks = [CheckResult.from_dict(c) for c in checks]
    [finding] = judge_suite(suite, TritonEnvironment()).findings
    assert finding.id == "triton.miscompile" and finding.severity == "warn"
    assert finding.evidence["first_wrong_index"] == [999]
    assert len(finding.evidence["failing_checks"]) == len(checks)
    assert "NaN or Inf" in finding.title and "writes outside the output" in finding.title


def test_correct_twins_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code = _cli(["triton", "--cases", str(TRITON_FIXTURES / "good_kernels.py"), "--seeds", "3"])
    printed = capsys.readouterr().out
    assert code == ExitCode.OK, printed
    assert "21 checks: 21 pass" in printed and "seeds 1–3" in printed


@pytest.mark.slow
def test_the_corpus_gives_the_same_verdicts_on_every_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No seed asked for: the fixed default, so two runs print the same bytes (but the time)."""
    printed, verdicts = [], []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        assert _cli(["triton", "--json", str(out)]) == ExitCode.OK
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].endswith(" s)")  # the one line that may differ: how long it took
        printed.append("\n".join(lines[:-1]))
        document = json.loads(out.read_text())
        assert document["seeds"] == [DEFAULT_SEED]
        verdicts.append(
            [
                (c["case"], c["shape"], c["dtype"], c["verdict"], c["worst_ratio"])
                for c in document["checks"]
            ]
        )
    assert printed[0] == printed[1]
    assert verdicts[0] == verdicts[1]
    assert f"seed {DEFAULT_SEED}" in printed[0]


def test_a_crash_and_a_compile_error_cost_only_their_own_checks(tmp_path: Path) -> None:
    out = tmp_path / "verdicts.json"
    code = _cli(
        ["triton", "--cases", str(TRITON_FIXTURES / "failing_kernels.py"), "--json", str(out)]
    )
    assert code == CHECKS_FAILED
    verdicts = {c["case"]: c for c in json.loads(out.read_text())["checks"]}
    assert verdicts["crashes"]["verdict"] == "launch_error"
    assert "SIGABRT" in verdicts["crashes"]["message"]
    assert verdicts["static_assert"]["verdict"] == "compile_error"
    assert "BLOCK must be at most 64" in verdicts["static_assert"]["message"]
    assert verdicts["negate"]["verdict"] == "pass"


def test_bad_case_path_is_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for source in ("fixtures/triton/no_such_file.py", "no_such_module_for_diagnose_tests"):
        assert _cli(["triton", "--cases", source]) == ExitCode.BAD_INPUT
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and source in err


# --- the probe ------------------------------------------------------------------------------------

_HIDE_TRITON = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, sys

    class Hide(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        mode = "missing"
        def find_spec(self, name, path=None, target=None):
            if name != "triton" and not name.startswith("triton."):
                return None
            if self.mode == "missing":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return importlib.machinery.ModuleSpec(name, self)
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            raise ImportError("libtriton.so: cannot open shared object file: No such file")

    hide = Hide()
    sys.meta_path.insert(0, hide)
    import torch
    from diagnose.config import RunConfig
    from diagnose.probes.base import ProbeContext, run_probe
    from diagnose.probes.triton.probe import TritonProbe
    from diagnose.record import DeviceInfo, new_record

    ctx = ProbeContext(RunConfig(), torch.device("cpu"), DeviceInfo(kind="cpu"), new_record("run"))
    for mode in ("missing", "broken"):
        hide.mode = mode
        result = run_probe(TritonProbe(), ctx)
        print(json.dumps({"mode": mode, "status": result.status, "reason": result.reason}))
    """
)


def test_missing_or_broken_triton_is_skipped_or_an_error_with_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HIDE_TRITON],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    results = {r["mode"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
    assert results["missing"]["status"] == "skipped"
    assert results["missing"]["reason"] == "package not installed: triton"
    assert results["broken"]["status"] == "error"
    assert results["broken"]["reason"] == (
        "triton is installed but does not import: ImportError: libtriton.so: cannot open shared "
        "object file: No such file"
    )


@pytest.mark.slow
def test_the_corpus_passes_in_interpreter_mode() -> None:
    probe = TritonProbe()
    assert isinstance(probe, Probe)
    result = run_probe(probe, _cpu_ctx())
    assert result.status == "ok", result.traceback
    checks = [CheckResult.from_dict(c) for c in result.data["checks"]]
    print("\n" + verdict_table(checks))
    print(f"{result.duration_seconds:.1f} s")
    not_passing = [c for c in checks if c.verdict != "pass"]
    # Only bf16 tl.dot cannot run in the interpreter (triton-lang/triton#11584).
    assert all(c.verdict == "unsupported" and c.dtype == "bfloat16" for c in not_passing)
    assert {c.case for c in not_passing} <= {"matmul", "flash_attention"}
    assert result.findings == []
    assert result.data["mode"] == "interpreter"
    assert {c.case for c in checks} >= {
        "axpy",
        "silu_mul",
        "geglu",
        "softmax",
        "layernorm",
        "rmsnorm",
        "groupnorm",
        "matmul",
        "flash_attention",
        "atomic_reduction",
        "compiled_lora_linear",
        "compiled_attention_block",
    }
    environment = result.data["environment"]
    assert environment["triton_version"] and environment["cache_dir"]
    assert set(result.data["seconds_per_case"]) == {c.case for c in checks}
    passed = sum(1 for c in checks if c.kind == "triton" and c.verdict == "pass")
    assert any(
        line.startswith(f"Triton: {passed} kernel checks passed (interpreter mode")
        for line in ok_lines(result)
    )
    # The record carrying it still serialises (NaN-free) and loads back.
    record = new_record("run")
    record.probes.append(result)
    assert record_from_dict(json.loads(record.to_json())).probes[0].data["mode"] == "interpreter"


def _signatures(d: str) -> list[tuple[str, str, dict[str, str], dict[str, object]]]:
    """(module, kernel, signature, constexprs) of every corpus kernel for element type ``d``."""
    p, i = "*" + d, "i32"

    def ints(*names: str) -> dict[str, str]:
        return dict.fromkeys(names, i)

    def const(**values: object) -> tuple[dict[str, str], dict[str, object]]:
        return dict.fromkeys(values, "constexpr"), values

    table = [
        ("elementwise", "_axpy_kernel", {"x_ptr": p, "y_ptr": p, "out_ptr": p, "alpha": "fp32",
                                         **ints("n")}, const(BLOCK=256)),
        ("elementwise", "_geglu_kernel", {"x_ptr": p, "out_ptr": p,
                                          **ints("hidden", "stride_x", "stride_out")},
         const(BLOCK=128)),
        ("softmax", "_softmax_kernel", {"x_ptr": p, "out_ptr": p,
                                        **ints("n_cols", "stride_x", "stride_out")},
         const(BLOCK=128)),
        ("norms", "_layernorm_kernel", {"x_ptr": p, "w_ptr": p, "b_ptr": p, "y_ptr": p,
                                        "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                                        **ints("n_cols", "stride"), "eps": "fp32"},
         const(BLOCK=256)),
        ("norms", "_groupnorm_kernel", {"x_ptr": p, "w_ptr": p, "b_ptr": p, "y_ptr": p,
                                        "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                                        **ints("channels_per_group", "spatial", "groups"),
                                        "eps": "fp32"}, const(BLOCK=256)),
        ("matmul", "_matmul_kernel", {"a_ptr": p, "w_ptr": p, "out_ptr": p,
                                      **ints("M", "N", "K", "stride_am", "stride_ak", "stride_wn",
                                             "stride_wk", "stride_om", "stride_on")},
         const(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, PRECISION="ieee" if d == "fp32" else None)),
        ("attention", "_attention_kernel", {"q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": p,
                                            "lse_ptr": "*fp32",
                                            **ints("seq_q", "seq_kv", "head_dim"),
                                            "scale_log2": "fp32",
                                            **ints("stride_qb", "stride_qs", "stride_kb",
                                                   "stride_ks", "stride_vb", "stride_vs",
                                                   "stride_ob", "stride_os")},
         const(BLOCK_M=32, BLOCK_N=32, BLOCK_D=64)),
        ("atomics", "_column_sum_kernel", {"x_ptr": p, "col_sum_ptr": "*fp32",
                                           "total_ptr": "*fp32", **ints("M", "N", "stride")},
         const(BLOCK_M=16, BLOCK_N=32)),
    ]  # fmt: skip
    return [(m, k, {**sig, **c[0]}, c[1]) for m, k, sig, c in table]


@pytest.mark.slow
# Triton 3.9 announces a change of its FP-fusion default; it does not concern this test.
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")
@pytest.mark.parametrize(("backend", "arch", "warp"), [("cuda", 90, 32), ("hip", "gfx1100", 32)])
def test_corpus_kernels_compile_for_real_gpu_targets(
    backend: str, arch: int | str, warp: int
) -> None:
    """Without a GPU: the corpus goes through Triton's real compiler to a device binary."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for d in ("fp16", "fp32"):
        for module, kernel, signature, constexprs in _signatures(d):
            fn = getattr(importlib.import_module(f"diagnose.probes.triton.cases.{module}"), kernel)
            try:
                source = ASTSource(fn, signature, constexprs)
            except TypeError as exc:  # another Triton's compiler API
                pytest.skip(f"triton {triton.__version__}: ASTSource API differs ({exc})")
            try:
                triton.compile(source, target=GPUTarget(backend, arch, warp))
            except Exception as exc:
                failures.append(f"{kernel} {d}: {type(exc).__name__}: {exc}")
    assert not failures, failures
