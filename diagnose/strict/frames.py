"""Where an op was run from, read off the Python stack only when strict mode has something to say.

Nothing here runs per op: the module path, the user's own line and the trimmed traceback are
worked out from the frames at a violation, so watching a step costs no module hooks.

- **module path**: every ``nn.Module`` call has a ``Module._call_impl`` frame whose ``self`` is the
  module; the chain of them, outermost first, named child by child (``unet.down_blocks.1...``),
  the outermost by the variable or attribute that holds it in the code that called it;
- **the user's frame**: the innermost frame of code that is not torch's, diagnose's, the standard
  library's or an installed package's (the trainer's own script or package);
- **the traceback**: a :class:`~diagnose.strict.violations.StrictViolation` is raised inside torch,
  so its traceback ends in torch's and diagnose's frames; the exception hooks installed here cut
  it after the user's frame before it is printed.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch

from diagnose.strict.violations import StrictViolation
from diagnose.torch_compat import module_call_codes

_CALL_IMPL_CODE, _WRAPPED_CODE = module_call_codes()
#: Child names found per (parent, child) object pair (a module tree does not change mid-run).
_CHILD_NAMES: dict[tuple[int, int], str | None] = {}
_LIBRARY_DIRS: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
    """Folders whose code is not the user's: torch, diagnose, the standard library, packages."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        import diagnose

        dirs = {
            os.path.dirname(os.path.abspath(torch.__file__)),
            os.path.dirname(os.path.abspath(diagnose.__file__)),
        }
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            path = sysconfig.get_paths().get(key)
            if path:
                dirs.add(os.path.abspath(path))
        try:
            dirs.update(os.path.abspath(p) for p in site.getsitepackages())
            dirs.add(os.path.abspath(site.getusersitepackages()))
        except (AttributeError, TypeError):  # a virtualenv's old site module
            pass
        _LIBRARY_DIRS = tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))
    return _LIBRARY_DIRS


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own code (not a library's, not ``<frozen ...>``)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(d) for d in _library_dirs())


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the user's own code at or outside ``frame``."""
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def describe_frame(frame: FrameType | None) -> str:
    """``/path/train.py:31, in loss_of``."""
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}, in {frame.f_code.co_name}"


# --------------------------------------------------------------------------------------------
# Module path


def module_chain(frame: FrameType | None) -> list[tuple[torch.nn.Module, FrameType]]:
    """The modules being called at ``frame``, outermost first, with their ``_call_impl`` frames."""
    chain: list[tuple[torch.nn.Module, FrameType]] = []
    if _CALL_IMPL_CODE is None:
        return chain
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                chain.append((module, frame))
        frame = frame.f_back
    chain.reverse()
    return chain


def _child_name(parent: torch.nn.Module, child: torch.nn.Module) -> str | None:
    key = (id(parent), id(child))
    if key not in _CHILD_NAMES:
        found = None
        for name, module in parent.named_modules():
            if module is child and name:
                found = name
                break
        _CHILD_NAMES[key] = found
    return _CHILD_NAMES[key]


def _caller_of(call_impl: FrameType) -> FrameType | None:
    """The frame that called the module whose ``_call_impl`` frame this is."""
    caller = call_impl.f_back
    while caller is not None and caller.f_code is _WRAPPED_CODE:
        caller = caller.f_back
    return caller


def _attribute_holding(owner: object, module: torch.nn.Module) -> str | None:
    children = getattr(owner, "_modules", None)
    if isinstance(children, dict):
        for name, value in children.items():
            if value is module:
                return str(name)
    for name, value in getattr(owner, "__dict__", {}).items():
        if value is module:
            return str(name)
    return None


def _held_as(module: torch.nn.Module, caller: FrameType | None) -> str:
    """The name the calling code holds ``module`` by: a local variable, an attribute of its
    ``self`` (``self.unet``) or of another local (``components.denoiser``: "denoiser"); else the
    module's class name."""
    if caller is not None:
        local = caller.f_locals
        for name, value in local.items():
            if value is module and name != "self":
                return name
        owners = [local["self"]] if "self" in local else []
        owners += [v for k, v in local.items() if k != "self" and hasattr(v, "__dict__")]
        for owner in owners:
            held = _attribute_holding(owner, module)
            if held is not None:
                return held
    return type(module).__name__


def module_path(frame: FrameType | None) -> tuple[str, str]:
    """(dotted path, class name) of the innermost module being called at ``frame``: ("", "")
    outside any module."""
    chain = module_chain(frame)
    if not chain:
        return "", ""
    root, root_frame = chain[0]
    parts = [_held_as(root, _caller_of(root_frame))]
    parent = root
    for module, call_frame in chain[1:]:
        name = _child_name(parent, module)
        if name is None:  # called from outside its parent's tree: start again from it
            parts = [_held_as(module, _caller_of(call_frame))]
        else:
            parts.append(name)
        parent = module
    return ".".join(parts), type(chain[-1][0]).__name__


# --------------------------------------------------------------------------------------------
# The traceback the user sees


def trim_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Cut ``tb`` after its innermost entry in the user's own code (in place; returned)."""
    entries: list[TracebackType] = []
    node = tb
    while node is not None:
        entries.append(node)
        node = node.tb_next
    last = None
    for index, entry in enumerate(entries):
        if is_user_file(entry.tb_frame.f_code.co_filename):
            last = index
    if last is not None:
        entries[last].tb_next = None
    return tb


_HOOKED = False


def install_exception_hooks() -> None:
    """Make the printed traceback of a strict violation end in the user's frame (``sys`` and
    ``threading`` hooks, chained to the ones already set; once per process)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, StrictViolation):
            with contextlib.suppress(Exception):
                tb = trim_traceback(tb)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    previous_thread: Callable[[Any], Any] = threading.excepthook

    def thread_hook(args: Any) -> None:
        if isinstance(args.exc_value, StrictViolation):
            with contextlib.suppress(Exception):
                trim_traceback(args.exc_traceback)
        previous_thread(args)

    threading.excepthook = thread_hook


__all__ = [
    "describe_frame",
    "install_exception_hooks",
    "is_user_file",
    "module_chain",
    "module_path",
    "trim_traceback",
    "user_frame",
]
