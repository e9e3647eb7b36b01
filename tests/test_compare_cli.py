"""`diagnose compare` end to end on recorded records: exit codes, the table, JUnit XML, markdown,
the HTML report with the comparison, and the refusals (bad input, existing outputs)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import pytest

from diagnose.cli import all_commands
from diagnose.commands import ArgumentParser
from diagnose.commands.compare import (
    CompareCommand,
    add_gate_options,
    apply_gate,
    parse_threshold,
    print_gate,
)
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.gate import compare_records
from diagnose.record import Finding, RunRecord
from diagnose.record_io import load_record
from diagnose.reports import render_html
from diagnose.reports.gate_outputs import compare_junit, compare_markdown, compare_table
from tests.conftest import FIXTURES, REPO_ROOT

COMPARE = FIXTURES / "compare"
BASELINE = COMPARE / "baseline.json"
SAME = COMPARE / "same_config.json"
SLOW = COMPARE / "slow_data.json"


def run_compare(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run `diagnose compare ARGV` in-process: through diagnose.cli.main once the command is
    registered, else through the same parser class and error handling main() uses."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if any(c.name == "compare" for c in all_commands()):
            from diagnose.cli import main

            code = main(["compare", *argv])
        else:
            parser = ArgumentParser(prog="diagnose compare")
            command = CompareCommand()
            command.prepare_parser(parser)
            try:
                code = command.run(parser.parse_args(list(argv)))
            except DiagnoseError as exc:
                print(f"diagnose: error: {exc.message}", file=sys.stderr)
                code = int(exc.code)
    return code, out.getvalue(), err.getvalue()


def write_record(path: Path, record: RunRecord) -> Path:
    path.write_text(record.to_json(), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# Exit codes


def test_same_config_passes_or_says_it_cannot_judge(tmp_path: Path) -> None:
    """The fixtures' s/it spread leaves it unjudged: INCONCLUSIVE with its own exit code, never
    PASS; a --fail-on without inconclusive lets it pass."""
    code, out, err = run_compare([str(BASELINE), str(SAME)])
    assert code == ExitCode.INCONCLUSIVE, out + err
    assert out.startswith("diagnose compare: INCONCLUSIVE")
    assert "s/it" in out and "forward" in out
    code, out, err = run_compare([str(BASELINE), str(SAME), "--fail-on", "slower,new-critical"])
    assert code == ExitCode.OK, out + err
    assert out.startswith("diagnose compare: PASS")


def test_planted_slowdown_fails_with_regression_and_writes_every_output(tmp_path: Path) -> None:
    junit, markdown, html = tmp_path / "gate.xml", tmp_path / "gate.md", tmp_path / "r.html"
    argv = [str(BASELINE), str(SLOW), "--junit", str(junit), "--markdown", str(markdown)]
    code, out, _ = run_compare([*argv, "--html", str(html), "--fail-on", "slower,phase"])
    assert code == ExitCode.REGRESSION
    assert out.startswith("diagnose compare: FAIL")
    assert junit.is_file() and markdown.is_file() and html.is_file()
    page = html.read_text(encoding="utf-8")
    assert 'id="comparison"' in page and "data wait" in page and "FAIL" in page
    # Existing outputs are refused without --force, before anything is compared.
    code, _, err = run_compare(argv)
    assert code == ExitCode.OUTPUT_EXISTS and "--force" in err and err.count("\n") == 1
    code, _, _ = run_compare([*argv, "--force"])
    assert code == ExitCode.REGRESSION


def test_run_folders_are_accepted(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    write_record(folder / "record.json", load_record(BASELINE))
    code, out, _ = run_compare([str(folder), str(SAME)])
    assert code == ExitCode.INCONCLUSIVE and "record.json" in out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "invalid JSON"),
        ('{"hello": 1}', "not a diagnose record"),
        (None, "no such file"),
    ],
)
def test_bad_records_exit_3_with_one_line(tmp_path: Path, content: str | None, needle: str) -> None:
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content, encoding="utf-8")
    code, out, err = run_compare([str(BASELINE), str(bad)])
    assert code == ExitCode.BAD_INPUT
    assert needle in err and err.count("\n") == 1 and not out


def test_mismatched_records_exit_3_unless_allowed_and_then_say_so_loudly(tmp_path: Path) -> None:
    other = load_record(SAME)
    other.config["attention"] = "math"
    other_path = write_record(tmp_path / "math.json", other)
    code, _, err = run_compare([str(BASELINE), str(other_path)])
    assert code == ExitCode.BAD_INPUT and err.count("\n") == 1
    assert "config attention differs (baseline 'auto', current 'math')" in err
    junit, markdown, html = tmp_path / "g.xml", tmp_path / "g.md", tmp_path / "g.html"
    code, out, _ = run_compare(
        [
            str(BASELINE),
            str(other_path),
            "--allow-different",
            "--junit",
            str(junit),
            "--markdown",
            str(markdown),
            "--html",
            str(html),
        ]
    )
    assert code == ExitCode.INCONCLUSIVE
    loud = "NOT LIKE FOR LIKE"
    assert loud in out
    assert loud in junit.read_text(encoding="utf-8")
    assert loud in markdown.read_text(encoding="utf-8")
    assert loud in html.read_text(encoding="utf-8")


def test_several_baselines_on_the_command_line(tmp_path: Path) -> None:
    """BASELINE BASELINE CURRENT: both baselines are listed, their drift is said, and the same
    run given twice is refused with one line."""
    code, out, err = run_compare([str(BASELINE), str(SAME), str(SLOW)])
    assert code == ExitCode.REGRESSION, out + err  # the slow data is beyond both baselines
    assert out.count("  baseline: ") == 2 and "  drift:    the 2 baselines' s/it medians" in out
    junit = tmp_path / "gate.xml"
    run_compare([str(BASELINE), str(SAME), str(SLOW), "--junit", str(junit)])
    names = {p.get("name") for p in ET.parse(junit).getroot().iter("property")}
    assert {"baseline", "baseline 2", "current", "drift"} <= names
    code, out, err = run_compare([str(BASELINE), str(BASELINE), str(SLOW)])
    assert code == ExitCode.BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "the same run as" in err


def test_an_output_over_a_compared_record_is_refused_even_with_force(tmp_path: Path) -> None:
    current = write_record(tmp_path / "current.json", load_record(SLOW))
    before = current.read_bytes()
    code, out, err = run_compare([str(BASELINE), str(current), "--junit", str(current), "--force"])
    assert code == ExitCode.USAGE and out == ""
    assert "a record being compared" in err and err.count("\n") == 1
    assert current.read_bytes() == before


def test_the_summary_writes_a_tiny_p_value_as_an_inequality() -> None:
    quiet = load_record(BASELINE)
    slower = copy.deepcopy(quiet)
    slower.created = "2026-11-30T10:00:00+00:00"
    for sample in slower.timing.samples:
        sample.seconds *= 2  # every step slower than every baseline step: p is tiny
    table = compare_table(compare_records(quiet, slower))
    assert "p<0.0001" in table.splitlines()[0]
    assert "p=<" not in table


def test_usage_errors_exit_2() -> None:
    for argv in (
        [str(BASELINE), str(SAME), "--fail-on", "slower,sometimes"],
        [str(BASELINE), str(SAME), "--threshold", "10"],
        [str(BASELINE), str(SAME), "--significance", "2"],
        [str(BASELINE)],
    ):
        code, _, err = run_compare(argv)
        assert code == ExitCode.USAGE, argv
        assert err.count("\n") == 1


def test_threshold_parsing() -> None:
    assert parse_threshold("10%") == pytest.approx(0.10)
    assert parse_threshold("0.05") == pytest.approx(0.05)
    assert parse_threshold("150%") == pytest.approx(1.5)
    for bad in ("10", "abc", "0", "-5%"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_threshold(bad)


def test_threshold_option_changes_the_verdict(tmp_path: Path) -> None:
    base = load_record(BASELINE)
    for i, sample in enumerate(base.timing.samples):  # quiet steps: 100 ms ± 0.5%
        sample.seconds = 0.1 * (1 + 0.001 * (i % 5))
    slower = copy.deepcopy(base)
    for sample in slower.timing.samples:
        sample.seconds *= 1.07
    base_path = write_record(tmp_path / "base.json", base)
    path = write_record(tmp_path / "slower.json", slower)
    assert run_compare([str(base_path), str(path)])[0] == ExitCode.OK  # +7% < 10%
    assert run_compare([str(base_path), str(path), "--threshold", "5%"])[0] == ExitCode.REGRESSION


def test_gate_options_work_for_another_command() -> None:
    """`diagnose run --baseline` reuses add_gate_options, apply_gate and print_gate."""
    parser = ArgumentParser(prog="diagnose run")
    parser.add_argument("--force", action="store_true")
    add_gate_options(parser)
    args = parser.parse_args(["--fail-on", "slower,phase", "--threshold", "5%"])
    assert args.fail_on == {"slower", "phase"} and args.threshold == pytest.approx(0.05)
    stream = io.StringIO()
    outcome = apply_gate([load_record(BASELINE)], load_record(SLOW), args)
    assert outcome.exit_code == ExitCode.REGRESSION
    print_gate(outcome, args, stream=stream)
    assert stream.getvalue().startswith("diagnose compare: FAIL")


# --------------------------------------------------------------------------------------------
# JUnit


def test_junit_has_the_required_structure(tmp_path: Path) -> None:
    comparison = compare_records(load_record(BASELINE), load_record(SLOW))
    text = compare_junit(comparison)
    root = ET.fromstring(text.encode("utf-8"))
    assert text.startswith("<?xml")
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    for element in (root, suite):
        for attribute in ("tests", "failures", "errors", "skipped", "time"):
            assert element.get(attribute) is not None and element.get(attribute, "").isdigit()
    cases = suite.findall("testcase")
    assert int(suite.get("tests", "")) == len(cases)
    assert all(c.get("name") and c.get("classname") for c in cases)
    failures = [c for c in cases if c.find("failure") is not None]
    assert int(suite.get("failures", "")) == len(failures)
    assert int(suite.get("skipped", "")) == sum(c.find("skipped") is not None for c in cases)
    # One testcase per metric and per new (or escalated) finding; the gate's failures are the
    # failures.
    metric_cases = [c for c in cases if c.get("classname") != "diagnose.compare.findings"]
    assert len(metric_cases) == len(comparison.metrics)
    finding_cases = [c for c in cases if c.get("classname") == "diagnose.compare.findings"]
    assert [c.get("name") for c in finding_cases] == ["dataloader.gpu_starved"]
    failed = {c.get("name") for c in failures}
    assert failed == {"s/it", "dataloader.gpu_starved"}
    for case in failures:
        failure = case.find("failure")
        assert failure is not None and failure.get("message") and failure.get("type")
    # The phase regression is reported but does not fail: "phase" is not in the default gate.
    data_wait = next(c for c in cases if c.get("name") == "data wait")
    assert data_wait.find("failure") is None
    assert "slower" in (data_wait.findtext("system-out") or "")


def test_junit_reads_back_in_an_independent_junit_reader(tmp_path: Path) -> None:
    """junitparser (what many CI tools and scripts read JUnit with) must see the same cases,
    results and counts the gate wrote."""
    from junitparser import Failure, JUnitXml, Skipped

    comparison = compare_records(load_record(BASELINE), load_record(SLOW))
    path = tmp_path / "gate.xml"
    path.write_text(compare_junit(comparison), encoding="utf-8")
    suites = list(JUnitXml.fromfile(str(path)))
    assert len(suites) == 1
    suite = suites[0]
    cases = list(suite)
    assert suite.tests == len(cases) == len(comparison.metrics) + 1  # + the escalated finding
    failed = {c.name for c in cases if any(isinstance(r, Failure) for r in c.result)}
    skipped = {c.name for c in cases if any(isinstance(r, Skipped) for r in c.result)}
    assert failed == {"s/it", "dataloader.gpu_starved"} and suite.failures == len(failed)
    inconclusive = {m.label for m in comparison.metrics if m.verdict == "inconclusive"}
    assert skipped == inconclusive and suite.skipped == len(skipped)
    assert {p.name for p in suite.properties()} >= {"baseline", "current", "gate", "verdict"}


def test_the_tables_interval_is_the_one_the_verdict_words_say() -> None:
    """The table's confidence interval and the verdict's reason quote the same numbers, to a
    tenth of a per cent: a table that rounded +10.4% to "+10%" read as inside the ±10% the
    verdict said it reaches beyond."""
    from diagnose.reports.gate_outputs import build_compare_view

    comparison = compare_records(load_record(BASELINE), load_record(SLOW))
    view = build_compare_view(comparison)
    quoted = [row for row in view.rows if row.interval and ", CI " in row.reason]
    assert quoted
    for row in quoted:
        assert f"CI {row.interval}" in row.reason, (row.interval, row.reason)


def test_junit_escapes_hostile_record_strings() -> None:
    base = load_record(BASELINE)
    current = copy.deepcopy(base)
    current.findings = [
        Finding(
            id='x"<&>\x1b[31m',
            severity="critical",
            title="</testcase><injected/>\x00 & ]]>",
            category="compute",
        )
    ]
    root = ET.fromstring(compare_junit(compare_records(base, current)).encode("utf-8"))
    assert root.find(".//injected") is None
    case = next(
        c for c in root.iter("testcase") if c.get("classname") == "diagnose.compare.findings"
    )
    assert "<injected/>" in (case.find("failure").get("message") or "")  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# Markdown, terminal, HTML


def _table_rows(markdown: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    assert re.fullmatch(r"\|(\s*-+:?\s*\|)+", lines[start + 1].replace("---:", "---"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        assert len(cells) == len(header), line
        rows.append(cells)
    return header, rows


def test_markdown_has_a_table_with_the_right_columns() -> None:
    comparison = compare_records(load_record(BASELINE), load_record(SLOW))
    text = compare_markdown(comparison)
    assert text.startswith("## ❌ diagnose compare: FAIL")
    header, rows = _table_rows(text, "| metric")
    assert header == ["metric", "baseline", "current", "change", "CI", "p", "n", "verdict"]
    assert len(rows) == len(comparison.metrics)
    step = rows[0]
    assert step[0] == "s/it" and step[1].endswith("/it") and "fails (slower)" in step[7]
    header, rows = _table_rows(text, "| change")
    assert header == ["change", "severity", "was", "id", "title", "gate"]
    assert rows[0][:3] == ["escalated", "critical", "warn"] and "new-critical" in rows[0][5]


def test_markdown_neutralises_hostile_strings() -> None:
    base = load_record(BASELINE)
    current = copy.deepcopy(base)
    current.findings = [
        Finding(id="a|b", severity="warn", title="<script>x</script> | [link](http://x)")
    ]
    text = compare_markdown(compare_records(base, current))
    assert "<script>" not in text and "&lt;script&gt;" in text
    _, rows = _table_rows(text, "| change")  # every row has exactly six cells
    assert [r for r in rows if r[3] == "`a\\|b`"]  # the "|" in the id did not add a cell


def test_terminal_table_and_html_agree() -> None:
    comparison = compare_records(load_record(BASELINE), load_record(SLOW))
    table = compare_table(comparison)
    assert "\033[" not in table
    assert "\033[" in compare_table(comparison, color=True)
    html = render_html(load_record(SLOW), comparison=comparison)
    for row in ("s/it", "data wait", "dataloader.gpu_starved"):
        assert row in table and row in html


def test_html_comparison_has_a_chart_of_every_compared_step_and_no_record_string_in_it(
    tmp_path: Path,
) -> None:
    hostile = load_record(SLOW)
    hostile.command = "diagnose run <script>alert(1)</script>"
    current = write_record(tmp_path / "current.json", hostile)
    html = tmp_path / "r.html"
    assert run_compare([str(BASELINE), str(SAME), str(current), "--html", str(html)])[0] in (0, 6)
    page = html.read_text(encoding="utf-8")
    section = page[page.index('id="comparison"') :]
    svg = section[section.index("<svg") : section.index("</svg>")]
    assert 'aria-label="Seconds of every compared step, per record"' in svg
    assert "<script" not in svg and str(tmp_path) not in svg and "compare/" not in svg
    assert "<script>alert" not in page  # the record's command is escaped in the page


def test_html_with_a_comparison_and_with_a_refused_one() -> None:
    current = load_record(SLOW)
    html = render_html(current, comparison=compare_records(load_record(BASELINE), current))
    assert 'id="comparison"' in html and "Compared with the baseline" in html
    other = load_record(BASELINE)
    other.device.name = "NVIDIA H100 80GB HBM3"
    with pytest.raises(DiagnoseError) as raised:
        compare_records(other, current)
    refused = render_html(current, not_compared=raised.value.message)
    assert "not compared" in refused and "device name differs" in refused
    assert 'id="comparison"' not in render_html(current)


def test_html_escapes_hostile_finding_titles() -> None:
    base = load_record(BASELINE)
    current = copy.deepcopy(base)
    current.findings = [Finding(id="x", severity="critical", title="<img src=x onerror=alert(1)>")]
    html = render_html(current, comparison=compare_records(base, current))
    assert "<img src=x" not in html and "&lt;img src=x" in html


def test_python_dash_m_compare_subprocess(tmp_path: Path) -> None:
    """The real entry point."""
    result = subprocess.run(
        [sys.executable, "-m", "diagnose", "compare", str(BASELINE), str(SLOW)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == ExitCode.REGRESSION, result.stderr
    assert "FAIL" in result.stdout


def test_a_closed_output_pipe_loses_no_file_and_prints_no_traceback(tmp_path: Path) -> None:
    """`diagnose compare ... | head`: the reader is gone before diagnose prints. The JUnit,
    markdown and HTML files are written first, and the exit is 141 with nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to write_end now fails with EPIPE
    junit, markdown, html = tmp_path / "gate.xml", tmp_path / "gate.md", tmp_path / "r.html"
    outputs = ["--junit", str(junit), "--markdown", str(markdown), "--html", str(html)]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "diagnose", "compare", str(BASELINE), str(SLOW), *outputs],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == ExitCode.BROKEN_PIPE == 141, result.stderr
    assert result.stderr == ""
    assert junit.is_file() and markdown.is_file() and html.is_file()


def test_fixture_records_are_small() -> None:
    for path in COMPARE.glob("*.json"):
        assert path.stat().st_size < 64_000, path
        json.loads(path.read_text(encoding="utf-8"))
