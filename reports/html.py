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

from diagnose.compare import Comparison
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
    return not row.children and not row.columns


def render_html(
    record: RunRecord,
    *,
    baseline: RunRecord | None = None,
    comparison: Comparison | None = None,
) -> str:
    """The report page for ``record`` as a string.

    With ``comparison`` (the gate's, so the page shows the gate's own options and verdict) or
    ``baseline`` (compared here with the default options), the page opens with the comparison.
    A baseline that cannot be compared (another device or config) is said so on the page.
    """
    from .compare import build_compare_view, compare_chart_svg, refused_view

    compare_view = None
    if comparison is None and baseline is not None:
        from diagnose.compare import compare_records
        from diagnose.errors import DiagnoseError

        try:
            comparison = compare_records(baseline, record)
        except DiagnoseError as exc:
            compare_view = refused_view(exc.message)
    if comparison is not None:
        compare_view = build_compare_view(comparison)
        try:
            chart = compare_chart_svg(comparison)
        except Exception:  # a chart is optional: its numbers are in the table next to it
            chart = ""
        compare_view = dataclasses.replace(compare_view, chart=chart)
    view = build_view(record, comparison=compare_view)
    return _environment().get_template("report.html").render(view=view)


def write_html(
    record: RunRecord,
    path: Path,
    *,
    baseline: RunRecord | None = None,
    comparison: Comparison | None = None,
) -> None:
    """Render ``record`` (with the comparison, if given) and write the page to ``path`` (UTF-8)."""
    path.write_text(render_html(record, baseline=baseline, comparison=comparison), encoding="utf-8")


__all__ = ["render_html", "write_html"]
