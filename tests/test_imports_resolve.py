"""Every ``from diagnose... import name`` in the repository names something that exists.

Modules move (the house was reorganised by concern), and an import in a file no test runs (a
benchmark, a fixture maker, a script) would only break the day someone runs it. The imports are
read from the source with ``ast`` and resolved against the installed package: the module must
import and each name must be an attribute of it or a submodule.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO_ROOT

#: Where code that imports the project lives (scripts without a ``.py`` suffix included).
FOLDERS = ("diagnose", "probes", "reports", "tests", "benchmarks", "scripts", "fixtures")


def _sources() -> Iterator[Path]:
    for folder in FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".py":
                yield path
            elif not path.suffix:
                with path.open("rb") as handle:
                    first = handle.readline()
                if first.startswith(b"#!") and b"python" in first:
                    yield path


def unresolved(path: Path) -> list[str]:
    """The project imports of ``path`` that do not resolve, as ``module: name`` lines."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    missing: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] != "diagnose":
            continue
        try:
            module = importlib.import_module(node.module)
        except ImportError as exc:
            missing.append(f"{node.module}: {exc}")
            continue
        for alias in node.names:
            if alias.name == "*" or hasattr(module, alias.name):
                continue
            try:
                importlib.import_module(f"{node.module}.{alias.name}")
            except ImportError:
                missing.append(f"{node.module}: {alias.name}")
    return missing


def test_every_project_import_in_the_repository_resolves() -> None:
    sources = sorted(set(_sources()))
    assert any(p.parent.name == "benchmarks" for p in sources)
    assert any(p.parent.name == "scripts" and not p.suffix for p in sources)
    broken = [f"{p.relative_to(REPO_ROOT)}: {line}" for p in sources for line in unresolved(p)]
    assert not broken, "\n".join(broken)


def test_a_moved_name_and_a_moved_module_are_named(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from diagnose.stats import ab_verdict\n"
        "from diagnose.stats import no_such_name\n"
        "from diagnose.no_such_module import anything\n"
        "from .relative import skipped\n"
    )
    found = unresolved(planted)
    assert found[0] == "diagnose.stats: no_such_name"
    assert found[1].startswith("diagnose.no_such_module: ")
    assert len(found) == 2
