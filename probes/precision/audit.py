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

The audit costs tens of microseconds per op, so it runs one extra step, never a timed one, under
:func:`diagnose.workload.untouched.steps_without_update`: the run is unchanged afterwards; only
the data iterator moves on by one batch. The records: :mod:`diagnose.probes.precision.audit_log`.

Each distinct matmul/conv/attention call signature is kept as a :class:`ReplaySpec` (op, shapes,
strides, dtypes, non-tensor arguments) so that it can be re-run on random data in another dtype:
the microbenchmark of :mod:`diagnose.probes.precision.replay`.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from diagnose.precision_policy import (
    ATTENTION_FUNCTIONS,
    COMPUTE_KINDS,
    OpKind,
    deliberate_reason,
    judge,
    majority_dtype,
    op_base_name,
    op_kind,
)
from diagnose.probes.precision.audit_log import (
    AuditLog,
    CapturedWarning,
    OpGroup,
    ReplaySpec,
    Site,
    TensorSpec,
    dtype_name,
)
from diagnose.probes.precision.weights import workload_components
from diagnose.timing import PhaseTimer
from diagnose.torch_compat import (
    TorchDispatchMode,
    current_autograd_node_reader,
    is_autocast_enabled,
    tree_leaves,
    tree_map,
)
from diagnose.workload.untouched import steps_without_update

#: Key under which an autograd node carries the forward call that made it.
_NODE_LABEL = "diagnose_precision"
#: Autograd nodes labelled per Python-level call at most (the walk stops at labelled nodes; this
#: bounds it when a graph was built by code the function mode did not see).
MAX_NODES_LABELLED_PER_CALL = 256
#: Distinct compute-op signatures kept for replay (the largest by time are benchmarked).
MAX_REPLAY_SPECS = 512
#: Torch functions that only read attributes: not worth tracking.
_ATTRIBUTE_FUNCTIONS = frozenset({"__get__", "__set__", "__delete__"})


@dataclass(frozen=True)
class _CallLabel:
    """What the function mode knew about a Python-level call: put on its autograd nodes."""

    site: Site
    function: str
    autocast: bool | None


# --------------------------------------------------------------------------------------------
# Helpers


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
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


def _signature_key(op: str, args: Any, kwargs: Any) -> str:
    """Op + the shapes, strides and dtypes of its tensors + its other arguments."""
    parts = [op]
    for leaf in tree_leaves((args, kwargs)):
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
        self._node_of = current_autograd_node_reader()
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
            dtype_name(t.dtype) for t in tensors if t.is_floating_point() or t.is_complex()
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
                template=tree_map(_spec_of, (args, kwargs)),
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
        autocast = is_autocast_enabled(auditor.device_type)
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
    GradScaler and random generators are as before afterwards, and its gradients are cleared.
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
        with steps_without_update(workload), _warnings_captured(auditor):
            sync()
            start = time.perf_counter()
            with _CallTracker(auditor), _OpRecorder(auditor):
                workload.step(batch, _PhaseTracker(sync, auditor))
            auditor.log.wall_seconds = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return auditor.finish()


__all__ = [
    "AuditLog",
    "CapturedWarning",
    "OpGroup",
    "ReplaySpec",
    "Site",
    "audit_step",
    "estimated_work",
]
