"""The report's two charts written as SVG by our own code: the breakdown bar and the per-step times.

What the page relies on: the same bytes for the same numbers, nothing external, no id clash between
charts, no record string, sensible ticks, and no matplotlib import to draw them.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from diagnose.reports.charts import (
    Segment,
    StepPoint,
    breakdown_bar_svg,
    nice_step,
    nice_ticks,
    step_decimals,
    step_times_svg,
)


def _points(seconds: list[float], start: int = 1) -> list[StepPoint]:
    return [StepPoint(start + i, s) for i, s in enumerate(seconds)]


def bar(*seconds: float, chart_id: str = "breakdown") -> str:
    colors = ("#E69F00", "#0072B2", "#56B4E9", "#009E73")
    return breakdown_bar_svg(
        [Segment(s, colors[i % len(colors)]) for i, s in enumerate(seconds)], chart_id=chart_id
    )


def steps(
    unprofiled: list[float] | None = None,
    profiled: list[float] | None = None,
    warmup: list[float] | None = None,
    median: float | None = None,
    chart_id: str = "steps",
) -> str:
    warm = warmup or []
    timed = unprofiled or []
    return step_times_svg(
        warmup=_points(warm),
        unprofiled=_points(timed, len(warm) + 1),
        profiled=_points(profiled or [], len(warm) + len(timed) + 1),
        median=median,
        chart_id=chart_id,
    )


def _tree(svg: str) -> ET.Element:
    """Parsed as XML: the chart is well formed (the test adds the namespace the page implies)."""
    return ET.fromstring(svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1))


def _texts(svg: str) -> list[str]:
    return [t.text or "" for t in _tree(svg).iter("{http://www.w3.org/2000/svg}text")]


def _numbers(svg: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", svg)


_NOT_A_NUMBER = re.compile(r"\b(nan|inf|infinity)\b", re.IGNORECASE)


def _ids(svg: str) -> list[str]:
    return re.findall(r'\bid="([^"]+)"', svg)


FULL = {
    "warmup": [25.0, 2.2],
    "unprofiled": [1.8, 1.82, 1.79, 1.85],
    "profiled": [2.0, 2.1],
    "median": 1.82,
}


# --- nice ticks ------------------------------------------------------------------------------


def test_nice_ticks_pick_round_steps_like_a_plotting_library() -> None:
    assert nice_ticks(0.337) == (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35)
    assert nice_ticks(1.44) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6)
    assert nice_ticks(0.175, max_intervals=10) == tuple(round(0.02 * k, 2) for k in range(10))
    assert nice_ticks(10_800, max_intervals=10)[:3] == (0.0, 2000.0, 4000.0)
    assert nice_ticks(1.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # an exact multiple ends there
    assert nice_ticks(3e-5) == tuple(round(5e-6 * k, 6) for k in range(7))


def test_nice_ticks_are_free_of_float_noise() -> None:
    for high in (0.3, 0.7, 1.1, 2.9, 0.00037, 123.4, 9.99e-7):
        for tick in nice_ticks(high):
            assert len(repr(tick)) <= 12, (high, tick)
    assert 0.3 in nice_ticks(0.3)


def test_integer_ticks_and_odd_ranges() -> None:
    assert nice_ticks(14.5, low=0.5, max_intervals=10, integer=True) == (2, 4, 6, 8, 10, 12, 14, 16)
    assert nice_ticks(1.5, low=0.5, integer=True) == (1.0, 2.0)
    assert nice_step(0.001, integer=True) == 1.0
    assert nice_ticks(0.0) == (0.0,)
    assert nice_ticks(math.inf) == () and nice_ticks(math.nan) == () and nice_ticks(1, low=2) == ()
    assert nice_step(-1.0) == 1.0
    assert (step_decimals(0.05), step_decimals(0.2), step_decimals(2000.0)) == (2, 1, 0)


# --- the page's promises -------------------------------------------------------------------


def test_same_numbers_same_bytes() -> None:
    assert steps(**FULL) == steps(**FULL)  # type: ignore[arg-type]
    assert bar(0.06, 0.04, 0.07) == bar(0.06, 0.04, 0.07)


def test_charts_are_inline_svg_with_no_external_reference() -> None:
    for svg in (bar(0.06, 0.04, 0.07), steps(**FULL)):  # type: ignore[arg-type]
        assert svg.startswith('<svg role="img" aria-label="')
        assert svg.endswith("</svg>")
        _tree(svg)  # well formed
        lowered = svg.lower()
        for banned in ("://", "xmlns", "href", "url(", "<script", "<style", "<image", "<foreign"):
            assert banned not in lowered, banned
        assert not _NOT_A_NUMBER.search(lowered)


def test_ids_carry_the_chart_id_and_two_charts_never_clash() -> None:
    page = bar(0.1, 0.2, chart_id="bar") + steps(**FULL, chart_id="steps")  # type: ignore[arg-type]
    page += steps([0.5, 0.6], chart_id="steps-2")
    ids = _ids(page)
    assert ids and len(ids) == len(set(ids))
    assert all(i.split("-")[0] in ("bar", "steps") for i in ids)
    assert all(i.startswith("steps-2-") for i in _ids(steps([0.5, 0.6], chart_id="steps-2")))
    with pytest.raises(ValueError):
        bar(0.1, chart_id='x" onload="alert(1)')


def test_text_is_only_our_labels_and_numbers() -> None:
    labels = {
        "seconds per step",
        "seconds",
        "milliseconds per step",
        "milliseconds",
        "step, in run order",
        "warm-up (not counted)",
        "unprofiled",
        "profiled",
        "unprofiled median",
    }
    for svg in (bar(0.06, 0.04, 0.07), steps(**FULL)):  # type: ignore[arg-type]
        for text in _texts(svg):
            assert text in labels or re.fullmatch(r"(↑ )?[\d.]+( [µm]?s)?", text), text


def test_numbers_are_compact() -> None:
    svg = steps([0.1 + 0.2, 0.3, 0.7], warmup=[0.1], median=0.3) + bar(0.1, 0.2, 1 / 3)
    assert not [n for n in _numbers(svg) if len(n.split(".")[-1]) > 3 and "." in n]


def test_the_breakdown_bar_draws_segments_left_to_right_on_a_time_axis() -> None:
    """A step under a second reads in milliseconds, as the page's own numbers beside the bar do
    ("11.9 ms"), not as 0.00-0.30 seconds."""
    svg = bar(0.1, 0.2, 0.037)
    rects = _tree(svg).findall(".//{http://www.w3.org/2000/svg}rect")
    assert [r.get("fill") for r in rects] == ["#E69F00", "#0072B2", "#56B4E9"]
    xs = [float(r.get("x", "")) for r in rects]
    widths = [float(r.get("width", "")) for r in rects]
    assert xs == sorted(xs) and widths[1] == pytest.approx(2 * widths[0], rel=0.01)
    assert _texts(svg) == [
        "0",
        "50",
        "100",
        "150",
        "200",
        "250",
        "300",
        "milliseconds per step",
    ]
    assert _texts(bar(1.5, 0.5))[-1] == "seconds per step"


def test_the_step_chart_shows_each_series_the_median_and_a_legend() -> None:
    svg = steps(**FULL)  # type: ignore[arg-type]
    root = _tree(svg)
    ns = "{http://www.w3.org/2000/svg}"
    groups = {g.get("id"): g for g in root.iter(f"{ns}g") if g.get("id")}
    assert len(groups["steps-warmup"].findall(f"{ns}rect")) == 2  # squares
    assert len(groups["steps-unprofiled"].findall(f"{ns}circle")) == 4
    assert len(groups["steps-profiled"].findall(f"{ns}path")) == 2  # triangles
    assert 'id="steps-median"' in svg and "stroke-dasharray" in svg
    texts = _texts(svg)
    assert {"warm-up (not counted)", "unprofiled", "profiled", "unprofiled median"} <= set(texts)
    assert {"seconds", "step, in run order", "0.0", "0.5", "2.0"} <= set(texts)
    assert "↑ 25.0 s" in texts  # the warm-up step far above is drawn at the top with its value
    only_profiled = _texts(steps(profiled=[0.17, 0.18]))
    assert "profiled" in only_profiled and "unprofiled" not in only_profiled
    assert "unprofiled median" not in only_profiled


# --- edge cases ------------------------------------------------------------------------------


def test_nothing_to_draw_is_an_empty_string() -> None:
    assert bar() == "" and bar(0.0, -1.0, math.nan, math.inf) == ""
    assert bar(1e308, 1e308) == ""  # the total overflows
    assert steps() == ""
    assert steps([math.nan, -1.0], [math.inf], [math.nan], median=math.nan) == ""


def test_bad_values_are_left_out() -> None:
    clean = steps([0.5, 0.6], median=0.55)
    svg = step_times_svg(
        warmup=[StepPoint(0, math.nan)],
        unprofiled=[
            StepPoint(1, 0.5),
            StepPoint(2, -3.0),
            StepPoint(3, math.inf),
            StepPoint(2, 0.6),
        ],
        profiled=[],
        median=0.55,
    )
    assert svg == clean
    assert bar(0.1, math.nan, 0.2) == bar(0.1, 0.2).replace("#0072B2", "#56B4E9")
    assert "steps-median" not in steps([0.5], median=-1.0) + steps([0.5], median=math.inf)


def test_one_point_and_all_equal_values() -> None:
    one = steps([0.5], median=0.5)
    assert "step, in run order" in one and "1" in _texts(one)
    assert not {"0.945", "1.005"} & set(_texts(one))  # one step tick on the x axis
    equal = steps(profiled=[0.2] * 5)
    assert {"0", "200"} <= set(_texts(equal))
    zeros = steps([0.0, 0.0])
    assert zeros.startswith("<svg") and not _NOT_A_NUMBER.search(zeros)
    assert bar(0.25).startswith("<svg")


@pytest.mark.parametrize(
    ("seconds", "unit", "ticks"),
    [
        (1.2e-5, "microseconds", ["0", "2", "4", "6", "8", "10", "12"]),
        (0.004, "milliseconds", ["0.0", "0.5", "1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]),
        (10_800.0, "minutes", ["0", "20", "40", "60", "80", "100", "120", "140", "160", "180"]),
        (40 * 3600.0, "hours", ["0", "5", "10", "15", "20", "25", "30", "35", "40"]),
    ],
)
def test_tiny_and_huge_magnitudes_read_in_a_fitting_unit(
    seconds: float, unit: str, ticks: list[str]
) -> None:
    texts = _texts(bar(seconds))
    assert texts[-1] == f"{unit} per step"
    assert texts[:-1] == ticks
    step_texts = _texts(steps([seconds, seconds * 0.9]))
    assert unit in step_texts


def test_absurd_magnitudes_still_draw() -> None:
    for seconds in (1e-15, 1e200):
        for svg in (bar(seconds), steps([seconds, seconds / 2], median=seconds)):
            assert svg.startswith("<svg") and not _NOT_A_NUMBER.search(svg)
            _tree(svg)


def test_many_steps_get_few_ticks_and_small_markers() -> None:
    svg = steps([2.5 + (i % 7) * 0.05 for i in range(500)], warmup=[40.0, 3.0], median=2.6)
    ticks = [t for t in _texts(svg) if t.isdigit()]
    assert 3 <= len(ticks) <= 11
    radii = {c.get("r") for c in _tree(svg).iter("{http://www.w3.org/2000/svg}circle")}
    assert all(float(r or 0) <= 1.5 for r in radii - {"2.2"})  # 2.2: the legend's marker


# --- no matplotlib -------------------------------------------------------------------------


def test_drawing_the_report_charts_does_not_import_matplotlib() -> None:
    code = textwrap.dedent(
        """
        import sys
        from diagnose.reports.charts import Segment, StepPoint, breakdown_bar_svg, step_times_svg
        from diagnose.reports.html import render_html
        from tests.test_reports import full_record

        assert breakdown_bar_svg([Segment(0.2, "#E69F00")])
        assert step_times_svg(
            unprofiled=[StepPoint(2, 0.2)], profiled=[StepPoint(3, 0.3)],
            warmup=[StepPoint(1, 9.0)], median=0.2,
        )
        page = render_html(full_record())
        assert page.count('<svg role="img"') == 2, page.count("<svg")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib")
        print(loaded)
        sys.exit(1 if loaded else 0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
