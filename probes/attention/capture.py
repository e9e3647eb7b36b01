"""Every attention call of one training step: its module, its inputs and the path that ran.

One extra training step (the workload left untouched: diagnose.workload.untouched) runs under
``torch.profiler`` and an :class:`AttentionRecorder`:

- forward hooks on the attention modules (diffusers ``Attention`` and anything with a
  ``processor``, transformers' ``*Attention`` modules) name the module and its processor and put a
  ``diagnose::attention_module#N`` range around each call;
- a ``TorchFunctionMode`` sees every ``scaled_dot_product_attention`` call (diffusers'
  ``AttnProcessor2_0``, ``dispatch_attention_fn``, transformers, custom code) with its real
  q/k/v/mask, dropout and the SDPA switches as they were at that moment, and wraps it in a
  ``diagnose::attention_call#N`` range; inside attention modules it also records
  matmul/softmax calls, so a hand-written ``softmax(QKᵀ)V`` is found with its shapes;
- afterwards :func:`diagnose.probes.attention.attribution.attribute` reads the profiler's events
  under each range: which op really ran, its kernels, its forward and backward time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from diagnose import attention_paths
from diagnose.probes.attention.attribution import ProfEvent, attribute, events_from_profiler
from diagnose.probes.attention.calls import (
    CALL_RANGE,
    MODULE_RANGE,
    OP_RANGE,
    SDPA_SWITCHES,
    AttentionCall,
    Signature,
    bind_sdpa_args,
    dtype_name,
    sdpa_signature,
    sdpa_switches,
    tensor_or_none,
)
from diagnose.torch_compat import PRIVATE_SOFTMAXES
from diagnose.workload.untouched import steps_without_update

# --------------------------------------------------------------------------------------------
# Python-level recording: module hooks and a TorchFunctionMode

_MATMULS: frozenset[Any] = frozenset(
    {
        torch.bmm,
        torch.baddbmm,
        torch.matmul,
        torch.einsum,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.bmm,
        torch.Tensor.baddbmm,
    }
)
_SOFTMAXES: frozenset[Any] = frozenset(
    {torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax, *PRIVATE_SOFTMAXES}
)


def _is_matmul_or_softmax(func: Any) -> bool:
    try:
        return func in _MATMULS or func in _SOFTMAXES
    except TypeError:  # an unhashable callable: none of ours
        return False


@dataclass
class _MatmulSeen:
    op_index: int
    left: torch.Size | None
    right: torch.Size | None
    dtype: str
    requires_grad: bool
    mask_shape: tuple[int, ...] = ()
    mask_dtype: str = ""


@dataclass
class _SoftmaxSeen:
    op_index: int
    shape: torch.Size
    dim: int


@dataclass
class _Frame:
    """One call of an attention module, while it runs."""

    name: str
    processor: str
    module_index: int
    span: Any
    #: What happened inside, in order: _MatmulSeen, _SoftmaxSeen, or an int (an SDPA call index).
    seen: list[Any] = field(default_factory=list)


def attention_modules(models: Mapping[str, torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """The innermost attention modules of ``models``, by qualified name ("denoiser.…attn1").

    An attention module is one with a ``processor`` attribute (diffusers) or a class name that
    contains "Attention" (transformers, kohya, custom code); of nested ones only the innermost is
    kept, since that is where the attention itself is computed.
    """
    found: list[tuple[str, torch.nn.Module]] = []
    for prefix, model in models.items():
        candidates = [
            (name, module)
            for name, module in model.named_modules()
            if hasattr(module, "processor") or "Attention" in type(module).__name__
        ]
        names = {name for name, _ in candidates}
        for name, module in candidates:
            inner = any(
                other != name and (other.startswith(name + ".") or not name) for other in names
            )
            if not inner:
                found.append((f"{prefix}.{name}" if name else prefix, module))
    return found


def processor_label(module: torch.nn.Module) -> str:
    """The processor class (diffusers), attention implementation (transformers) or class name."""
    processor = getattr(module, "processor", None)
    if processor is not None:
        return type(processor).__name__
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if isinstance(implementation, str):
        return f"{type(module).__name__} (attn_implementation={implementation})"
    return type(module).__name__


class AttentionRecorder(TorchFunctionMode):
    """Records attention calls (see the module docstring). Use as a context manager."""

    def __init__(self, models: Mapping[str, torch.nn.Module]) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []
        self.module_spans: dict[int, tuple[str, str]] = {}
        #: Profiler op-range index -> manual call index, filled when a pattern is found.
        self.op_owner: dict[int, int] = {}
        self._modules = attention_modules(models)
        self._stack: list[_Frame] = []
        self._handles: list[Any] = []
        self._next_op = 0

    # ---------------------------------------------------------------- hooks

    def __enter__(self) -> AttentionRecorder:
        for name, module in self._modules:
            label = processor_label(module)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name, label)))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._stack:  # a step that raised inside an attention module
            self._stack.pop().span.__exit__(None, None, None)

    def _pre_hook(self, name: str, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            index = len(self.module_spans)
            self.module_spans[index] = (name, label)
            span = torch.profiler.record_function(f"{MODULE_RANGE}{index}")
            span.__enter__()  # type: ignore[no-untyped-call]
            self._stack.append(_Frame(name, label, index, span))

        return hook

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        frame = self._stack.pop()
        frame.span.__exit__(None, None, None)
        self._find_manual(frame)

    # ---------------------------------------------------------------- the mode

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            return self._sdpa(func, args, kwargs)
        if self._stack and _is_matmul_or_softmax(func):
            return self._inside_module(func, args, kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        bound = bind_sdpa_args(args, kwargs)
        query, key, value = (tensor_or_none(bound.get(n)) for n in ("query", "key", "value"))
        frame = self._stack[-1] if self._stack else None
        call = AttentionCall(
            index=len(self.calls),
            module=frame.name if frame else "",
            processor=frame.processor if frame else "",
            entry="sdpa",
            scale=float(bound["scale"]) if bound.get("scale") is not None else None,
            switches=sdpa_switches(),
        )
        if query is not None and key is not None and value is not None:
            backward = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            call.signature = sdpa_signature(
                query,
                key,
                value,
                tensor_or_none(bound.get("attn_mask")),
                float(bound.get("dropout_p") or 0.0),
                bool(bound.get("is_causal") or False),
                backward,
            )
        self.calls.append(call)
        if frame is not None:
            frame.seen.append(call.index)
        with torch.profiler.record_function(f"{CALL_RANGE}{call.index}"):
            return func(*args, **kwargs)

    def _inside_module(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        frame = self._stack[-1]
        op_index = self._next_op
        self._next_op += 1
        if func in _SOFTMAXES:
            source = tensor_or_none(args[0] if args else kwargs.get("input"))
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            if source is not None and isinstance(dim, int):
                frame.seen.append(_SoftmaxSeen(op_index, source.shape, dim))
        else:
            frame.seen.append(_matmul_seen(func, args, kwargs, op_index))
        with torch.profiler.record_function(f"{OP_RANGE}{op_index}"):
            return func(*args, **kwargs)

    def _find_manual(self, frame: _Frame) -> None:
        """matmul → softmax(last dim) → matmul, with no SDPA call between: a manual attention."""
        seen = frame.seen
        k = 0
        while k + 2 < len(seen):
            first, soft, second = seen[k], seen[k + 1], seen[k + 2]
            if (
                isinstance(first, _MatmulSeen)
                and isinstance(soft, _SoftmaxSeen)
                and isinstance(second, _MatmulSeen)
                and soft.dim in (-1, len(soft.shape) - 1)
                and len(soft.shape) >= 3
            ):
                call = AttentionCall(
                    index=len(self.calls),
                    module=frame.name,
                    processor=frame.processor,
                    entry="manual",
                    signature=manual_signature(first, soft, second),
                    switches=sdpa_switches(),
                    path=attention_paths.MANUAL,
                    provider="hand-written",
                )
                self.calls.append(call)
                for op in (first, soft, second):
                    self.op_owner[op.op_index] = call.index
                k += 3
            else:
                k += 1


def _matmul_seen(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], op_index: int
) -> _MatmulSeen:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if func is torch.einsum:
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        tensors = [a for a in operands if isinstance(a, torch.Tensor)]
    mask_shape: tuple[int, ...] = ()
    mask_dtype = ""
    if func in (torch.baddbmm, torch.Tensor.baddbmm) and len(tensors) >= 3:
        # baddbmm(input, q, kᵀ, beta, alpha): input is the mask when beta is not 0.
        beta = kwargs.get("beta", 1)
        if beta != 0:
            mask_shape = tuple(int(s) for s in tensors[0].shape)
            mask_dtype = dtype_name(tensors[0].dtype)
        tensors = tensors[1:]
    elif func is torch.Tensor.__rmatmul__ and len(tensors) >= 2:
        tensors = [tensors[1], tensors[0]]
    left = tensors[0] if tensors else None
    right = tensors[1] if len(tensors) > 1 else None
    return _MatmulSeen(
        op_index=op_index,
        left=left.shape if left is not None else None,
        right=right.shape if right is not None else None,
        dtype=dtype_name(left.dtype) if left is not None else "",
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors[:2]),
        mask_shape=mask_shape,
        mask_dtype=mask_dtype,
    )


def manual_signature(first: _MatmulSeen, soft: _SoftmaxSeen, second: _MatmulSeen) -> Signature:
    """The signature of a hand-written attention from its scores (…, Lq, Lk) and operands."""
    scores = soft.shape
    lead = tuple(int(s) for s in scores[:-2])
    folded = len(lead) == 1
    batch = lead[0] if folded else math.prod(lead[:-1])
    heads = 1 if folded else lead[-1]
    head_dim = int(first.left[-1]) if first.left is not None else 0
    value_dim = int(second.right[-1]) if second.right is not None else head_dim
    return Signature(
        batch=int(batch),
        heads=int(heads),
        kv_heads=int(heads),
        q_len=int(scores[-2]),
        kv_len=int(scores[-1]),
        head_dim=head_dim or value_dim,
        value_dim=value_dim,
        dtype=first.dtype,
        mask_shape=first.mask_shape,
        mask_dtype=first.mask_dtype,
        backward=first.requires_grad or second.requires_grad,
        heads_folded=folded,
    )


# --------------------------------------------------------------------------------------------
# Running the extra step


def workload_models(workload: Any) -> dict[str, torch.nn.Module]:
    """The models whose attention runs in a step: denoiser, text encoders, VAE."""
    models: dict[str, torch.nn.Module] = {"denoiser": workload.denoiser}
    for i, encoder in enumerate(getattr(workload, "text_encoders", []) or []):
        models[f"text_encoder_{i + 1}" if i else "text_encoder"] = encoder
    vae = getattr(workload, "vae", None)
    if isinstance(vae, torch.nn.Module):
        models["vae"] = vae
    return models


@dataclass
class CapturedStep:
    calls: list[AttentionCall]
    #: Wall seconds of the profiled step (with the profiler's and recorder's overhead).
    step_seconds: float
    loss: float | None = None


def capture_step(workload: Any, sync: Callable[[], None]) -> CapturedStep:
    """One training step on the next batch, profiled and recorded; parameters left untouched."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from diagnose.quiet import native_stderr_filtered
    from diagnose.timing import PhaseTimer

    device: torch.device = workload.device
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    batch = next(workload.batches())
    recorder = AttentionRecorder(workload_models(workload))
    with steps_without_update(workload), native_stderr_filtered():
        with profile(activities=activities, record_shapes=True) as prof, recorder:
            sync()
            start = time.perf_counter()
            loss = workload.step(batch, PhaseTimer(sync))
            sync()
            seconds = time.perf_counter() - start
        events = events_from_profiler(prof, on_device)
    calls = attribute(
        recorder.calls,
        events,
        op_owner=recorder.op_owner,
        module_spans=recorder.module_spans,
        on_device=on_device,
    )
    return CapturedStep(calls=calls, step_seconds=seconds, loss=float(loss))


__all__ = [
    "CALL_RANGE",
    "MODULE_RANGE",
    "OP_RANGE",
    "SDPA_SWITCHES",
    "AttentionCall",
    "AttentionRecorder",
    "CapturedStep",
    "ProfEvent",
    "Signature",
    "attention_modules",
    "attribute",
    "capture_step",
    "dtype_name",
    "events_from_profiler",
    "manual_signature",
    "processor_label",
    "sdpa_signature",
    "sdpa_switches",
    "workload_models",
]
