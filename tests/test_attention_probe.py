"""The attention probe on real steps, and its rules: which path ran, why, and what a faster one
would save.

Real tiny SD1.5 LoRA workloads on the CPU, real diffusers attention processors, real profiler
traces. Timings are never asserted on beyond planted effects (math vs the CPU's fused kernel in
fp32 is about 2x per call), since several processes may share the machine. The recorder and the
profiler attribution are ``test_attention_capture.py``; the classification the probe shares with
the trace rule is ``test_attention_paths.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from diagnose import attention_paths as ap
from diagnose.catalogs import attention_catalog as ac
from diagnose.catalogs import specs
from diagnose.config import RunConfig
from diagnose.probes.attention.bench import (
    SignatureTrials,
    Trial,
    benchmark_signature,
    clean_reason,
    estimated_peak_bytes,
    try_backend,
)
from diagnose.probes.attention.calls import AttentionCall, Signature
from diagnose.probes.attention.findings import answer_checks
from diagnose.probes.attention.full_size import RealShapes
from diagnose.probes.attention.probe import (
    AttentionProbe,
    Judged,
    PackageStatus,
    PathGroup,
    Saving,
    group_saving,
    math_rule,
    slower_backend_rule,
    torch_requirement,
    xformers_rule,
)
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.budgets import BUDGET_STOPPED
from diagnose.record import DeviceInfo, Finding, ProbeResult, StepSample, new_record
from diagnose.reports.checks import build_checks
from diagnose.verdicts import contradictions, settle, settle_findings
from diagnose.workload import build_workload
from diagnose.workload.step import Workload
from diagnose.workload.synthetic_images import generate_images
from tests.conftest import ok_lines, unjudged_lines

CPU = torch.device("cpu")


def _fast_probe() -> AttentionProbe:
    """Few samples: these tests check what the probe reports, not precise timings."""
    return AttentionProbe(min_samples=5, max_samples=7, trial_budget_s=0.0)


# --------------------------------------------------------------------------------------------
# Tiny workloads


def _workload(folder: Path, attention: str) -> Workload:
    config = RunConfig(
        preset="sd15",
        size="tiny",
        resolution=[64],
        data_dir=str(folder),
        precision="fp32",  # fp32: the CPU's fused kernel beats math clearly (bf16 may not)
        attention=attention,  # type: ignore[arg-type]
        steps=1,
        warmup=0,
    )
    return build_workload(config, CPU)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=2, seed=1, size=(96, 80))
    return folder


@pytest.fixture(scope="module")
def default_workload(images: Path) -> Iterator[Workload]:
    workload = _workload(images, "auto")
    try:
        yield workload
    finally:
        workload.close()


def _run(
    workload: Workload,
    probe: AttentionProbe | None = None,
    budgets: dict[str, float] | None = None,
) -> ProbeResult:
    ctx = ProbeContext(
        config=workload.config,
        device=CPU,
        device_info=DeviceInfo(kind="cpu", arch="x86_64"),
        record=new_record("run"),
        workload=workload,
    )
    # Without a time budget unless one is planted: what the probe reports is under test, and on
    # a busy machine its budget would cut the A/B short.
    result: ProbeResult = run_probe(
        probe or _fast_probe(), ctx, budgets={} if budgets is None else budgets
    )
    assert result.status == "ok", result.traceback
    return result


def _ids(result: ProbeResult) -> set[str]:
    return {f.id for f in result.findings}


def _answers(result: ProbeResult) -> dict[str, set[str]]:
    """Check id -> the outcomes given to it (a sound result gives each id one)."""
    result.settle_checks(result.name or "attention")
    answers: dict[str, set[str]] = {}
    for check in result.checks:
        answers.setdefault(check.id, set()).add(check.outcome)
    return answers


class HandWrittenProcessor:
    """A custom diffusers processor that computes softmax(QKᵀ)V itself, as old code did."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        batch = hidden_states.shape[0]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        heads = attn.heads
        q, k, v = (
            t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v)
        )
        attended = self.attend(q, k, v, attn.scale)
        out = attended.transpose(1, 2).reshape(batch, -1, heads * q.shape[-1])
        out = attn.to_out[1](attn.to_out[0](out))
        return out / attn.rescale_output_factor  # type: ignore[no-any-return]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        weights = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
        return weights @ v


class DropoutSdpaProcessor(HandWrittenProcessor):
    """SDPA with attention dropout: on the CPU no fused kernel takes it, so math runs."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, scale=scale)


def _with_processor(workload: Workload, processor: Any) -> ProbeResult:
    denoiser: Any = workload.denoiser
    original = dict(denoiser.attn_processors)
    lora = [p.detach().clone() for p in workload.lora_parameters()]
    denoiser.set_attn_processor(processor)
    try:
        return _run(workload)
    finally:
        denoiser.set_attn_processor(original)
        # The probe's extra step leaves the LoRA weights alone.
        assert all(torch.equal(a, b) for a, b in zip(lora, workload.lora_parameters(), strict=True))


# --------------------------------------------------------------------------------------------
# The probe on real steps: planted faults fire, the clean twin stays quiet


def test_default_step_ran_fused_kernels(default_workload: Workload) -> None:
    denoiser: Any = default_workload.denoiser
    processors_before = dict(denoiser.attn_processors)
    result = _run(default_workload)
    assert not _ids(result) & {ac.MATH_ID, ac.MANUAL_ID}
    step = result.data["step"]
    # 20 UNet attention calls (10 blocks x self + cross), 2 CLIP layers, 1 VAE mid-block.
    assert step["calls_per_step"] == 23
    assert step["calls_by_path"] == {"flash": 23}
    rows = result.data["modules"]
    unet = [r for r in rows if r["module"].startswith("denoiser.")]
    assert unet and all(r["processor"] == "AttnProcessor2_0" for r in unet)
    assert all(r["ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"] for r in rows)
    # Training calls have a backward, the VAE and text encoder (no_grad) do not.
    assert all(r["backward_ms"] > 0 for r in unet)
    assert all(r["backward_ms"] == 0 for r in rows if not r["module"].startswith("denoiser."))
    assert any(line.startswith("attention: all 23 of 23 calls") for line in ok_lines(result))
    answers = _answers(result)
    assert answers[ac.MATH_ID] == {"ok"} and answers[ac.MANUAL_ID] == {"ok"}
    # Every call ran a fused kernel: the "nothing faster" question is answered (one way).
    assert len(answers[ac.SLOWER_ID]) == 1
    # What the CPU cannot measure is a not-judged check the report lists, not a side channel.
    assert "not_checked" not in result.data
    unjudged = unjudged_lines(result)
    assert any("peak memory per backend" in line for line in unjudged)
    assert any("ran on 1 thread(s)" in line for line in unjudged)
    report = build_checks([result])
    assert {n.reason for n in report.could_not_check if n.probe == "attention"} == set(unjudged)
    # Every signature was tried on every backend; GPU-only kernels are reported, not tried.
    for sig in result.data["signatures"]:
        trials = {t["backend"]: t for t in sig["trials"]}
        assert trials["flash"]["runs"] and trials["math"]["runs"]
        assert not trials["efficient"]["runs"] and "GPU" in trials["efficient"]["reasons"][0]
        assert trials["math"]["memory_basis"] == "estimated"
        assert trials["math"]["peak_bytes"] > trials["flash"]["peak_bytes"]
    # Unavailable optional packages are information, never an error.
    assert ac.XFORMERS_ID not in _ids(result)
    assert result.data["environment"]["packages"]["xformers"]["installed"] is False
    assert any("xformers: not installed" in line for line in ok_lines(result))
    assert dict(denoiser.attn_processors) == processors_before
    json.dumps(result.data, allow_nan=False)  # the record stores it


def test_forced_math_is_a_measured_fallback(images: Path) -> None:
    workload = _workload(images, "math")
    try:
        result = _run(workload)
    finally:
        workload.close()
    finding = next(f for f in result.findings if f.id == ac.MATH_ID)
    assert finding.evidence["calls_per_step"] == 20  # the UNet's; encoders ran outside the step's
    assert finding.saving_basis == "measured"
    assert finding.est_seconds_saved_per_it is not None and finding.est_seconds_saved_per_it > 0
    assert "SDPA flash" in finding.title
    why = " ".join(finding.evidence["why"])
    assert "switched off at the call" in why and "--attention math" in why
    assert "sdpa_kernel(SDPBackend.MATH)" in finding.fix and "--sdpa" in finding.fix
    assert "microbenchmarked per call" in finding.detail
    groups = finding.evidence["groups"]
    assert all(
        g["ops"] == {"aten::_scaled_dot_product_attention_math": g["calls_per_step"]}
        for g in groups
    )
    # Regression: the text encoder and VAE still ran the fused kernel, and the probe used to add
    # "no backend that runs here is measurably faster than the fused kernel that ran" beside the
    # measured math finding. One question, one answer: no "nothing faster" line here.
    assert result.data["step"]["calls_by_path"] == {"math": 20, "flash": 3}
    answers = _answers(result)
    assert answers[ac.MATH_ID] == {"finding"}
    assert "ok" not in answers.get(ac.SLOWER_ID, set())
    assert not any("measurably faster" in line for line in ok_lines(result))
    assert all(len(outcomes) == 1 for outcomes in answers.values()), answers
    record = new_record("run")
    record.probes = [result]
    record.findings = list(result.findings)
    result.findings = []
    settle(record, specs())
    assert contradictions(record, specs()) == []


def test_hand_written_processor_is_unfused_manual(default_workload: Workload) -> None:
    result = _with_processor(default_workload, HandWrittenProcessor())
    assert ac.MATH_ID not in _ids(result)
    finding = next(f for f in result.findings if f.id == ac.MANUAL_ID)
    assert finding.evidence["calls_per_step"] == 20
    assert finding.evidence["processors"] == {"HandWrittenProcessor": 20}
    assert "HandWrittenProcessor" in finding.title
    assert finding.evidence["modules"].startswith("denoiser.")
    assert "and 16 more" in finding.evidence["modules"]  # 4 named, 20 modules in all
    assert "AttnProcessor2_0" in finding.fix
    assert finding.saving_basis == "measured"
    manual = [r for r in result.data["modules"] if r["entry"] == "manual"]
    assert len(manual) == 20 and all(r["backward_ms"] > 0 for r in manual)
    assert any(
        t["backend"] == "manual" and t["runs"]
        for s in result.data["signatures"]
        for t in s["trials"]
    )


def test_dropout_forces_math_with_the_reason(default_workload: Workload) -> None:
    result = _with_processor(default_workload, DropoutSdpaProcessor())
    finding = next(f for f in result.findings if f.id == ac.MATH_ID)
    assert finding.evidence["calls_per_step"] == 20
    why = " ".join(finding.evidence["why"])
    assert "dropout_p=0.1" in why
    assert "do not support non-zero dropout" in why  # torch's own words, captured
    assert "attention dropout to 0" in finding.fix
    # The fused kernel's time is measured at dropout 0: what the fix buys.
    notes = [t["note"] for s in result.data["signatures"] for t in s["trials"] if t["note"]]
    assert any("dropout_p=0" in n for n in notes)


def test_past_its_time_budget_each_signature_takes_its_fewest_rounds_and_says_why(
    default_workload: Workload,
) -> None:
    """One round per backend can never decide a comparison, so without the probe's budget the
    rounds would go on towards max_samples; with the budget planted spent they stop at the
    first, and the result says so. (The full-size judgement is left out: not under test.)"""

    def no_shapes(preset: str, batch: int, dtype: str) -> RealShapes:
        return RealShapes(preset, 512, batch, error="left out")

    probe = AttentionProbe(
        min_samples=1, max_samples=40, trial_budget_s=3600.0, real_shapes=no_shapes
    )
    result = _run(default_workload, probe, {"attention": 0.0})
    signatures = result.data["signatures"]
    assert signatures and all(s["stopped_by_budget"] for s in signatures)
    for signature in signatures:
        assert {t["samples"] for t in signature["trials"] if t["runs"]} == {1}
    [rounds] = [c for c in result.checks if c.id == ac.ROUNDS_CHECK]
    assert rounds.outcome == "not_judged" and BUDGET_STOPPED in rounds.text
    assert f"at {len(signatures)} of {len(signatures)} attention signatures" in rounds.text
    # Within its budget the rounds go on (here to a max_samples of 2), and nothing is said.
    probe = AttentionProbe(
        min_samples=1, max_samples=2, trial_budget_s=3600.0, real_shapes=no_shapes
    )
    within = _run(default_workload, probe, {"attention": 3600.0})
    assert not any(s["stopped_by_budget"] for s in within.data["signatures"])
    for signature in within.data["signatures"]:
        assert {t["samples"] for t in signature["trials"] if t["runs"]} == {2}
    assert ac.ROUNDS_CHECK not in {c.id for c in within.checks}


# --------------------------------------------------------------------------------------------
# Why and what it costs


SIG = Signature(
    batch=1,
    heads=2,
    kv_heads=2,
    q_len=64,
    kv_len=64,
    head_dim=32,
    value_dim=32,
    dtype="float32",
    backward=True,
)


def test_cpu_reasons_are_torchs_own_words() -> None:
    dropout = Signature(**{**SIG.__dict__, "dropout_p": 0.1})
    trial, _ = try_backend("flash", dropout, CPU)
    assert not trial.runs
    assert "Both fused kernels do not support non-zero dropout." in trial.reasons
    assert not any(r.endswith("because:") or "Triggered internally" in r for r in trial.reasons)
    trial, _ = try_backend("efficient", SIG, CPU)
    assert not trial.runs and "only on CUDA/ROCm" in trial.reasons[0]
    assert (
        clean_reason(
            "[W1129 15:10:18.123 sdp_utils.cpp:99] Warning: Flash attention requires q,k,v to have "
            "the same last dimension. (function operator())"
        )
        == "Flash attention requires q,k,v to have the same last dimension."
    )


def test_benchmark_measures_math_slower_than_fused_in_fp32() -> None:
    trials = benchmark_signature(
        SIG,
        CPU,
        lambda: None,
        ["flash", "math", "manual"],
        min_samples=5,
        max_samples=9,
        budget_s=0.0,
    )
    flash, math_, manual = (trials.trial(b) for b in ("flash", "math", "manual"))
    assert flash and math_ and manual and flash.runs and math_.runs and manual.runs
    assert all(t.stats.n >= 5 for t in (flash, math_, manual))
    assert estimated_peak_bytes(SIG, "math") > estimated_peak_bytes(SIG, "flash")
    assert math.isfinite(flash.stats.median) and flash.memory_basis == "estimated"


def _trial(backend: str, ms: float, spread: float = 0.01) -> Trial:
    values = [ms * (1 + spread * i) / 1e3 for i in (-2, -1, 0, 1, 2)]
    return Trial(backend, runs=True, samples=values)


def _judged(path: str, provider: str, trials: list[Trial], calls: int = 10) -> Judged:
    group = PathGroup(SIG, path, provider, calls=calls)
    group.modules["denoiser.attn1"] = calls
    group.processors["AttnProcessor2_0"] = calls
    st = SignatureTrials(SIG, trials)
    return Judged(group, st, group_saving(group, st))


def test_slower_backend_needs_a_clear_and_worthwhile_gain() -> None:
    clear = _judged(ap.FLASH, "torch SDPA", [_trial("flash", 2.0), _trial("cudnn", 1.0)])
    assert isinstance(clear.saving, Saving) and clear.saving.clearly
    finding = slower_backend_rule([clear], s_per_it=0.5)
    assert finding is not None and finding.id == ac.SLOWER_ID
    assert finding.est_seconds_saved_per_it == pytest.approx(0.010)
    assert "_native_cudnn" in finding.fix and finding.saving_basis == "measured"
    # Within the noise: no finding.
    noisy = _judged(ap.FLASH, "torch SDPA", [_trial("flash", 2.0, 0.3), _trial("cudnn", 1.8, 0.3)])
    assert slower_backend_rule([noisy], s_per_it=0.5) is None
    # Clear but a negligible share of s/it: no finding either.
    assert slower_backend_rule([clear], s_per_it=100.0) is None
    # The faster backend wins at some shapes only: the title says of how many calls, so that it
    # agrees with the "all N of N calls ran fused kernels" answer beside it.
    assert finding.title.startswith("SDPA flash ran for 10 attention calls per step; ")
    other_shapes = _judged(ap.FLASH, "torch SDPA", [_trial("flash", 1.0), _trial("cudnn", 1.0)], 7)
    some = slower_backend_rule([clear, other_shapes], s_per_it=0.5)
    assert some is not None
    assert some.title.startswith(
        "SDPA flash ran for 10 of the 17 attention calls per step; at their shapes "
    )


def _graded(finding: Finding, step_seconds: float) -> Finding:
    """The finding as a saved record shows it: graded by the one severity rule."""
    record = new_record("run")
    record.timing.samples = [StepSample(index=i, seconds=step_seconds) for i in range(3)]
    record.timing.summarize()
    record.findings = [finding]
    settle_findings(record, specs())
    return finding


def test_slower_backend_severity_follows_the_saving_the_ab_is_sure_of() -> None:
    """10 calls saving 1.2 ms each by the median is 12% of a 0.1 s step (warn by the median); with
    a loose spread the A/B is only sure of under 10%, so the finding stays info and does not flip
    between runs; measured tightly it is warn. The probe passes both numbers, the verdict
    module grades. (Timed samples do not tie; these are written without ties, which would
    leave five samples a side too few for the sequential level's interval.)"""

    def trial(backend: str, values_ms: list[float]) -> Trial:
        return Trial(backend, runs=True, samples=[v / 1e3 for v in values_ms])

    loose = _judged(
        ap.FLASH,
        "torch SDPA",
        [trial("flash", [1.9, 2.0, 2.2, 2.6, 2.7]), trial("cudnn", [0.9, 0.95, 1.0, 1.01, 1.05])],
    )
    finding = slower_backend_rule([loose], s_per_it=0.1)
    assert finding is not None and finding.est_seconds_saved_per_it == pytest.approx(0.012)
    assert loose.saving is not None and loose.saving.sure_per_step < 0.10 * 0.1
    assert finding.sure_seconds_saved_per_it == pytest.approx(loose.saving.sure_per_step)
    assert _graded(finding, 0.1).severity == "info"
    tight = _judged(
        ap.FLASH,
        "torch SDPA",
        [
            trial("flash", [2.19, 2.195, 2.2, 2.205, 2.21]),
            trial("cudnn", [0.99, 0.995, 1.0, 1.005, 1.01]),
        ],
    )
    tight_finding = slower_backend_rule([tight], s_per_it=0.1)
    assert tight_finding is not None and _graded(tight_finding, 0.1).severity == "warn"


def test_math_rule_without_a_runnable_fused_backend_says_so() -> None:
    judged = _judged(ap.MATH, "torch SDPA", [Trial("flash", reasons=["nope"]), _trial("math", 3)])
    judged.why = ["gfx1100 needs TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1"]
    rocm = {"arch": "gfx1100", "needs_experimental": True, "experimental_enabled": False}
    finding = math_rule([judged], device_kind="rocm", arch="gfx1100", rocm=rocm, total_calls=10)
    assert finding is not None and finding.severity == "warn"
    assert finding.est_seconds_saved_per_it is None and finding.saving_basis == "none"
    assert finding.fix.startswith(
        "Start the trainer with TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1"
    )
    assert "not measured" in finding.detail


def _fused_call(index: int, path: str = ap.FLASH) -> AttentionCall:
    return AttentionCall(index=index, signature=SIG, path=path, provider="torch SDPA")


def test_nothing_faster_is_only_said_when_every_call_ran_fused() -> None:
    """Regression: math ran in most calls (flash measured faster there) while a few calls ran
    flash with nothing faster. The "nothing faster than the fused kernel that ran" answer used to
    be added beside the math finding; it is only true, and only said, when every call ran fused,
    under the id of the finding it excludes."""
    math_group = _judged(ap.MATH, "torch SDPA", [_trial("math", 2.0), _trial("flash", 1.0)], 20)
    fused_group = _judged(ap.FLASH, "torch SDPA", [_trial("flash", 1.0), _trial("math", 2.0)], 3)
    calls = [_fused_call(i, ap.MATH) for i in range(20)] + [_fused_call(20 + i) for i in range(3)]
    planted = ProbeResult(name="attention")
    finding = math_rule(
        [math_group, fused_group], device_kind="cpu", arch="", rocm={}, total_calls=23
    )
    assert finding is not None and "SDPA flash" in finding.title
    planted.add_finding(finding)
    answer_checks(planted, calls=calls, judged=[math_group, fused_group], packages={}, s_per_it=1)
    answers = _answers(planted)
    assert answers[ac.MATH_ID] == {"finding"} and ac.SLOWER_ID not in answers
    assert not any("faster" in line for line in ok_lines(planted))
    # The clean twin: every call ran flash and nothing is faster.
    clean = ProbeResult(name="attention")
    answer_checks(clean, calls=calls[20:], judged=[fused_group], packages={}, s_per_it=1)
    answers = _answers(clean)
    assert answers[ac.SLOWER_ID] == {"ok"} and answers[ac.MATH_ID] == {"ok"}
    assert any("measurably faster" in line for line in ok_lines(clean))


def test_rocm_architecture_rule() -> None:
    assert ap.rocm_needs_experimental("gfx1100") and ap.rocm_needs_experimental("gfx1201")
    assert ap.rocm_needs_experimental("gfx1151")
    assert not ap.rocm_needs_experimental("gfx90a") and not ap.rocm_needs_experimental("gfx942")
    assert ap.env_enabled("1") and ap.env_enabled("on") and not ap.env_enabled("0")
    env = ap.ROCM_EXPERIMENTAL_ENV
    assert env in ac.math_fix("rocm", "gfx1100") and env not in ac.math_fix("rocm", "gfx942")
    assert "RDNA3/RDNA4 GPUs" in ac.math_fix("rocm", "")  # a trace that does not name the GPU
    cpu = ac.math_fix("cpu", "x86_64", forced=True)
    assert env not in cpu and "enable_flash_sdp(False) also turns off" in cpu
    dropout_only = ac.math_fix("cpu", dropout=True)
    assert "dropout to 0" in dropout_only and "--sdpa" not in dropout_only


def test_xformers_reported_only_when_it_matters() -> None:
    absent = PackageStatus("xformers")
    assert xformers_rule(absent, config_attention="auto") is None
    assert "not installed" in absent.summary()
    broken = PackageStatus(
        "xformers",
        installed=True,
        version="0.0.28",
        imports=False,
        error="xFormers can't load C++/CUDA extensions. xFormers was built for PyTorch 2.5.1",
    )
    finding = xformers_rule(broken, config_attention="auto")
    assert finding is not None and finding.severity == "info" and finding.id == ac.XFORMERS_ID
    assert "built for PyTorch 2.5.1" in finding.title and "pip install" in finding.fix
    mismatched = PackageStatus(
        "xformers",
        installed=True,
        version="0.0.28",
        imports=True,
        torch_requirement="torch==2.5.1",
        matches_torch=False,
    )
    assert xformers_rule(mismatched, config_attention="auto") is not None
    assert torch_requirement(["numpy", "torch==2.5.1"]) == ("torch==2.5.1", False)
    assert torch_requirement(["torch>=2.0"]) == ("torch>=2.0", None)
    assert torch_requirement([f"torch=={torch.__version__}"])[1] is True
    assert torch_requirement(["torchvision==0.1"]) == ("", None)
