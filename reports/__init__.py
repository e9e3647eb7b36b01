"""Renderers of a saved RunRecord: the HTML report and the terminal summary.

They only read a record (never torch, never a GPU), so a saved run re-renders anywhere.
"""

from __future__ import annotations

from .html import render_html, write_html
from .terminal import terminal_summary

__all__ = ["render_html", "terminal_summary", "write_html"]
