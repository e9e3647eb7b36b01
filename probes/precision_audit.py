"""The dtype audit of one training step: every operator, the dtype it really computed in, the
module that issued it, and how long it took.

Two torch interposition layers are combined, because each sees half of the truth (learned on
torch 2.13):

- a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each aten op *after* autocast
  cast its inputs and after composite ops decomposed (``F.linear`` under autocast arrives as a
  bf16 ``aten.addmm``): the dtypes that ran. It times each op with the device synchronised. But
  ``torch.is_autocast_enabled()`` reads False inside it;
- a :class:`~torch.overrides.TorchFunctionMode` sees the Python-level call (``F.linear``,
  ``Tensor.float``) with the real autocast state, so it says whether autocast was on around an
  op. It also labels the autograd nodes a call created with the module that made them, which is
  how a backward op (dispatched by the autograd engine, outside any module) is attributed: the
  dispatch mode reads the label off ``torch._C._current_autograd_node()``.

Module paths come from forward pre/post hooks that keep a stack of the modules being run.
Warnings raised during the step are captured (with ``torch.set_warn_always(True)``, since the
fused-kernel dtype warnings are TORCH_WARN_ONCE and the timed steps have usually used them up)
and attributed to the torch function and module that raised them.

The audit costs tens of microseconds per op, so it runs one extra step, never a timed one. The
optimizer is swapped for one that updates nothing, and the GradScaler, the noise generator and the
gradients are put back afterwards, so the run is unchanged; only the data iterator moves on by one
batch.

Each distinct matmul/conv/attention call signature is kept as a :class:`ReplaySpec` (op, shapes,
strides, dtypes, non-tensor arguments) so that it can be re-run on random data in another dtype:
the microbenchmark that estimates what computing in bf16 instead of fp32 would save.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from diagnose.precision_policy import (
    ATTENTION_FUNCTIONS,
    COMPUTE_KINDS,
    OpKind,
    Verdict,
    deliberate_reason,
    judge,
    majority_dtype,
    normalize_dtype,
    op_base_name,
    op_kind,
)
from diagnose.record import Stats
from diagnose.timing import PhaseTimer

#: Key under which an autograd node carries the forward call that made it.
_NODE_LABEL = "diagnose_precision"
#: Autograd nodes labelled per Python-level call at most (the walk stops at labelled nodes; this
#: bounds it when a graph was built by code the function mode did not see).
MAX_NODES_LABELLED_PER_CALL = 256
#: Distinct compute-op signatures kept for replay (the largest by time are benchmarked).
MAX_REPLAY_SPECS = 512
#: Torch functions that only read attributes: not worth tracking.
_ATTRIBUTE_FUNCTIONS = frozenset({"__get__", "__set__", "__delete__"})


# --------------------------------------------------------------------------------------------
# What the audit records


@dataclass(frozen=True)
class Site:
    """Where an op was issued from."""

    #: "denoiser", "vae", "text_encoder", "text_encoder_2"... ("" outside the hooked models).
    component: str = ""
    #: Module path inside the component ("down_blocks.1.attentions.0.proj_in"; "" for its root).
    module: str = ""
    module_class: str = ""

    @property
    def where(self) -> str:
        """The path a reader looks for: denoiser paths bare, others prefixed by the component."""
        if not self.component:
            return "(outside the models: noise, loss)"
        if self.component == "denoiser":
            return self.module or "(denoiser root)"
        return f"{self.component}/{self.module}" if self.module else self.component


@dataclass(frozen=True)
class _CallLabel:
    """What the function mode knew about a Python-level call: put on its autograd nodes."""

    site: Site
    function: str
    autocast: bool | None


@dataclass
class OpGroup:
    """Calls of one op signature from one site, in one phase, with one verdict."""

    op: str
    kind: OpKind
    dtype: str | None
    site: Site
    #: The step phase ("forward", "backward", "encode", ...).
    phase: str
    #: The torch function that issued it ("linear", "conv2d", "float"; "" when unknown).
    function: str
    #: Whether autocast was enabled around the issuing call (None: unknown, e.g. backward).
    autocast: bool | None
    verdict: Verdict
    deliberate: str
    #: Input shapes of the signature, e.g. "[2, 64, 32] [32, 32]".
    shapes: str
    #: Key of the :class:`ReplaySpec` of this signature ("" when none was kept).
    signature: str = ""
    calls: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "kind": self.kind,
            "dtype": self.dtype,
            "component": self.site.component,
            "module": self.site.where,
            "module_class": self.site.module_class,
            "phase": self.phase,
            "function": self.function,
            "autocast": self.autocast,
            "verdict": self.verdict,
            "deliberate": self.deliberate,
            "shapes": self.shapes,
            "calls": self.calls,
            "seconds": self.seconds,
        }


@dataclass
class CapturedWarning:
    """A warning raised during the audited step, with the call and module that raised it."""

    message: str
    category: str
    function: str = ""
    site: Site = field(default_factory=Site)
    phase: str = ""
    count: int = 0
    #: Device-synchronised seconds of the calls that raised it.
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "category": self.category,
            "function": self.function,
            "module": self.site.where,
            "phase": self.phase,
            "count": self.count,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class ReplaySpec:
    """One compute-op call signature, re-runnable on random data in another dtype."""

    key: str
    op: str
    func: Any
    template: Any
    #: The dtype it ran in (normalised name) and the torch dtype of its float inputs.
    dtype: str | None
    torch_dtype: torch.dtype | None
    #: Input shapes, e.g. "[2, 64, 32] [32, 32]".
    shapes: str = ""
    #: Multiply-adds of one call, estimated from the shapes (deterministic, unlike its time).
    work: float = 0.0
    calls: int = 0
    seconds: float = 0.0


@dataclass
class AuditLog:
    """Everything one audited step recorded."""

    precision: str
    requested_low: str | None
    groups: list[OpGroup] = field(default_factory=list)
    warnings: list[CapturedWarning] = field(default_factory=list)
    replays: dict[str, ReplaySpec] = field(default_factory=dict)
    #: Wall seconds of the audited step (inflated by the audit itself: not a step time).
    wall_seconds: float = 0.0
    ops: int = 0
    #: Whether backward ops could be attributed through autograd nodes on this torch.
    node_attribution: bool = True

    def compute_groups(self) -> list[OpGroup]:
        return [g for g in self.groups if g.kind in COMPUTE_KINDS]

    def compute_seconds_by_dtype(self) -> dict[str, float]:
        """Audited seconds of matmul/conv/attention ops per dtype (not those run inside an
        attention call: the attention op itself is judged)."""
        totals: dict[str, float] = {}
        for g in self.compute_groups():
            if g.dtype and (g.kind == "attention" or g.function not in ATTENTION_FUNCTIONS):
                totals[g.dtype] = totals.get(g.dtype, 0.0) + g.seconds
        return totals

    def compute_seconds_by_component(self) -> dict[str, dict[str, float]]:
        """Audited matmul/conv/attention seconds per component ("denoiser", "vae", ...; "" for
        ops outside the models) and dtype."""
        totals: dict[str, dict[str, float]] = {}
        for g in self.compute_groups():
            if g.dtype and (g.kind == "attention" or g.function not in ATTENTION_FUNCTIONS):
                by_dtype = totals.setdefault(g.site.component, {})
                by_dtype[g.dtype] = by_dtype.get(g.dtype, 0.0) + g.seconds
        return totals

    def with_verdict(self, verdict: Verdict) -> list[OpGroup]:
        return [g for g in self.groups if g.verdict == verdict]


# --------------------------------------------------------------------------------------------
# Helpers


_DTYPE_NAMES: dict[torch.dtype, str | None] = {}


def _dtype_name(dtype: torch.dtype) -> str | None:
    if dtype not in _DTYPE_NAMES:
        _DTYPE_NAMES[dtype] = normalize_dtype(str(dtype))
    return _DTYPE_NAMES[dtype]


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in op arguments or outputs: tensors, tuples/lists/dicts of them, nested.

    Hand-rolled rather than pytree: it runs for every op of the audited step."""
    found: list[torch.Tensor] = []
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
    return found


def _shape_text(tensors: Sequence[torch.Tensor]) -> str:
    return " ".join(str(list(t.shape)) for t in tensors)


def _function_name(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    if name in ("__get__", "__set__"):
        return name
    return str(name)


def _spec_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


def _signature_key(op: str, args: Any, kwargs: Any) -> str:
    """Op + the shapes, strides and dtypes of its tensors + its other arguments."""
    parts = [op]
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            parts.append(
                f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}/{list(leaf.stride())}"
            )
        else:
            parts.append(repr(leaf))
    return "|".join(parts)


def _numel(shape: Sequence[int]) -> float:
    return float(math.prod(shape)) if shape else 1.0


def estimated_work(op: str, tensors: Sequence[torch.Tensor]) -> float:
    """Multiply-adds of one call of a matmul/conv/attention op from its input shapes; the
    summed input elements for anything not recognised. Used to pick the heaviest signatures to
    benchmark: audited times of single calls are too noisy on a busy machine to rank by."""
    shapes = [tuple(t.shape) for t in tensors]
    matrices = [sh for sh in shapes if len(sh) >= 2]
    try:
        if (
            op in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear")
            and len(matrices) >= 2
        ):
            a, b = matrices[-2], matrices[-1]
            if op == "linear":  # (input, weight[out, in])
                a, b = matrices[0], matrices[1][::-1]
            return _numel(a[:-1]) * a[-1] * b[-1]
        if op.startswith("convolution") and len(matrices) >= 2:
            if op == "convolution_backward":  # (grad_out, input, weight): two convs' worth
                grad_out, weight = matrices[0], matrices[2]
                return 2.0 * _numel(grad_out) * _numel(weight[1:])
            inp, weight = matrices[0], matrices[1]
            # Output elements ~ batch x out channels x input spatial (stride ignored).
            return _numel(inp[:1]) * weight[0] * _numel(inp[2:]) * _numel(weight[1:])
        if op_kind(op) == "attention" and len(matrices) >= 2:
            q, k = matrices[0], matrices[1]
            return 2.0 * _numel(q) * k[-2]
    except (IndexError, TypeError):
        pass
    return float(sum(_numel(sh) for sh in shapes))


class _NoUpdate(torch.optim.Optimizer):
    """Stands in for the workload's optimizer during the audit: updates nothing."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params or [torch.nn.Parameter(torch.zeros(1))], {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class _PhaseTracker(PhaseTimer):
    """The step's own phase labels, told to the audit as they are entered."""

    def __init__(self, synchronize: Callable[[], None], audit: _Auditor) -> None:
        super().__init__(synchronize)
        self._audit = audit

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous = self._audit.phase
        self._audit.phase = name
        try:
            with super().phase(name):
                yield
        finally:
            self._audit.phase = previous


# --------------------------------------------------------------------------------------------
# The auditor


class _Auditor:
    """State shared by the hooks and the two modes while one step runs."""

    def __init__(
        self,
        *,
        precision: str,
        requested_low: str | None,
        device_type: str,
        sync: Callable[[], None],
        component_reasons: Mapping[str, str],
        keep_fp32_parts: Mapping[str, frozenset[str]],
    ) -> None:
        self.log = AuditLog(precision=precision, requested_low=requested_low)
        self.device_type = device_type
        self.sync = sync
        self.component_reasons = component_reasons
        self.keep_fp32_parts = keep_fp32_parts
        self.phase = ""
        self.modules: list[Site] = []
        #: (function name, autocast enabled) of the Python-level calls being run.
        self.calls: list[tuple[str, bool]] = []
        self.caught: list[warnings.WarningMessage] = []
        self._owned = 0
        self._groups: dict[tuple[Any, ...], OpGroup] = {}
        self._warnings: dict[tuple[str, str, Site, str], CapturedWarning] = {}
        self._op_names: dict[Any, tuple[str, OpKind]] = {}
        self._deliberate_of: dict[tuple[str | None, Site], str] = {}
        self._node_of: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)
        self.log.node_attribution = self._node_of is not None

    # ------------------------------------------------------------ module hooks

    def hook(self, components: Mapping[str, torch.nn.Module]) -> list[Any]:
        handles: list[Any] = []
        for component, root in components.items():
            for path, module in root.named_modules():
                site = Site(component, path, type(module).__name__)
                handles.append(module.register_forward_pre_hook(self._enter(site)))
                handles.append(module.register_forward_hook(self._leave(site), always_call=True))
        return handles

    def _enter(self, site: Site) -> Callable[..., None]:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.modules.append(site)

        return pre

    def _leave(self, site: Site) -> Callable[..., None]:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            # Pop down to this module: a module that raised inside left its entry behind.
            while self.modules:
                if self.modules.pop() == site:
                    break

        return post

    # ------------------------------------------------------------ where an op comes from

    def _current_label(self) -> _CallLabel | None:
        """The forward call's label when a backward op runs (None in the forward)."""
        if self._node_of is None:
            return None
        node = self._node_of()
        if node is None:
            return None
        try:
            label = node.metadata.get(_NODE_LABEL)
        except (AttributeError, RuntimeError):
            return _CallLabel(Site(), "", None)
        return label if isinstance(label, _CallLabel) else _CallLabel(Site(), "", None)

    def _deliberate(self, dtype: str | None, site: Site) -> str:
        reason = self.component_reasons.get(site.component, "")
        keep = self.keep_fp32_parts.get(site.component)
        if not reason and keep and any(part in keep for part in site.module.split(".")):
            reason = "kept in fp32 by the model, _keep_in_fp32_modules"
        return (
            deliberate_reason(
                dtype=dtype,
                module_path=site.module,
                module_class=site.module_class,
                component_reason=reason,
            )
            or ""
        )

    # ------------------------------------------------------------ ops (dispatch mode)

    def record_op(self, func: Any, args: Any, kwargs: Any, seconds: float) -> None:
        self.log.ops += 1
        named = self._op_names.get(func)
        if named is None:
            op = op_base_name(str(func.name()) if hasattr(func, "name") else str(func))
            named = self._op_names[func] = (op, op_kind(op))
        op, kind = named
        tensors = _tensors((args, kwargs))
        dtype = majority_dtype(
            _dtype_name(t.dtype) for t in tensors if t.is_floating_point() or t.is_complex()
        )
        label = self._current_label()
        if self.modules:  # in a forward (or a checkpoint's recompute inside the backward)
            site = self.modules[-1]
            function, autocast = self.calls[-1] if self.calls else ("", None)
            if self.phase == "backward" and label is not None:
                function = label.function or function
        elif label is not None:
            site, function, autocast = label.site, label.function, label.autocast
        else:
            site = Site()
            function, autocast = self.calls[-1] if self.calls else ("", None)
        phase = "backward" if label is not None else (self.phase or "step")
        if function == "backward":  # Tensor.backward itself is no forward call
            function = ""
        deliberate = ""
        if dtype not in (None, "bf16", "fp16"):
            cached = self._deliberate_of.get((dtype, site))
            if cached is None:
                cached = self._deliberate_of[(dtype, site)] = self._deliberate(dtype, site)
            deliberate = cached
        verdict = judge(
            kind,
            dtype,
            self.log.requested_low,
            deliberate or None,
            inside_attention=function in ATTENTION_FUNCTIONS,
        )
        interesting = kind != "other" or verdict == "deliberate"
        shapes = _shape_text(tensors) if interesting else ""
        signature = ""
        if kind in COMPUTE_KINDS:
            signature = self._keep_replay(op, func, args, kwargs, dtype, tensors, seconds)
        key = (op, dtype, site, phase, function, autocast, verdict, signature or shapes)
        group = self._groups.get(key)
        if group is None:
            group = OpGroup(
                op=op,
                kind=kind,
                dtype=dtype,
                site=site,
                phase=phase,
                function=function,
                autocast=autocast,
                verdict=verdict,
                deliberate=deliberate if verdict == "deliberate" else "",
                shapes=shapes,
                signature=signature,
            )
            self._groups[key] = group
        group.calls += 1
        group.seconds += seconds

    def _keep_replay(
        self,
        op: str,
        func: Any,
        args: Any,
        kwargs: Any,
        dtype: str | None,
        tensors: Sequence[torch.Tensor],
        seconds: float,
    ) -> str:
        key = _signature_key(op, args, kwargs)
        spec = self.log.replays.get(key)
        if spec is None:
            if len(self.log.replays) >= MAX_REPLAY_SPECS:
                return ""
            float_dtypes = [t.dtype for t in tensors if t.is_floating_point()]
            torch_dtype = max(set(float_dtypes), key=float_dtypes.count) if float_dtypes else None
            spec = ReplaySpec(
                key=key,
                op=op,
                func=func,
                template=pytree.tree_map(_spec_of, (args, kwargs)),
                dtype=dtype,
                torch_dtype=torch_dtype,
                shapes=_shape_text(tensors),
                work=estimated_work(op, tensors),
            )
            self.log.replays[key] = spec
        spec.calls += 1
        spec.seconds += seconds
        return key

    # ------------------------------------------------------------ calls (function mode)

    def label_graph(self, output: Any, label: _CallLabel) -> None:
        """Put ``label`` on the autograd nodes ``output`` was made by (up to labelled ones)."""
        pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        labelled = 0
        while pending and labelled < MAX_NODES_LABELLED_PER_CALL:
            node: Any = pending.pop()  # torch's stubs type Node.metadata as a method
            try:
                metadata: dict[str, Any] = node.metadata
            except (AttributeError, RuntimeError):
                continue
            if _NODE_LABEL in metadata:
                continue
            metadata[_NODE_LABEL] = label
            labelled += 1
            for next_node, _ in node.next_functions:
                if next_node is not None and type(next_node).__name__ != "AccumulateGrad":
                    pending.append(next_node)

    def own_new_warnings(self, start: int, function: str, seconds: float) -> None:
        """Warnings caught since ``start`` were raised by this call in the current module."""
        site = self.modules[-1] if self.modules else Site()
        for message in self.caught[max(start, self._owned) :]:
            self._add_warning(message, function, site, seconds)
        self._owned = len(self.caught)

    def own_remaining_warnings(self) -> None:
        for message in self.caught[self._owned :]:
            self._add_warning(message, "", Site(), 0.0)
        self._owned = len(self.caught)

    def _add_warning(
        self, message: warnings.WarningMessage, function: str, site: Site, seconds: float
    ) -> None:
        text = str(message.message).strip()
        category = message.category.__name__
        key = (text, function, site, self.phase)
        entry = self._warnings.get(key)
        if entry is None:
            entry = CapturedWarning(text, category, function, site, self.phase)
            self._warnings[key] = entry
        entry.count += 1
        entry.seconds += seconds

    def finish(self) -> AuditLog:
        self.own_remaining_warnings()
        self.log.groups = sorted(self._groups.values(), key=lambda g: -g.seconds)
        self.log.warnings = list(self._warnings.values())
        return self.log


class _OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Times every aten op (device-synchronised) and hands it to the auditor."""

    def __init__(self, auditor: _Auditor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.auditor = auditor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", "aten") == "profiler":
            return func(*args, **kwargs)  # record_function ranges: bookkeeping, not compute
        # The previous op was synchronised after it ran, so nothing else is queued here.
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.auditor.sync()
        self.auditor.record_op(func, args, kwargs, time.perf_counter() - start)
        return out


class _CallTracker(TorchFunctionMode):
    """Sees Python-level torch calls with the real autocast state; labels their graph nodes."""

    def __init__(self, auditor: _Auditor) -> None:
        super().__init__()
        self.auditor = auditor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _function_name(func)
        if name in _ATTRIBUTE_FUNCTIONS:
            return func(*args, **kwargs)
        auditor = self.auditor
        autocast = torch.is_autocast_enabled(auditor.device_type)
        auditor.calls.append((name, autocast))
        warned = len(auditor.caught)
        start = time.perf_counter()
        try:
            out = func(*args, **kwargs)
        finally:
            auditor.calls.pop()
        if len(auditor.caught) > warned:
            auditor.sync()
            auditor.own_new_warnings(warned, name, time.perf_counter() - start)
        if name != "backward" and torch.is_grad_enabled():
            site = auditor.modules[-1] if auditor.modules else Site()
            auditor.label_graph(out, _CallLabel(site, name, autocast))
        return out


# --------------------------------------------------------------------------------------------
# Running the audited step


def workload_components(workload: Any) -> dict[str, torch.nn.Module]:
    """The models a workload runs, by the folder names of a diffusers model."""
    components: dict[str, torch.nn.Module] = {}
    denoiser = getattr(workload, "denoiser", None)
    if isinstance(denoiser, torch.nn.Module):
        components["denoiser"] = denoiser
    vae = getattr(workload, "vae", None)
    if isinstance(vae, torch.nn.Module):
        components["vae"] = vae
    for i, encoder in enumerate(getattr(workload, "text_encoders", None) or []):
        if isinstance(encoder, torch.nn.Module):
            components["text_encoder" if i == 0 else f"text_encoder_{i + 1}"] = encoder
    return components


@dataclass
class _Saved:
    """What the audited step may touch, to put back."""

    grads: list[torch.Tensor | None]
    scaler_state: dict[str, Any]
    generator_state: torch.Tensor | None


@contextlib.contextmanager
def _run_unchanged(workload: Any) -> Iterator[None]:
    """Swap in an optimizer that updates nothing; put back gradients, scaler and generator."""
    params: list[torch.nn.Parameter] = list(workload.lora_parameters())
    scaler = getattr(workload, "scaler", None)
    generator = getattr(workload, "noise_generator", None)
    saved = _Saved(
        grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
        scaler_state=scaler.state_dict() if scaler is not None else {},
        generator_state=generator.get_state() if isinstance(generator, torch.Generator) else None,
    )
    optimizer = workload.optimizer
    workload.optimizer = _NoUpdate(params)
    try:
        yield
    finally:
        workload.optimizer = optimizer
        for param, grad in zip(params, saved.grads, strict=True):
            param.grad = grad
        if scaler is not None and saved.scaler_state:
            scaler.load_state_dict(saved.scaler_state)
        if isinstance(generator, torch.Generator) and saved.generator_state is not None:
            generator.set_state(saved.generator_state)


@contextlib.contextmanager
def _warnings_captured(auditor: _Auditor) -> Iterator[None]:
    warn_always = torch.is_warn_always_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auditor.caught = caught
        torch.set_warn_always(True)
        try:
            yield
        finally:
            torch.set_warn_always(warn_always)


def audit_step(
    workload: Any,
    *,
    precision: str,
    requested_low: str | None,
    device: torch.device,
    component_reasons: Mapping[str, str] | None = None,
    keep_fp32_parts: Mapping[str, frozenset[str]] | None = None,
    batch: Any = None,
) -> AuditLog:
    """Run one training step of ``workload`` under the audit and return what it recorded.

    ``batch`` defaults to the workload's next batch. The workload's parameters, optimizer state,
    gradients, GradScaler and noise generator are as before afterwards.
    """
    from diagnose.timing import device_synchronizer

    sync = device_synchronizer(device)
    auditor = _Auditor(
        precision=precision,
        requested_low=requested_low,
        device_type=device.type,
        sync=sync,
        component_reasons=component_reasons or {},
        keep_fp32_parts=keep_fp32_parts or {},
    )
    if batch is None:
        batch = next(workload.batches())
    handles = auditor.hook(workload_components(workload))
    try:
        with _run_unchanged(workload), _warnings_captured(auditor):
            sync()
            start = time.perf_counter()
            with _CallTracker(auditor), _OpRecorder(auditor):
                workload.step(batch, _PhaseTracker(sync, auditor))
            auditor.log.wall_seconds = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return auditor.finish()


# --------------------------------------------------------------------------------------------
# Weights left in fp32


@dataclass
class Fp32Weights:
    """fp32 parameters of one module (its own, not its children's)."""

    component: str
    module: str
    module_class: str
    tensors: int = 0
    elements: int = 0
    bytes: int = 0
    #: LoRA (trainable) weights rather than frozen base weights.
    trainable: bool = False
    names: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return Site(self.component, self.module, self.module_class).where

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.where,
            "module_class": self.module_class,
            "kind": "LoRA" if self.trainable else "base",
            "tensors": self.tensors,
            "elements": self.elements,
            "bytes": self.bytes,
            "parameters": self.names[:8],
        }


def fp32_parameters(
    components: Mapping[str, torch.nn.Module],
    keep_fp32_parts: Mapping[str, frozenset[str]] | None = None,
) -> list[Fp32Weights]:
    """Modules holding fp32 parameters, largest first; modules a model keeps in fp32 on purpose
    (``_keep_in_fp32_modules``) are left out."""
    rows: list[Fp32Weights] = []
    for component, root in components.items():
        keep = (keep_fp32_parts or {}).get(component, frozenset())
        for path, module in root.named_modules():
            if keep and any(part in keep for part in path.split(".")):
                continue
            for trainable in (False, True):
                row = Fp32Weights(component, path, type(module).__name__, trainable=trainable)
                for name, param in module.named_parameters(recurse=False):
                    if param.dtype != torch.float32 or param.requires_grad != trainable:
                        continue
                    row.tensors += 1
                    row.elements += param.numel()
                    row.bytes += param.numel() * param.element_size()
                    row.names.append(f"{path}.{name}" if path else name)
                if row.tensors:
                    rows.append(row)
    rows.sort(key=lambda r: -r.bytes)
    return rows


# --------------------------------------------------------------------------------------------
# Replaying a signature in another dtype (the microbenchmark)


def _materialise(
    spec: _TensorSpec, dtype: torch.dtype, generators: dict[torch.device, torch.Generator]
) -> torch.Tensor:
    """A tensor of the spec's shape and strides (overlapping strides included) with random
    values, in ``dtype``, made on its device with a private generator (the run's global random
    state is not touched)."""
    if any(n == 0 for n in spec.shape):
        extent = 0
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True))
    if dtype.is_floating_point or dtype.is_complex:
        generator = generators.get(spec.device)
        if generator is None:
            generator = generators[spec.device] = torch.Generator(device=spec.device)
            generator.manual_seed(0)
        flat = torch.randn(extent, generator=generator, dtype=torch.float32, device=spec.device).to(
            dtype
        )
    else:
        flat = torch.zeros(extent, dtype=dtype, device=spec.device)
    return flat.as_strided(spec.shape, spec.stride)


def replay_arguments(spec: ReplaySpec, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """(args, kwargs) for one call of ``spec`` with its ``spec.torch_dtype`` inputs in ``dtype``
    (others as recorded)."""
    generators: dict[torch.device, torch.Generator] = {}

    def make(value: Any) -> Any:
        if isinstance(value, _TensorSpec):
            target = value.dtype
            if dtype is not None and value.dtype == spec.torch_dtype:
                target = dtype
            return _materialise(value, target, generators)
        return value

    args, kwargs = pytree.tree_map(
        make, spec.template, is_leaf=lambda v: isinstance(v, _TensorSpec)
    )
    return args, kwargs


@dataclass
class BenchResult:
    """Device-synchronised seconds per call of one signature in one dtype."""

    dtype: str
    samples: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan


def _prepared(spec: ReplaySpec, dtype: torch.dtype) -> tuple[Callable[[], Any], str]:
    """A zero-argument call of ``spec`` in ``dtype``, warmed up once; or the error it raised."""
    try:
        args, kwargs = replay_arguments(spec, dtype)
        with torch.no_grad():
            spec.func(*args, **kwargs)  # warm-up: kernel selection, first-call allocation
    except Exception as exc:  # a dtype this op or device does not take
        return (lambda: None), f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"

    def call() -> Any:
        with torch.no_grad():
            return spec.func(*args, **kwargs)

    return call, ""


def bench_pair(
    spec: ReplaySpec,
    base: torch.dtype,
    low: torch.dtype,
    sync: Callable[[], None],
    *,
    repeats: int = 15,
    budget_s: float = 0.25,
) -> tuple[BenchResult, BenchResult]:
    """Time ``spec`` in ``base`` and in ``low``, alternating calls so that a busy machine slows
    both alike; up to ``repeats`` synchronised calls each (at least 3, then until the budget)."""
    first = BenchResult(dtype=_dtype_name(base) or str(base))
    second = BenchResult(dtype=_dtype_name(low) or str(low))
    call_a, first.error = _prepared(spec, base)
    call_b, second.error = _prepared(spec, low)
    if first.error or second.error:
        return first, second
    sync()
    deadline = time.perf_counter() + budget_s
    try:
        for i in range(repeats):
            for call, result in ((call_a, first), (call_b, second)):
                start = time.perf_counter()
                call()
                sync()
                result.samples.append(time.perf_counter() - start)
            if i >= 2 and time.perf_counter() > deadline:
                break
    except Exception as exc:  # a failure after the warm-up: report it, keep nothing
        text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        for result in (first, second):
            result.error, result.samples = text, []
    return first, second


__all__ = [
    "AuditLog",
    "BenchResult",
    "CapturedWarning",
    "Fp32Weights",
    "OpGroup",
    "ReplaySpec",
    "Site",
    "audit_step",
    "bench_pair",
    "estimated_work",
    "fp32_parameters",
    "replay_arguments",
    "workload_components",
]
