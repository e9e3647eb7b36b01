"""What is the same on every run, kept between runs in the user's cache folder.

Some work before a run's first step depends only on things known before it starts (the
configuration, the device's memory, the code and library versions): whether a full-size model with
a LoRA on modules of the user's choosing fits the GPU is counted on the meta device, seconds before
every first step, and gives the same line every time (the presets' own LoRAs are counted from
their shipped counts). It
is kept under ``$XDG_CACHE_HOME/diagnose`` (else ``~/.cache/diagnose``), one file per key, keyed
by everything that decides it, this package's own code included; an entry that cannot be read or
holds another key is computed again and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from diagnose.output import write_text_atomic

#: Bumped when an entry's layout changes.
LAYOUT = 1
#: Libraries whose version can change what a cached value is (models built from their configs).
LIBRARIES = ("torch", "diffusers", "transformers", "peft", "bitsandbytes")


def cache_root() -> Path:
    """The user's cache folder for diagnose (the XDG base directory rule)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "diagnose"


@cache
def code_version() -> str:
    """A digest of this installation's own modules and of the libraries' versions."""
    digest = hashlib.sha256()
    folders = []
    for package in ("diagnose", "diagnose.probes"):
        spec = importlib.util.find_spec(package)
        folders += list(spec.submodule_search_locations or []) if spec else []
    for folder in sorted(set(folders)):
        for path in sorted(Path(folder).rglob("*.py")):
            digest.update(f"{path.relative_to(folder)}:".encode())
            digest.update(path.read_bytes())
    for library in LIBRARIES:
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{library}={version};".encode())
    return digest.hexdigest()[:16]


def remembered_text(kind: str, key: Mapping[str, Any], compute: Callable[[], str]) -> str:
    """``compute()``'s text, from the cache when an entry of ``kind`` holds it for ``key`` (plus
    this code's version), else computed and kept."""
    text_key = json.dumps(
        {"layout": LAYOUT, "code": code_version(), **key}, sort_keys=True, default=str
    )
    path = cache_root() / kind / f"{hashlib.sha256(text_key.encode()).hexdigest()[:32]}.json"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("key") == text_key and isinstance(entry.get("value"), str):
            return str(entry["value"])
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not ours: computed
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": text_key, "value": value}))
    except OSError:  # a read-only home: the run goes on without the cache
        pass
    return value


__all__ = ["cache_root", "code_version", "remembered_text"]
