"""The HTML report: one self-contained, offline page that explains the measured s/it.

The page is laid out by Jinja2 templates (``templates/``) from the view (:mod:`.view`), with
autoescaping on: every value from the record is escaped; the only markup passed through untouched is
the charts' SVG, which :mod:`.charts` builds from numbers alone. Styles are inline, there is no
script, and a Content-Security-Policy forbids loading anything, so the file works offline and a
hostile string in a record (an op name, a traceback) cannot run or fetch anything.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from diagnose.gate import Comparison
from diagnose.record import RunRecord
from diagnose.record_io import load_record

from .key_values import KV
from .view import build_view


@functools.lru_cache(maxsize=1)
def template_environment() -> Environment:
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
    return not row.children and not row.columns


def render_html(
    record: RunRecord,
    *,
    comparison: Comparison | None = None,
    not_compared: str = "",
) -> str:
    """The report page for ``record`` as a string.

    With ``comparison`` (the gate's, so the page shows the gate's own options and verdict) the
    page opens with it; with ``not_compared`` (why the baselines could not be compared: another
    device or config) it says so in that place instead.
    """
    from .gate_outputs import build_compare_view, compare_chart_svg, refused_view

    compare_view = refused_view(not_compared) if not_compared else None
    if comparison is not None:
        compare_view = build_compare_view(comparison)
        try:
            chart = compare_chart_svg(comparison)
        except Exception:  # a chart is optional: its numbers are in the table next to it
            chart = ""
        compare_view = dataclasses.replace(compare_view, chart=chart)
    view = build_view(record, comparison=compare_view)
    return template_environment().get_template("report.html").render(view=view)


def write_html(
    record: RunRecord,
    path: Path,
    *,
    comparison: Comparison | None = None,
    not_compared: str = "",
) -> None:
    """Render ``record`` (see :func:`render_html`) and write the page to ``path`` (UTF-8)."""
    from diagnose.output import write_text_atomic

    page = render_html(record, comparison=comparison, not_compared=not_compared)
    # Atomic: a kill mid-write must not leave an empty report beside a complete record.
    write_text_atomic(path, page)


#: How every page diagnose writes begins (templates/base.html): what tells a report it wrote,
#: derived output it may render again, from a file of the user's by the same name.
_OWN_PAGE_HEAD = '<meta name="generator" content="diagnose '


def is_own_report(path: Path) -> bool:
    """Whether ``path`` is a regular file holding a page diagnose rendered."""
    try:
        if not path.is_file() or path.is_symlink():
            return False
        with path.open("rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return head.startswith(b"<!DOCTYPE html>") and _OWN_PAGE_HEAD.encode() in head


def save_record_and_report(record: RunRecord, record_path: Path, report_path: Path) -> RunRecord:
    """Save ``record``, then render the report from the file as saved, as ``diagnose report``
    reads it: re-rendering the folder gives the same bytes (a record's mappings come back in
    the file's key order, so a page built from the live record laid its tables out otherwise).
    Returns the record as read back."""
    record.save(record_path)
    saved = load_record(record_path)
    write_html(saved, report_path)
    return saved


__all__ = ["is_own_report", "render_html", "save_record_and_report", "write_html"]
