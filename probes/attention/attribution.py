"""Profiler events → the path, ops, kernels and forward/backward time of each attention call.

Pure: :func:`attribute` works on :class:`ProfEvent`, a plain copy of the profiler's events, so it
is tested without a profiler. The recorder (:mod:`diagnose.probes.attention.capture`) puts a named
range around every call it sees; the events under each range say which op really ran
(:func:`diagnose.attention_paths.classify_op`), and backward nodes are matched to the forward op
that created them by autograd sequence number.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diagnose import torch_compat
from diagnose.attention_paths import classify_op
from diagnose.probes.attention.calls import (
    CALL_RANGE,
    MODULE_RANGE,
    OP_RANGE,
    PROFILER_DTYPES,
    AttentionCall,
    Signature,
)

_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"

# --------------------------------------------------------------------------------------------
# Profiler events → per-call path and time (pure)


@dataclass
class ProfEvent:
    """One profiler event, copied from torch's (times in microseconds)."""

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


#: Events torch's own FunctionEvent list leaves out (profiler bookkeeping and tiny autograd
#: queries); left out here too, so both readings give one tree.
_UNLISTED_NAMES = frozenset(
    {
        "[memory]",
        "[OutOfMemory]",
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    }
)


def events_from_profiler(prof: Any, on_device: bool = False) -> list[ProfEvent]:
    """Plain copies of the events of ``prof`` (torch.profiler.profile after it stopped).

    Without a device the profiler's raw results are read directly (:func:`events_from_raw`):
    ``prof.events()`` builds its tree of FunctionEvents in Python at a cost larger than the step
    it profiled. A GPU run needs what only that tree links up (each op's kernels and device time
    through correlation ids), so it reads ``prof.events()``, as does a torch without raw results.
    """
    if not on_device:
        raw = torch_compat.raw_events(prof, keep=_is_listed, inputs_of=_is_attention)
        if raw is not None:
            return events_from_raw(raw)
    return [
        ProfEvent(
            id=op.id,
            name=op.name,
            parent=op.parent,
            start_us=op.start_us,
            end_us=op.end_us,
            cpu_us=op.end_us - op.start_us,
            device_us=op.device_us,
            sequence_nr=op.sequence_nr,
            thread=op.thread,
            fwd_thread=op.fwd_thread,
            input_dtypes=op.input_dtypes or [],
            input_shapes=op.input_shapes or [],
            kernels=op.kernels or [],
        )
        # Device times and kernels only for a GPU run, input shapes and dtypes only for
        # attention ops (the only ones read later): both are slow to read for every event.
        for op in torch_compat.function_ops(prof, device=on_device, inputs_of=_is_attention)
    ]


def _is_attention(name: str) -> bool:
    return classify_op(name) is not None


def _is_listed(name: str) -> bool:
    return name not in _UNLISTED_NAMES


def events_from_raw(raw_events: Sequence[torch_compat.RawEvent]) -> list[ProfEvent]:
    """CPU events from the profiler's raw results, with parents found as torch finds them.

    An event's parent is the innermost event on the same thread whose interval holds its own;
    events that end on another thread than they started (async) are neither parents nor
    children. An only child named as its parent is one op recorded twice by the dispatcher and
    is folded into it, as torch folds it.
    """
    copied: list[ProfEvent] = []
    nestable: list[ProfEvent] = []
    for raw in raw_events:
        if raw.hidden or not raw.on_cpu or not _is_listed(raw.name):
            continue
        start_us = raw.start_ns / 1000.0
        end_us = raw.end_ns / 1000.0
        event = ProfEvent(
            id=len(copied),
            name=raw.name,
            parent=None,
            start_us=start_us,
            end_us=end_us,
            cpu_us=end_us - start_us,
            sequence_nr=raw.sequence_nr,
            thread=raw.thread,
            fwd_thread=raw.fwd_thread,
            input_dtypes=raw.input_dtypes or [],
            input_shapes=raw.input_shapes or [],
        )
        copied.append(event)
        if not raw.is_async and not raw.crosses_threads:
            nestable.append(event)
    _link_parents(nestable)
    return _fold_repeated_ops(copied)


def _fold_repeated_ops(events: list[ProfEvent]) -> list[ProfEvent]:
    """Drop each only child that bears its parent's name; its children become the parent's."""
    by_id = {e.id: e for e in events}
    children: dict[int, list[int]] = defaultdict(list)
    for e in events:
        if e.parent is not None:
            children[e.parent].append(e.id)
    dropped: set[int] = set()
    for e in events:  # in reading order, so a chain of repeats folds from the top down
        parent = by_id.get(e.parent) if e.parent is not None else None
        while parent is not None and parent.id in dropped:
            parent = by_id.get(parent.parent) if parent.parent is not None else None
        if parent is None or parent.name != e.name or len(children[parent.id]) != 1:
            continue
        dropped.add(e.id)
        children[parent.id] = children.pop(e.id, [])
        for child in children[parent.id]:
            by_id[child].parent = parent.id
    return [e for e in events if e.id not in dropped]


def _link_parents(events: list[ProfEvent]) -> None:
    """Set each event's parent: the innermost enclosing event of its thread (one stack each)."""
    events.sort(key=lambda e: (e.thread, e.start_us, -e.end_us))
    open_spans: list[ProfEvent] = []
    thread: int | None = None
    for event in events:
        if event.thread != thread:
            open_spans, thread = [], event.thread
        while open_spans and (
            event.start_us >= open_spans[-1].end_us or event.end_us > open_spans[-1].end_us
        ):
            open_spans.pop()
        if open_spans:
            event.parent = open_spans[-1].id
        open_spans.append(event)


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
            call.signature = signature_from_op(op)
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
    dtype = PROFILER_DTYPES.get(chosen.input_dtypes[0]) if chosen.input_dtypes else None
    if call.signature is not None and dtype and dtype != call.signature.dtype:
        # Autocast casts q/k/v after the Python call: the kernel saw this dtype.
        call.signature = call.signature.with_dtype(dtype)


def signature_from_op(op: ProfEvent) -> Signature | None:
    """Shapes of an attention op: torch's SDPA ops take (B, H, L, D), xFormers and flash-attn
    (B, L, H, D). Seen when the Python call was not (recomputation, other libraries)."""
    shapes = [s for s in op.input_shapes[:3] if isinstance(s, list)]
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes):
        return None
    kind = classify_op(op.name)
    heads_first = kind is not None and kind.provider.startswith("torch SDPA")
    q, k, v = shapes
    h, length = (1, 2) if heads_first else (2, 1)
    dtype = PROFILER_DTYPES.get(op.input_dtypes[0], "") if op.input_dtypes else ""
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
            PROFILER_DTYPES.get(op.input_dtypes[3], op.input_dtypes[3])
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


__all__ = ["ProfEvent", "attribute", "events_from_profiler"]
