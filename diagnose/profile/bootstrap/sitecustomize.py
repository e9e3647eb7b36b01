"""Bootstrap that ``diagnose profile`` injects into every Python process of the user's command.

``diagnose profile`` puts this folder first on ``PYTHONPATH``; Python's ``site`` module imports
the first ``sitecustomize`` it finds at start-up, so every Python process the command starts
(``python train.py``, the ``torchrun``/``accelerate launch`` launcher and its ranks, DataLoader
workers started with spawn) runs this file before the user's code.

It must cost nothing in processes that never train: it imports only what the interpreter has
already loaded, and puts a finder on ``sys.meta_path`` that waits for ``torch.optim.optimizer``
(and ``torch.utils.data.dataloader``) to be imported. Only then is the capture code
(``diagnose/profile/capture.py``, loaded by file path because the user's Python may not have
``diagnose`` installed) loaded and handed the freshly executed module. The finder leaves
``sys.meta_path`` once both modules were seen.

It then runs the ``sitecustomize`` that this one shadows, if there is one (a distribution's or the
user's own), so that nothing changes for the user's program. Nothing here may raise into that
program: a failure of ours is written to ``<capture dir>/process-<pid>.json`` and swallowed.
"""

from __future__ import annotations

import os
import sys
import time

#: ``typing`` is not loaded at start-up in a plain interpreter; mypy treats this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

#: When this process started running Python code (the capture reports the first step against it).
STARTED_AT_PERF = time.perf_counter()
STARTED_AT_UNIX = time.time()

#: As ENV_DIR, ENV_CAPTURE and PROCESS_PREFIX of ``capture_contract.py``, which this file does not
#: load (it loads nothing at start-up); a test keeps them equal.
_DIR_VARIABLE = "DIAGNOSE_PROFILE_DIR"
_CAPTURE_VARIABLE = "DIAGNOSE_PROFILE_CAPTURE"
_PROCESS_PREFIX = "process-"
#: The modules the capture wants to see executed, in the order they are usually imported.
_WATCHED = ("torch.optim.optimizer", "torch.utils.data.dataloader")
#: The name the capture module is registered under (not ``diagnose.…``: the user's Python may have
#: another diagnose, or none).
_CAPTURE_MODULE = "_diagnose_profile_capture"
_SHADOWED_MODULE = "_diagnose_profile_shadowed_sitecustomize"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _record_failure(where: str, exc: BaseException) -> None:
    """Write our failure to this process's status file; never raise."""
    try:
        import json

        folder = os.environ.get(_DIR_VARIABLE)
        if not folder:
            return
        path = os.path.join(folder, f"{_PROCESS_PREFIX}{os.getpid()}.json")
        payload = {
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "error": f"bootstrap {where}: {type(exc).__name__}: {exc}".splitlines()[0][:500],
        }
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
        os.replace(temporary, path)
    except Exception:
        pass


def _load_capture() -> ModuleType:
    """The capture module, loaded once by file path."""
    loaded = sys.modules.get(_CAPTURE_MODULE)
    if loaded is not None:
        return loaded
    import importlib.util

    path = os.environ.get(_CAPTURE_VARIABLE) or os.path.join(os.path.dirname(_HERE), "capture.py")
    spec = importlib.util.spec_from_file_location(_CAPTURE_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the capture module from {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as the import system does, so that dataclasses can resolve it.
    sys.modules[_CAPTURE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_CAPTURE_MODULE, None)
        raise
    return module


def _executed(name: str, module: ModuleType) -> None:
    try:
        _load_capture().on_import(name, module, STARTED_AT_PERF, STARTED_AT_UNIX)
    except Exception as exc:
        _record_failure(f"on import of {name}", exc)


class _Loader:
    """Runs the real loader, then tells the capture that the module exists.

    It stands in for the real loader only while the module executes: afterwards the module's
    ``__loader__`` and ``__spec__.loader`` point at the real one again (``inspect``, ``linecache``
    and ``importlib.resources`` ask them).
    """

    def __init__(self, real: Any, name: str) -> None:
        self._real = real
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._real, attribute)

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self._real, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            module.__loader__ = self._real
            if module.__spec__ is not None:
                module.__spec__.loader = self._real
        except Exception:
            pass
        self._real.exec_module(module)
        _executed(self._name, module)


class _Watcher:
    """A ``sys.meta_path`` finder that answers for nothing: it only wraps the loader of the watched
    modules, found by the finders behind it."""

    def __init__(self) -> None:
        self.pending = set(_WATCHED)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        try:
            self.pending.discard(fullname)
            if not self.pending:
                self.remove()
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _Loader(spec.loader, fullname)
            return spec
        except Exception as exc:
            _record_failure(f"finding {fullname}", exc)
            return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _install() -> None:
    if not os.environ.get(_DIR_VARIABLE):
        return
    # Our folder served its purpose (this import); the user's program should not see it on
    # sys.path. Children still get it through PYTHONPATH.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.meta_path.insert(0, _Watcher())


def _chain() -> None:
    """Run the sitecustomize we shadow, as ``site`` would have (its errors are reported the way
    ``site`` reports them, on stderr, and do not stop the program)."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.origin is None or spec.loader is None:
        return
    spec = importlib.util.spec_from_file_location(_SHADOWED_MODULE, spec.origin)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[_SHADOWED_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(
            "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(exc).__name__}: {exc}\n"
        )


try:
    _install()
except Exception as _exc:
    _record_failure("install", _exc)
try:
    _chain()
except Exception as _exc:
    _record_failure("chaining to the shadowed sitecustomize", _exc)
