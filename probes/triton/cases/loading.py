"""Loading cases: the corpus modules, and users' own files or modules with a ``CASES`` list."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diagnose.probes.triton.cases.api import TritonCase
from diagnose.probes.triton.cases.failures import first_line


class CaseLoadError(Exception):
    """A MODULE_OR_FILE that does not give a list of TritonCase (the message is one line)."""


def looks_like_file(source: str) -> bool:
    return source.endswith(".py") or "/" in source or "\\" in source


def validate_source(source: str) -> str:
    """Check a MODULE_OR_FILE without importing it; return it normalised (files made absolute)."""
    if looks_like_file(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise CaseLoadError(f"{source}: no such file")
        if path.suffix != ".py":
            raise CaseLoadError(f"{source}: not a Python file")
        return str(path.resolve())
    try:
        with _cwd_importable():
            spec = importlib.util.find_spec(source)
    except (ImportError, ValueError) as exc:
        raise CaseLoadError(f"{source}: cannot find the module ({first_line(exc)})") from None
    if spec is None:
        raise CaseLoadError(f"{source}: no such module or file")
    return source


@contextmanager
def _cwd_importable() -> Iterator[None]:
    """Modules in the current folder import, as with ``python -m`` (the worker runs that way)."""
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_cases(source: str) -> list[TritonCase]:
    """Import MODULE_OR_FILE and return its module-level ``CASES`` list."""
    source = validate_source(source)
    try:
        if looks_like_file(source):
            module = _import_file(Path(source))
        else:
            with _cwd_importable():
                module = importlib.import_module(source)
    except CaseLoadError:
        raise
    except Exception as exc:
        raise CaseLoadError(f"{source}: importing it raised {first_line(exc)}") from None
    cases = getattr(module, "CASES", None)
    if cases is None:
        raise CaseLoadError(f"{source}: defines no CASES list")
    if not isinstance(cases, (list, tuple)) or not all(isinstance(c, TritonCase) for c in cases):
        raise CaseLoadError(f"{source}: CASES must be a list of TritonCase")
    if not cases:
        raise CaseLoadError(f"{source}: CASES is empty")
    return list(cases)


def _import_file(path: Path) -> Any:
    name = f"_diagnose_cases_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaseLoadError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # Like running a script: the file's folder is importable while it loads (its own helpers).
    folder = str(path.parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module
