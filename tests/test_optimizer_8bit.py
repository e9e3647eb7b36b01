"""The optimizer probe's 8-bit questions: is an 8-bit optimizer's state really 8-bit on small
LoRA tensors, and do its updates stay within the rounding bound of the blockwise quantiser (real
bitsandbytes, its CPU build, and a recorded real update pair). The rest of the probe is
``test_optimizer_probe.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.probes.optimizer.numerics import (
    BNB_BLOCKSIZE,
    AdamHyper,
    compare_updates,
    moment_rounding_bound,
    numerics_rule,
    run_numerics,
)
from diagnose.probes.optimizer.probe import eight_bit_rule, eight_bit_split, state_bytes_by_dtype
from tests.test_optimizer_probe import LORA_SHAPES, _lora_tensors, needs_bnb

CPU = torch.device("cpu")
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "optimizer"
PAIR = FIXTURE / "adamw8bit_update_pair.pt"


# --------------------------------------------------------------------------------------------
# Is 8-bit really 8-bit?


def _stepped_8bit(**options: Any) -> torch.optim.Optimizer:
    params, grads = _lora_tensors()
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    import bitsandbytes

    adamw8bit: Any = getattr(bitsandbytes.optim, "AdamW8bit")  # noqa: B009 - untyped package
    optimizer: torch.optim.Optimizer = adamw8bit(params, lr=1e-4, **options)
    optimizer.step()
    return optimizer


@needs_bnb
def test_small_lora_tensors_keep_fp32_state_in_adamw8bit() -> None:
    optimizer = _stepped_8bit()
    split = eight_bit_split(optimizer)
    assert split is not None
    elements = sum(a * b for a, b in LORA_SHAPES)
    assert (split.tensors_8bit, split.tensors_fp32) == (0, len(LORA_SHAPES))
    assert split.bytes_fp32 == 2 * 4 * elements  # two fp32 moments
    assert split.fp32_share == 1.0
    assert split.saved_bytes == 0  # the same as fp32 AdamW
    assert state_bytes_by_dtype(optimizer) == {"float32": 2 * 4 * elements}
    finding = eight_bit_rule(split)
    assert finding is not None
    assert finding.id == "optimizer.8bit_state_mostly_fp32"
    assert finding.severity == "warn"
    assert (
        finding.evidence["bytes_by_kind"]["fp32 moments (below min_8bit_size)"] == 2 * 4 * elements
    )
    assert "min_8bit_size=512" in finding.fix  # the smallest LoRA tensor


@needs_bnb
def test_lowered_min_8bit_size_makes_the_state_8bit_and_the_finding_goes() -> None:
    optimizer = _stepped_8bit(min_8bit_size=256)
    split = eight_bit_split(optimizer)
    assert split is not None
    elements = sum(a * b for a, b in LORA_SHAPES)
    assert (split.tensors_8bit, split.tensors_fp32) == (len(LORA_SHAPES), 0)
    assert split.bytes_8bit == 2 * elements  # two uint8 moments
    assert split.fp32_share == 0.0
    assert split.saved_share > 0.6
    assert state_bytes_by_dtype(optimizer)["uint8"] == 2 * elements
    assert eight_bit_rule(split) is None
    # Not a bitsandbytes 8-bit optimizer: nothing to split.
    assert eight_bit_split(torch.optim.AdamW(_lora_tensors()[0])) is None


# --------------------------------------------------------------------------------------------
# Numerics


@needs_bnb
def test_the_bound_covers_the_real_blockwise_quantiser() -> None:
    """Store moments with bitsandbytes' own blockwise quantiser: every error within the bound,
    and the bound not loose (some element uses most of it)."""
    import bitsandbytes.functional as functional

    _, grads = _lora_tensors(seed=3)
    for signed in (True, False):
        code = getattr(functional, "create_dynamic_map")(signed=signed)  # noqa: B009
        for grad in grads:
            moment = 0.1 * grad if signed else 1e-3 * grad * grad
            stored, absmax = torch.ops.bitsandbytes.quantize_blockwise(
                moment.contiguous(), code.clone(), BNB_BLOCKSIZE
            )
            back = torch.ops.bitsandbytes.dequantize_blockwise(
                stored, absmax, code, BNB_BLOCKSIZE, torch.float32
            )
            bound = moment_rounding_bound(moment, code, BNB_BLOCKSIZE)
            error = (back - moment).abs()
            assert bool((error <= bound * (1 + 1e-5)).all())
            assert float((error / bound).max()) > 0.3


@needs_bnb
def test_real_adamw8bit_update_lies_within_the_bound() -> None:
    pair = torch.load(PAIR, weights_only=True)
    report = run_numerics(pair["params"], pair["grads"], hyper=AdamHyper(), device=CPU)
    assert report.quantised_tensors == len(pair["params"])
    stats = report.stats
    assert stats.elements == sum(p.numel() for p in pair["params"])
    assert stats.nonfinite == 0
    assert stats.share_outside_bound <= 0.01
    assert 0 < stats.rel_error_mean < stats.rel_bound_mean
    assert numerics_rule(stats) is None


def test_recorded_update_pair_clean_is_quiet_and_perturbed_fires() -> None:
    pair = torch.load(PAIR, weights_only=True)
    clean = compare_updates(pair["update_8bit"], pair["update_fp32"], pair["bound"])
    assert clean.outside_bound == 0
    assert numerics_rule(clean) is None

    broken = compare_updates(pair["update_8bit_perturbed"], pair["update_fp32"], pair["bound"])
    assert broken.share_outside_bound > 0.5
    finding = numerics_rule(broken)
    assert finding is not None
    assert finding.id == "optimizer.8bit_numerics"
    assert finding.severity == "critical"
    assert finding.evidence["outside_bound"] == broken.outside_bound


def test_compare_updates_is_pure_and_catches_gross_errors() -> None:
    reference = torch.linspace(-1e-4, 1e-4, 1001)
    reference[500] = 0.0
    same = compare_updates(reference.clone(), reference, 1e-9)
    assert same.outside_bound == 0 and same.rel_error_max == 0.0
    assert same.zero_reference == 1  # left out of the relative statistics
    assert numerics_rule(compare_updates(reference * 1.5, reference, 1e-6)) is not None
    with_nan = reference.clone()
    with_nan[3] = math.nan
    nan_stats = compare_updates(with_nan, reference, 1.0)
    assert nan_stats.nonfinite == 1
    assert numerics_rule(nan_stats) is not None
    with pytest.raises(ValueError):
        compare_updates(reference[:10], reference, 1.0)
