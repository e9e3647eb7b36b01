"""The HTML report: one self-contained, offline page that explains the measured s/it.

The page is laid out by Jinja2 templates (``templates/``) from the view (:mod:`.view`), with
autoescaping on: every value from the record is escaped; the only markup passed through untouched is
the charts' SVG, which :mod:`.charts` builds from numbers alone. Styles are inline, there is no
script, and a Content-Security-Policy forbids loading anything, so the file works offline and a
hostile string in a record (an op name, a traceback) cannot run or fetch anything.
"""

from __future__ import annotations

import functools
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from diagnose.record import RunRecord

from .view import KV, build_view


@functools.lru_cache(maxsize=1)
def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("diagnose.reports", "templates"),
        autoescape=True,
        undefined=StrictUndefined,  # a template typo fails the tests instead of rendering blank
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["svg"] = _trusted_svg
    env.tests["kv_leaf"] = _is_leaf
    return env


def _trusted_svg(svg: str) -> Markup:
    """Mark chart SVG safe: only for :mod:`.charts` output, which holds no record string."""
    return Markup(svg)


def _is_leaf(row: KV) -> bool:
    return not row.children


def render_html(record: RunRecord, *, baseline: RunRecord | None = None) -> str:
    """The report page for ``record`` as a string.

    ``baseline`` is reserved for comparing against an earlier record (the CI gate); it is not shown
    yet.
    """
    del baseline  # accepted now so callers need not change when comparison lands
    view = build_view(record)
    return _environment().get_template("report.html").render(view=view)


def write_html(record: RunRecord, path: Path) -> None:
    """Render ``record`` and write the page to ``path`` (UTF-8)."""
    path.write_text(render_html(record), encoding="utf-8")


__all__ = ["render_html", "write_html"]
