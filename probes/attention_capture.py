"""Every attention call of one training step: its module, its inputs and the path that ran.

One extra training step runs under ``torch.profiler`` and an :class:`AttentionRecorder`:

- forward hooks on the attention modules (diffusers ``Attention`` and anything with a
  ``processor``, transformers' ``*Attention`` modules) name the module and its processor and put a
  ``diagnose::attention_module#N`` range around each call;
- a ``TorchFunctionMode`` sees every ``scaled_dot_product_attention`` call (diffusers'
  ``AttnProcessor2_0``, ``dispatch_attention_fn``, transformers, custom code) with its real
  q/k/v/mask, dropout and the SDPA switches as they were at that moment, and wraps it in a
  ``diagnose::attention_call#N`` range; inside attention modules it also records
  matmul/softmax calls, so a hand-written ``softmax(QKᵀ)V`` is found with its shapes;
- afterwards the profiler's events under each range say which op really ran
  (:func:`diagnose.attention_paths.classify_op`), its kernels, and its forward and backward time
  (backward nodes are matched to the forward op that created them by autograd sequence number).

The pure part (:func:`attribute`) works on :class:`ProfEvent`, a plain copy of the profiler's
events, so it is tested without a profiler.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from diagnose import attention_paths
from diagnose.attention_paths import classify_op

CALL_RANGE = "diagnose::attention_call#"
OP_RANGE = "diagnose::attention_op#"
MODULE_RANGE = "diagnose::attention_module#"
#: torch.backends.cuda switches that decide SDPA's choice (on the CPU too: flash_sdp covers the
#: CPU's fused kernel).
SDPA_SWITCHES: tuple[str, ...] = (
    "flash_sdp_enabled",
    "mem_efficient_sdp_enabled",
    "cudnn_sdp_enabled",
    "math_sdp_enabled",
)
_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"

#: Profiler dtype names -> torch dtype names.
_PROFILER_DTYPES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::BFloat16": "bfloat16",
    "c10::Half": "float16",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
}


# --------------------------------------------------------------------------------------------
# What one attention call looks like


@dataclass(frozen=True)
class Signature:
    """The inputs that decide which kernel can run and what it costs (one benchmark each)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    #: torch dtype name of q/k/v as the kernel saw them (after autocast).
    dtype: str
    #: Mask shape and dtype name; empty shape for no mask.
    mask_shape: tuple[int, ...] = ()
    mask_dtype: str = ""
    dropout_p: float = 0.0
    is_causal: bool = False
    #: Whether the call is differentiated (a training call: benchmark forward + backward).
    backward: bool = False
    #: q laid out as (B, L, H, D) transposed to (B, H, L, D), as diffusers' processors pass it.
    transposed: bool = False
    #: A hand-written attention over (B·H, L, D): heads folded into the batch.
    heads_folded: bool = False

    @property
    def has_mask(self) -> bool:
        return bool(self.mask_shape)

    def label(self) -> str:
        bh = f"B·H={self.batch}" if self.heads_folded else f"B={self.batch} H={self.heads}"
        if self.kv_heads != self.heads and not self.heads_folded:
            bh += f" KVH={self.kv_heads}"
        dims = f"D={self.head_dim}" + (
            f" Dv={self.value_dim}" if self.value_dim != self.head_dim else ""
        )
        parts = [bh, f"Lq={self.q_len}", f"Lk={self.kv_len}", dims, self.dtype]
        if self.has_mask:
            parts.append(f"mask {self.mask_dtype}[{','.join(map(str, self.mask_shape))}]")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.is_causal:
            parts.append("causal")
        parts.append("fwd+bwd" if self.backward else "fwd")
        return " ".join(parts)

    def with_dtype(self, dtype: str) -> Signature:
        return Signature(**{**self.__dict__, "dtype": dtype})


@dataclass
class AttentionCall:
    """One attention computation in the profiled step."""

    index: int
    #: Qualified module name ("denoiser.down_blocks.0...attn1"), "" outside attention modules.
    module: str = ""
    #: The module's processor class (diffusers), attention implementation (transformers) or
    #: module class.
    processor: str = ""
    #: How it was found: "sdpa" (a scaled_dot_product_attention call), "manual" (matmul →
    #: softmax → matmul in Python), "op" (an attention op seen only by the profiler: xFormers,
    #: flash-attn).
    entry: str = "sdpa"
    signature: Signature | None = None
    scale: float | None = None
    #: SDPA switches at the moment of the call.
    switches: dict[str, bool] = field(default_factory=dict)
    #: Path that ran (diagnose.attention_paths names), "unknown" when the profiler saw none.
    path: str = "unknown"
    provider: str = ""
    ops: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    #: Autograd nodes of this call that ran in the backward.
    backward_nodes: int = 0
    #: Run again inside the backward (gradient checkpointing recomputes the forward).
    recomputed: bool = False

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "module": self.module,
            "processor": self.processor,
            "entry": self.entry,
            "signature": self.signature.label() if self.signature else "",
            "scale": self.scale,
            "switches": dict(self.switches),
            "path": self.path,
            "provider": self.provider,
            "ops": list(self.ops),
            "kernels": list(self.kernels),
            "forward_ms": round(self.forward_seconds * 1e3, 4),
            "backward_ms": round(self.backward_seconds * 1e3, 4),
            "recomputed": self.recomputed,
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sdpa_switches() -> dict[str, bool]:
    """The SDPA switches now (they change inside ``sdpa_kernel`` contexts)."""
    backends = torch.backends.cuda
    return {
        name: bool(getattr(backends, name)()) for name in SDPA_SWITCHES if hasattr(backends, name)
    }


def _tensor(value: object) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def sdpa_signature(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    backward: bool,
) -> Signature:
    """The signature of one SDPA call from its arguments ((..., H, L, D) layout)."""
    lead = query.shape[:-3]
    batch = math.prod(lead) if lead else 1
    heads = query.shape[-3] if query.dim() >= 3 else 1
    kv_heads = key.shape[-3] if key.dim() >= 3 else 1
    transposed = (
        query.dim() == 4 and not query.is_contiguous() and query.transpose(1, 2).is_contiguous()
    )
    return Signature(
        batch=int(batch),
        heads=int(heads),
        kv_heads=int(kv_heads),
        q_len=int(query.shape[-2]),
        kv_len=int(key.shape[-2]),
        head_dim=int(query.shape[-1]),
        value_dim=int(value.shape[-1]),
        dtype=dtype_name(query.dtype),
        mask_shape=tuple(int(s) for s in attn_mask.shape) if attn_mask is not None else (),
        mask_dtype=dtype_name(attn_mask.dtype) if attn_mask is not None else "",
        dropout_p=float(dropout_p),
        is_causal=bool(is_causal),
        backward=backward,
        transposed=bool(transposed),
    )


# --------------------------------------------------------------------------------------------
# Python-level recording: module hooks and a TorchFunctionMode

_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
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
    {torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax, torch._softmax}
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
        bound = dict(zip(_SDPA_PARAMS, args, strict=False))
        bound.update(kwargs)
        query, key, value = (_tensor(bound.get(n)) for n in ("query", "key", "value"))
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
                _tensor(bound.get("attn_mask")),
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
            source = _tensor(args[0] if args else kwargs.get("input"))
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
# Profiler events → per-call path and time (pure)


@dataclass
class ProfEvent:
    """One profiler event, copied from torch's FunctionEvent (times in microseconds)."""

    id: int
    name: str
    parent: int | None
    start_us: float
    end_us: float
    cpu_us: float
    device_us: float = 0.0
    sequence_nr: int = -1
    thread: int = 0
    fwd_thread: int = 0
    input_dtypes: list[str] = field(default_factory=list)
    input_shapes: list[Any] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)


def events_from_profiler(prof: Any, on_device: bool = False) -> list[ProfEvent]:
    """Plain copies of ``prof.events()`` (torch.profiler.profile after it stopped).

    Device times and kernels are read only for a GPU run, input shapes and dtypes only for
    attention ops (the only ones read later): both are slow to compute for every event.
    """
    copied: list[ProfEvent] = []
    for event in prof.events():
        parent = event.cpu_parent
        name = str(event.name)
        is_attention = classify_op(name) is not None
        copied.append(
            ProfEvent(
                id=int(event.id),
                name=name,
                parent=int(parent.id) if parent is not None else None,
                start_us=float(event.time_range.start),
                end_us=float(event.time_range.end),
                cpu_us=float(event.time_range.end - event.time_range.start),
                device_us=float(event.self_device_time_total or 0.0) if on_device else 0.0,
                sequence_nr=int(event.sequence_nr),
                thread=int(event.thread),
                fwd_thread=int(event.fwd_thread or 0),
                input_dtypes=list(event.input_dtypes or []) if is_attention else [],
                input_shapes=list(event.input_shapes or []) if is_attention else [],
                kernels=[str(k.name) for k in event.kernels] if on_device else [],
            )
        )
    return copied


def _range_index(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix) :]
    return int(tail) if tail.isdigit() else None


@dataclass
class _Tree:
    by_id: dict[int, ProfEvent]
    children: dict[int, list[int]]

    @classmethod
    def of(cls, events: Sequence[ProfEvent]) -> _Tree:
        children: dict[int, list[int]] = defaultdict(list)
        for e in events:
            if e.parent is not None:
                children[e.parent].append(e.id)
        return cls({e.id: e for e in events}, children)

    def descendants(self, root: int) -> Iterator[ProfEvent]:
        todo = list(self.children.get(root, ()))
        while todo:
            current = todo.pop()
            yield self.by_id[current]
            todo.extend(self.children.get(current, ()))

    def inclusive_device_us(self, root: int) -> float:
        own = self.by_id[root].device_us
        return own + sum(e.device_us for e in self.descendants(root))

    def cost_us(self, root: int, on_device: bool) -> float:
        return self.inclusive_device_us(root) if on_device else self.by_id[root].cpu_us

    def outermost(self, root: int, keep: Callable[[ProfEvent], bool]) -> list[ProfEvent]:
        """Descendants of ``root`` that match ``keep`` and have no matching ancestor below root."""
        found: list[ProfEvent] = []
        todo = list(self.children.get(root, ()))
        while todo:
            current = self.by_id[todo.pop()]
            if keep(current):
                found.append(current)
            else:
                todo.extend(self.children.get(current.id, ()))
        return found


def attribute(
    calls: list[AttentionCall],
    events: Sequence[ProfEvent],
    *,
    op_owner: Mapping[int, int],
    module_spans: Mapping[int, tuple[str, str]],
    on_device: bool,
) -> list[AttentionCall]:
    """Fill in each call's path, ops, kernels and forward/backward seconds from the profiler.

    Returns the calls plus any found only by the profiler: an attention op (xFormers,
    flash-attn) inside an attention module with no SDPA call or manual pattern of its own.
    Forward time is the call's range (device time on a GPU, host time on the CPU); backward
    time is the autograd nodes whose sequence number was last taken inside the call's range.
    """
    tree = _Tree.of(events)
    owner: dict[int, int] = {}  # event id -> call index
    call_ranges: dict[int, ProfEvent] = {}
    op_ranges: dict[int, list[ProfEvent]] = defaultdict(list)
    module_ranges: list[tuple[int, ProfEvent]] = []
    for e in events:
        if (i := _range_index(e.name, CALL_RANGE)) is not None:
            call_ranges[i] = e
        elif (i := _range_index(e.name, OP_RANGE)) is not None and i in op_owner:
            op_ranges[op_owner[i]].append(e)
        elif (i := _range_index(e.name, MODULE_RANGE)) is not None:
            module_ranges.append((i, e))

    by_index = {c.index: c for c in calls}
    anchors: dict[int, ProfEvent] = {}  # call index -> the range or op that stands for it
    for index, span in call_ranges.items():
        call = by_index.get(index)
        if call is None:
            continue
        anchors[index] = span
        owner[span.id] = index
        for d in tree.descendants(span.id):
            owner[d.id] = index
        _fill_path(call, tree, span.id)
        call.forward_seconds = tree.cost_us(span.id, on_device) / 1e6
    for index, spans in op_ranges.items():
        call = by_index[index]
        anchors[index] = spans[0]
        for span in spans:
            owner[span.id] = index
            for d in tree.descendants(span.id):
                owner[d.id] = index
            call.ops.extend(d.name for d in tree.outermost(span.id, _is_aten))
            call.kernels.extend(k for d in tree.descendants(span.id) for k in d.kernels)
            call.forward_seconds += tree.cost_us(span.id, on_device) / 1e6

    # Attention ops the mode could not see (xFormers, flash-attn): one call per outermost op.
    added = list(calls)
    for module_index, span in module_ranges:
        name, label = module_spans.get(module_index, ("", ""))
        if any(d.id in owner for d in tree.descendants(span.id)):
            continue
        for op in tree.outermost(span.id, lambda ev: classify_op(ev.name) is not None):
            call = AttentionCall(index=len(added), module=name, processor=label, entry="op")
            call.signature = _signature_from_op(op)
            anchors[call.index] = op
            owner[op.id] = call.index
            for d in tree.descendants(op.id):
                owner[d.id] = call.index
            _fill_path(call, tree, op.id, include_root=True)
            call.forward_seconds = tree.cost_us(op.id, on_device) / 1e6
            added.append(call)

    _attribute_backward(added, events, tree, owner, on_device)
    _mark_recomputed(added, events, tree, anchors)
    for call in added:
        call.kernels = [k for k, _ in Counter(call.kernels).most_common(4)]
    return added


def _mark_recomputed(
    calls: list[AttentionCall],
    events: Sequence[ProfEvent],
    tree: _Tree,
    anchors: Mapping[int, ProfEvent],
) -> None:
    """Flag calls run inside the backward, and make forward-only the ones whose graph was dropped.

    With gradient checkpointing a call's first forward is discarded (its backward never runs)
    and the forward runs again inside the backward. The first one then costs a forward only:
    its signature loses ``backward`` so it is benchmarked as what it cost. This is only decided
    when some call's backward was found at all (otherwise attribution failed, and nothing is
    changed).
    """
    backward_roots = {e.id for e in events if e.name.startswith(_BACKWARD_PREFIX)}
    by_index = {c.index: c for c in calls}
    for index, anchor in anchors.items():
        if index in by_index and _has_ancestor_in(anchor, tree, backward_roots):
            by_index[index].recomputed = True
    if not any(c.backward_nodes for c in calls):
        return
    for call in calls:
        sig = call.signature
        if sig is not None and sig.backward and not call.backward_nodes:
            call.signature = Signature(**{**sig.__dict__, "backward": False})


def _is_aten(event: ProfEvent) -> bool:
    return event.name.startswith("aten::")


def _fill_path(call: AttentionCall, tree: _Tree, root: int, include_root: bool = False) -> None:
    """Path, op, kernels and kernel dtype of the outermost attention op under ``root``.

    Under ``aten::scaled_dot_product_attention`` (no path itself) the dispatcher's choice is the
    first attention op: ``aten::_scaled_dot_product_flash_attention`` rather than the
    ``aten::_flash_attention_forward`` it calls.
    """
    if include_root and classify_op(tree.by_id[root].name) is not None:
        found = [tree.by_id[root]]
    else:
        found = tree.outermost(root, lambda ev: classify_op(ev.name) is not None)
    if not found:
        return
    chosen = min(found, key=lambda ev: ev.start_us)
    kind = classify_op(chosen.name)
    assert kind is not None
    call.path, call.provider = kind.path, kind.provider
    call.ops = [chosen.name]
    call.kernels = [k for d in [chosen, *tree.descendants(chosen.id)] for k in d.kernels]
    dtype = _PROFILER_DTYPES.get(chosen.input_dtypes[0]) if chosen.input_dtypes else None
    if call.signature is not None and dtype and dtype != call.signature.dtype:
        # Autocast casts q/k/v after the Python call: the kernel saw this dtype.
        call.signature = call.signature.with_dtype(dtype)


def _signature_from_op(op: ProfEvent) -> Signature | None:
    """Shapes of an attention op: torch's SDPA ops take (B, H, L, D), xFormers and flash-attn
    (B, L, H, D). Seen when the Python call was not (recomputation, other libraries)."""
    shapes = [s for s in op.input_shapes[:3] if isinstance(s, list)]
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes):
        return None
    kind = classify_op(op.name)
    heads_first = kind is not None and kind.provider.startswith("torch SDPA")
    q, k, v = shapes
    h, length = (1, 2) if heads_first else (2, 1)
    dtype = _PROFILER_DTYPES.get(op.input_dtypes[0], "") if op.input_dtypes else ""
    mask = op.input_shapes[3] if heads_first and len(op.input_shapes) > 3 else []
    return Signature(
        batch=int(q[0]),
        heads=int(q[h]),
        kv_heads=int(k[h]),
        q_len=int(q[length]),
        kv_len=int(k[length]),
        head_dim=int(q[3]),
        value_dim=int(v[3]),
        dtype=dtype,
        mask_shape=tuple(int(x) for x in mask) if isinstance(mask, list) else (),
        mask_dtype=(
            _PROFILER_DTYPES.get(op.input_dtypes[3], op.input_dtypes[3])
            if mask and len(op.input_dtypes) > 3
            else ""
        ),
        transposed=not heads_first,
    )


def _attribute_backward(
    calls: list[AttentionCall],
    events: Sequence[ProfEvent],
    tree: _Tree,
    owner: Mapping[int, int],
    on_device: bool,
) -> None:
    """Charge each autograd node's time to the call whose forward op created it.

    Autograd numbers nodes per thread; ops record the number current when they start, and the
    op that creates a node is the last one to see its number. So the creator of node (thread,
    n) is the latest-starting forward op with that number.
    """
    backward_ids: set[int] = set()
    for e in events:
        if e.name.startswith(_BACKWARD_PREFIX):
            backward_ids.add(e.id)
            backward_ids.update(d.id for d in tree.descendants(e.id))
    creator: dict[tuple[int, int], ProfEvent] = {}
    for e in events:
        if e.sequence_nr < 0 or e.id in backward_ids:
            continue
        key = (e.thread, e.sequence_nr)
        if key not in creator or e.start_us >= creator[key].start_us:
            creator[key] = e
    by_index = {c.index: c for c in calls}
    counted: set[int] = set()
    nodes = sorted(
        (e for e in events if e.name.startswith(_BACKWARD_PREFIX) and e.sequence_nr >= 0),
        key=lambda e: e.start_us,
    )
    for node in nodes:
        made_by = creator.get((node.fwd_thread, node.sequence_nr))
        if made_by is None or made_by.id not in owner:
            continue
        if _has_ancestor_in(node, tree, counted):
            continue  # nested inside a node already charged (checkpoint recomputation)
        call = by_index.get(owner[made_by.id])
        if call is None:
            continue
        call.backward_seconds += tree.cost_us(node.id, on_device) / 1e6
        call.backward_nodes += 1
        counted.add(node.id)


def _has_ancestor_in(event: ProfEvent, tree: _Tree, ids: set[int]) -> bool:
    parent = event.parent
    while parent is not None:
        if parent in ids:
            return True
        parent = tree.by_id[parent].parent if parent in tree.by_id else None
    return False


# --------------------------------------------------------------------------------------------
# Running the extra step


class _NoUpdate(torch.optim.Optimizer):
    """Stands in for the workload's optimizer during the profiled step: updates nothing."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


@contextlib.contextmanager
def parameters_untouched(workload: Any) -> Iterator[None]:
    """The optimizer swapped for one that updates nothing and the GradScaler put back, so an extra
    step leaves the LoRA weights and optimizer state as they were."""
    optimizer = workload.optimizer
    scaler = getattr(workload, "scaler", None)
    scaler_state = scaler.state_dict() if scaler is not None else {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    workload.optimizer = _NoUpdate(params)
    try:
        yield
    finally:
        workload.optimizer = optimizer
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        for p in params:
            p.grad = None


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
    with parameters_untouched(workload), native_stderr_filtered():
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
    "parameters_untouched",
    "processor_label",
    "sdpa_signature",
    "sdpa_switches",
    "workload_models",
]
