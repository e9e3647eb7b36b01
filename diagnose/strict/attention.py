"""Attention in strict mode: which SDPA calls ran unfused, whether a fused kernel runs their inputs
here, and why it did not (the attention probe's own reasons).

- **SDPA calls**: ``torch.nn.functional.scaled_dot_product_attention`` is wrapped while the steps
  are watched (diffusers, transformers and hand-made processors look it up there at each call);
  the dispatch mode tells the wrapper whether a fused attention op ran inside the call. None did:
  the math path ran.
- **Hand-written attention**: a batched matmul, a softmax over its last dim, and a batched matmul
  of the result (``bmm → softmax → bmm``, as diffusers' legacy processors and custom code write
  it) seen in the dispatched ops. SDPA's math path, called around the wrapper, is the same chain
  with ``_safe_softmax`` (torch 2.5+).
- **Whether a fused kernel runs here**: each fused SDPA backend is tried once at the call's exact
  signature (:func:`diagnose.probes.attention.bench.try_backend`), with the random generators put
  back afterwards; the reasons are :func:`diagnose.probes.attention.judging.why_not_fused`'s. On
  a CPU without a fused kernel for the case (dropout, unequal head dims) nothing fires and the
  record says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diagnose import attention_paths as ap

#: The fused SDPA backends tried at a math call's signature (the CPU has only "flash").
FUSED_BACKENDS = ("flash", "efficient", "cudnn")
#: Softmax ops of SDPA's own math path (a hand-written softmax dispatches ``_softmax``).
SDPA_MATH_SOFTMAX = "aten::_safe_softmax"
MANUAL_OP = "softmax(QKᵀ)V"
SDPA_OP = "scaled_dot_product_attention"


def device_kind(device: torch.device) -> str:
    """The device kind in the attention catalog's words: cpu, cuda or rocm."""
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    try:
        props = torch.cuda.get_device_properties(device)
        return str(getattr(props, "gcnArchName", "") or "").split(":")[0]
    except Exception:
        return ""


@dataclass(frozen=True)
class FusedVerdict:
    """Whether a fused SDPA kernel runs one signature here, and why the call did not use one."""

    #: The fused backends that ran at the signature ("flash", "efficient", "cudnn").
    runs: tuple[str, ...]
    #: Why the call ran unfused (switches, dtype, dropout, torch's own refusals), most decisive
    #: first; for a signature no fused kernel runs, why none does.
    reasons: tuple[str, ...]
    forced: bool
    rocm_experimental_missing: bool
    kind: str
    arch: str

    @property
    def exists(self) -> bool:
        return bool(self.runs)


@dataclass
class FusedPaths:
    """Fused-kernel verdicts per (signature, switches), tried once each."""

    cache: dict[tuple[Any, ...], FusedVerdict] = field(default_factory=dict)

    def verdict(
        self,
        signature: Any,
        device: torch.device,
        switches: dict[str, bool],
        call: SdpaCall | None = None,
    ) -> FusedVerdict:
        """The verdict at ``signature``; with ``call``, tried on inputs laid out as the call's
        own (its dims and strides decide too: no fused kernel takes 3-D inputs)."""
        layout = call.layout() if call is not None else ()
        key = (signature, layout, str(device), tuple(sorted(switches.items())))
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = _try_fused(signature, device, switches, call)
        return found


def _try_fused(
    signature: Any, device: torch.device, switches: dict[str, bool], call: SdpaCall | None
) -> FusedVerdict:
    from diagnose.probes.attention.bench import SignatureTrials, can_use_reasons, try_backend
    from diagnose.probes.attention.environment import rocm_experimental_missing, rocm_facts
    from diagnose.probes.attention.judging import PathGroup, why_not_fused

    kind = device_kind(device)
    arch = _arch(device)
    devices: list[int] = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    # A trial with dropout draws from the generators: the user's run must not see it.
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        inputs = call.trial_inputs(signature) if call is not None else None
        trials = [try_backend(b, signature, device, inputs)[0] for b in FUSED_BACKENDS]
        can_use = can_use_reasons(signature, device)
    group = PathGroup(signature, ap.MATH, "torch SDPA")
    group.switches_off = {name for name, on in switches.items() if not on}
    rocm = rocm_facts(kind, arch)
    reasons = why_not_fused(
        group,
        SignatureTrials(signature, trials, can_use),
        device_kind=kind,
        rocm=rocm,
        config_attention="",
        diffusers={},
    )
    fused_switches = (
        {"flash_sdp_enabled"}
        if kind == "cpu"
        else {
            "flash_sdp_enabled",
            "mem_efficient_sdp_enabled",
            "cudnn_sdp_enabled",
        }
    )
    return FusedVerdict(
        runs=tuple(t.backend for t in trials if t.runs),
        reasons=tuple(reasons),
        forced=bool(group.switches_off & fused_switches),
        rocm_experimental_missing=rocm_experimental_missing(rocm),
        kind=kind,
        arch=arch,
    )


# --------------------------------------------------------------------------------------------
# One SDPA call while it runs


@dataclass
class SdpaCall:
    """An SDPA call in progress: its arguments, and whether a fused op ran inside it."""

    bound: dict[str, Any]
    fused: bool = False

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SdpaCall:
        from diagnose.probes.attention.calls import bind_sdpa_args

        return cls(bind_sdpa_args(args, kwargs))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        q, k, v = (self.bound.get(n) for n in ("query", "key", "value"))
        if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return q, k, v  # type: ignore[return-value]
        return None

    def layout(self) -> tuple[Any, ...]:
        """Shapes and strides of q, k, v (what a fused kernel's checks read beside the
        signature)."""
        found = self.tensors()
        if found is None:
            return ()
        return tuple((tuple(t.shape), tuple(t.stride())) for t in found)

    def trial_inputs(self, signature: Any) -> Any:
        """Random inputs laid out as this call's own, in the signature's dtype, for a trial."""
        from diagnose.probes.attention.bench import Inputs
        from diagnose.probes.attention.calls import tensor_or_none

        found = self.tensors()
        assert found is not None
        q, k, v = found
        dtype = getattr(torch, signature.dtype)

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.randn_like(t, dtype=dtype).requires_grad_(signature.backward)

        mask = tensor_or_none(self.bound.get("attn_mask"))
        grad_out = None
        if signature.backward:
            shape = (*q.shape[:-1], v.shape[-1])
            grad_out = torch.randn(shape, dtype=dtype, device=q.device)
        return Inputs(like(q), like(k), like(v), None if mask is None else mask.detach(), grad_out)

    def signature(self, dtype: torch.dtype) -> Any:
        """The attention probe's signature of this call, at the dtype it computed in."""
        from diagnose.probes.attention.calls import dtype_name, sdpa_signature, tensor_or_none

        found = self.tensors()
        assert found is not None
        q, k, v = found
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        signature = sdpa_signature(
            q,
            k,
            v,
            tensor_or_none(self.bound.get("attn_mask")),
            float(self.bound.get("dropout_p") or 0.0),
            bool(self.bound.get("is_causal") or False),
            backward,
        )
        return signature.with_dtype(dtype_name(dtype))


def is_fused_op(name: str) -> bool:
    """Whether an aten op (``aten::_scaled_dot_product_flash_attention_for_cpu``) is a fused
    attention kernel's."""
    return ap.op_path(name) in ap.FUSED_PATHS


# --------------------------------------------------------------------------------------------
# Hand-written attention in the dispatched ops


@dataclass
class _Scores:
    left: torch.Size
    right: torch.Size
    out: torch.Size
    dtype: str
    requires_grad: bool
    mask_shape: tuple[int, ...] = ()
    mask_dtype: str = ""


@dataclass
class ManualChain:
    """``bmm → softmax → bmm`` in the dispatched ops of one thread."""

    scores: _Scores | None = None
    softmax: tuple[torch.Size, int, bool] | None = None

    def reset(self) -> None:
        self.scores = None
        self.softmax = None

    def matmul(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A batched matmul about to run: the end of a chain (its signature, and whether SDPA's
        math path made it) or the start of one; None when no chain ends here."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        mask_shape: tuple[int, ...] = ()
        mask_dtype = ""
        if name == "aten::baddbmm" and len(tensors) >= 3:
            beta = args[3] if len(args) > 3 else kwargs.get("beta", 1)
            if beta != 0:
                mask_shape, mask_dtype = tuple(tensors[0].shape), str(tensors[0].dtype)
            tensors = tensors[1:]
        if len(tensors) < 2 or tensors[0].dim() < 3 or tensors[1].dim() < 3:
            self.reset()
            return None
        left, right = tensors[0], tensors[1]
        ended = self._ends(left, right)
        self.reset()
        if ended is not None:
            return ended
        out = torch.Size([*left.shape[:-1], right.shape[-1]])
        self.scores = _Scores(
            left.shape,
            right.shape,
            out,
            str(left.dtype).removeprefix("torch."),
            torch.is_grad_enabled() and (left.requires_grad or right.requires_grad),
            mask_shape,
            mask_dtype.removeprefix("torch."),
        )
        return None

    def softmax_op(self, name: str, args: tuple[Any, ...]) -> None:
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        scores = self.scores
        if (
            source is None
            or scores is None
            or dim not in (-1, source.dim() - 1)
            or source.numel() != scores.out.numel()
            or tuple(source.shape[-2:]) != tuple(scores.out[-2:])
        ):
            self.reset()
            return
        self.softmax = (source.shape, dim, name == SDPA_MATH_SOFTMAX)

    def _ends(self, left: torch.Tensor, right: torch.Tensor) -> Any:
        scores, soft = self.scores, self.softmax
        if scores is None or soft is None:
            return None
        shape, dim, sdpa = soft
        if left.numel() != scores.out.numel() or tuple(left.shape[-2:]) != tuple(shape[-2:]):
            return None
        if right.shape[-2] != shape[-1]:
            return None
        from diagnose.probes.attention.capture import (
            _MatmulSeen,
            _SoftmaxSeen,
            manual_signature,
        )

        first = _MatmulSeen(
            0,
            scores.left,
            scores.right,
            scores.dtype,
            scores.requires_grad,
            scores.mask_shape,
            scores.mask_dtype,
        )
        second = _MatmulSeen(
            2,
            left.shape,
            right.shape,
            str(left.dtype).removeprefix("torch."),
            torch.is_grad_enabled() and (left.requires_grad or right.requires_grad),
        )
        return manual_signature(first, _SoftmaxSeen(1, shape, dim), second), sdpa


__all__ = [
    "FUSED_BACKENDS",
    "MANUAL_OP",
    "SDPA_OP",
    "FusedPaths",
    "FusedVerdict",
    "ManualChain",
    "SdpaCall",
    "device_kind",
    "is_fused_op",
]
