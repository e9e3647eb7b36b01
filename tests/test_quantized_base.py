"""Quantized and low-precision frozen bases (``--base``): the stored layers, their numerics, the
trace rule that measures their expansion, and a run that builds one.

Real bitsandbytes layers (its CPU build runs 4-bit and 8-bit), real peft LoRA on top, real
profiler traces of real training steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diagnose.catalogs.quantization_catalog import DEQUANT_COST
from diagnose.cli import main
from diagnose.config import RunConfig
from diagnose.errors import DiagnoseError
from diagnose.quantized_base import KINDS
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from diagnose.workload.quantize import Float8StorageLinear, quantize_linears
from tests.conftest import profile_steps

pytest.importorskip("bitsandbytes")
CPU = torch.device("cpu")
STORED = {
    "nf4": "Linear4bit",
    "fp4": "Linear4bit",
    "int8": "Linear8bitLt",
    "fp8": "Float8StorageLinear",
}


def _frozen_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
    ).requires_grad_(False)


@pytest.mark.parametrize("kind", list(STORED))
def test_stored_layers_replace_the_linears_within_the_documented_error(kind: str) -> None:
    model = _frozen_mlp()
    x = torch.randn(32, 256)
    reference = model(x)
    assert quantize_linears(model, kind, torch.float32, CPU) == 2  # type: ignore[arg-type]
    assert [type(m).__name__ for m in model] == [STORED[kind], "GELU", STORED[kind]]
    out = model(x)
    error = float((out - reference).norm() / reference.norm())
    assert 0 < error < KINDS[kind].relative_error_bound  # type: ignore[index]
    # Stored in fewer bytes than the fp32 layer: what a quantized base is for.
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored < sum(p.numel() * 4 for p in _frozen_mlp().parameters()) / 3


def test_the_float_kinds_leave_the_linears_to_the_precision_cast() -> None:
    model = _frozen_mlp()
    assert quantize_linears(model, "bf16", torch.bfloat16, CPU) == 0
    assert all(type(m) is not Float8StorageLinear for m in model)


def _lora_trace(folder: Path, kind: str | None, other_work: int = 0) -> Path:
    """A real profiler trace of LoRA training steps on a frozen base stored as ``kind``; with
    ``other_work``, each step also multiplies two unquantized matrices of that side (the rest
    of a model, which dwarfs the quantized layers)."""
    from peft import LoraConfig, get_peft_model

    base = _frozen_mlp()
    if kind is not None:
        quantize_linears(base, kind, torch.float32, CPU)  # type: ignore[arg-type]
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0", "2"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x = torch.randn(16, 256)
    other = torch.randn(other_work, other_work)

    def step() -> None:
        if other_work:
            other @ other
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return profile_steps(step, folder / f"{kind or 'fp32'}.json")


def _quantization_check(path: Path) -> tuple[dict[str, object] | None, dict[str, object]]:
    record = analysis_to_record(analyze_trace(path), path)
    findings = [f for p in record.probes for f in p.findings] + list(record.findings)
    finding = next((f for f in findings if f.id == DEQUANT_COST.id), None)
    checks = [c for p in record.probes for c in p.checks if c.id == DEQUANT_COST.id]
    assert len(checks) == 1, checks
    step = record.timing.profiled.median
    return (
        None
        if finding is None
        else {
            "title": finding.title,
            "saving": finding.est_seconds_saved_per_it,
            "evidence": finding.evidence,
            "step": step,
        },
        {"outcome": checks[0].outcome, "text": checks[0].text},
    )


def test_a_4bit_base_is_found_expanding_its_weights_and_its_fp32_twin_is_quiet(
    tmp_path: Path,
) -> None:
    finding, check = _quantization_check(_lora_trace(tmp_path, "nf4"))
    assert finding is not None and check["outcome"] == "finding"
    evidence = finding["evidence"]
    assert isinstance(evidence, dict)
    assert evidence["storage"].startswith("4-bit")
    assert any(name.startswith("bitsandbytes::") for name in evidence["ops_per_step"])
    # What can be saved is the expansion alone, within the time measured, within the step.
    saving, seconds = finding["saving"], evidence["seconds_per_step"]
    assert isinstance(saving, float) and 0 < saving <= seconds <= finding["step"]

    twin, twin_check = _quantization_check(_lora_trace(tmp_path, None))
    assert twin is None
    assert twin_check["outcome"] == "ok" and "no quantized base" in str(twin_check["text"])


@pytest.mark.parametrize(("other_work", "outcome"), [(0, "finding"), (2048, "ok")])
def test_the_probe_reads_the_share_the_trace_rule_gave(
    tmp_path: Path, other_work: int, outcome: str
) -> None:
    """The probe quotes the rule's share beside its A/B, from a finding or, when the matmuls
    dwarf the expansion, from an ok check's data alike."""
    from diagnose.probes.quantization.probe import _trace_share
    from diagnose.units import pct

    path = _lora_trace(tmp_path, "nf4", other_work)
    record = analysis_to_record(analyze_trace(path), path)
    (check,) = [c for p in record.probes for c in p.checks if c.id == DEQUANT_COST.id]
    assert check.outcome == outcome, check.text
    share = _trace_share(record)
    assert share is not None and 0 < share < 1
    assert f"take {pct(share)} of each profiled step" in check.text, (check.text, share)


@pytest.mark.parametrize(("kind", "storage"), [("int8", "int8"), ("fp8", "fp8")])
def test_int8_and_fp8_bases_are_told_apart(tmp_path: Path, kind: str, storage: str) -> None:
    finding, check = _quantization_check(_lora_trace(tmp_path, kind))
    said = finding["title"] if finding is not None else check["text"]
    assert f"stored as {storage}" in str(said)


def test_unknown_or_unsupported_bases_are_usage_errors() -> None:
    with pytest.raises(DiagnoseError, match="unknown --base 'nf3'"):
        RunConfig(base="nf3").validate()
    with pytest.raises(DiagnoseError, match="--strategy ddp"):
        RunConfig(base="nf4", nproc=2, strategy="fsdp").validate()
    assert "--base nf4" in RunConfig(base="nf4").command_line()


def test_a_run_on_an_nf4_base_trains_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The quantization probe's A/B has its own tests (test_quantization_probe): here the run
    # says what the trace rule read.
    probes = ("dataloader", "attention", "optimizer", "precision", "quantization")
    skip = [f"--skip={p}" for p in probes]
    code = main(
        [
            "run", "--out", str(out), "--base", "nf4", "--precision", "fp32",
            "--steps", "2", "--warmup", "1", "--profiled-steps", "1", *skip,
        ]
    )  # fmt: skip
    assert code == 0
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["base"] == "nf4"
    (check,) = [c for p in record["probes"] for c in p["checks"] if c["id"] == DEQUANT_COST.id]
    assert check["source"] == "trace:quantization" and "4-bit" in check["text"]
    assert "on a nf4 base" in (out / "report.html").read_text()


SHARED_TRACE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "gpu-traces"
    / "cuda"
    / "a100_alexnet_train.json.gz"
)


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="needs ../shared/gpu-traces")
def test_bitsandbytes_kernels_without_a_torch_op_are_found_on_a_real_gpu_trace(
    tmp_path: Path,
) -> None:
    """Older bitsandbytes launched its kernels without a torch op: plant its dequantization
    kernel's name on a real A100 trace's busiest kernel, and the unplanted trace stays quiet."""
    import gzip
    from collections import Counter

    doc = json.loads(gzip.decompress(SHARED_TRACE.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    busiest, _ = Counter({e["name"]: 0.0 for e in kernels} | _durations(kernels)).most_common(1)[0]
    planted = "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 0>(float*, unsigned char*)"
    for event in kernels:
        if event["name"] == busiest:
            event["name"] = planted
    path = tmp_path / "planted.json"
    path.write_text(json.dumps(doc))
    finding, check = _quantization_check(path)
    # Found, whether it is a finding or a small share stated as fine (the step decides which).
    assert "stored as 4-bit" in str(finding["title"] if finding else check["text"])
    if finding is not None:
        evidence = finding["evidence"]
        assert isinstance(evidence, dict) and evidence["kernels_without_op_per_step"] > 0
        assert finding["saving"] == evidence["seconds_per_step"]  # all of it is expansion
    clean, check = _quantization_check(SHARED_TRACE)
    assert clean is None and check["outcome"] == "ok"


def _durations(kernels: list[dict[str, object]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for event in kernels:
        name = str(event["name"])
        totals[name] = totals.get(name, 0.0) + float(event["dur"])  # type: ignore[arg-type]
    return totals


def _resident_bytes(module: torch.nn.Module) -> int:
    """What the built module really holds: its parameters' storage and the quantization state
    bitsandbytes keeps beside a 4-bit or 8-bit weight (absmax blocks, their own quantization,
    row scales)."""
    total = 0
    for parameter in module.parameters():
        total += parameter.numel() * parameter.element_size()
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            total += state.absmax.nbytes + state.code.nbytes
            if state.nested:
                total += state.state2.absmax.nbytes + state.state2.code.nbytes
        scales = getattr(parameter, "SCB", None)
        if scales is not None:
            total += scales.nbytes
    return total


@pytest.mark.parametrize("kind", ["nf4", "int8", "fp8"])
def test_the_predicted_footprint_of_a_stored_base_matches_the_built_one(kind: str) -> None:
    """The prediction for the real model (from shapes alone, on the meta device) against a tiny
    SD1.5 denoiser really built and quantized here: within 20%."""
    from diagnose.workload.models import build_denoiser, construct_on
    from diagnose.workload.presets import load_preset
    from diagnose.workload.quantize import stored_bytes

    spec = load_preset("sd15", "tiny")
    with construct_on(torch.device("meta"), torch.float32):
        predicted = stored_bytes(build_denoiser(spec), kind, 4)
    with construct_on(CPU, torch.float32):
        built = build_denoiser(spec).requires_grad_(False)
    quantize_linears(built, kind, torch.float32, CPU)  # type: ignore[arg-type]
    measured = _resident_bytes(built)
    assert abs(predicted - measured) / measured < 0.2, (predicted, measured)


def test_the_real_models_memory_counts_the_stored_base() -> None:
    from diagnose.probes.environment.probe import full_size_memory

    def frozen(**base: str) -> int:
        config = RunConfig(preset="sd15", size="tiny", **base)  # type: ignore[arg-type]
        full = full_size_memory(config, activations=False)
        assert full is not None
        return full.frozen_bytes

    plain, nf4, fp32 = frozen(), frozen(base="nf4"), frozen(base="fp32")
    # Most of SD1.5's weights are in its linear layers and convolutions: a 4-bit base keeps the
    # convolutions in bf16, so it lands between a quarter of bf16 and bf16.
    assert plain / 4 < nf4 < plain < fp32
    assert frozen(base="nf4", text_encoder_base="bf16") > nf4


def test_a_full_size_model_that_cannot_fit_is_said_before_running() -> None:
    """SD1.5 at full size (its real shapes on the meta device) against a GPU of 1.6 GiB: in bf16
    its weights, LoRA and AdamW state need about 2.0 GiB, stored as fp8 1.7, as NF4 1.5 (its
    convolutions and VAE stay bf16)."""
    from diagnose.run import fit_before_running, out_of_memory_error

    gpu = int(1.6 * 2**30)
    said = fit_before_running(RunConfig(preset="sd15", size="full"), "cuda", gpu)
    assert said.startswith("sd15 at full size needs 2.03 GiB") and "GPU's 1.60 GiB" in said
    assert said.endswith("stored as nf4 it needs 1.54 GiB: --base nf4")
    # Stored as NF4 the weights fit: nothing to say before the step; one step's activations at
    # 512 px do not fit, which the step's out-of-memory error then says.
    nf4_config = RunConfig(preset="sd15", size="full", base="nf4")
    assert fit_before_running(nf4_config, "cuda", gpu) == ""
    nf4 = out_of_memory_error(nf4_config, gpu, "CUDA out of memory.").message
    assert "weights and state 1.54 GiB" in nf4 and "more than the GPU's 1.60 GiB" in nf4
    fp8 = fit_before_running(RunConfig(preset="sd15", size="full", base="fp8"), "cuda", gpu)
    assert "needs 1.70 GiB" in fp8 and fp8.endswith("--base nf4")
    tight = fit_before_running(RunConfig(preset="sd15", size="full"), "cuda", 2**30)
    assert tight.endswith("no stored base makes it fit")
    # Nothing to say on a CPU, for a tiny model, or without a known memory size.
    assert fit_before_running(RunConfig(preset="sd15", size="full"), "cpu", gpu) == ""
    assert fit_before_running(RunConfig(preset="sd15", size="tiny"), "cuda", gpu) == ""
    assert fit_before_running(RunConfig(preset="sd15", size="full"), "cuda", None) == ""


def test_the_weights_fit_is_said_without_building_or_importing_diffusers(tmp_path: Path) -> None:
    """A run says whether a full-size model fits before its first step: from the shipped counts
    (held against a fresh build by tests/test_presets.py), in a fresh process with an empty cache,
    without building a model or importing the libraries that build it (seconds on every cold
    start); a LoRA on other modules than the preset's is counted by building it."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from diagnose.config import RunConfig\n"
        "from diagnose.run import fit_before_running\n"
        "sdxl = RunConfig(preset='sdxl', size='full', rank=32)\n"
        "print(fit_before_running(sdxl, 'cuda', 4 << 30))\n"
        "print(sorted({'diffusers', 'transformers', 'peft', 'bitsandbytes'} & set(sys.modules)))\n"
        "custom = RunConfig(preset='sdxl', size='full', rank=32, target_modules=('to_q', 'to_v'))\n"
        "print(fit_before_running(custom, 'cuda', 4 << 30))\n"
        "print(sorted({'diffusers', 'peft'} & set(sys.modules)))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    said, imported, custom, imported_after = done.stdout.splitlines()[-4:]
    assert said.startswith("sdxl at full size needs ") and "counted from its configs" in said
    assert "46,448,640 LoRA parameters" in said  # rank 32: twice the listed rank-16 count
    assert imported == "[]"
    assert custom.startswith("sdxl at full size needs ") and custom != said
    assert imported_after == "['diffusers', 'peft']"
