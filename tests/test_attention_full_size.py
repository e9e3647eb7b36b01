"""Attention verdicts that hold: interleaved A/B decided by diagnose.stats, and kernel advice
judged at the real model's shapes on a run that trained its tiny stand-in.

Real SDPA kernels on the CPU (flash and math both run there). Nothing here asserts a timing
beyond planted effects: the planted slow path is SDPA's math path against the CPU's fused
kernel in fp32 at a tiny model's attention shape (several times slower per call), and its clean
twin is one kernel on both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from diagnose import attention_paths as ap
from diagnose import stats
from diagnose.catalogs import attention_catalog as ac
from diagnose.config import RunConfig
from diagnose.probes.attention.bench import (
    SignatureTrials,
    Trial,
    attention_call,
    interleaved_samples,
    make_inputs,
)
from diagnose.probes.attention.calls import AttentionCall, Signature
from diagnose.probes.attention.findings import (
    answer_checks,
    slower_backend_at_full_size,
    slower_backend_rule,
)
from diagnose.probes.attention.full_size import (
    FULL_SIZE_BUDGET_S,
    FullSizeJudgement,
    RealShapes,
    judge_at_full_size,
    real_attention_shapes,
)
from diagnose.probes.attention.judging import (
    Judged,
    PathGroup,
    comparisons_decided,
    group_saving,
)
from diagnose.probes.attention.probe import AttentionProbe
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.record import DeviceInfo, ProbeResult, new_record
from diagnose.workload import build_workload
from diagnose.workload.presets import load_preset
from diagnose.workload.step import Workload
from diagnose.workload.synthetic_images import generate_images
from tests.conftest import ok_lines, one_torch_thread, unjudged_lines

CPU = torch.device("cpu")
#: An attention call of the tiny SD1.5 (self-attention at its 64-token level), fp32, training.
TINY = Signature(
    batch=1,
    heads=2,
    kv_heads=2,
    q_len=64,
    kv_len=64,
    head_dim=8,
    value_dim=8,
    dtype="float32",
    backward=True,
    transposed=True,
)


def _interleaved(slow: str, fast: str, signature: Signature = TINY) -> dict[str, list[float]]:
    """Samples of ``slow`` (as "ran") and ``fast`` (as "other"), interleaved until the stats
    rule is sure or the budget is spent."""
    inputs = make_inputs(signature, CPU)
    calls = {
        "ran": attention_call(slow, inputs, signature),
        "other": attention_call(fast, inputs, signature),
    }
    with one_torch_thread():
        samples, failed, _ = interleaved_samples(
            calls,
            lambda: None,
            min_samples=5,
            max_samples=40,
            budget_s=2.0,
            decided=comparisons_decided(["ran"]),
        )
    assert not failed
    return samples


def _judge(signature: Signature, ran: str, others: list[str], budget_s: float) -> FullSizeJudgement:
    with one_torch_thread():
        return judge_at_full_size(
            _stand_in(signature), ran, [ran, *others], CPU, lambda: None, budget_s=budget_s
        )


def _fused_group(ran: list[float], other: list[float], calls: int = 10) -> Judged:
    """A group of calls that ran SDPA flash, with ``ran`` as its measured samples and ``other``
    as the alternative (SDPA math)'s."""
    group = PathGroup(TINY, ap.FLASH, "torch SDPA (CPU)", calls=calls)
    group.modules["denoiser.attn1"] = calls
    trials = SignatureTrials(
        TINY, [Trial("flash", runs=True, samples=ran), Trial("math", runs=True, samples=other)]
    )
    return Judged(group, trials, group_saving(group, trials))


# --------------------------------------------------------------------------------------------
# The one statistics rule


def test_ab_verdict_has_three_answers_and_two_of_them_exclude_each_other() -> None:
    base = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97]
    halved = [v / 2 for v in base]
    same = [v * 1.001 for v in reversed(base)]
    assert stats.ab_verdict(base, halved, min_relative=0.1).outcome == "faster"
    assert stats.ab_verdict(halved, base, min_relative=0.1).outcome == "not_faster"
    assert stats.ab_verdict(base, same, min_relative=0.1).outcome == "not_faster"
    # Too few samples for an interval at the sequential level: inconclusive, never a verdict.
    few = stats.ab_verdict(base[:2], halved[:2], min_relative=0.1)
    assert few.outcome == "inconclusive" and few.ratio is None
    # A 2x gap hidden in noise as wide as the gap is inconclusive, not a flip either way.
    noisy = [0.5, 2.0, 0.6, 1.9, 0.55, 2.1, 0.7]
    assert stats.ab_verdict(noisy, [v / 1.05 for v in noisy], min_relative=0.1).outcome in (
        "inconclusive",
        "not_faster",
    )


def test_planted_slower_backend_fires_and_its_clean_twin_stays_quiet() -> None:
    """Planted: the calls that 'ran' are really SDPA's math path and the alternative the CPU's
    fused kernel (several times faster per call at this shape); the A/B, interleaved until
    the U test is sure, finds it. Clean twin: the fused kernel on both sides; it must never
    be called faster (it may be "not faster" or inconclusive)."""
    planted = _interleaved("math", "flash")
    judged = _fused_group(planted["ran"], planted["other"])
    assert judged.saving is not None and judged.saving.clearly, judged.saving
    finding = slower_backend_rule([judged], s_per_it=judged.group.calls * 2e-3)
    assert finding is not None and finding.id == ac.SLOWER_ID
    assert finding.evidence["groups"][0]["verdict"] == "faster"

    twin = _interleaved("flash", "flash")
    quiet = _fused_group(twin["ran"], twin["other"])
    assert quiet.saving is not None and quiet.saving.verdict.outcome != "faster"
    assert slower_backend_rule([quiet], s_per_it=1e-3) is None
    result = ProbeResult(name="attention")
    calls = _calls(quiet.group.calls)  # every call ran the fused kernel
    answer_checks(result, calls=calls, judged=[quiet], packages={}, s_per_it=1e-3)
    [answer] = [c for c in result.checks if c.id == ac.SLOWER_ID]
    if quiet.saving.verdict.outcome == "inconclusive":
        assert answer.outcome == "not_judged" and "inconclusive" in answer.text
    else:
        assert answer.outcome == "ok" and "measurably faster" in answer.text


def _calls(n: int) -> list[AttentionCall]:
    return [
        AttentionCall(index=i, signature=TINY, path=ap.FLASH, provider="torch SDPA (CPU)")
        for i in range(n)
    ]


# --------------------------------------------------------------------------------------------
# The real model's shapes, on the meta device


def test_real_attention_shapes_follow_the_full_size_config() -> None:
    shapes = real_attention_shapes("sd15", 1, "bfloat16")
    assert not shapes.error
    config = load_preset("sd15", "full").denoiser.config
    resolution = max(load_preset("sd15", "full").resolutions)
    levels = len(config["block_out_channels"]) - 1
    heads = config["attention_head_dim"]  # SD1.5's config names the head count so
    latent = resolution // 2**levels  # the VAE's scale factor for SD1.5 (3 downsamplings)
    largest = shapes.largest()
    assert largest is not None
    assert largest.q_len == latent * latent and largest.kv_len == latent * latent
    assert largest.heads == heads
    assert largest.head_dim == config["block_out_channels"][0] // heads
    assert largest.dtype == "bfloat16" and largest.backward
    dims = {s.head_dim for s in shapes.signatures}
    assert dims == {c // heads for c in config["block_out_channels"][:-1]}
    # Cross-attention reads the text encoder's tokens.
    assert any(s.kv_len == 77 for s in shapes.signatures)
    assert "head dims" in shapes.summary()


# --------------------------------------------------------------------------------------------
# Tiny-model advice judged at full size: both sides


def _stand_in(signature: Signature) -> RealShapes:
    """Real shapes that a CPU measures in milliseconds, standing in for a full-size model's (one
    call there takes seconds on a CPU): the measurement on this side is real, its shape is not
    the real model's."""
    return RealShapes("sd15", 512, 1, (signature,))


def test_a_tiny_winner_the_full_size_contradicts_gives_no_advice() -> None:
    """The tiny model's A/B says the fused kernel that ran is slower than math (planted: the
    samples under its name are the math path's). Measured for real at the stand-in full size,
    math is not faster than the fused kernel there, so the tiny model's finding is withdrawn
    and the answer names it as the shrunk model's artefact."""
    planted = _interleaved("math", "flash")
    tiny_finding = slower_backend_rule(
        [_fused_group(planted["ran"], planted["other"])], s_per_it=0.02
    )
    assert tiny_finding is not None and tiny_finding.evidence["best"] == "math"
    judgement = _judge(TINY, "flash", ["math"], budget_s=30.0)
    assert judgement.measured, judgement.not_measured
    assert judgement.verdicts["math"].outcome != "faster"
    finding, outcome, text = slower_backend_at_full_size(tiny_finding, [], judgement)
    assert finding is None
    assert "artefact" in text and tiny_finding.title in text
    if judgement.none_faster:
        assert outcome == "ok" and "no backend that runs here is faster" in text
    else:  # inconclusive on a loaded machine: withheld, still no advice
        assert outcome == "not_judged"


def test_a_winner_confirmed_at_full_size_keeps_its_measured_advice() -> None:
    """The other side: the backend that won on the tiny model wins at the stand-in full size
    too (the math path ran, the fused kernel is measured faster at both), so the measured
    finding stands, with the full-size measurement in its evidence."""
    planted = _interleaved("math", "flash")
    saving = stats.sure_saving(planted["other"], planted["ran"]) * 10
    tiny_finding = ac.slower_backend(
        ran=ac.BACKEND_LABELS["math"],
        calls=10,
        best="flash",
        best_label=ac.BACKEND_LABELS["flash"],
        how_measured="",
        evidence={"best": "flash"},
        saving=saving,
        sure_saving=saving,
    )
    judgement = _judge(TINY, "math", ["flash"], budget_s=30.0)
    assert judgement.measured, judgement.not_measured
    finding, outcome, _ = slower_backend_at_full_size(tiny_finding, [], judgement)
    if "flash" in judgement.faster:
        assert finding is tiny_finding and outcome is None
        assert finding.evidence["full_size"]["verdicts"]["flash"]["outcome"] == "faster"
    else:  # a loaded machine may leave it unsure: then no advice, never the opposite
        assert finding is None and outcome == "not_judged"


def test_an_unaffordable_full_size_measurement_withholds_the_advice() -> None:
    """At SD1.5's real largest attention (4096 tokens) one call takes seconds on a CPU: the
    pilot's estimate is over the budget, nothing is measured, and the answer says why."""
    huge = dataclasses.replace(
        TINY, heads=8, kv_heads=8, q_len=4096, kv_len=4096, head_dim=40, value_dim=40
    )
    judgement = _judge(huge, "flash", ["math"], budget_s=2.0)
    assert not judgement.measured and "over the 2 s" in judgement.not_measured
    finding, outcome, text = slower_backend_at_full_size(None, [], judgement)
    assert finding is None and outcome == "not_judged"
    assert "depends on the shapes" in text and "over the 2 s" in text


# --------------------------------------------------------------------------------------------
# The probe on a real tiny run: a tiny run gives no kernel advice from the tiny model


@pytest.fixture(scope="module")
def tiny_workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    folder: Path = tmp_path_factory.mktemp("images")
    generate_images(folder, count=2, seed=1, size=(96, 80))
    config = RunConfig(
        preset="sd15",
        size="tiny",
        resolution=[64],
        data_dir=str(folder),
        precision="fp32",
        steps=1,
        warmup=0,
    )
    workload = build_workload(config, CPU)
    try:
        yield workload
    finally:
        workload.close()


def _probe_run(
    workload: Workload, size: str, *, full_size_budget_s: float = FULL_SIZE_BUDGET_S
) -> ProbeResult:
    ctx = ProbeContext(
        config=dataclasses.replace(workload.config, size=size),  # type: ignore[arg-type]
        device=CPU,
        device_info=DeviceInfo(kind="cpu", arch="x86_64"),
        record=new_record("run"),
        workload=workload,
    )
    probe = AttentionProbe(
        min_samples=5, max_samples=12, trial_budget_s=0.3, full_size_budget_s=full_size_budget_s
    )
    result: ProbeResult = run_probe(probe, ctx)
    assert result.status == "ok", result.traceback
    return result


def test_the_probe_judges_the_kernel_choice_of_a_tiny_run_at_full_size(
    tiny_workload: Workload,
) -> None:
    """As the tiny stand-in of SD1.5, whatever the tiny shapes measured, the kernel advice is
    the full-size judgement's: where SD1.5's real attention is too costly to measure within the
    budget (a budget no CPU fits its interleaved rounds into, so that this does not depend on
    the machine's speed), it is withheld with the reason. Run as the model it really is (judged
    at the size it trains), the measured answer stands and no full-size judgement is made."""
    tiny = _probe_run(tiny_workload, "tiny", full_size_budget_s=0.2)
    assert ac.SLOWER_ID not in {f.id for f in tiny.findings}
    full = tiny.data["full_size"]
    assert full["shapes"]["largest"].startswith("B=1 H=8 Lq=4096 Lk=4096 D=40")
    assert "over the" in full["not_measured"]
    [answer] = [c for c in tiny.checks if c.id == ac.SLOWER_ID]
    assert answer.outcome == "not_judged"
    assert "depends on the shapes" in answer.text and answer.text in unjudged_lines(tiny)

    as_real = _probe_run(tiny_workload, "full")
    assert "full_size" not in as_real.data
    answers = [c for c in as_real.checks if c.id == ac.SLOWER_ID]
    raised = [f for f in as_real.findings if f.id == ac.SLOWER_ID]
    assert len(answers) + len(raised) >= 1
    assert not any("depends on the shapes" in line for line in ok_lines(as_real))
