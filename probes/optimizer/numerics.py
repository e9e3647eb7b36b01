"""Is this bitsandbytes build's 8-bit AdamW numerically AdamW? One update against fp32 AdamW.

AdamW8bit keeps both Adam moments in 8 bits: each moment tensor is cut into blocks of 256
elements, each block is scaled by its largest magnitude (``absmax``) and every scaled value is
stored as the index of a code in a 256-entry *dynamic* map (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", 2022): the first moment uses the signed map, the second moment (which
is never negative) the unsigned one. A code map has a fixed relative resolution per decade below
the block's absmax (the signed map: 6.6 % between codes in [0.1, 1], 12 % in [0.01, 0.1], ...), so
the error a stored moment can carry is known element by element.

The experiment (:func:`run_numerics`): fp32 copies of the LoRA tensors and their real gradients
get two steps of ``bitsandbytes.optim.AdamW8bit`` and two steps of ``torch.optim.AdamW`` with the
same hyper-parameters. Step 1 reads zero moments (exact in 8 bits) and is the same in both; the
moments it writes are quantised, so step 2 is the first update that carries quantisation error,
and exactly one rounding of each moment. Its bound (:func:`adam_update_bound`):

- per moment element, the worst rounding to either neighbouring code of its block-scaled value
  (:func:`moment_rounding_bound`), whatever rounding mode the kernel uses (nearest or stochastic);
- the step-2 update ``lr/c1 * m2 / (sqrt(v2)/c2 + eps)`` with ``m2 = b1*m1 + (1-b1)*g`` and
  ``v2 = b2*v1 + (1-b2)*g^2`` is linear in ``m1`` and monotone in ``v1``, so its largest deviation
  over the rounding box of ``(m1, v1)`` is reached at one of the four corners: the bound is the
  largest of those four deviations, exact (no linearisation);
- plus fp32 rounding of the parameter arithmetic (a few ulps of the parameter and the update).

A healthy build lands inside the bound for (nearly) every element; a build that computes the
wrong block scales, reads the wrong code map or miscompiles the kernel lands outside it for many.
:func:`compare_updates` is pure (two update tensors and the bound), so a recorded or deliberately
perturbed update can be judged without bitsandbytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.record import Finding
from diagnose.stats import at_line

#: Elements per quantisation block of bitsandbytes' blockwise 8-bit optimizers (fixed in
#: ``Optimizer2State.init_state``).
BNB_BLOCKSIZE = 256
#: Share of elements allowed outside their bound before the build is called broken (the
#: catalog's threshold).
MAX_SHARE_OUTSIDE_BOUND = catalog.MAX_SHARE_OUTSIDE_BOUND
#: Below this fraction of its block's absmax, a moment is only guaranteed to this absolute
#: precision (times absmax). The kernels find a value's code with an approximate search
#: (bitsandbytes' CPU kernel: a direct-lookup binary search, ``BinAlgo<Direct2>``, whose table is
#: coarser than the map's smallest codes): on bitsandbytes 0.50's CPU build the stored value of
#: |x| < 1e-4 * absmax was up to 2.1e-5 * absmax off, beyond its neighbouring codes. 1e-4 covers
#: that five times over and matters only for moments four decades below their block's largest.
SEARCH_FLOOR = 1e-4
#: Tensors and elements compared at most: enough for a distribution, cheap on any device
#: (bitsandbytes' CPU kernels take milliseconds per tensor and more on a busy machine).
MAX_NUMERICS_TENSORS = 16
MAX_NUMERICS_ELEMENTS = 2_000_000
_FP32_EPS = float(torch.finfo(torch.float32).eps)


@dataclass
class AdamHyper:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2


@dataclass
class NumericsStats:
    """How far one 8-bit update lies from the fp32 update, against its quantisation bound."""

    elements: int = 0
    #: Elements whose fp32 update is exactly zero (left out of the relative statistics).
    zero_reference: int = 0
    nonfinite: int = 0
    #: Relative error |u8 - u32| / |u32|.
    rel_error_max: float = math.nan
    rel_error_p99: float = math.nan
    rel_error_mean: float = math.nan
    #: The bound, relative to |u32|, over the same elements.
    rel_bound_max: float = math.nan
    rel_bound_p99: float = math.nan
    rel_bound_mean: float = math.nan
    #: Elements whose error exceeds their bound, and the largest error / bound ratio.
    outside_bound: int = 0
    share_outside_bound: float = 0.0
    worst_ratio_to_bound: float = 0.0


@dataclass
class NumericsReport:
    """What :func:`run_numerics` did and found (JSON-serialisable through :meth:`to_dict`)."""

    tensors: int = 0
    elements: int = 0
    #: Tensors whose 8-bit optimizer state really was 8-bit (the rest are not compared).
    quantised_tensors: int = 0
    min_8bit_size_used: int = 0
    hyper: AdamHyper = field(default_factory=AdamHyper)
    stats: NumericsStats = field(default_factory=NumericsStats)
    device: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# The bound


def moment_rounding_bound(
    moment: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    floor: float = SEARCH_FLOOR,
) -> torch.Tensor:
    """Per element of ``moment``, the largest error of storing it in blockwise 8 bits.

    The value is scaled by its block's absmax into [-1, 1]; a quantiser stores one of the two
    codes that bracket it (nearest or stochastic rounding alike), so the error is at most the
    distance to the farther of the two, and never less than ``floor`` (the kernels' search
    resolution, see :data:`SEARCH_FLOOR`), scaled back by absmax. Same shape as ``moment``;
    float32.
    """
    flat = moment.detach().reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return torch.zeros_like(moment, dtype=torch.float32)
    pad = (-n) % blocksize
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = (blocks / safe).reshape(-1)[:n]
    codes = torch.sort(code.detach().float().to(flat.device).reshape(-1)).values
    last = codes.numel() - 1
    above = torch.searchsorted(codes, scaled).clamp(0, last)
    below = (above - 1).clamp(0, last)
    error = torch.maximum((scaled - codes[below]).abs(), (scaled - codes[above]).abs())
    error = error.clamp_min(floor)
    scale = absmax.expand(-1, blocksize).reshape(-1)[:n]
    # A block of zeros stores zeros exactly.
    return (error * scale).reshape(moment.shape)


def adam_update_bound(
    m_prev: torch.Tensor,
    v_prev: torch.Tensor,
    grad: torch.Tensor,
    param_prev: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper,
    m_error: torch.Tensor,
    v_error: torch.Tensor,
) -> torch.Tensor:
    """Largest |8-bit update - fp32 update| of step ``step`` when the moments read at its start
    (``m_prev``, ``v_prev``) carry at most ``m_error``/``v_error``; all float32, one shape.

    The update is linear in ``m_prev`` and decreasing in ``v_prev``, so the worst case over the
    box is one of its four corners. fp32 arithmetic on the parameter adds a few ulps.
    """
    g = grad.float()
    c1 = 1.0 - hyper.beta1**step
    c2 = math.sqrt(1.0 - hyper.beta2**step)

    def update(m0: torch.Tensor, v0: torch.Tensor) -> torch.Tensor:
        m = hyper.beta1 * m0 + (1.0 - hyper.beta1) * g
        v = hyper.beta2 * v0 + (1.0 - hyper.beta2) * g * g
        return (hyper.lr / c1) * m / (v.sqrt() / c2 + hyper.eps)

    m0, v0 = m_prev.float(), v_prev.float()
    base = update(m0, v0)
    worst = torch.zeros_like(base)
    for m_sign in (-1.0, 1.0):
        for v_sign in (-1.0, 1.0):
            corner = update(m0 + m_sign * m_error, (v0 + v_sign * v_error).clamp_min(0.0))
            worst = torch.maximum(worst, (corner - base).abs())
    rounding = 4.0 * _FP32_EPS * (param_prev.float().abs() + base.abs())
    return worst + rounding


# --------------------------------------------------------------------------------------------
# The comparison (pure)


def _quantile(sorted_values: torch.Tensor, q: float) -> float:
    n = sorted_values.numel()
    if n == 0:
        return math.nan
    return float(sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))])


def compare_updates(
    update_8bit: torch.Tensor,
    update_fp32: torch.Tensor,
    bound: torch.Tensor | float,
) -> NumericsStats:
    """The distribution of the 8-bit update's error against the fp32 update and the bound.

    ``bound`` is the largest acceptable |u8 - u32| per element (a tensor of the same shape, or
    one number for all).
    """
    u8 = update_8bit.detach().reshape(-1).double().cpu()
    u32 = update_fp32.detach().reshape(-1).double().cpu()
    if u8.shape != u32.shape:
        raise ValueError(f"update shapes differ: {tuple(u8.shape)} vs {tuple(u32.shape)}")
    if isinstance(bound, torch.Tensor):
        limit = bound.detach().reshape(-1).double().cpu()
        if limit.numel() == 1:
            limit = limit.expand_as(u32)
    else:
        limit = torch.full_like(u32, float(bound))
    stats = NumericsStats(elements=u8.numel())
    if not u8.numel():
        return stats
    finite = torch.isfinite(u8)
    stats.nonfinite = int((~finite).sum())
    error = (u8 - u32).abs()
    # A non-finite update is outside any bound.
    error = torch.where(finite, error, torch.full_like(error, math.inf))
    outside = error > limit
    stats.outside_bound = int(outside.sum())
    stats.share_outside_bound = stats.outside_bound / u8.numel()
    ratio = torch.where(limit > 0, error / limit, torch.where(error > 0, math.inf, 0.0))
    stats.worst_ratio_to_bound = float(ratio.max())

    nonzero = u32 != 0
    stats.zero_reference = int((~nonzero).sum())
    if nonzero.any():
        magnitude = u32[nonzero].abs()
        rel_error = torch.sort(error[nonzero] / magnitude).values
        rel_bound = torch.sort(limit[nonzero] / magnitude).values
        stats.rel_error_max = float(rel_error[-1])
        stats.rel_error_p99 = _quantile(rel_error, 0.99)
        stats.rel_error_mean = float(rel_error.mean())
        stats.rel_bound_max = float(rel_bound[-1])
        stats.rel_bound_p99 = _quantile(rel_bound, 0.99)
        stats.rel_bound_mean = float(rel_bound.mean())
    return stats


def numerics_rule(
    stats: NumericsStats,
    *,
    running: str | None = "adamw8bit",
    max_share_outside: float = MAX_SHARE_OUTSIDE_BOUND,
) -> Finding | None:
    """``optimizer.8bit_numerics`` when the 8-bit update lies far outside its quantisation bound.

    ``running`` is the key of the optimizer the run steps with: critical when it is the 8-bit
    one, a warning against switching to it otherwise (the catalog words both)."""
    if not stats.elements:
        return None
    if stats.nonfinite == 0 and not at_line(stats.share_outside_bound, max_share_outside).above:
        return None
    evidence = {
        "elements_compared": stats.elements,
        "outside_bound": stats.outside_bound,
        "share_outside_bound": round(stats.share_outside_bound, 6),
        "worst_error_over_bound": _finite_or_none(stats.worst_ratio_to_bound),
        "nonfinite_updates": stats.nonfinite,
        "relative_error": {
            "max": _finite_or_none(stats.rel_error_max),
            "p99": _finite_or_none(stats.rel_error_p99),
            "mean": _finite_or_none(stats.rel_error_mean),
        },
        "relative_bound": {
            "max": _finite_or_none(stats.rel_bound_max),
            "p99": _finite_or_none(stats.rel_bound_p99),
            "mean": _finite_or_none(stats.rel_bound_mean),
        },
    }
    what = (
        f"{stats.nonfinite} non-finite updates"
        if stats.nonfinite
        else f"{stats.share_outside_bound:.1%} of elements outside the 8-bit quantisation bound"
    )
    return catalog.numerics_8bit(
        what=what,
        running=running,
        evidence=evidence,
        detail=(
            "From identical parameters, gradients and hyper-parameters, one AdamW8bit update was "
            "compared with fp32 torch AdamW. 8-bit moments may only differ by the rounding of "
            "each moment to its neighbouring codes of the blockwise dynamic map; this build's "
            "update differs by far more for many elements, so training with it follows a "
            "different (possibly diverging) trajectory."
        ),
    )


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------------------------
# The experiment (needs bitsandbytes)


def _pick(params: Sequence[torch.Tensor], max_tensors: int, max_elements: int) -> list[int]:
    """Indices of up to ``max_tensors`` tensors spread evenly over ``params`` (so every kind of
    LoRA matrix is represented), within ``max_elements`` in all; at least one tensor."""
    count = len(params)
    if count == 0:
        return []
    wanted = min(count, max(1, max_tensors))
    spread = sorted({round(i * (count - 1) / max(1, wanted - 1)) for i in range(wanted)})
    chosen: list[int] = []
    total = 0
    for index in spread:
        size = params[index].numel()
        if chosen and total + size > max_elements:
            continue
        chosen.append(index)
        total += size
    return chosen


@dataclass
class UpdatePair:
    """Step-2 updates of both optimizers and the bound, flattened over the quantised tensors."""

    update_8bit: torch.Tensor
    update_fp32: torch.Tensor
    bound: torch.Tensor
    #: Tensors whose state really was 8-bit (only those are in the tensors above).
    quantised_tensors: int = 0


def second_step_updates(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    hyper: AdamHyper,
    device: torch.device,
    between_steps: Callable[[Any], None] | None = None,
) -> UpdatePair:
    """Two steps of bitsandbytes AdamW8bit and of torch AdamW on fp32 copies of ``params`` with
    ``grads``; the second step's updates and their bound (CPU tensors).

    ``min_8bit_size`` is set to the smallest tensor so that every tensor goes through the 8-bit
    kernel: the question is whether the build's kernel is right, not which tensors a default
    would quantise. ``between_steps`` receives the 8-bit optimizer after step 1 (a fixture uses it
    to plant a fault). The inputs are not modified.
    """
    import bitsandbytes
    import bitsandbytes.functional as bnb_functional

    base = [p.detach().to(device=device, dtype=torch.float32).clone() for p in params]
    grad = [g.detach().to(device=device, dtype=torch.float32).clone() for g in grads]

    def leaves() -> list[torch.nn.Parameter]:
        made = []
        for value, g in zip(base, grad, strict=True):
            leaf = torch.nn.Parameter(value.clone())
            leaf.grad = g.clone()
            made.append(leaf)
        return made

    kwargs: dict[str, Any] = {
        "lr": hyper.lr,
        "betas": (hyper.beta1, hyper.beta2),
        "eps": hyper.eps,
        "weight_decay": hyper.weight_decay,
    }
    ref_params = leaves()
    # Single-tensor path: the textbook formula, the same on every device.
    reference = torch.optim.AdamW(ref_params, foreach=False, **kwargs)
    q_params = leaves()
    adamw8bit: Any = getattr(bitsandbytes.optim, "AdamW8bit")  # noqa: B009 - untyped package
    quantised = adamw8bit(q_params, min_8bit_size=min(t.numel() for t in base), **kwargs)

    reference.step()
    quantised.step()
    m1 = [reference.state[p]["exp_avg"].clone() for p in ref_params]
    v1 = [reference.state[p]["exp_avg_sq"].clone() for p in ref_params]
    ref_before = [p.detach().clone() for p in ref_params]
    q_before = [p.detach().clone() for p in q_params]
    if between_steps is not None:
        between_steps(quantised)
    reference.step()
    quantised.step()

    dynamic_map: Any = getattr(bnb_functional, "create_dynamic_map")  # noqa: B009 - untyped
    signed = dynamic_map(signed=True)
    unsigned = dynamic_map(signed=False)
    u8_parts, u32_parts, bound_parts = [], [], []
    for i, (rp, qp) in enumerate(zip(ref_params, q_params, strict=True)):
        if quantised.state[qp]["state1"].dtype != torch.uint8:
            continue
        bound = adam_update_bound(
            m1[i],
            v1[i],
            grad[i],
            ref_before[i],
            step=2,
            hyper=hyper,
            m_error=moment_rounding_bound(m1[i], signed, BNB_BLOCKSIZE),
            v_error=moment_rounding_bound(v1[i], unsigned, BNB_BLOCKSIZE),
        )
        u32_parts.append((rp.detach() - ref_before[i]).reshape(-1).cpu())
        u8_parts.append((qp.detach() - q_before[i]).reshape(-1).cpu())
        bound_parts.append(bound.reshape(-1).cpu())
    empty = torch.zeros(0)
    return UpdatePair(
        update_8bit=torch.cat(u8_parts) if u8_parts else empty,
        update_fp32=torch.cat(u32_parts) if u32_parts else empty,
        bound=torch.cat(bound_parts) if bound_parts else empty,
        quantised_tensors=len(u8_parts),
    )


def run_numerics(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    *,
    hyper: AdamHyper,
    device: torch.device,
    max_tensors: int = MAX_NUMERICS_TENSORS,
    max_elements: int = MAX_NUMERICS_ELEMENTS,
) -> NumericsReport:
    """The numerics check on up to ``max_tensors`` of ``params`` (those with a gradient)."""
    with_grad = [i for i, g in enumerate(grads) if g is not None]
    picked = [
        with_grad[i] for i in _pick([params[i] for i in with_grad], max_tensors, max_elements)
    ]
    report = NumericsReport(hyper=hyper, device=str(device))
    if not picked:
        report.notes.append("no gradient to compare")
        return report
    chosen = [params[i] for i in picked]
    chosen_grads = [g for g in (grads[i] for i in picked) if g is not None]
    report.tensors = len(chosen)
    report.elements = sum(t.numel() for t in chosen)
    report.min_8bit_size_used = min(t.numel() for t in chosen)
    if len(picked) < len(params):
        report.notes.append(
            f"compared {len(picked)} of {len(params)} tensors, spread over the list"
        )
    pair = second_step_updates(chosen, chosen_grads, hyper=hyper, device=device)
    report.quantised_tensors = pair.quantised_tensors
    if not pair.quantised_tensors:
        report.notes.append("no tensor got 8-bit state; nothing compared")
        return report
    report.stats = compare_updates(pair.update_8bit, pair.update_fp32, pair.bound)
    return report


__all__ = [
    "BNB_BLOCKSIZE",
    "MAX_NUMERICS_ELEMENTS",
    "MAX_NUMERICS_TENSORS",
    "MAX_SHARE_OUTSIDE_BOUND",
    "SEARCH_FLOOR",
    "AdamHyper",
    "NumericsReport",
    "NumericsStats",
    "UpdatePair",
    "adam_update_bound",
    "compare_updates",
    "moment_rounding_bound",
    "numerics_rule",
    "run_numerics",
    "second_step_updates",
]
