"""Numbers no run can have, in a record read from a file: left out with a note, never shown.

A record may come from another machine, an older diagnose or a hand edit. A saving below zero or
above the step, a share outside [0, 1], a negative duration or a negative count is dropped when
the record is read (a note names each field); the report and the gate never print it. Wrong types
and infinities stay refusals (exit 3, one line naming the field).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.record_io import LEFT_OUT, left_out_notes, load_record
from tests.conftest import FIXTURES, SHARED, percentages

SOURCE = FIXTURES / "compare" / "same_config.json"
BASELINE = FIXTURES / "compare" / "baseline.json"

Edit = Callable[[dict[str, Any]], None]


def _finding(doc: dict[str, Any], **values: Any) -> None:
    doc["findings"][0].update(values)


def _evidence(doc: dict[str, Any], **values: Any) -> None:
    doc["findings"][0]["evidence"].update(values)


def _host_load(doc: dict[str, Any]) -> None:
    doc["timing"]["host_load"] = {"basis": "psutil", "cpus": 2, "competing_share": 6.1}


#: (what is planted, the edit, the field the note must name, what must never be shown)
IMPOSSIBLE: list[tuple[str, Edit, str, str]] = [
    (
        "saving 1e9 s",
        lambda d: _finding(d, est_seconds_saved_per_it=1e9),
        "est_seconds_saved",
        r"1000000000|1e\+09",
    ),
    (
        "saving -0.5 s",
        lambda d: _finding(d, est_seconds_saved_per_it=-0.5),
        "est_seconds_saved",
        r"[−-]500 ms|[−-]0\.5\b",
    ),
    (
        "sure saving above the step",
        lambda d: _finding(d, sure_seconds_saved_per_it=5.0),
        "sure_seconds_saved",
        r"\b5(\.0+)? s/it",
    ),
    (
        "share 6.1 in evidence",
        lambda d: _evidence(d, data_wait_share_of_step=6.1),
        "data_wait_share_of_step",
        r"share_of_step\W+6\.1",
    ),
    ("negative share", lambda d: _evidence(d, share=-0.2), "share", r"share\W+[−-]0\.2"),
    ("host load share 6.1", _host_load, "competing_share", r"610%"),
    (
        "negative phase",
        lambda d: d["breakdown"]["seconds"].update(forward=-0.036),
        "breakdown.seconds",
        r"[−-]36\.0 ms",
    ),
    (
        "negative probe duration",
        lambda d: d["probes"][0].update(duration_seconds=-3.0),
        "duration_seconds",
        r"[−-]3\.00 s",
    ),
    (
        "negative first batch",
        lambda d: d["timing"].update(first_batch_seconds=-1.0),
        "first_batch",
        r"[−-]1\.00 s",
    ),
    (
        "negative parameter count",
        lambda d: d["model"].update(parameters=-5),
        "parameters",
        r"[−-]5 param",
    ),
    (
        "negative kernel class time",
        lambda d: d["breakdown"]["device_seconds_by_kernel_class"].update(gemm=-0.5),
        "['gemm']",
        r"[−-]500 ms",
    ),
]


def _write(tmp_path: Path, edit: Edit, source: Path = SOURCE) -> Path:
    doc = json.loads(source.read_text())
    edit(doc)
    path = tmp_path / "record.json"
    path.write_text(json.dumps(doc))
    return path


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("planted", "edit", "field", "shown"), IMPOSSIBLE, ids=[c[0] for c in IMPOSSIBLE]
)
def test_an_impossible_number_is_left_out_with_a_note_naming_its_field(
    tmp_path: Path, planted: str, edit: Edit, field: str, shown: str
) -> None:
    path = _write(tmp_path, edit)
    record = load_record(path)
    notes = left_out_notes(record)
    assert len(notes) == 1 and field in notes[0], notes
    html = tmp_path / "page.html"
    code, printed = _run(["report", str(path), "-o", str(html)])
    assert code == 0, printed
    assert field in printed
    for text in (printed, html.read_text()):
        assert all(0 <= p <= 100 for p in percentages(text)), sorted(percentages(text))[-3:]
        assert re.search(shown, text) is None, re.search(shown, text)
    # The gate reads the same record: the number is gone there too.
    code, printed = _run(["compare", str(BASELINE), str(path)])
    assert code in (0, 6, 9), printed  # a verdict: pass, regression or inconclusive
    assert re.search(shown, printed) is None


def test_the_savings_that_remain_are_the_records_own(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda d: _finding(d, est_seconds_saved_per_it=1e9))
    record = load_record(path)
    original = json.loads(SOURCE.read_text())["findings"]
    by_id = {f.id: f.est_seconds_saved_per_it for f in record.findings}
    assert by_id[original[0]["id"]] is None  # "not quantified", not a number
    assert by_id[original[1]["id"]] == original[1]["est_seconds_saved_per_it"]


def test_records_diagnose_writes_have_nothing_left_out() -> None:
    """The clean twin: every record of the project's fixtures reads with no note (the rules
    catch impossible numbers, not numbers the tool writes)."""
    paths = [*FIXTURES.rglob("*.json"), *(SHARED / "gpu-evidence").rglob("record.json")]
    records = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and "schema_version" in doc and "mode" in doc:
            records.append(path)
    assert len(records) >= 5
    for path in records:
        notes = [n for n in load_record(path).notes if n.startswith(LEFT_OUT)]
        assert not notes, (path, notes)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: _finding(d, est_seconds_saved_per_it="fast"), "est_seconds_saved_per_it"),
        (lambda d: d["model"].update(parameters=2.5), "parameters"),
        (lambda d: d["breakdown"]["seconds"].update(forward=float("inf")), "forward"),
    ],
)
def test_wrong_types_and_infinities_are_refused_naming_the_field(
    tmp_path: Path, edit: Edit, field: str
) -> None:
    path = _write(tmp_path, edit)
    code, printed = _run(["report", str(path), "-o", str(tmp_path / "page.html")])
    assert code == 3
    lines = printed.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diagnose: error:") and field in lines[0]
