"""`--strict`: real trainers run through `diagnose profile` (and `diagnose run`), stopped at the op
that left the precision or the fused attention path they asked for.

Each trainer is a real child process (a plain loop under autocast, one that casts by hand, an
accelerate launch, Lightning, the diffusers LoRA example); each planted fault has a clean twin
that must train to its end with exit 0. Runs are kept to a few steps of small models.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.errors import ExitCode

DATA = Path(__file__).parent / "data"
SCRIPT = DATA / "strict_train.py"
LIGHTNING = DATA / "lightning_train.py"
#: One skipped step, one timed, no profiled: strict mode watches every step after the first.
FAST = ["--skip-steps", "1", "--steps", "1", "--profile-steps", "0"]
PRECISION_ID = "precision.strict_violation"


def _needs(package: str) -> pytest.MarkDecorator:
    # Looked up, not imported: importing Lightning sets environment variables in this process.
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(missing, reason=f"{package} is not installed")


needs_accelerate = _needs("accelerate")
needs_lightning = _needs("lightning")
needs_diffusers = _needs("diffusers")
ATTENTION_ID = "attention.strict_violation"


def _profile(out: Path, command: list[str], *strict: str) -> int:
    return main(["profile", "--out", str(out), *FAST, *strict, "--", *command])


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


def _checks(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (strict,) = [p for p in record["probes"] if p["name"] == "strict"]
    return {c["id"]: c for c in strict["checks"]}


def _violations(record: dict[str, Any]) -> list[dict[str, Any]]:
    (strict,) = [p for p in record["probes"] if p["name"] == "strict"]
    return [v for process in strict["data"]["processes"] for v in process["violations"]]


def _line_of(script: Path, text: str) -> int:
    (number,) = [i for i, line in enumerate(script.read_text().splitlines(), 1) if text in line]
    return number


def _last_frame(stderr: str) -> tuple[str, int]:
    """The innermost frame of the StrictViolation traceback printed on ``stderr``."""
    block = stderr[: stderr.index("diagnose.strict.StrictViolation:")]
    block = block[block.rindex("Traceback (most recent call last):") :]
    (path, line) = re.findall(r'File "([^"]+)", line (\d+)', block)[-1]
    return path, int(line)


def _assert_stopped_at(stderr: str, script: Path, planted: str) -> str:
    """The traceback ends at the planted line of ``script``; returns the violation's message."""
    path, line = _last_frame(stderr)
    assert (Path(path).resolve(), line) == (script.resolve(), _line_of(script, planted)), stderr
    return stderr[stderr.index("diagnose.strict.StrictViolation:") :]


# --------------------------------------------------------------------------------------------
# A loop under torch.autocast


def test_a_planted_fp32_block_stops_the_loop_at_its_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = _profile(out, [sys.executable, str(SCRIPT), "--plant", "fp32"], "--strict", "precision")
    stderr = capfd.readouterr().err
    assert code == ExitCode.STRICT_VIOLATION == 8
    message = _assert_stopped_at(stderr, SCRIPT, "# the planted fp32 block (autocast)")
    # Op, module, input dtypes and shapes, the claim and who made it, the fix.
    assert "addmm ran in fp32 in model.3.proj (Linear)" in message
    assert "float32[64, 64]" in message
    assert 'claimed by torch.autocast("cpu", dtype=torch.bfloat16)' in message
    assert "fix:" in message and "--strict-allow 'model.3.proj'" in message
    assert "diagnose exits with 8 (strict violation)" in stderr
    record = _record(out)
    assert _checks(record)[PRECISION_ID]["outcome"] == "finding"
    (violation,) = _violations(record)
    assert violation["module"] == "model.3.proj" and violation["op"] == "addmm"
    assert any("stopped the run at its first violation" in n for n in record["notes"])


def test_its_clean_twin_trains_to_the_end_with_exit_0(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = _profile(out, [sys.executable, str(SCRIPT)], "--strict", "precision,attention")
    assert code == 0
    assert "trained 6" in capfd.readouterr().out
    checks = _checks(_record(out))
    # Both checks were made, over every step after the first; the fused SDPA call passes.
    assert checks[PRECISION_ID]["outcome"] == "ok", checks
    assert checks[ATTENTION_ID]["outcome"] == "ok", checks
    assert "over 5 watched step(s)" in checks[PRECISION_ID]["text"]


def test_warn_in_the_capture_window_counts_its_steps_only_and_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # Two steps skipped, one timed, the probe step: the capture's window is steps 3 and 4.
    options = ["--skip-steps", "2", "--steps", "1", "--profile-steps", "0"]
    strict = ["--strict", "precision,warn", "--strict-window", "capture"]
    command = [sys.executable, str(SCRIPT), "--plant", "fp32"]
    code = main(["profile", "--out", str(out), *options, *strict, "--", *command])
    assert code == ExitCode.STRICT_VIOLATION
    assert "trained 6" in capfd.readouterr().out
    record = _record(out)
    (violation,) = _violations(record)
    (strict_result,) = [p for p in record["probes"] if p["name"] == "strict"]
    assert strict_result["data"]["processes"][0]["watched_steps"] == 2
    assert violation["count"] == 2 and violation["first_step"] == 1


# --------------------------------------------------------------------------------------------
# Attention


def test_sdpa_forced_onto_the_math_backend_is_stopped_with_the_reasons(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--plant", "math"]
    code = _profile(out, command, "--strict", "attention")
    stderr = capfd.readouterr().err
    assert code == ExitCode.STRICT_VIOLATION
    message = _assert_stopped_at(stderr, SCRIPT, "out = F.scaled_dot_product_attention(")
    assert "scaled_dot_product_attention ran unfused (math) in model.1 (Attention)" in message
    # Why not fused, in the attention probe's words, and what runs fused here instead.
    assert "switched off at the call" in message and "sdpa_kernel(SDPBackend.MATH)" in message
    assert "runs fused here at these inputs: SDPA flash" in message
    (violation,) = _violations(_record(out))
    assert violation["check"] == "attention" and violation["ran"] == "math"


def test_on_a_cpu_without_a_fused_kernel_for_the_case_it_says_so_and_does_not_fire(
    tmp_path: Path,
) -> None:
    # Attention dropout: the CPU's one fused kernel (flash) takes none.
    out = tmp_path / "out"
    code = _profile(
        out, [sys.executable, str(SCRIPT), "--plant", "dropout"], "--strict", "attention"
    )
    assert code == 0
    check = _checks(_record(out))[ATTENTION_ID]
    assert check["outcome"] == "not_judged"
    assert "no fused kernel runs these inputs on this cpu" in check["text"]
    assert "dropout" in check["text"]


# --------------------------------------------------------------------------------------------
# A loop that casts by hand: --expect


def test_a_hand_cast_loop_with_an_fp32_module_is_stopped_under_expect(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--cast", "hand", "--plant", "fp32"]
    code = _profile(out, command, "--strict", "precision", "--expect", "bf16")
    stderr = capfd.readouterr().err
    assert code == ExitCode.STRICT_VIOLATION
    message = _assert_stopped_at(stderr, SCRIPT, "# the planted fp32 block (hand cast)")
    assert "addmm ran in fp32 in model.3.proj (Linear)" in message
    assert "claimed by --expect bf16" in message
    # A hand cast's fix is the weights' cast, not autocast's.
    assert "Cast every weight to bf16" in message


def test_its_hand_cast_twin_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--cast", "hand"]
    assert _profile(out, command, "--strict", "precision", "--expect", "bf16") == 0
    assert _checks(_record(out))[PRECISION_ID]["outcome"] == "ok"


# --------------------------------------------------------------------------------------------
# accelerate launch --mixed_precision bf16


def _accelerate(*args: str) -> list[str]:
    from tests.test_profile_lora import LAUNCH

    return [sys.executable, *LAUNCH, *args]


@pytest.mark.slow
@needs_accelerate
def test_accelerate_mixed_precision_is_the_claim_and_the_fp32_block_stops_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    command = _accelerate(str(SCRIPT), "--cast", "accelerate", "--plant", "fp32")
    code = _profile(out, command, "--strict", "precision")
    stderr = capfd.readouterr().err
    assert code == ExitCode.STRICT_VIOLATION
    message = _assert_stopped_at(stderr, SCRIPT, "# the planted fp32 block (autocast)")
    assert "addmm ran in fp32 in model.3.proj" in message
    assert "claimed by accelerate launch --mixed_precision bf16" in message


@pytest.mark.slow
@needs_accelerate
def test_its_accelerate_twin_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = _accelerate(str(SCRIPT), "--cast", "accelerate")
    assert _profile(out, command, "--strict", "precision") == 0
    check = _checks(_record(out))[PRECISION_ID]
    assert check["outcome"] == "ok" and "accelerate launch --mixed_precision bf16" in check["text"]


# --------------------------------------------------------------------------------------------
# Lightning Trainer(precision="bf16-mixed")


@needs_lightning
def test_lightning_bf16_mixed_with_a_float_block_is_stopped_at_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(LIGHTNING), "--upcast", "--steps", "4"]
    code = _profile(out, command, "--strict", "precision")
    stderr = capfd.readouterr().err
    assert code == ExitCode.STRICT_VIOLATION
    message = _assert_stopped_at(stderr, LIGHTNING, "h = act2(middle(h.float()))")
    assert "addmm ran in fp32 in middle (Linear)" in message
    assert 'claimed by Lightning Trainer(precision="bf16-mixed")' in message
    # In Lightning's words only.
    assert 'Lightning: Trainer(precision="bf16-mixed")' in message and "kohya" not in message


@needs_lightning
def test_its_lightning_twin_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(LIGHTNING), "--steps", "4"]
    assert _profile(out, command, "--strict", "precision") == 0
    assert _checks(_record(out))[PRECISION_ID]["outcome"] == "ok"


# --------------------------------------------------------------------------------------------
# --strict warn on the diffusers LoRA example


@needs_accelerate
@needs_diffusers
def test_warn_on_the_diffusers_lora_example_counts_one_planted_module_and_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from tests.test_profile_lora import TRAIN_LORA

    script = tmp_path / "train_lora.py"
    script.write_text(TRAIN_LORA)
    planted = "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2"
    command = _accelerate(str(script), "--max_train_steps", "4", "--fp32_module", planted)
    out = tmp_path / "out"
    code = _profile(out, command, "--strict", "precision,attention,warn")
    captured = capfd.readouterr()
    assert code == ExitCode.STRICT_VIOLATION
    assert "trained 4" in captured.out  # the run went on to its end
    assert "the command exited with code 0" in captured.err
    record = _record(out)
    (violation,) = _violations(record)  # deduplicated: one module, one op
    assert violation["module"] == f"unet.{planted}"
    (strict,) = [p for p in record["probes"] if p["name"] == "strict"]
    watched = strict["data"]["processes"][0]["watched_steps"]
    assert watched == 3 and violation["count"] == watched  # one call per watched step
    assert _checks(record)[ATTENTION_ID]["outcome"] == "ok"
    html = (out / "report.html").read_text()
    assert f"unet.{planted}" in html and f"{watched} call(s) over {watched} step(s)" in html


# --------------------------------------------------------------------------------------------
# diagnose run --strict


def test_diagnose_run_strict_stops_its_own_forced_math_attention(tmp_path: Path) -> None:
    from tests.conftest import QUICK

    out = tmp_path / "out"
    skipped = [
        a
        for name in (
            "precision",
            "attention",
            "dataloader",
            "optimizer",
            "quantization",
            "roofline",
            "triton",
        )
        for a in ("--skip", name)
    ]
    code = main(
        ["run", "--out", str(out), *QUICK, "--attention", "math", *skipped, "--strict", "attention"]
    )
    assert code == ExitCode.STRICT_VIOLATION
    record = _record(out)
    (violation,) = _violations(record)
    assert violation["op"] == "scaled_dot_product_attention"
    assert violation["module"].startswith("denoiser.") and violation["module"].endswith(".attn1")
