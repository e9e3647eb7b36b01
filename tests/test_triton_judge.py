"""The Triton judge: references at the kernel's precision, their bounds, and the three verdicts.

Correct kernels are emulated on the CPU (``emulate``: fp32 arithmetic in random orders and block
sizes, truncating or rounding accumulators, approximate functions, casts fused away or not) and
must pass; planted faults (patterns, far beyond the bound, NaN, writes outside) must not. The
full calibration (200 seeds) is ``benchmarks/bench_triton_judge.py``; this keeps a few seeds.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from diagnose.catalogs.triton_catalog import DRIFT_FACTOR, HANDFUL, ISOLATED_FACTOR
from diagnose.probes.triton.cases.api import CheckEnv, TritonCase, dtype_name, shape_label
from diagnose.probes.triton.cases.bounds import Error
from diagnose.probes.triton.cases.emulate import judge_emulated
from diagnose.probes.triton.cases.formats import BF16, FP16, TF32, XF32
from diagnose.probes.triton.cases.formats import TF32_RNA as TF32_ROUNDED
from diagnose.probes.triton.cases.judge import element_bounds, judge_output
from diagnose.probes.triton.cases.numerics import Bounded, Numerics
from diagnose.probes.triton.cases.reference import reference_of
from diagnose.probes.triton.cases.runner import CORPUS

pytest.importorskip("triton", reason="the triton package is not installed")

CPU = torch.device("cpu")
H100 = CheckEnv("device", "cuda", "sm_90", CPU)
T4 = CheckEnv("device", "cuda", "sm_75", CPU)
MI300 = CheckEnv("device", "hip", "gfx942", CPU)
RX7900 = CheckEnv("device", "hip", "gfx1100", CPU)
INTERPRETER = CheckEnv("interpreter", "interpreter", "", CPU)


def _corpus() -> list[TritonCase]:
    return [case for module in CORPUS for case in importlib.import_module(module).CASES]


def _case(name: str) -> TritonCase:
    return next(case for case in _corpus() if case.name == name)


# --- formats ------------------------------------------------------------------------------------


def test_tf32_truncates_and_the_split_rounds_ties_away() -> None:
    ulp = 2.0**-10
    x = torch.tensor(
        [1 + ulp / 2, 1 + 1.5 * ulp, -(1 + 1.5 * ulp), 1 + ulp / 4], dtype=torch.float64
    )
    # NVIDIA tensor cores drop the 13 low bits of an fp32 operand.
    assert TF32.round(x).tolist() == [1.0, 1 + ulp, -(1 + ulp), 1.0]
    # cvt.rna.tf32.f32 (tf32x3's split): to nearest, ties away from zero.
    assert TF32_ROUNDED.round(x).tolist() == [1 + ulp, 1 + 2 * ulp, -(1 + 2 * ulp), 1.0]
    # Nearest-even (the reference's guess where the mode is not documented): ties to even.
    assert XF32.round(x).tolist() == [1.0, 1 + 2 * ulp, -(1 + 2 * ulp), 1.0]
    assert TF32.unit == ulp and XF32.unit == ulp / 2 and not XF32.rounding_known
    # 16-bit formats round as torch casts them.
    assert FP16.round(x).tolist() == x.to(torch.float16).double().tolist()
    assert BF16.round(x).tolist() == x.to(torch.bfloat16).double().tolist()


@pytest.mark.parametrize(
    ("env", "requested", "dtype", "declared"),
    [
        (H100, None, torch.float32, "tf32, truncated"),
        (H100, "ieee", torch.float32, "fp32 (ieee)"),
        (H100, "tf32x3", torch.float32, "tf32x3"),
        (T4, None, torch.float32, "fp32 (ieee)"),  # no TF32 tensor cores before sm_80
        (MI300, None, torch.float32, "xf32"),
        (RX7900, None, torch.float32, "fp32 (ieee)"),
        (INTERPRETER, None, torch.float32, "interpreter"),  # numpy float32 whatever is asked
        (INTERPRETER, "tf32", torch.float32, "interpreter"),
        (H100, None, torch.float16, "fp16 as stored"),
        (H100, None, torch.bfloat16, "bf16 as stored"),
    ],
)
def test_a_dot_declares_the_precision_of_its_backend(
    env: CheckEnv, requested: str | None, dtype: torch.dtype, declared: str
) -> None:
    num = Numerics(env)
    a = num.input(torch.randn(4, 16).to(dtype))
    num.dot(a, a.mT, input_precision=requested, name="a·aᵀ")
    [step] = num.steps
    assert declared in step and "K=16" in step


def test_triton_f32_default_changes_the_default_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    num = Numerics(H100)
    a = num.input(torch.randn(4, 16))
    num.dot(a, a.mT)
    assert "fp32 (ieee)" in num.steps[0]


def test_the_corpus_declares_where_its_kernels_round() -> None:
    """Every built-in case takes ``(inputs, num)``: none falls back to a generic bound."""
    for case in _corpus():
        dtype = case.dtypes[0]
        inputs = case.make_inputs(case.shapes[0], dtype, torch.Generator().manual_seed(1))
        outputs, precision = reference_of(case, inputs, dtype, H100)
        assert not precision.startswith("generic"), case.name
        assert all(isinstance(v, Bounded) for v in outputs.values())
    # Attention declares both dots and the weights' cast between them.
    inputs = _case("flash_attention").make_inputs(
        {"bh": 1, "sq": 32, "skv": 40, "d": 16}, torch.float32, torch.Generator().manual_seed(1)
    )
    _, precision = reference_of(_case("flash_attention"), inputs, torch.float32, H100)
    assert "q·kᵀ: operands tf32, truncated" in precision
    assert "softmax weights: rounded to fp32 before p·v" in precision
    assert "p·v: operands tf32, truncated" in precision


def test_an_exact_operand_rounded_as_the_kernel_does_adds_no_error() -> None:
    num = Numerics(H100)
    a = num.input(torch.randn(8, 32))
    b = num.input(torch.randn(32, 8))
    product = num.dot(a, b)
    # The bound of a TF32 dot of exact inputs is accumulation alone: far below TF32's own unit.
    magnitude = TF32.round(a.value).abs() @ TF32.round(b.value).abs()
    assert float((product.err / magnitude).max()) < 1e-4
    # The value is the product of the truncated operands, not of the fp32 ones.
    assert torch.equal(product.value, TF32.round(a.value) @ TF32.round(b.value))


def test_the_bound_grows_with_the_reduction_length() -> None:
    num = Numerics(INTERPRETER)
    ratios = []
    for k in (16, 256, 4096):
        a = num.input(torch.ones(1, k))
        b = num.input(torch.ones(k, 1))
        ratios.append(float(num.dot(a, b).err) / k)  # relative to |A|·|B| = k
    assert ratios[0] < ratios[1] < ratios[2]


def test_independent_noise_adds_up_in_quadrature_but_never_beyond_the_worst_case() -> None:
    many = Error.none().plus_noise(torch.full((1, 4096), 1e-3, dtype=torch.float64))
    few = Error.none().plus_noise(torch.full((1, 2), 1e-3, dtype=torch.float64))

    def summed(error: Error) -> float:
        n = error.worst.shape[-1]
        return float(error.added_up(lambda t, sq: t.sum(-1, keepdim=True)).bound()) / n

    # 4096 independent errors: far below their worst case; 2: no better than it.
    assert summed(many) < 0.2 * 1e-3
    assert summed(few) == pytest.approx(1e-3)


# --- the verdicts ---------------------------------------------------------------------------------


def _reference(shape: tuple[int, ...], bound: float = 1e-3) -> Bounded:
    num = Numerics(INTERPRETER)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return Bounded(value, Error.none().plus_worst(torch.full(shape, bound)), None, num)


def _off_by(want: Bounded, where: torch.Tensor, times: float) -> torch.Tensor:
    """The reference with the elements at ``where`` moved ``times`` their own bound."""
    bound = element_bounds(torch.float64, want)
    return torch.where(where, want.value + times * bound, want.value)


def test_within_the_bound_passes() -> None:
    want = _reference((32, 64))
    judged = judge_output("out", _off_by(want, torch.ones(32, 64, dtype=torch.bool), 0.9), want)
    assert judged.verdict == "pass" and 0.85 < judged.worst_ratio < 0.95


def test_a_little_beyond_without_a_pattern_is_drift() -> None:
    want = _reference((32, 64))
    scattered = torch.zeros(32 * 64, dtype=torch.bool)
    scattered[::97] = True  # 22 elements, never two in a row or a column
    judged = judge_output("out", _off_by(want, scattered.view(32, 64), 2.0), want)
    assert judged.verdict == "drift" and judged.pattern == "spread"
    assert 1.9 < judged.worst_ratio <= DRIFT_FACTOR


def test_a_handful_of_isolated_elements_is_drift_unless_far_beyond() -> None:
    want = _reference((32, 64))
    isolated = torch.zeros(32, 64, dtype=torch.bool)
    isolated[3, 5] = isolated[20, 40] = True
    assert HANDFUL >= 2
    near = judge_output("out", _off_by(want, isolated, ISOLATED_FACTOR / 2), want)
    assert near.verdict == "drift" and near.pattern == "isolated"
    far = judge_output("out", _off_by(want, isolated, ISOLATED_FACTOR * 2), want)
    assert far.verdict == "mismatch" and far.pattern == "scattered"


@pytest.mark.parametrize(
    ("pattern", "where"),
    [
        ("rows", lambda m: m[5].fill_(True)),
        ("columns", lambda m: m[:, 7].fill_(True)),
        ("tail", lambda m: m.view(-1)[-100:].fill_(True)),
        ("block", lambda m: m.view(-1)[300:330].fill_(True)),
        ("everywhere", lambda m: m.fill_(True)),
    ],
)
def test_a_pattern_is_a_mismatch_even_close_to_the_bound(pattern: str, where: object) -> None:
    want = _reference((32, 64))
    mask = torch.zeros(32, 64, dtype=torch.bool)
    where(mask)  # type: ignore[operator]
    judged = judge_output("out", _off_by(want, mask, 2.0), want)
    assert judged.verdict == "mismatch" and judged.pattern == pattern, judged.detail


def test_a_constant_factor_is_named_a_wrong_scale() -> None:
    want = _reference((32, 64), bound=1e-6)
    judged = judge_output("out", want.value * 0.5, want)
    assert judged.verdict == "mismatch" and judged.pattern == "scaled"
    assert "×0.5" in judged.detail and "wrong scale" in judged.detail


def test_nan_where_the_reference_is_finite_and_writes_outside_are_mismatches() -> None:
    want = _reference((8, 8))
    poisoned = want.value.clone()
    poisoned[2, 3] = math.nan
    judged = judge_output("out", poisoned, want)
    assert judged.verdict == "mismatch" and judged.pattern == "nonfinite"
    assert judged.first_index == [2, 3] and "never written" in judged.detail
    outside = judge_output("out", want.value.clone(), want, outside_writes=3)
    assert outside.verdict == "mismatch" and outside.pattern == "outside"
    assert "3 element(s) written past the end" in outside.detail
    shape = judge_output("out", want.value.T.clone(), _reference((8, 4)))
    assert shape.verdict == "mismatch" and shape.pattern == "shape"


def test_integer_outputs_must_be_exact() -> None:
    want = torch.arange(10)
    assert judge_output("idx", want.clone(), want).verdict == "pass"
    wrong = want.clone()
    wrong[4] = 5
    assert judge_output("idx", wrong, want).verdict in ("drift", "mismatch")


# --- calibration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("env", [H100, MI300, INTERPRETER], ids=["cuda", "gfx942", "interpreter"])
def test_emulated_correct_devices_pass_every_corpus_check(env: CheckEnv) -> None:
    """A few seeds of the benchmark's false-alarm sweep: every case, dtype and interpreter shape."""
    worst = 0.0
    for case in _corpus():
        dtypes = list(case.dtypes) + [d for d in case.gpu_dtypes if d not in case.dtypes]
        for dtype in dtypes:
            for shape in case.shapes:
                for seed in (1, 2, 3):
                    for judged in judge_emulated(case, dict(shape), dtype, env, seed):
                        label = f"{case.name} {dtype_name(dtype)} {shape_label(shape)} {seed}"
                        assert judged.verdict == "pass", (label, judged.detail)
                        worst = max(worst, judged.worst_ratio)
    # The bounds hold with room to spare (a rounding alone never comes near one).
    assert worst < 0.9


def test_an_emulated_device_that_rounds_differently_is_caught() -> None:
    """The clean twin of the test above: the same emulation with bf16 operands where the kernel
    declares TF32 is far outside the bound."""
    case = _case("matmul")
    shape = dict(case.shapes[0])
    good = judge_emulated(case, shape, torch.float32, H100, 1)
    assert [j.verdict for j in good] == ["pass"]
    inputs = case.make_inputs(shape, torch.float32, torch.Generator().manual_seed(1))
    expected, _ = reference_of(case, inputs, torch.float32, H100)
    coarse = BF16.round(inputs["a"].double()) @ BF16.round(inputs["w"].double()).T
    [judged] = [judge_output("out", coarse.float(), expected["out"])]
    assert judged.verdict == "mismatch" and judged.worst_ratio > 10
