"""Renderers of a saved RunRecord: the HTML report and the terminal summary.

They only read a record (never torch, never a GPU), so a saved run re-renders anywhere.
"""

from __future__ import annotations

from .html import is_own_report, render_html, save_record_and_report, write_html
from .terminal import terminal_summary

__all__ = [
    "is_own_report",
    "render_html",
    "save_record_and_report",
    "terminal_summary",
    "write_html",
]
