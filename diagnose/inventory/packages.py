"""The packages a LoRA trainer leans on: version and whether each imports. Imports run with
their output captured; xformers and flash-attn, which can hang or crash the interpreter on a broken
build, are imported in a child interpreter with a timeout."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnose.inventory.printed import (
    _exception_text,
    _format_warnings,
    _one_line,
    _recorded_warnings,
    _trim_printed,
)
from diagnose.quiet import capture_output

#: Seconds a child interpreter may take to import xformers or flash-attn (they import torch and
#: load large CUDA/HIP libraries; a broken build can hang in a driver call).
ISOLATED_IMPORT_TIMEOUT_S = 60.0

#: What a package entry's "status" can say.
PACKAGE_STATUSES: tuple[str, ...] = (
    "ok",
    "not installed",
    "import failed",  # the error text is kept verbatim (one line)
    "timed out",  # isolated import took longer than the timeout
    "crashed",  # the child interpreter died (segfault/abort in a native library)
    "not checked",  # a child interpreter could not be started
)


@dataclass(frozen=True)
class PackageSpec:
    """A package whose version and importability the inventory records."""

    #: Key in the inventory (the name users know).
    name: str
    #: Top-level module to import.
    module: str
    #: Distribution names to look up, in order (ROCm wheels ship triton as pytorch-triton-rocm).
    distributions: tuple[str, ...]
    #: Import in a child interpreter with a timeout: slow to import, or may crash the process.
    isolated: bool = False
    #: Further modules to import after ``module`` (what users actually call).
    also_import: tuple[str, ...] = ()


#: In import order: dependencies before their users, so that what a package prints is charged to
#: it (peft imports bitsandbytes; importing bitsandbytes first keeps its message on its own line).
PACKAGES: tuple[PackageSpec, ...] = (
    PackageSpec("numpy", "numpy", ("numpy",)),
    PackageSpec("pillow", "PIL", ("pillow", "Pillow", "pillow-simd")),
    PackageSpec("safetensors", "safetensors", ("safetensors",)),
    PackageSpec(
        "triton", "triton", ("triton", "pytorch-triton-rocm", "pytorch-triton", "triton-rocm")
    ),
    PackageSpec("torchvision", "torchvision", ("torchvision",)),
    PackageSpec("transformers", "transformers", ("transformers",)),
    PackageSpec("accelerate", "accelerate", ("accelerate",)),
    PackageSpec("bitsandbytes", "bitsandbytes", ("bitsandbytes",)),
    PackageSpec("diffusers", "diffusers", ("diffusers",)),
    PackageSpec("peft", "peft", ("peft",)),
    # diffusers calls xformers.ops.memory_efficient_attention; a build for another torch often
    # imports "xformers" fine and fails (or warns) on xformers.ops.
    PackageSpec(
        "xformers", "xformers", ("xformers",), isolated=True, also_import=("xformers.ops",)
    ),
    PackageSpec("flash_attn", "flash_attn", ("flash-attn", "flash_attn"), isolated=True),
)

_CHILD_IMPORT = r"""
import importlib, json, sys, time
out = {"ok": True, "error": "", "version": None}
started = time.perf_counter()
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        break
out["seconds"] = time.perf_counter() - started
module = sys.modules.get(sys.argv[2])
version = getattr(module, "__version__", None)
out["version"] = None if version is None else str(version)
with open(sys.argv[1], "w", encoding="utf-8") as handle:
    json.dump(out, handle)
"""


def _distribution_version(spec: PackageSpec) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first installed distribution, else (None, None)."""
    for dist in spec.distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):
            return dist, importlib.metadata.version(dist)
    return None, None


def _module_present(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _package_entry(spec: PackageSpec, dist: str | None, version: str | None) -> dict[str, Any]:
    return {
        "module": spec.module,
        "distribution": dist,
        "version": version,
        "installed": False,
        "imports": None,
        "status": "not installed",
        "error": "",
        "printed": "",
        "checked": "",
        # Seconds the import took (in a child: without starting the interpreter). A first import
        # pays for shared dependencies (torch._dynamo), so the order of PACKAGES matters.
        "import_seconds": None,
    }


@contextlib.contextmanager
def torch_compile_deferred() -> Iterator[None]:
    """Within the block, ``torch.compile(fn)`` returns a wrapper that compiles on its first call.

    bitsandbytes decorates its CPU kernels with ``torch.compile`` at import, which imports torch's
    compiler stack (seconds on a small CPU) for functions a LoRA step on most devices never calls.
    A compiled function only compiles when called anyway; deferring the wrapping to that call
    changes when the compiler is imported, not what runs.
    """
    torch: Any = sys.modules.get("torch")
    real = getattr(torch, "compile", None)
    if torch is None or real is None:
        yield
        return

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred(fn, **options)
        if not inspect.isfunction(model):
            return real(model, **options)  # modules and callables keep their compiled type
        compiled: Any = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def _import_in_process(modules: Iterable[str]) -> tuple[bool, str, str, float]:
    """Import ``modules`` here with output captured: (imported, error, printed, seconds)."""
    error = ""
    started = time.perf_counter()
    with _recorded_warnings() as caught, capture_output() as captured, torch_compile_deferred():
        for module in modules:
            try:
                importlib.import_module(module)
            except (Exception, SystemExit) as exc:
                error = _exception_text(exc)
                break
    seconds = time.perf_counter() - started
    printed = "\n".join(t for t in (captured.text, _format_warnings(caught)) if t.strip())
    return not error, error, printed, seconds


@dataclass
class _Child:
    spec: PackageSpec
    process: subprocess.Popen[bytes]
    result_path: Path


def _start_child_import(spec: PackageSpec, folder: Path) -> _Child:
    result_path = folder / f"{spec.name}.json"
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD_IMPORT, str(result_path), spec.module, *spec.also_import],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return _Child(spec, process, result_path)


@dataclass
class _ChildOutcome:
    imports: bool
    status: str
    error: str
    printed: str
    version: str | None = None
    seconds: float | None = None


def _finish_child_import(child: _Child, deadline: float, timeout_s: float) -> _ChildOutcome:
    """Wait for a child import until ``deadline`` and read what it reported."""
    try:
        output, _ = child.process.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.process.kill()
        output, _ = child.process.communicate()
        return _ChildOutcome(
            imports=False,
            status="timed out",
            error=f"importing {child.spec.module} took longer than {timeout_s:g} s",
            printed=output.decode("utf-8", errors="replace"),
        )
    printed = output.decode("utf-8", errors="replace")
    try:
        result = json.loads(child.result_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        result = None
    if isinstance(result, dict):
        ok = bool(result.get("ok"))
        seconds = result.get("seconds")
        return _ChildOutcome(
            imports=ok,
            status="ok" if ok else "import failed",
            error=_one_line(result.get("error") or ""),
            printed=printed,
            version=str(result["version"]) if result.get("version") else None,
            seconds=round(float(seconds), 3) if isinstance(seconds, (int, float)) else None,
        )
    # No report: the interpreter died before writing it (a segfault in a CUDA/HIP library).
    code = child.process.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        reason = f"the interpreter crashed ({name}) while importing {child.spec.module}"
    else:
        reason = f"the interpreter exited with status {code} while importing {child.spec.module}"
    return _ChildOutcome(imports=False, status="crashed", error=reason, printed=printed)


def collect_packages(
    packages: Sequence[PackageSpec] = PACKAGES,
    *,
    isolated_timeout_s: float = ISOLATED_IMPORT_TIMEOUT_S,
) -> dict[str, dict[str, Any]]:
    """Version and import status of each package (not yet redacted).

    Isolated packages are imported in child interpreters started first, so they run on other
    cores while this process imports the rest; each child gets ``isolated_timeout_s`` seconds
    counted from when the in-process imports are done.
    """
    entries: dict[str, dict[str, Any]] = {}
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="diagnose-imports-") as folder:
        try:
            # Children first: they run on other cores while this process imports the rest.
            for spec in packages:
                dist, version = _distribution_version(spec)
                entry = entries[spec.name] = _package_entry(spec, dist, version)
                if dist is None and not _module_present(spec.module):
                    continue
                entry["installed"] = True
                if spec.module in sys.modules and all(m in sys.modules for m in spec.also_import):
                    entry.update(imports=True, status="ok", checked="already imported")
                elif spec.isolated:
                    entry["checked"] = "child process"
                    try:
                        children.append(_start_child_import(spec, Path(folder)))
                    except OSError as exc:
                        entry.update(
                            imports=None,
                            status="not checked",
                            error=f"cannot start a child interpreter: {_exception_text(exc)}",
                        )
            for spec in packages:
                entry = entries[spec.name]
                if entry["installed"] and not entry["checked"]:
                    _check_in_process(spec, entry)
            deadline = time.monotonic() + isolated_timeout_s
            for child in children:
                entry = entries[child.spec.name]
                outcome = _finish_child_import(child, deadline, isolated_timeout_s)
                entry.update(
                    imports=outcome.imports,
                    status=outcome.status,
                    error=outcome.error,
                    printed=_trim_printed(outcome.printed),
                    import_seconds=outcome.seconds,
                )
                if entry["version"] is None and outcome.version:
                    entry["version"] = outcome.version
        finally:
            for child in children:  # interrupted (Ctrl-C): leave no interpreter behind
                if child.process.poll() is None:
                    child.process.kill()
                    child.process.wait()
    return entries


def _check_in_process(spec: PackageSpec, entry: dict[str, Any]) -> None:
    ok, error, printed, seconds = _import_in_process((spec.module, *spec.also_import))
    entry.update(
        import_seconds=round(seconds, 3),
        imports=ok,
        status="ok" if ok else "import failed",
        error=error,
        printed=_trim_printed(printed),
        checked="this process",
    )
    if entry["version"] is None and ok:
        entry["version"] = _module_version(spec.module)


def _module_version(module: str) -> str | None:
    version = getattr(sys.modules.get(module), "__version__", None)
    return None if version is None else str(version)
