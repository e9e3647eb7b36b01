"""The H200 run that reported a healthy stack as miscompiling, judged again under the new bounds.

``../shared/gpu-evidence/h200-2026-12-04/triton.json`` holds, per check, the seed of its inputs and
its errors against the plain float64 reference of the time (rel_l2, max_abs, and for the two
"mismatches" the flagged element's device value). The inputs regenerate exactly from the seeds, so
each recorded number can be set beside the new precision-matched reference: the flagged device
values are judged as they are, and every check is rebuilt with an emulated correct device whose
errors are checked against the recorded ones before it is judged. Skipped without ../shared.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.probes.triton.cases.api import CheckEnv, Tensors, TritonCase
from diagnose.probes.triton.cases.bounds import Error
from diagnose.probes.triton.cases.check import CheckResult
from diagnose.probes.triton.cases.emulate import emulated_outputs
from diagnose.probes.triton.cases.formats import DotPrecision, Format
from diagnose.probes.triton.cases.judge import element_bounds, judge_output
from diagnose.probes.triton.cases.numerics import Bounded, Numerics
from diagnose.probes.triton.cases.reference import reference_of
from diagnose.probes.triton.cases.runner import CORPUS, SuiteResult
from diagnose.probes.triton.probe import TritonEnvironment, judge_suite

pytest.importorskip("triton", reason="the triton package is not installed")

EVIDENCE = Path(__file__).resolve().parent.parent.parent / "shared" / "gpu-evidence"
RECORD = EVIDENCE / "h200-2026-12-04" / "triton.json"
H200 = CheckEnv("device", "cuda", "sm_90", torch.device("cpu"))


class _Plain(Numerics):
    """Float64 without any of the kernel's roundings: the reference triton.json was judged by."""

    def rounded(self, x: Bounded, fmt: Format, optional: bool) -> Bounded:
        return Bounded(x.value, x.error, fmt, self)

    def constant(self, value: float) -> Bounded:
        return Bounded(torch.tensor(value, dtype=torch.float64), Error.none(), None, self)

    def _precision(self, a: Bounded, requested: str | None = None) -> DotPrecision:
        return DotPrecision(None, label="exact")


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    if not RECORD.is_file():
        pytest.skip(f"the H200 evidence is not present at {RECORD}")
    document: dict[str, Any] = json.loads(RECORD.read_text())
    return document


def _cases() -> dict[str, TritonCase]:
    return {case.name: case for m in CORPUS for case in importlib.import_module(m).CASES}


def _regenerate(check: dict[str, Any]) -> tuple[TritonCase, torch.dtype, Tensors]:
    case = _cases()[check["case"]]
    dtype = getattr(torch, check["dtype"])
    inputs = case.make_inputs(check["shape"], dtype, torch.Generator().manual_seed(check["seed"]))
    return case, dtype, inputs


def _plain(case: TritonCase, inputs: Tensors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    outputs, _ = reference_of(case, inputs, dtype, H200, _Plain(H200, case.kind))
    return {name: value.value for name, value in outputs.items()}


def _flagged(recorded: dict[str, Any]) -> list[dict[str, Any]]:
    flagged = [c for c in recorded["checks"] if c["verdict"] == "mismatch"]
    assert [c["case"] for c in flagged] == ["flash_attention", "flash_attention"]
    return flagged


def test_the_recorded_inputs_regenerate_from_their_seeds(recorded: dict[str, Any]) -> None:
    for check in _flagged(recorded):
        case, dtype, inputs = _regenerate(check)
        plain = _plain(case, inputs, dtype)[check["output"]]
        index = tuple(check["first_wrong_index"])
        assert float(plain[index]) == pytest.approx(check["expected"], rel=1e-9)


def test_the_h200_truncates_tf32_operands_as_the_reference_does(recorded: dict[str, Any]) -> None:
    """The fp32 matmul's recorded error is the distance between the plain reference and the
    reference with truncated operands, to within accumulation order (rounding to nearest would
    give less than half of it)."""
    matmuls = [c for c in recorded["checks"] if c["case"] == "matmul" and c["dtype"] == "float32"]
    assert len(matmuls) == 4
    for check in matmuls:
        case, dtype, inputs = _regenerate(check)
        plain = _plain(case, inputs, dtype)["out"]
        matched = reference_of(case, inputs, dtype, H200)[0]["out"].value
        explained = float((matched - plain).norm() / plain.norm())
        assert explained == pytest.approx(check["rel_l2"], rel=0.01), check["shape"]


def test_the_two_old_mismatches_are_well_within_the_new_bounds(recorded: dict[str, Any]) -> None:
    """The device values the old judge flagged, against the reference at the kernel's precision."""
    for check in _flagged(recorded):
        case, dtype, inputs = _regenerate(check)
        want = reference_of(case, inputs, dtype, H200)[0][check["output"]]
        index = tuple(check["first_wrong_index"])
        bound = float(element_bounds(torch.float32, want)[index])
        ratio = abs(check["actual"] - float(want.value[index])) / bound
        assert ratio < 0.5, (check["shape"], ratio)
        # Against the plain reference the same value was 10 times as far off.
        assert abs(check["actual"] - check["expected"]) > 5 * ratio * bound


#: Inputs of more elements than this are emulated only in the full replay: the emulated device
#: computes GPU-sized attention and LoRA shapes element by element in float64, minutes of CPU
#: that the suite's budget cannot hold. Those checks' own recorded values (the two old
#: "mismatches" among them) are judged above at every size.
SUITE_INPUT_ELEMENTS = 1 << 20
#: Set to 1 to replay every recorded check: ``DIAGNOSE_H200_FULL_REPLAY=1 python -m pytest
#: tests/test_triton_h200_replay.py``.
FULL_REPLAY = os.environ.get("DIAGNOSE_H200_FULL_REPLAY") == "1"


def test_the_h200_result_judged_again_has_no_finding_above_info(recorded: dict[str, Any]) -> None:
    """Every recorded check, rebuilt: an emulated correct device on the same inputs must show the
    errors the H200 recorded (against the plain reference), and is then judged; where the record
    holds the device's own value, that value is judged."""
    torch.manual_seed(0)
    checks = []
    left_for_the_full_replay = 0
    for entry in recorded["checks"]:
        case, dtype, inputs = _regenerate(entry)
        elements = sum(t.numel() for t in inputs.values())
        if not FULL_REPLAY and elements > SUITE_INPUT_ELEMENTS:
            left_for_the_full_replay += 1
            continue
        name = entry["output"]
        expected, precision = reference_of(case, inputs, dtype, H200)
        device = torch.Generator().manual_seed(entry["seed"] ^ 0x5DEECE66D)
        # The H200 stores with cvt.rn: rounded to nearest.
        got = emulated_outputs(
            case, entry["shape"], dtype, inputs, H200, device, truncating_stores=False
        )
        plain = _plain(case, inputs, dtype)[name]
        emulated = float((got[name].double() - plain).norm() / plain.norm())
        # The same size of error as the H200's: within a factor 2 where the kernel's roundings
        # dominate (16-bit, TF32), 10 where only fp32 accumulation order is left.
        factor = 2.0 if entry["rel_l2"] > 1e-5 else 10.0
        assert emulated / factor <= entry["rel_l2"] <= emulated * factor, (entry, emulated)
        output = got[name].clone()
        if entry["first_wrong_index"] is not None:
            output[tuple(entry["first_wrong_index"])] = entry["actual"]
        judged = [judge_output(n, output if n == name else got[n], w) for n, w in expected.items()]
        worst = max(judged, key=lambda j: (j.verdict != "pass", j.worst_ratio))
        checks.append(
            CheckResult(
                case=entry["case"],
                kind=entry["kind"],
                shape=entry["shape"],
                dtype=entry["dtype"],
                verdict=worst.verdict,
                mode="device",
                backend=entry["backend"],
                output=worst.name,
                precision=precision,
                worst_ratio=worst.worst_ratio,
                pattern=worst.pattern,
                message=worst.detail,
                run_seed=1,
                seed=entry["seed"],
            )
        )
    suite = SuiteResult("device", "cuda", "sm_90", "cuda:0", 1, [], checks=checks)
    environment = TritonEnvironment(
        torch_version="2.11.0+cu130",
        torch_build="cuda 13.0",
        expected_package="triton",
        expected_version="3.6.0",
        installed={"triton": "3.6.0"},
        triton_version="3.6.0",
    )
    result = judge_suite(suite, environment)
    above_info = [f for f in result.findings if f.severity != "info"]
    assert above_info == [], [f.title for f in above_info]
    assert {c.verdict for c in checks} == {"pass"}
    assert max(c.worst_ratio or 0.0 for c in checks) < 1.0
    assert not any(math.isnan(c.worst_ratio or 0.0) for c in checks)
    # Every case and dtype is replayed at one shape at least, GPU-sized ones in the full replay.
    assert {(c.case, c.dtype) for c in checks} == {
        (e["case"], e["dtype"]) for e in recorded["checks"]
    }
    assert left_for_the_full_replay < len(recorded["checks"]) / 4 or FULL_REPLAY
