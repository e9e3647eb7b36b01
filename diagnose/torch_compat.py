"""Every private or version-dependent part of torch that diagnose reads, in one place.

Users run torch 2.4 to 2.15 as their CUDA or ROCm stack ships it, and torch's internals move
between those releases: the profiler's ``FunctionEvent`` gained ``input_dtypes`` late, its raw
``_KinetoEvent`` gained ``end_ns`` and ``is_hidden_event``, FSDP2's ``fully_shard`` left
``torch.distributed._composable``, autocast's queries took a device type. Each such part is read
here, by feature (never by version number), and what a torch lacks becomes a :class:`Lack`: the
feature and what is therefore not known. A probe's runner turns each lack met while the probe ran
into a ``not_judged`` check, so a missing piece of torch costs one answer, never the run.

``tests/test_torch_compat.py`` fails when such a part is reached from anywhere else.

This module imports nothing from ``diagnose``: ``diagnose profile``'s in-process capture loads it
by file path inside the user's program, where diagnose may not be installed.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

TORCH_VERSION = str(torch.__version__)

# ------------------------------------------------------------------------------------------------
# What this torch lacks


@dataclass(frozen=True)
class Lack:
    """A part of torch this one does not have, and what diagnose cannot tell without it."""

    #: The missing part, as torch names it ("FunctionEvent.input_dtypes").
    feature: str
    #: What is not known for want of it ("the dtype each attention kernel ran in").
    unknown: str

    @property
    def check_id(self) -> str:
        return "torch_lacks." + re.sub(r"[^a-z0-9]+", "_", self.feature.lower()).strip("_")

    def text(self) -> str:
        return f"torch {TORCH_VERSION} lacks {self.feature}: {self.unknown} is not known"


class TorchLacks(Exception):
    """Raised where a whole experiment needs a part of torch this one does not have."""

    def __init__(self, lack: Lack) -> None:
        super().__init__(lack.text())
        self.lack = lack


#: The collectors of the blocks now inside :func:`lacks_met` (innermost last).
_collectors: list[list[Lack]] = []


def note_lack(feature: str, unknown: str) -> Lack:
    """Record that this torch lacks ``feature`` for every block now collecting lacks."""
    lack = Lack(feature, unknown)
    for collected in _collectors:
        if lack not in collected:
            collected.append(lack)
    return lack


def lacking(feature: str, unknown: str) -> TorchLacks:
    """The exception for an experiment that cannot run without ``feature`` (noted as well)."""
    return TorchLacks(note_lack(feature, unknown))


@contextmanager
def lacks_met() -> Iterator[list[Lack]]:
    """The lacks met inside the block, each once (also those met before it, elsewhere)."""
    collected: list[Lack] = []
    _collectors.append(collected)
    try:
        yield collected
    finally:
        _collectors.remove(collected)


# ------------------------------------------------------------------------------------------------
# The profiler's events


@dataclass
class RawEvent:
    """One event of the profiler's raw results (torch's ``_KinetoEvent``), copied."""

    name: str
    start_ns: int
    end_ns: int
    #: The thread it started on.
    thread: int
    #: Ended on another thread than it started on.
    crosses_threads: bool
    is_async: bool
    #: A host-side event (an op, a range, a runtime call), not a device activity.
    on_cpu: bool
    #: Profiler bookkeeping torch itself leaves out of its event list.
    hidden: bool
    sequence_nr: int
    fwd_thread: int
    #: Read only for the events ``inputs_of`` selects; None elsewhere.
    input_dtypes: list[str] | None = None
    input_shapes: list[Any] | None = None


def _raw_results(prof: Any) -> Any:
    return getattr(getattr(prof, "profiler", None), "kineto_results", None)


def raw_events(
    prof: Any,
    keep: Callable[[str], bool] = lambda name: True,
    inputs_of: Callable[[str], bool] = lambda name: False,
) -> list[RawEvent] | None:
    """The events of a stopped ``torch.profiler.profile`` whose name ``keep`` accepts, read from
    its raw results, or None where this torch has no raw results this code can read.

    Torch's own event list (``prof.events()``) builds a tree of ``FunctionEvent`` objects in
    Python at a cost larger than a CPU step; most readers need only names, times and threads.
    """
    results = _raw_results(prof)
    read = getattr(results, "events", None)
    if not callable(read):
        return None
    try:
        events = read()
        kept: list[RawEvent] = []
        for raw in events:
            name = str(raw.name())
            if keep(name):
                kept.append(_copy_raw(raw, name, inputs_of(name)))
        return kept
    except (AttributeError, TypeError, RuntimeError):
        return None  # accessors this code does not know: the caller reads torch's own list


def _copy_raw(raw: Any, name: str, with_inputs: bool) -> RawEvent:
    start_ns = int(raw.start_ns())
    # ``end_ns`` and ``is_hidden_event`` came after torch 2.4; a torch without hidden events
    # has none to leave out.
    end = getattr(raw, "end_ns", None)
    hidden = getattr(raw, "is_hidden_event", None)
    return RawEvent(
        name=name,
        start_ns=start_ns,
        end_ns=int(end()) if end is not None else start_ns + int(raw.duration_ns()),
        thread=int(raw.start_thread_id()),
        crosses_threads=raw.start_thread_id() != raw.end_thread_id(),
        is_async=bool(raw.is_async()),
        on_cpu=str(raw.device_type()) == "DeviceType.CPU",
        hidden=bool(hidden()) if hidden is not None else False,
        sequence_nr=int(raw.sequence_nr()),
        fwd_thread=int(raw.fwd_thread_id() or 0),
        input_dtypes=[str(d) for d in raw.dtypes() or []] if with_inputs else None,
        input_shapes=list(raw.shapes() or []) if with_inputs else None,
    )


@dataclass
class FunctionOp:
    """One event of torch's own event list (a ``FunctionEvent``), copied (times in µs)."""

    id: int
    name: str
    parent: int | None
    start_us: float
    end_us: float
    thread: int
    sequence_nr: int
    fwd_thread: int
    #: Device time of its own kernels, and their names (read only when asked for).
    device_us: float = 0.0
    kernels: list[str] | None = None
    #: Read only for the events ``inputs_of`` selects; None there when this torch cannot say.
    input_dtypes: list[str] | None = None
    input_shapes: list[Any] | None = None


_DTYPES_UNKNOWN = "the dtype each attention op ran in (autocast's casts are not seen)"


def function_ops(
    prof: Any,
    *,
    device: bool,
    inputs_of: Callable[[str], bool] = lambda name: False,
) -> list[FunctionOp]:
    """Torch's own events of a stopped profiler, with each op's kernels and device time when
    ``device`` (what only this list links up, through correlation ids).

    ``FunctionEvent.input_dtypes`` is newer than torch 2.4: where it is missing, the dtypes are
    taken from the raw event the ``FunctionEvent`` was made from (same thread, name and start).
    """
    events = list(prof.events())
    raw_dtypes: dict[tuple[int, str, int], list[str]] | None = None
    copied: list[FunctionOp] = []
    for event in events:
        name = str(event.name)
        parent = event.cpu_parent
        op = FunctionOp(
            id=int(event.id),
            name=name,
            parent=int(parent.id) if parent is not None else None,
            start_us=float(event.time_range.start),
            end_us=float(event.time_range.end),
            thread=int(event.thread),
            sequence_nr=int(getattr(event, "sequence_nr", -1)),
            fwd_thread=int(getattr(event, "fwd_thread", 0) or 0),
        )
        if device:
            op.device_us = _self_device_us(event)
            op.kernels = [str(k.name) for k in getattr(event, "kernels", None) or []]
        if inputs_of(name):
            op.input_shapes = list(getattr(event, "input_shapes", None) or [])
            if hasattr(event, "input_dtypes"):
                op.input_dtypes = list(event.input_dtypes or [])
            else:
                if raw_dtypes is None:
                    raw_dtypes = _raw_dtypes_by_start(prof, inputs_of)
                op.input_dtypes = raw_dtypes.get(_start_key(op.thread, name, op.start_us))
                if op.input_dtypes is None:
                    note_lack("FunctionEvent.input_dtypes", _DTYPES_UNKNOWN)
        copied.append(op)
    return copied


def _self_device_us(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    note_lack("FunctionEvent.self_device_time_total", "the device time of each op")
    return 0.0


def _start_key(thread: int, name: str, start_us: float) -> tuple[int, str, int]:
    return (thread, name, round(start_us * 1000))


def _raw_dtypes_by_start(
    prof: Any, inputs_of: Callable[[str], bool]
) -> dict[tuple[int, str, int], list[str]]:
    """Input dtypes of the raw events, keyed as torch keys its ``FunctionEvent``s: start thread,
    name and start relative to the trace's start."""
    start_of = getattr(_raw_results(prof), "trace_start_ns", None)
    events = raw_events(prof, keep=inputs_of, inputs_of=inputs_of)
    if not callable(start_of) or events is None:
        return {}
    try:
        origin = int(start_of())
    except (TypeError, RuntimeError):
        return {}
    return {
        (e.thread, e.name, e.start_ns - origin): e.input_dtypes or []
        for e in events
        if e.input_dtypes is not None
    }


def profiler_is_running() -> bool | None:
    """Whether a torch profiler is recording in this process; None where torch cannot say."""
    enabled = getattr(torch.autograd.profiler, "_is_profiler_enabled", None)
    if isinstance(enabled, bool):
        return enabled
    note_lack("torch.autograd.profiler._is_profiler_enabled", "whether a profiler already runs")
    return None


# ------------------------------------------------------------------------------------------------
# Dispatch, autograd and pytree internals

try:
    from torch.utils._pytree import tree_leaves, tree_map
except ImportError:  # pragma: no cover - every torch diagnose accepts has it
    from torch.utils.pytree import tree_leaves, tree_map  # type: ignore[no-redef]

try:
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    #: Why this torch cannot watch aten ops with a dispatch mode ("" when it can).
    DISPATCH_MODE_ERROR = ""
except ImportError as _exc:  # pragma: no cover - every torch diagnose accepts has it
    DISPATCH_MODE_ERROR = f"this torch has no TorchDispatchMode ({_exc})"
    _get_current_dispatch_mode = None  # type: ignore[assignment]

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands for a torch without dispatch modes: using one says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise lacking("torch.utils._python_dispatch.TorchDispatchMode", "what each aten op did")


def current_autograd_node_reader() -> Callable[[], Any] | None:
    """``torch._C._current_autograd_node`` (the backward node now running), or None."""
    reader = getattr(torch._C, "_current_autograd_node", None)
    if reader is None:
        note_lack(
            "torch._C._current_autograd_node", "which forward module a backward op belongs to"
        )
    return reader if callable(reader) else None


def innermost_dispatch_mode() -> object | None:
    """The dispatch mode on top of this thread's stack, or None (strict mode pops its own only
    when it is on top)."""
    if _get_current_dispatch_mode is None:
        return None
    return _get_current_dispatch_mode()  # type: ignore[no-any-return]


_NODE_OF: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)


def in_backward() -> bool:
    """Whether the autograd engine runs a backward node on this thread right now (False when
    this torch cannot tell)."""
    return _NODE_OF is not None and _NODE_OF() is not None


def module_call_codes() -> tuple[Any, Any]:
    """The code objects of ``nn.Module._call_impl`` (its frame's ``self`` is the module called)
    and of ``_wrapped_call_impl`` (the frame between it and the caller); None where absent."""
    call = getattr(torch.nn.Module, "_call_impl", None)
    wrapped = getattr(torch.nn.Module, "_wrapped_call_impl", None)
    return getattr(call, "__code__", None), getattr(wrapped, "__code__", None)


def has_kernel_for(op: str, dispatch_key: str) -> bool | None:
    """Whether the dispatcher has a kernel of ``op`` for ``dispatch_key``; None if torch cannot
    say (no such query, or no such op)."""
    query = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if query is None:
        note_lack("torch._C._dispatch_has_kernel_for_dispatch_key", "which devices an op runs on")
        return None
    try:
        return bool(query(op, dispatch_key))
    except (RuntimeError, TypeError, ValueError):
        return None


def fused_cpu_attention_op() -> Callable[..., Any]:
    """The private aten op of a fused attention kernel on the CPU (flash attention's layout:
    it keeps the output and one float per query row for the backward pass)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        raise lacking(
            "aten._scaled_dot_product_flash_attention_for_cpu",
            "the memory a fused attention kernel keeps",
        )
    return op  # type: ignore[no-any-return]


@functools.cache
def sdpa_takes_enable_gqa() -> bool:
    """Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch 2.5 on): diffusers'
    attention dispatch (Flux, Z-Image) passes it on every call."""
    tiny = torch.zeros(1, 1, 1, 1)
    try:
        torch.nn.functional.scaled_dot_product_attention(tiny, tiny, tiny, enable_gqa=False)
    except TypeError:
        return False
    return True


#: Softmax entry points below the public ones (``torch._softmax``), where this torch has them.
PRIVATE_SOFTMAXES: tuple[Any, ...] = tuple(
    f for f in (getattr(torch, "_softmax", None),) if f is not None
)


# ------------------------------------------------------------------------------------------------
# Autocast


def _has_device_type_overload() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return hasattr(torch, "get_autocast_dtype")
    except TypeError:
        return False


#: ``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype`` (torch 2.4 on);
#: older torch named a query per device (``is_autocast_cpu_enabled``, ``get_autocast_gpu_dtype``).
_DEVICE_TYPE_OVERLOAD = _has_device_type_overload()


def is_autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` ("cuda" covers ROCm) right now."""
    if _DEVICE_TYPE_OVERLOAD:
        return bool(torch.is_autocast_enabled(device_type))
    if device_type == "cpu":
        return bool(torch.is_autocast_cpu_enabled())
    return bool(torch.is_autocast_enabled())


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype autocast casts to on ``device_type``."""
    if _DEVICE_TYPE_OVERLOAD:
        return torch.get_autocast_dtype(device_type)
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype()
    return torch.get_autocast_gpu_dtype()


def autocast_request(context: Any) -> tuple[bool, torch.dtype | None, str]:
    """(enabled, dtype, device type) that a ``torch.autocast`` context being entered asks for
    (its private ``_enabled``; ``fast_dtype`` and ``device`` are public)."""
    return bool(getattr(context, "_enabled", True)), context.fast_dtype, str(context.device)


# ------------------------------------------------------------------------------------------------
# torch.compile


def dynamo_counters() -> Mapping[str, Mapping[str, Any]] | None:
    """``torch._dynamo``'s counters when dynamo is loaded (never imported here: importing it
    costs seconds, and a program that never compiles has nothing to count)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None) if utils is not None else None
    return counters if isinstance(counters, Mapping) else None


def inductor_cxx_compilers() -> tuple[str | None, ...]:
    """The C++ compilers inductor's CPU backend tries, as its config names them."""
    try:
        config = importlib.import_module("torch._inductor.config")
        cxx = config.cpp.cxx
    except (ImportError, AttributeError):
        note_lack("torch._inductor.config.cpp.cxx", "which C++ compiler inductor would use")
        return ()
    return tuple(cxx) if isinstance(cxx, (list, tuple)) else (cxx,)


# ------------------------------------------------------------------------------------------------
# FSDP


def fsdp2_fully_shard() -> Callable[..., Any] | None:
    """FSDP2's ``fully_shard`` (public from torch 2.6, in ``_composable`` before), or None."""
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(where), "fully_shard", None)
        except ImportError:
            continue
        if callable(found):
            return found  # type: ignore[no-any-return]
    return None


def fsdp1_class() -> type[torch.nn.Module]:
    """FSDP1's ``FullyShardedDataParallel``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError as exc:
        raise lacking("torch.distributed.fsdp.FullyShardedDataParallel", "FSDP") from exc
    return FullyShardedDataParallel


__all__ = [
    "TORCH_VERSION",
    "FunctionOp",
    "Lack",
    "RawEvent",
    "TorchDispatchMode",
    "TorchLacks",
    "autocast_dtype",
    "current_autograd_node_reader",
    "dynamo_counters",
    "fsdp1_class",
    "fsdp2_fully_shard",
    "function_ops",
    "fused_cpu_attention_op",
    "has_kernel_for",
    "inductor_cxx_compilers",
    "is_autocast_enabled",
    "lacking",
    "lacks_met",
    "note_lack",
    "profiler_is_running",
    "raw_events",
    "sdpa_takes_enable_gqa",
    "tree_leaves",
    "tree_map",
]
