"""No Python source of the repository is over :data:`LIMIT` lines unless its top says why it must
be one file: a line within its first :data:`HEAD_LINES` lines (in the module docstring or a
comment) that starts with ``Why one file:``. A file that holds several ideas is split at its
seams instead; the line is for a file that is one idea (a schema, one concern's catalog, tests
that share one real run).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

LIMIT = 600
HEAD_LINES = 40
#: The folders whose Python sources are held to the limit.
SCANNED = ("diagnose", "probes", "reports", "scripts", "benchmarks", "tests", "fixtures")
#: A reason line: ``Why one file:`` at its start, after an optional ``#`` and spaces.
REASON = re.compile(r"^\s*#?\s*Why one file:")


def is_python_source(path: Path) -> bool:
    """A ``.py`` file, or a script without the suffix whose first line runs Python."""
    if path.suffix == ".py":
        return True
    if path.suffix:
        return False
    with path.open("rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def python_sources(root: Path = REPO_ROOT) -> list[Path]:
    """Every Python source under the scanned folders of ``root`` (caches and hidden folders
    left out)."""
    found: list[Path] = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*")):
            parts = path.relative_to(root).parts
            if any(part == "__pycache__" or part.startswith(".") for part in parts):
                continue
            if path.is_file() and is_python_source(path):
                found.append(path)
    return found


def unexplained_length(path: Path) -> int | None:
    """The file's line count when it is over :data:`LIMIT` lines and none of its first
    :data:`HEAD_LINES` lines says why it must be one file; None when it is within the limit or
    says why."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) <= LIMIT:
        return None
    if any(REASON.match(line) for line in lines[:HEAD_LINES]):
        return None
    return len(lines)


def test_no_source_file_is_over_the_limit_without_saying_why() -> None:
    over = [
        f"{path.relative_to(REPO_ROOT)}: {length} lines"
        for path in python_sources()
        if (length := unexplained_length(path)) is not None
    ]
    assert not over, (
        f"over {LIMIT} lines with no 'Why one file:' line in the first {HEAD_LINES} lines (split "
        "the file at its seams, or say why it is one idea):\n" + "\n".join(over)
    )


def test_the_walk_reads_every_scanned_folder() -> None:
    """A walk that found nothing would pass the check above on any tree."""
    found = python_sources()
    assert Path(__file__).resolve() in found
    assert {path.relative_to(REPO_ROOT).parts[0] for path in found} == set(SCANNED)


def _module(tmp_path: Path, name: str, head: list[str], lines: int) -> Path:
    """A module of ``lines`` lines that begins with ``head``."""
    body = [f"VALUE_{i} = {i}" for i in range(lines - len(head))]
    path = tmp_path / name
    path.write_text("\n".join([*head, *body]) + "\n", encoding="utf-8")
    return path


def test_a_long_file_is_named_unless_its_top_says_why(tmp_path: Path) -> None:
    """Planted: a module one line over the limit with no reason (named), and its twins that say
    why in the docstring or in a comment (quiet)."""
    docstring = ['"""A table of values."""']
    plain = _module(tmp_path, "plain.py", docstring, LIMIT + 1)
    assert unexplained_length(plain) == LIMIT + 1

    said = ['"""A table of values.', "", "Why one file: one table, read top to bottom.", '"""']
    assert unexplained_length(_module(tmp_path, "said.py", said, LIMIT + 1)) is None
    commented = [*docstring, "", "# Why one file: one table, read top to bottom."]
    assert unexplained_length(_module(tmp_path, "commented.py", commented, LIMIT + 1)) is None


def test_the_reason_counts_only_at_the_top_and_only_past_the_limit(tmp_path: Path) -> None:
    at_limit = _module(tmp_path, "at_limit.py", ['"""A table of values."""'], LIMIT)
    assert unexplained_length(at_limit) is None
    # The reason below the first HEAD_LINES lines is not at the top.
    late = [f"# line {i}" for i in range(HEAD_LINES)] + ["# Why one file: too late to count."]
    assert unexplained_length(_module(tmp_path, "late.py", late, LIMIT + 1)) == LIMIT + 1
    # A line that mentions the phrase without starting with it is no reason.
    mentioned = ['"""Not a reason: Why one file: here."""']
    assert unexplained_length(_module(tmp_path, "mentioned.py", mentioned, LIMIT + 1)) is not None


def test_a_python_script_without_the_suffix_is_read(tmp_path: Path) -> None:
    script = _module(tmp_path, "tool", ["#!/usr/bin/env python3"], 3)
    shell = tmp_path / "run"
    shell.write_text("#!/usr/bin/env bash\necho hi\n", encoding="utf-8")
    data = tmp_path / "table.json"
    data.write_text("{}\n", encoding="utf-8")
    assert is_python_source(script)
    assert not is_python_source(shell) and not is_python_source(data)
