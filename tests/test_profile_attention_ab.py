"""Reading the trace's math-path calls back into a benchmarkable signature (pure), from the
evidence the trace rule writes for a real CPU trace with SDPA forced onto the math path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diagnose.catalogs.attention_catalog import MATH_ID
from diagnose.profile.attention_ab import math_signature
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from tests.conftest import profile_steps


@pytest.fixture(scope="module")
def math_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real profiler trace of three training steps whose attention ran on the math path."""
    q = torch.randn(2, 4, 128, 32, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(2, 4, 96, 32, dtype=torch.bfloat16)

    def step() -> None:
        with sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, kv, kv).float().sum().backward()

    return profile_steps(step, tmp_path_factory.mktemp("math") / "trace.json")


def test_the_math_calls_signature_is_read_back_from_the_findings_evidence(
    math_trace: Path,
) -> None:
    record = analysis_to_record(analyze_trace(math_trace), math_trace)
    finding = next(
        f for p in record.probes for f in [*p.findings, *record.findings] if f.id == MATH_ID
    )
    signature = math_signature(finding.evidence, training=True)
    assert signature is not None
    assert (signature.batch, signature.heads, signature.q_len, signature.kv_len) == (2, 4, 128, 96)
    assert signature.head_dim == 32 and signature.dtype == "bfloat16" and signature.backward


def test_evidence_without_an_sdpa_op_or_shapes_gives_no_signature() -> None:
    evidence = {"ops": {"aten::bmm": 2}, "input_shapes": ["[2, 4, 8]"], "input_types": ["float"]}
    assert math_signature(evidence, training=True) is None
    assert math_signature({"ops": {}, "input_shapes": []}, training=False) is None
