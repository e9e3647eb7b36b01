"""Kernel classes of real kernel names: every distinct kernel of the shared NVIDIA and AMD traces,
and the kernels of today's attention, MoE, quantization, sort and collective libraries as they
appear in public traces and sources (``tests/data/kernel_names.tsv``: name, class, where it was
seen; a name in "other" says why)."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from diagnose.trace.kernel_classes import COUNTED_ONCE_PRECEDENCE, KERNEL_CLASSES, classify_kernel

TABLE = Path(__file__).parent / "data" / "kernel_names.tsv"


def _rows() -> list[dict[str, str]]:
    with TABLE.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


ROWS = _rows()


def test_the_table_is_wide_and_well_formed() -> None:
    names = [r["name"] for r in ROWS]
    assert len(names) >= 150 and len(set(names)) == len(names)
    classes = Counter(r["class"] for r in ROWS)
    assert set(classes) <= set(KERNEL_CLASSES) - {"memcpy", "memset"}
    # Every class of kernel work is represented by real names, not one family.
    assert all(classes[c] >= 5 for c in set(KERNEL_CLASSES) - {"memcpy", "memset", "other"})
    assert all(" — " in r["source"] for r in ROWS if r["class"] == "other")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["name"][:60])
def test_real_kernel_name_class(row: dict[str, str]) -> None:
    assert classify_kernel(row["name"]) == row["class"], row["source"]


@pytest.mark.parametrize(
    ("name", "wrong"),
    [
        # Words inside words: "normal" in "renormalize", "pool" in "pooled", "lamb" in "lambda".
        ("void moe::dev::routing::routingRenormalize::routingIndicesHistogramKernel<int>()", ""),
        ("void fbgemm_gpu::permute_pooled_embs_kernel<float>(float const*, float*)", "reduction"),
        ("void at::native::elementwise_kernel<128, 2, impl<{lambda()#1}>>()", "optimizer"),
        # A KV-cache write is a copy, even when the cache serves flash attention.
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(__nv_bfloat16 const*)", ""),
    ],
)
def test_words_are_whole_words(name: str, wrong: str) -> None:
    got = classify_kernel(name)
    assert got != "other" and got != wrong
    assert got in {"moe_routing", "elementwise"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # Names of the same families that are not in the table: the words carry over.
        (
            "void at::native::(anonymous namespace)::upsample_bilinear2d_out_frame<float>()",
            "elementwise",
        ),
        ("ck_tile::kentry<FmhaBwdDQDKDVKernel>", "attention_fused"),
        ("void at::native::tensor_kernel_scan_innermost_dim<float>()", "sort_scan"),
        (
            "void at::native::_amp_non_finite_check_and_unscale_cuda_kernel()",
            "elementwise",
        ),
        ("void cutlass::Kernel<cutlass_75_tensorop_s1688gemm_64x64_32x2_tn_align1>()", "gemm"),
    ],
)
def test_unseen_names_of_known_families(name: str, expected: str) -> None:
    assert classify_kernel(name) == expected


def test_every_class_has_a_place_when_counted_once() -> None:
    assert sorted(COUNTED_ONCE_PRECEDENCE) == sorted(KERNEL_CLASSES)
    # Communication last: what is left to it is the time no other work hides.
    assert COUNTED_ONCE_PRECEDENCE[-1] == "communication"


# --- names of any length -------------------------------------------------------------------------

#: Names built to defeat one rule each: a run of word characters (the "cudnn" rule once tried it
#: from every position), camel case, a template that never closes, digits between letters.
LONG_UNITS = {
    "one word": "a",
    "kernel name": ".-a",
    "camel case": "aA",
    "words": "ab ",
    "open template": "x<",
    "letters and digits": "a1",
    "almost cudnn": "xcudn",
}
#: CPU seconds a 300 KB name may take: a linear classifier needs milliseconds, the quadratic one
#: took minutes.
LONG_NAME_BOUND_S = 1.0


@pytest.mark.parametrize("unit", list(LONG_UNITS.values()), ids=list(LONG_UNITS))
def test_a_long_name_is_classified_in_linear_time(unit: str) -> None:
    import time

    name = unit * (300_000 // len(unit))
    started = time.process_time()
    assert classify_kernel(name) in KERNEL_CLASSES
    seconds = time.process_time() - started
    assert seconds < LONG_NAME_BOUND_S, f"{seconds:.1f} s for a 300 KB name (quadratic?)"


def test_what_a_long_name_says_first_still_decides() -> None:
    """A name is cut to what a classifier needs: its class is the class of its start."""
    padding = "_" + "x" * 300_000
    assert classify_kernel("sm90_xmma_gemm_bf16bf16" + padding) == "gemm"
    assert classify_kernel(
        "void at::native::(anonymous namespace)::layer_norm_kernel" + padding
    ) == ("norm")
    assert classify_kernel("cudnn_infer_volta_scudnn_128x64_relu" + padding) == "conv"
