"""The README stays a short door into docs/: few words, every docs/ page linked from it, and every
link and every repository path the pages name resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
#: The README's budget: past it, reference text belongs on a docs/ page.
README_MAX_WORDS = 1500

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", re.MULTILINE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
#: A path the pages name in code spans, under one of the repository's top-level folders.
_REPO_PATH = re.compile(
    r"`((?:diagnose|probes|reports|tests|benchmarks|fixtures|scripts|docs)/[\w./-]+)`"
)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans: links are only read from prose."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text()))


def _anchors(page: Path) -> set[str]:
    """The anchors a renderer gives ``page``'s headings (lower case, punctuation dropped, spaces
    to hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, title in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_readme_is_short() -> None:
    words = len(README.read_text().split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words; move reference to docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (README.parent / target.split("#")[0]).resolve()
        for target in _links(README)
        if target.split("#")[0]
    }
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_link_resolves_inside_the_repository() -> None:
    root = REPO_ROOT.resolve()
    broken = []
    for page in _pages():
        for target in _links(page):
            where = f"{page.relative_to(REPO_ROOT)}: {target}"
            if _SCHEME.match(target) or target.startswith("/"):
                broken.append(f"{where} (points outside the repository)")
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page.resolve()
            if not path.is_relative_to(root):
                broken.append(f"{where} (points outside the repository)")
            elif not path.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_repository_path_the_pages_name_exists() -> None:
    missing = [
        f"{page.relative_to(REPO_ROOT)}: {name}"
        for page in _pages()
        for name in _REPO_PATH.findall(page.read_text())
        if not (REPO_ROOT / name.rstrip("/")).exists()
    ]
    assert not missing, "\n".join(missing)


def test_the_checks_see_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A `code` heading: two\n\n[ok](#a-code-heading-two) [gone](#nowhere)\n"
        "`[not a link](x.md)`\n\n```\n[nor this](y.md)\n```\n"
    )
    assert _links(page) == ["#a-code-heading-two", "#nowhere"]
    assert _anchors(page) == {"title", "a-code-heading-two"}
