"""Strict mode in this process: the checks on real tiny modules (no trainer process), the
options, the allow-list, the log the parent reads back and the record it becomes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.profile import capture, capture_contract
from diagnose.strict import StrictOptions, StrictViolation
from diagnose.strict.mode import RANK_EXPECT, StrictSession
from diagnose.strict.options import ENV_OPTIONS, ENV_PACKAGE, parse_strict
from diagnose.strict.result import add_strict, read_logs, strict_result
from diagnose.strict.violations import Claim, StrictLog, Violation

BF16 = Claim("bf16", "a test's own autocast")


class Upcast(torch.nn.Module):
    """A block that leaves autocast and computes in fp32 (the silent upcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            out: torch.Tensor = self.proj(x.float())
        return out


@pytest.fixture
def session_of() -> Iterator[Callable[..., StrictSession]]:
    """Strict sessions installed on this thread, uninstalled whatever the test does."""
    made: list[StrictSession] = []

    def make(claim: Claim | None = BF16, **options: object) -> StrictSession:
        session = StrictSession(StrictOptions(**options), claim=claim, claim_rank=RANK_EXPECT)  # type: ignore[arg-type]
        session.install()
        made.append(session)
        return session

    yield make
    for session in made:
        session.uninstall()


def _step(model: torch.nn.Module, x: torch.Tensor, session: StrictSession) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    session.step_reached()
    session.step_ended()


def test_an_upcast_block_raises_at_its_op_with_op_module_and_dtypes(
    session_of: Callable[..., StrictSession],
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Upcast())
    session = session_of(mode="fail")
    with pytest.raises(StrictViolation) as raised:
        _step(model, torch.randn(2, 8), session)
    violation = raised.value.violation
    assert (violation.op, violation.module, violation.ran) == ("addmm", "model.1.proj", "fp32")
    assert violation.inputs == ["float32[8]", "float32[2, 8]", "float32[8, 8]"]
    assert violation.code.endswith(", in forward") and __file__ in violation.code
    assert session.log.stopped and session.stopped


def test_warn_counts_each_module_and_op_once_and_leaves_autocast_ops_alone(
    session_of: Callable[..., StrictSession],
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Upcast(), torch.nn.LayerNorm(8))
    session = session_of(mode="warn")
    for _ in range(3):
        _step(model, torch.randn(2, 8), session)
    (violation,) = session.log.violations
    assert (violation.module, violation.count, session.log.watched_steps) == ("model.1.proj", 3, 3)
    # The bf16 Linear, the LayerNorm (autocast's fp32 list) and every backward op: not judged
    # as violations; only forward compute ops are counted as judged.
    assert session.log.ops_judged == 6


def test_the_allow_list_accepts_by_module_glob_or_op_and_says_which(
    session_of: Callable[..., StrictSession],
) -> None:
    model = torch.nn.Sequential(Upcast())
    for pattern in ("*.proj", "addmm", "aten.addmm"):
        session = session_of(mode="fail", allow=(pattern,))
        _step(model, torch.randn(2, 8), session)  # no raise
        (accepted,) = session.log.allowed
        assert accepted.allowed_by == pattern and not session.log.violations
        session.uninstall()


def test_a_run_without_a_claim_judges_no_precision(
    session_of: Callable[..., StrictSession],
) -> None:
    session = session_of(claim=None, mode="fail")
    torch.nn.Linear(8, 8)(torch.randn(2, 8))  # fp32 in an fp32 run: fine
    assert not session.log.violations


def test_rotary_tables_in_fp32_are_deliberate_not_a_violation(
    session_of: Callable[..., StrictSession],
) -> None:
    class Rotary(torch.nn.Module):
        def forward(self, positions: torch.Tensor) -> torch.Tensor:
            return torch.outer(positions, torch.ones(4)) @ torch.ones(4, 4)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rotary_emb = Rotary()

        def forward(self, positions: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                out: torch.Tensor = self.rotary_emb(positions)
            return out

    session = session_of(mode="fail")
    Model()(torch.arange(6.0))
    assert not session.log.violations
    assert any("position embedding" in n.text for n in session.log.not_judged)


def test_attention_in_fp32_inside_a_bf16_run_is_an_upcast(
    session_of: Callable[..., StrictSession],
) -> None:
    # diffusers' upcast_attention: the attention itself computed in fp32 with autocast off.
    q = torch.randn(1, 2, 16, 8)
    session = session_of(mode="warn", checks=("precision",))
    with torch.autocast("cpu", enabled=False):
        F.scaled_dot_product_attention(q, q, q)
    (violation,) = session.log.violations
    assert violation.op.startswith("_scaled_dot_product") and violation.ran == "fp32"


def test_a_hand_written_attention_is_found_and_a_classifier_softmax_is_not(
    session_of: Callable[..., StrictSession],
) -> None:
    session = session_of(claim=None, mode="warn", checks=("attention",))
    q = torch.randn(2, 4, 16, 8)
    weights = (q @ q.transpose(-1, -2) * 8**-0.5).softmax(dim=-1)
    weights @ q  # softmax(QKᵀ)V by hand
    logits = torch.randn(4, 10) @ torch.randn(10, 3)
    logits.softmax(dim=-1)  # a classifier's softmax: no attention
    (violation,) = session.log.violations
    assert (violation.op, violation.ran) == ("softmax(QKᵀ)V", "hand-written")
    assert "B=2 H=4 Lq=16 Lk=16 D=8" in violation.inputs[0]
    assert "scaled_dot_product_attention" in violation.fix
    # bmm, softmax, bmm, then mm and softmax: the fused-kernel trial's own ops are not judged.
    assert session.log.ops_judged == 5


def test_sdpa_math_is_judged_on_the_calls_own_layout(
    session_of: Callable[..., StrictSession],
) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    session = session_of(claim=None, mode="warn", checks=("attention",))
    three_d = torch.randn(2, 16, 8, requires_grad=True)
    # No fused kernel takes 3-D inputs: SDPA ran math by necessity, said and not counted.
    F.scaled_dot_product_attention(three_d, three_d, three_d).sum().backward()
    assert not session.log.violations
    (note,) = session.log.not_judged
    assert "4 dimensional" in note.text
    four_d = torch.randn(1, 2, 16, 8, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(four_d, four_d, four_d).sum().backward()
    (violation,) = session.log.violations
    assert violation.ran == "math" and any("switched off" in r for r in violation.reasons)


def test_uninstalled_nothing_is_watched(session_of: Callable[..., StrictSession]) -> None:
    session = session_of(mode="fail")
    session.uninstall()
    Upcast()(torch.randn(2, 8))
    assert not session.log.violations and session.log.ops_judged == 0
    assert F.scaled_dot_product_attention.__module__ == "torch._C._nn"


# --------------------------------------------------------------------------------------------
# Options, logs, the record


@pytest.mark.parametrize(
    ("text", "checks", "mode"),
    [
        ("precision", ("precision",), "fail"),
        ("attention,precision", ("attention", "precision"), "fail"),
        ("warn", ("precision", "attention"), "warn"),
        ("precision, warn", ("precision",), "warn"),
    ],
)
def test_strict_values(text: str, checks: tuple[str, ...], mode: str) -> None:
    assert parse_strict(text) == (checks, mode)


def test_bad_strict_values_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_strict("precision,fast")
    command = ["profile", "--out", str(tmp_path / "o"), "--expect", "bf16", "--", "python", "x"]
    assert main(command) == ExitCode.USAGE
    assert main(["profile", "--strict", "speed", "--", "python", "x"]) == ExitCode.USAGE


def test_the_capture_and_the_options_name_the_same_variables() -> None:
    # The capture runs in the user's Python and imports nothing of diagnose's.
    names = (capture_contract.ENV_STRICT, capture_contract.ENV_STRICT_PACKAGE)
    assert names == (ENV_OPTIONS, ENV_PACKAGE)


def test_a_python_without_diagnose_imports_strict_mode_from_the_launchers(tmp_path: Path) -> None:
    """The capture's loader, in a child whose import system cannot find diagnose (its editable
    finder taken out), loads its sibling modules by path and imports strict mode and the attention
    probe's modules from the folders the launcher names."""
    import os
    import subprocess
    import sys

    from diagnose.profile.launch import diagnose_search_path

    child = f"""
import importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != {str(Path.cwd())!r}]
for name in [n for n in sys.modules if n == "diagnose" or n.startswith("diagnose.")]:
    del sys.modules[name]
assert importlib.util.find_spec("diagnose") is None, "diagnose is still importable"
spec = importlib.util.spec_from_file_location("capture_under_test", {capture.__file__!r})
module = sys.modules["capture_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert module._contract.Settings.from_environ({{"DIAGNOSE_PROFILE_DIR": "x"}}) is not None
assert "diagnose" not in sys.modules
strict = module._process.start_strict(
    os.environ[{ENV_OPTIONS!r}], os.environ[{ENV_PACKAGE!r}], {str(tmp_path)!r}
)
assert strict is not None
import diagnose.probes.attention.calls
print("loaded from", diagnose.__file__)
"""
    env = dict(os.environ)
    env[ENV_OPTIONS] = StrictOptions().to_env()
    env[ENV_PACKAGE] = os.pathsep.join(diagnose_search_path())
    done = subprocess.run(
        [sys.executable, "-c", child],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded from" in done.stdout


def _violation(check: str, module: str, count: int) -> Violation:
    return Violation(check=check, op="addmm", module=module, ran="fp32", count=count)


def test_logs_round_trip_and_merge_across_processes(tmp_path: Path) -> None:
    options = StrictOptions(mode="warn", allow=("vae.*",))
    logs = []
    for pid, count in ((1, 3), (2, 4)):
        log = StrictLog(options=options, pid=pid, claim=BF16, watched_steps=5, ops_judged=10)
        log.violations.append(_violation("precision", "unet.ff", count))
        accepted = _violation("precision", "vae.conv", 2)
        accepted.allowed_by = "vae.*"
        log.allowed.append(accepted)
        (tmp_path / f"strict-{pid}.json").write_text(json.dumps(log.to_dict()))
        logs.append(log)
    read = read_logs(tmp_path)
    assert [log.to_dict() for log in read] == [log.to_dict() for log in logs]
    result = strict_result(options, read)
    (finding,) = result.findings
    (row,) = finding.evidence["violations"]
    assert row["count"] == 7 and row["module"] == "unet.ff"
    assert finding.evidence["accepted_by_strict_allow"][0]["pattern"] == "vae.*"
    attention = [c for c in result.checks if c.id == "attention.strict_violation"]
    assert attention[0].outcome == "ok"


def test_a_stopped_run_leaves_the_other_check_not_judged() -> None:
    log = StrictLog(options=StrictOptions(), claim=BF16, stopped=True, ops_judged=3)
    log.violations.append(_violation("precision", "net.1", 1))
    outcomes = {c.id: c.outcome for c in strict_result(StrictOptions(), [log]).checks}
    assert outcomes == {"attention.strict_violation": "not_judged"}  # the finding's check is
    # added when the record is settled


def test_a_run_without_a_claim_is_not_judged_for_precision() -> None:
    from diagnose.record import new_record

    record = new_record("profile")
    add_strict(record, StrictOptions(checks=("precision",)), [StrictLog(watched_steps=4)])
    (check,) = record.probes[-1].checks
    assert check.outcome == "not_judged" and "claimed no low precision" in check.text
