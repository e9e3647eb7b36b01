"""The private torch APIs strict mode stands on, in one place (so that they move together into the
project's torch compatibility layer).

- ``torch.utils._python_dispatch.TorchDispatchMode``: sees every aten op after autocast cast its
  inputs and composite ops decomposed (public in spirit, private in name since torch 1.13);
- ``torch.utils._python_dispatch._get_current_dispatch_mode``: whether ours is the innermost
  mode, so it is only popped when it is on top;
- ``torch._C._current_autograd_node``: non-None while the autograd engine runs a backward node
  (torch 2.1+); strict mode judges forward ops only;
- ``nn.Module._call_impl`` / ``_wrapped_call_impl``: the frames of a module call, read at a
  violation to name the module;
- ``torch.autocast``'s ``_enabled`` and ``fast_dtype``: what an autocast context being entered
  asks for.

Every accessor degrades: a torch without one of them makes strict mode report "not judged",
never crash the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    from torch.utils._python_dispatch import TorchDispatchMode as _Base
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    DISPATCH_MODE_ERROR = ""
except ImportError as exc:  # a torch without Python dispatch modes
    _Base = object  # type: ignore[assignment,misc]
    _get_current_dispatch_mode = None  # type: ignore[assignment]
    DISPATCH_MODE_ERROR = f"this torch has no TorchDispatchMode ({exc})"

#: The base class of strict mode's op watcher.
DispatchModeBase: type = _Base

_node_of: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward node on this thread right now (False
    when this torch cannot tell)."""
    return _node_of is not None and _node_of() is not None


def innermost_dispatch_mode() -> object | None:
    """The dispatch mode on top of this thread's stack, or None."""
    if _get_current_dispatch_mode is None:
        return None
    return _get_current_dispatch_mode()  # type: ignore[no-any-return]


def module_call_codes() -> tuple[Any, Any]:
    """The code objects of ``nn.Module._call_impl`` (its frame's ``self`` is the module called)
    and of ``_wrapped_call_impl`` (the frame between it and the caller); None when absent."""
    call = getattr(torch.nn.Module, "_call_impl", None)
    wrapped = getattr(torch.nn.Module, "_wrapped_call_impl", None)
    return getattr(call, "__code__", None), getattr(wrapped, "__code__", None)


def autocast_request(context: Any) -> tuple[bool, torch.dtype | None, str]:
    """(enabled, dtype, device type) a ``torch.autocast`` context asks for."""
    return bool(context._enabled), context.fast_dtype, str(context.device)


__all__ = [
    "DISPATCH_MODE_ERROR",
    "DispatchModeBase",
    "autocast_request",
    "in_backward",
    "innermost_dispatch_mode",
    "module_call_codes",
]
