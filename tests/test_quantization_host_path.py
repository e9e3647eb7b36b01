"""A quantized base's A/B slowdown against its kernels' share of the step: when the two are far
apart the finding says where the rest goes (the quantized layers' host path), which the first
GPU run left unsaid ("35% slower ... its quantized layers take 0.6% of each profiled step")."""

from __future__ import annotations

from pathlib import Path

from diagnose.catalogs.quantization_catalog import measured_cost
from diagnose.trace.analysis import analyze_trace
from tests.synthetic_gpu import KinetoWriter


def _cost(trace_share: float | None, on_gpu: bool = True) -> str:
    finding = measured_cost(
        storage="NF4",
        unquantized="bf16",
        stored_step=0.066,
        unquantized_step=0.041,
        whole_step=0.071,
        ratio="0.53–0.88× of the NF4 base's time",
        encode_seconds=0.006,
        saving=0.025,
        sure=0.010,
        trace_share=trace_share,
        trace_host_share=0.04,
        on_gpu=on_gpu,
        memory="",
        evidence={},
        source="quantization",
    )
    return f"{finding.title}\n{finding.detail}"


def test_a_slowdown_far_above_the_kernels_share_is_said_to_be_the_host_path() -> None:
    text = _cost(0.006)
    assert "kernels take 0.6% of each profiled step, the rest is their host path" in text
    assert "the rest is host time" in text and "4% of each profiled step" in text
    # Kernels that account for the slowdown: nothing to explain.
    close = _cost(0.30)
    assert "host path" not in close and "host time" not in close
    # On a CPU the trace's share is the layers' own CPU time: no kernels to set apart.
    assert "host path" not in _cost(0.006, on_gpu=False)


def test_the_trace_rule_reads_the_host_time_in_the_quantized_ops(tmp_path: Path) -> None:
    w = KinetoWriter()
    for number in range(3):
        with w.label(f"ProfilerStep#{number}"):
            for _ in range(40):
                with w.op("aten::linear", [[8, 512], [512, 512]]):
                    with w.op("bitsandbytes::dequantize_4bit", [[131072], [], []], cost_us=30.0):
                        w.kernel("kDequantizeBlockwise<nf4>", 2.0)
                    w.kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 20.0)
                w.python(10.0)
    analysis = analyze_trace(w.save(tmp_path / "nf4.json"))
    # The kernels are too small a share for a finding: the rule leaves its reading in its data.
    assert not [f for f in analysis.findings if f.id == "quantization.dequant_cost"]
    evidence = analysis.rule_data["quantization"]["quantization"]
    assert evidence["measured_as"] == "device time of the ops' kernels"
    # 40 calls of 60+ µs on the host a step against 2 µs kernels: the host's share is larger.
    assert evidence["host_seconds_per_step"] > 10 * evidence["seconds_per_step"]
    assert 0 < evidence["host_share_of_step"] < 1
