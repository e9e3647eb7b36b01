"""The one progress wrapper: a status line, or a bar of points; nothing when there is nothing to
count or the stream is no terminal."""

from __future__ import annotations

import io

from diagnose.progress import ProgressLine


def test_a_status_line_and_a_bar_of_points() -> None:
    stream = io.StringIO()
    with ProgressLine(enabled=True, stream=stream) as line:
        line("building the model")
    assert "diagnose: building the model" in stream.getvalue()

    stream = io.StringIO()
    with ProgressLine(
        enabled=True, stream=stream, total=3, bar_format="{n_fmt}/{total_fmt}"
    ) as bar:
        assert bar._bar is not None
        bar._bar.update(2)
        bar._bar.refresh()
    assert "2/3" in stream.getvalue()


def test_nothing_to_count_or_no_terminal_shows_nothing() -> None:
    stream = io.StringIO()
    with ProgressLine(enabled=True, stream=stream, total=0) as bar:
        bar("ignored")
    assert not bar.enabled and stream.getvalue() == ""
    with ProgressLine(stream=stream) as line:  # a StringIO is no terminal
        line("ignored")
    assert not line.enabled and stream.getvalue() == ""
