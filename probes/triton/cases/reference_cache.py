"""The float64 references of the corpus computed once per machine, not once per run.

At its GPU shapes a reference (float64 values with a bound per element, computed on the CPU)
takes far longer than the kernel it judges: seconds per check, a minute or more per seed on a
small CPU. What decides a reference is known before it is computed: the case, its shape and
dtype, the check's seed (which decides the inputs), the rounding the reference models (the mode,
backend and architecture, the case's kind, torch's fp32 matmul switches) and the code that
generates the inputs and computes the reference. A reference that took long enough to be worth a
file is kept under that key in the user's cache folder (``$XDG_CACHE_HOME/diagnose``, else
``~/.cache/diagnose``), so a rerun, or ``--seeds N`` after a run of the default seed, computes
only what it has not seen. An entry that cannot be read, or holds anything but that key's
reference, is ignored and computed again (then rewritten): the cache is never trusted over the
computation. The folder is kept under :data:`MAX_BYTES`, least recently used first out.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from diagnose.output import write_stream_atomic
from diagnose.probes.triton.cases import formats
from diagnose.probes.triton.cases.api import (
    CheckEnv,
    Shape,
    Tensors,
    TritonCase,
    dtype_name,
    shape_label,
)
from diagnose.probes.triton.cases.bounds import Error
from diagnose.probes.triton.cases.numerics import Bounded, Numerics
from diagnose.probes.triton.cases.reference import reference_of
from diagnose.user_cache import cache_root

#: A reference computed faster than this is not worth a file (the interpreter's small shapes).
MIN_SECONDS = 0.05
#: The folder's size cap; the least recently used entries go first. One seed of the corpus at its
#: GPU shapes keeps about 1 GiB.
MAX_BYTES = 8 << 30
#: Bumped when an entry's layout changes.
LAYOUT = 2
_FORMATS = {f.name: f for f in vars(formats).values() if isinstance(f, formats.Format)}


def cache_folder() -> Path:
    """Where the references are kept: the user's cache folder's ``triton-references``."""
    return cache_root() / "triton-references"


@cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def code_version(case: TritonCase) -> str:
    """The code a reference comes from: the harness's modules and the case's own file."""
    package = Path(__file__).parent
    files = sorted(str(p) for p in package.glob("*.py"))
    for part in (case.make_inputs, case.reference):
        try:
            files.append(inspect.getsourcefile(part) or "")
        except TypeError:  # a builtin or a C function: no file of its own
            files.append(repr(part))
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{Path(path).name}:{_file_digest(path)};".encode())
    return digest.hexdigest()[:16]


def rounding_mode(env: CheckEnv, kind: str) -> str:
    """What decides the rounding a reference models (see :mod:`~.formats`)."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    return (
        f"{env.mode}/{env.backend}/{env.arch}/{kind}/tf32={matmul}/"
        f"cudnn-tf32={torch.backends.cudnn.allow_tf32}/{torch.get_float32_matmul_precision()}"
    )


def entry_key(case: TritonCase, shape: Shape, dtype: torch.dtype, seed: int, env: CheckEnv) -> str:
    return (
        f"layout {LAYOUT} | {case.name} | {shape_label(shape)} | {dtype_name(dtype)} | seed "
        f"{seed} | {rounding_mode(env, case.kind)} | code {code_version(case)}"
    )


def _path(folder: Path, key: str) -> Path:
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"


def _load(path: Path, key: str, num: Numerics) -> tuple[dict[str, Bounded], str] | None:
    """The entry at ``path`` when it holds ``key``'s reference whole, else None."""
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None
        outputs = {}
        for name, part in entry["outputs"].items():
            value, err = part["value"], part["err"]
            if not (isinstance(value, torch.Tensor) and isinstance(err, torch.Tensor)):
                return None
            # A cut tensor raises or grows (checked on the shapes: adding them would copy both).
            broadcast: Any = torch.broadcast_shapes  # untyped
            if broadcast(value.shape, err.shape) != value.shape:
                return None
            fmt = _FORMATS[part["fmt"]] if part["fmt"] else None
            zero = torch.zeros((), dtype=torch.float64)
            # The judge reads a value and its bound: the bound kept as the whole worst case.
            outputs[str(name)] = Bounded(value, Error(err, zero, zero, zero), fmt, num)
        precision = entry["precision"]
        if not outputs or not isinstance(precision, str):
            return None
        return outputs, precision
    except Exception:  # unreadable, truncated, another layout: computed again, never trusted
        return None


def _store(path: Path, key: str, outputs: Mapping[str, Bounded], precision: str) -> None:
    parts: dict[str, Any] = {}
    for name, bounded in outputs.items():
        if bounded.fmt is not None and _FORMATS.get(bounded.fmt.name) is not bounded.fmt:
            return  # a format made on the fly: it could not be read back as itself
        parts[name] = {
            # Copies: a view would carry its whole storage into the file.
            "value": bounded.value.clone(),
            "err": bounded.err.clone(),
            "fmt": bounded.fmt.name if bounded.fmt is not None else "",
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "outputs": parts, "precision": precision}
    write_stream_atomic(path, lambda handle: torch.save(entry, handle))


def _trim(folder: Path, max_bytes: int) -> None:
    entries = []
    for path in folder.glob("*.pt"):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_atime, stat.st_mtime, stat.st_size, path))
    total = sum(size for _, _, size, _ in entries)
    for _, _, size, path in sorted(entries, key=lambda e: e[1]):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def cached_reference(
    case: TritonCase,
    inputs: Tensors,
    dtype: torch.dtype,
    env: CheckEnv,
    *,
    shape: Shape,
    seed: int,
    folder: Path | None = None,
    min_seconds: float = MIN_SECONDS,
    max_bytes: int = MAX_BYTES,
) -> tuple[dict[str, Bounded], str]:
    """:func:`~.check.reference_of` for the check of ``case`` at ``shape``, ``dtype`` and
    ``seed`` (whose inputs are ``inputs``), read from the cache when it holds it whole."""
    folder = folder or cache_folder()
    key = entry_key(case, shape, dtype, seed, env)
    path = _path(folder, key)
    if path.is_file():
        hit = _load(path, key, Numerics(env, case.kind))
        if hit is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: the last to be trimmed
            return hit
    started = time.perf_counter()
    outputs, precision = reference_of(case, inputs, dtype, env)
    if time.perf_counter() - started >= min_seconds:
        try:
            _store(path, key, outputs, precision)
            _trim(folder, max_bytes)
        except OSError:  # a read-only or full disk: the run goes on without the cache
            pass
    return outputs, precision


__all__ = ["MAX_BYTES", "MIN_SECONDS", "cache_folder", "cached_reference", "entry_key"]
