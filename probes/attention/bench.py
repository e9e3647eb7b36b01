"""Can each attention backend run at the model's exact inputs, why not, and what does each cost?

For one :class:`~diagnose.probes.attention.calls.Signature` (B, heads, Lq, Lk, D, dtype, mask,
dropout, causal, training or not) every backend gets a :class:`Trial`:

1. **Can it run, and if not why** — one forced call (``sdpa_kernel([backend])``) with torch's
   warnings captured: torch explains a refused kernel in warnings ("Flash attention requires ...",
   "Both fused kernels do not support non-zero dropout."), then raises "No available kernel".
   On GPU builds ``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention``
   / ``can_use_cudnn_attention`` with ``SDPAParams`` and ``debug=True`` add their reasons (they
   log through c10, so native stderr is captured as well as Python warnings).
2. **What it costs** — device-synchronised seconds per call of forward (+ backward for a
   training call), the backends sampled in turn (interleaved) until the comparison the caller
   needs is sure or its time budget is spent; peak memory from ``max_memory_allocated`` on a
   GPU, estimated from the shapes on the CPU (whose allocator keeps no peak), and the trial says
   which.

Backends: SDPA ``flash`` (on the CPU: its fused CPU kernel), ``efficient``, ``cudnn``, ``math``;
``manual`` (the hand-written softmax(QKᵀ)V a custom processor computes); ``xformers`` and
``flash_attn`` when those packages import (GPU only). On ROCm GPUs that need
``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL`` and run without it, the fused SDPA trials are repeated
with the variable set for that measurement only, so the finding can say what it would buy.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diagnose import contention
from diagnose.attention_paths import ROCM_EXPERIMENTAL_ENV
from diagnose.probes.attention.calls import Signature
from diagnose.probes.budgets import budget_spent
from diagnose.quiet import capture_output
from diagnose.record import Stats
from diagnose.units import ms_value

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
#: Kernels that exist only in GPU builds: on the CPU they are reported, not tried.
GPU_ONLY: frozenset[str] = frozenset({"efficient", "cudnn", "xformers", "flash_attn"})
#: A timed sample covers at least this many seconds (several calls of a short kernel).
MIN_SAMPLE_S = 2e-3
MAX_INNER_CALLS = 200

_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?\s*$")
_C10_PREFIX = re.compile(r"^\[W[^\]]*\]\s*(Warning:\s*)?")
_C10_SUFFIX = re.compile(r"\s*\(function .*\)\s*$")


@dataclass
class Trial:
    """One backend at one signature."""

    backend: str
    runs: bool = False
    #: Why it cannot run, in torch's words (one line each), or the error it raised.
    reasons: list[str] = field(default_factory=list)
    #: Seconds per call (forward, or forward+backward for a training call).
    samples: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    #: "measured" (max_memory_allocated) or "estimated" (from the shapes).
    memory_basis: str = ""
    note: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples)

    @property
    def median(self) -> float | None:
        return self.stats.median if self.samples else None

    def to_dict(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "backend": self.backend,
            "runs": self.runs,
            "reasons": list(self.reasons),
            "ms_median": ms_value(stats.median, 5),
            "ms_q1": ms_value(stats.q1, 5),
            "ms_q3": ms_value(stats.q3, 5),
            "samples": stats.n,
            "peak_bytes": self.peak_bytes,
            "memory_basis": self.memory_basis,
            "note": self.note,
        }


def clean_reason(text: str) -> str:
    """One readable line from a torch warning or c10 log line."""
    line = _C10_PREFIX.sub("", text.strip().splitlines()[0] if text.strip() else "")
    line = _TRIGGERED.sub("", line)
    return _C10_SUFFIX.sub("", line).strip()


def _reasons(texts: Sequence[str]) -> list[str]:
    kept: list[str] = []
    for text in texts:
        line = clean_reason(text)
        # Headers that announce the reasons without being one.
        if not line or line.endswith("because:") or line in kept:
            continue
        kept.append(line)
    return kept


# --------------------------------------------------------------------------------------------
# Inputs and the call under test


@dataclass
class Inputs:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    grad_out: torch.Tensor | None


def make_inputs(signature: Signature, device: torch.device, seed: int = 0) -> Inputs:
    """Random q/k/v (and mask) with the signature's shapes, dtype, layout and grad mode."""
    dtype = getattr(torch, signature.dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    s = signature

    def tensor(heads: int, length: int, dim: int) -> torch.Tensor:
        if s.transposed:
            raw = torch.randn(s.batch, length, heads, dim, generator=generator)
            t = raw.to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(s.batch, heads, length, dim, generator=generator)
            t = t.to(device=device, dtype=dtype)
        return t.requires_grad_(s.backward)

    query = tensor(s.heads, s.q_len, s.head_dim)
    key = tensor(s.kv_heads, s.kv_len, s.head_dim)
    value = tensor(s.kv_heads, s.kv_len, s.value_dim)
    mask: torch.Tensor | None = None
    if s.has_mask:
        if s.mask_dtype == "bool":
            mask = torch.ones(s.mask_shape, dtype=torch.bool, device=device)
        else:
            mask = torch.zeros(s.mask_shape, dtype=getattr(torch, s.mask_dtype), device=device)
    grad_out = None
    if s.backward:
        grad_out = torch.randn(s.batch, s.heads, s.q_len, s.value_dim, generator=generator).to(
            device=device, dtype=dtype
        )
    return Inputs(query, key, value, mask, grad_out)


def _manual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(QKᵀ·scale)V written out, as a hand-written processor computes it."""
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    weights = scores.softmax(dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    out: torch.Tensor = weights @ v
    return out


def attention_call(backend: str, inputs: Inputs, signature: Signature) -> Callable[[], None]:
    """One forward (+ backward) of ``backend`` on ``inputs``; raises when it cannot run."""
    s = signature
    q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.mask
    gqa = s.kv_heads != s.heads

    def forward() -> torch.Tensor:
        if backend in SDPA_BACKENDS:
            with sdpa_kernel([SDPA_BACKENDS[backend]]):
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=s.dropout_p,
                    is_causal=s.is_causal,
                    enable_gqa=gqa,
                )
        if backend == "manual":
            return _manual_attention(q, k, v, mask, s.dropout_p, s.is_causal)
        if backend == "xformers":
            if mask is not None or s.is_causal or gqa:
                raise RuntimeError(
                    "not measured: this mask/causal/GQA layout is not mapped to xFormers"
                )
            ops: Any = importlib.import_module("xformers.ops")
            out: torch.Tensor = ops.memory_efficient_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p=s.dropout_p
            )
            return out.transpose(1, 2)
        if backend == "flash_attn":
            if mask is not None:
                raise RuntimeError("flash-attn takes no attention mask")
            flash: Any = importlib.import_module("flash_attn")
            out = flash.flash_attn_func(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                s.dropout_p,
                causal=s.is_causal,
            )
            return out.transpose(1, 2)
        raise ValueError(f"unknown attention backend {backend!r}")

    def call() -> None:
        out = forward()
        if inputs.grad_out is not None:
            torch.autograd.grad(out, (q, k, v), inputs.grad_out)

    return call


# --------------------------------------------------------------------------------------------
# Can it run?


def can_use_reasons(signature: Signature, device: torch.device) -> dict[str, list[str]]:
    """torch's own verdict per fused SDPA backend, with ``debug=True`` reasons (GPU builds).

    Empty on a CPU device or a torch built without CUDA/HIP, where these functions return False
    for every input and say nothing.
    """
    if device.type != "cuda" or not (torch.version.cuda or torch.version.hip):
        return {}
    from torch.backends.cuda import (
        SDPAParams,
        can_use_cudnn_attention,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    inputs = make_inputs(signature, device)
    params = SDPAParams(
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.mask,
        signature.dropout_p,
        signature.is_causal,
        signature.kv_heads != signature.heads,
    )
    verdicts: dict[str, list[str]] = {}
    for name, check in (
        ("flash", can_use_flash_attention),
        ("efficient", can_use_efficient_attention),
        ("cudnn", can_use_cudnn_attention),
    ):
        with warnings.catch_warnings(record=True) as caught, capture_output() as printed:
            warnings.simplefilter("always")
            ok = bool(check(params, True))
        if ok:
            verdicts[name] = []
        else:
            texts = [str(w.message) for w in caught] + printed.text.splitlines()
            verdicts[name] = _reasons(texts) or ["torch.backends.cuda.can_use_*: False"]
    return verdicts


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the process environment for the block, then put back."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def try_backend(
    backend: str, signature: Signature, device: torch.device, inputs: Inputs | None = None
) -> tuple[Trial, Inputs]:
    """One call of ``backend``; the trial says whether it ran and, if not, torch's reasons.
    ``inputs``: the q/k/v to call it on (made from the signature when not given)."""
    trial = Trial(backend)
    if inputs is None:
        inputs = make_inputs(signature, device)
    if device.type != "cuda" and backend in GPU_ONLY:
        trial.reasons = [f"no {device.type.upper()} kernel: {backend} runs only on CUDA/ROCm GPUs"]
        return trial, inputs
    if backend == "xformers" or backend == "flash_attn":
        try:
            importlib.import_module("xformers.ops" if backend == "xformers" else "flash_attn")
        except Exception as exc:  # ImportError or a broken build raising anything
            trial.reasons = [f"does not import: {clean_reason(str(exc)) or type(exc).__name__}"]
            return trial, inputs
    call = attention_call(backend, inputs, signature)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
            trial.runs = True
        except torch.OutOfMemoryError:
            trial.reasons = ["out of memory at these shapes"]
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            texts = [str(w.message) for w in caught] + [str(exc)]
            trial.reasons = _reasons(texts)
    if device.type == "cuda" and not trial.runs:
        torch.cuda.empty_cache()
    return trial, inputs


# --------------------------------------------------------------------------------------------
# What does it cost?


#: A decision rule for :func:`interleaved_samples`: given the samples so far (seconds per call,
#: per backend), whether the comparison it serves is sure and sampling can stop.
Decided = Callable[[Mapping[str, Sequence[float]]], bool]


def _call_seconds(call: Callable[[], None], sync: Callable[[], None]) -> float:
    """Seconds of one call, timed after a warm-up call (a first call pays one-off costs)."""
    call()
    seconds = _timed(call, sync)
    if seconds < MIN_SAMPLE_S / 4:  # short calls: time a few together for a steadier estimate
        seconds = _timed(call, sync, 4) / 4
    return seconds


def _timed(call: Callable[[], None], sync: Callable[[], None], times: int = 1) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(times):
        call()
    sync()
    return time.perf_counter() - start


def interleaved_samples(
    calls: Mapping[str, Callable[[], None]],
    sync: Callable[[], None],
    *,
    min_samples: int,
    max_samples: int,
    budget_s: float,
    decided: Decided | None = None,
    deadline: float | None = None,
) -> tuple[dict[str, list[float]], dict[str, str], bool]:
    """Seconds per call of every one of ``calls``, sampled in turn (A B, then B A, ...) so that
    load from other processes falls on all of them alike.

    ``min_samples`` rounds are always taken; then more, until ``decided`` says the comparison
    is sure, ``max_samples`` rounds are taken, ``budget_s`` seconds of sampling have passed, or
    the probe's ``deadline`` has (then the caller's rule says "inconclusive"). A call that runs
    out of memory is dropped; the second value says which, and why. The third: whether the
    deadline stopped the rounds before ``decided`` was sure."""
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, call in calls.items():
        try:
            seconds[name] = _call_seconds(call, sync)
        except torch.OutOfMemoryError:
            failed[name] = "out of memory while timing at these shapes"
    # One count of calls a sample for every backend, so the slowest one's samples last
    # MIN_SAMPLE_S: a sample of more calls runs each call with warmer caches, and counts that
    # differ between backends would show up as a difference between identical calls.
    inner = max(1, min(MAX_INNER_CALLS, round(MIN_SAMPLE_S / max([*seconds.values(), 1e-9]))))
    samples: dict[str, list[float]] = {name: [] for name in seconds}
    order = list(seconds)
    contention.mark_rounds()
    began = time.perf_counter()
    rounds = 0
    while rounds < max_samples and order:
        if rounds >= min_samples and (
            (decided is not None and decided(samples))
            or decided is None
            or time.perf_counter() - began >= budget_s
        ):
            break
        if rounds >= min_samples and budget_spent(deadline):
            return _kept(samples, failed), failed, True
        for name in _round_order(order, rounds):
            try:
                samples[name].append(_timed(calls[name], sync, inner) / inner)
            except torch.OutOfMemoryError:
                failed[name] = "out of memory while timing at these shapes"
        order = [name for name in order if name not in failed]
        rounds += 1
    return _kept(samples, failed), failed, False


def _kept(samples: Mapping[str, list[float]], failed: Mapping[str, str]) -> dict[str, list[float]]:
    return {name: values for name, values in samples.items() if name not in failed}


def _round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order of one round: forwards, then backwards, alternately, for two; for more, a
    seeded shuffle, so that no backend always follows the same neighbour (a call that follows
    one which filled the caches with its own data runs slower)."""
    if len(names) <= 2:
        return list(names) if round_index % 2 == 0 else list(reversed(names))
    shuffled = list(names)
    random.Random(round_index).shuffle(shuffled)
    return shuffled


def measured_peak_bytes(call: Callable[[], None], device: torch.device) -> int:
    """Bytes allocated above the inputs at the peak of one call (CUDA/ROCm allocator)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def estimated_peak_bytes(signature: Signature, backend: str) -> int:
    """Bytes one call needs above its inputs, from the shapes.

    Unfused paths (math, manual) hold the B·H·Lq·Lk score matrix: scores and softmax in the
    forward, plus the saved weights and their gradient in the backward, plus the dropout mask.
    Fused kernels hold only the output, the row log-sum-exp (fp32) and the input gradients.
    """
    s = signature
    item = int(getattr(torch, s.dtype).itemsize)
    rows = s.batch * s.heads * s.q_len
    out = rows * s.value_dim * item
    grads = 0
    if s.backward:
        grads = (
            rows * s.head_dim + s.batch * s.kv_heads * s.kv_len * (s.head_dim + s.value_dim)
        ) * item
    if backend in ("math", "manual"):
        matrices = 2 + (1 if s.backward else 0) + (1 if s.dropout_p else 0)
        return int(out + grads + matrices * rows * s.kv_len * item)
    return int(out + grads + rows * 4)


@dataclass
class SignatureTrials:
    """All backends at one signature, and the reasons torch's can_use_* checks gave."""

    signature: Signature
    trials: list[Trial] = field(default_factory=list)
    can_use: dict[str, list[str]] = field(default_factory=dict)
    #: Whether the probe's time budget stopped the rounds before the comparison was sure.
    stopped_by_budget: bool = False

    def trial(self, backend: str) -> Trial | None:
        return next((t for t in self.trials if t.backend == backend), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "signature": self.signature.label(),
            "trials": [t.to_dict() for t in self.trials],
            "can_use": {k: list(v) for k, v in self.can_use.items()},
            "stopped_by_budget": self.stopped_by_budget,
        }


def benchmark_signature(
    signature: Signature,
    device: torch.device,
    sync: Callable[[], None],
    backends: Sequence[str],
    *,
    min_samples: int = 3,
    max_samples: int = 15,
    budget_s: float = 0.2,
    rocm_experimental: bool = False,
    decided: Decided | None = None,
    deadline: float | None = None,
) -> SignatureTrials:
    """Try every backend in ``backends`` at ``signature``, then time those that run,
    interleaved (:func:`interleaved_samples`): at least ``min_samples`` each, more until
    ``decided`` is sure, ``budget_s`` is spent or the probe's ``deadline`` has passed (without
    ``decided``, ``min_samples``).

    ``rocm_experimental``: run the fused SDPA trials with ROCM_EXPERIMENTAL_ENV=1 (a ROCm GPU
    that needs it and runs without); the trial's note says so.
    """
    result = SignatureTrials(signature)
    result.can_use = can_use_reasons(signature, device)
    inputs = make_inputs(signature, device)
    calls: dict[str, Callable[[], None]] = {}
    for backend in backends:
        experimental = rocm_experimental and backend in ("flash", "efficient")
        with _maybe_experimental(experimental):
            trial, _ = try_backend(backend, signature, device, inputs)
        if experimental:
            trial.note = f"with {ROCM_EXPERIMENTAL_ENV}=1 set for this measurement only"
        if trial.runs:
            calls[backend] = _in_env(attention_call(backend, inputs, signature), experimental)
        result.trials.append(trial)
    samples, failed, result.stopped_by_budget = interleaved_samples(
        calls,
        sync,
        min_samples=min_samples,
        max_samples=max_samples,
        budget_s=budget_s,
        decided=decided,
        deadline=deadline,
    )
    for trial in result.trials:
        if trial.backend in failed:
            trial.runs = False
            trial.reasons = [failed[trial.backend]]
        elif trial.backend in samples:
            trial.samples = samples[trial.backend]
            if device.type == "cuda":
                trial.peak_bytes = measured_peak_bytes(calls[trial.backend], device)
                trial.memory_basis = "measured"
            else:
                trial.peak_bytes = estimated_peak_bytes(signature, trial.backend)
                trial.memory_basis = "estimated"
    del inputs, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _maybe_experimental(on: bool) -> contextlib.AbstractContextManager[None]:
    return env_set(ROCM_EXPERIMENTAL_ENV, "1") if on else contextlib.nullcontext()


def _in_env(call: Callable[[], None], experimental: bool) -> Callable[[], None]:
    """``call`` run with ROCM_EXPERIMENTAL_ENV=1 set around it when ``experimental``."""
    if not experimental:
        return call

    def wrapped() -> None:
        with env_set(ROCM_EXPERIMENTAL_ENV, "1"):
            call()

    return wrapped


__all__ = [
    "GPU_ONLY",
    "SDPA_BACKENDS",
    "Decided",
    "Inputs",
    "SignatureTrials",
    "Trial",
    "attention_call",
    "benchmark_signature",
    "can_use_reasons",
    "clean_reason",
    "env_set",
    "estimated_peak_bytes",
    "interleaved_samples",
    "make_inputs",
    "measured_peak_bytes",
    "try_backend",
]
