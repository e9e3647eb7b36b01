"""The triton probe end to end: planted wrong kernels fire, correct twins stay quiet, verdicts
repeat, through the command and as a probe (its parts are ``test_triton_harness.py``).

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
from diagnose.probes.triton.cases import CheckResult
from diagnose.probes.triton.cases.check import DEFAULT_SEED
from diagnose.probes.triton.cases.runner import SuiteResult, verdict_table
from diagnose.probes.triton.probe import TritonEnvironment, TritonProbe, judge_suite
from diagnose.record import DeviceInfo, new_record
from diagnose.record_io import record_from_dict
from tests.conftest import FIXTURES, REPO_ROOT, ok_lines

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
