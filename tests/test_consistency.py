"""Every record the tool writes agrees with itself: no check id with two outcomes, no saving above
its step or phases, findings ranked critical → warn → info then by saving, and every check that
could not be judged shown in the report. Run over every trace fixture, every shared real GPU
trace, and real runs of the workload with planted slow-downs."""

from __future__ import annotations

import ast
import functools
import html
from pathlib import Path

import pytest

from diagnose.catalogs import specs
from diagnose.cli import main
from diagnose.record import SEVERITIES, Check, RunRecord
from diagnose.record_io import load_record
from diagnose.reports import render_html
from diagnose.reports.view import build_view
from diagnose.trace.analysis import analysis_to_record, analyze_trace
from diagnose.verdicts import contradictions, settle
from tests.conftest import FIXTURES, QUICK, REPO_ROOT, SHARED_TRACES


def _trace_files() -> list[Path]:
    files = sorted((FIXTURES / "traces").glob("*.json*"))
    if SHARED_TRACES.is_dir():
        files += sorted(SHARED_TRACES.rglob("*.json.gz"))
    return files


def assert_consistent(record: RunRecord) -> None:
    problems = contradictions(record, specs())
    assert not problems, [str(p) for p in problems]
    # The report ranks what the record ranks: critical, then warn, then info, larger saving first.
    shown = build_view(record).findings
    order = {s: i for i, s in enumerate(SEVERITIES)}
    saving = {f.id: f.est_seconds_saved_per_it or 0.0 for f in record.findings}
    keys = [(-order[f.severity], -saving[f.id]) for f in shown]
    assert keys == sorted(keys)
    # Every question that could not be judged is said on the page.
    page = html.unescape(render_html(record))
    for check in record.all_checks():
        if check.outcome == "not_judged":
            assert check.text.strip().splitlines()[0].strip() in page, check


@pytest.mark.parametrize("trace", _trace_files(), ids=lambda p: p.name)
def test_every_trace_record_is_consistent(trace: Path) -> None:
    record = analysis_to_record(analyze_trace(trace), trace)
    settle(record, specs())
    assert_consistent(record)


def test_a_planted_contradiction_is_caught_on_a_real_record() -> None:
    trace = FIXTURES / "traces" / "cpu_train_loop_math_attention.json.gz"
    record = analysis_to_record(analyze_trace(trace), trace)
    settle(record, specs())
    assert record.findings, "the math-attention fixture must raise a finding"
    finding = record.findings[0]
    record.probes[0].checks.append(Check(finding.id, "ok", "found fine after all", "planted"))
    assert contradictions(record, specs())


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """One real run with the slow-downs users hit together: SDPA forced onto the math path, two
    resolution buckets, an 8-bit optimizer (each made a report contradict itself before)."""
    out = tmp_path_factory.mktemp("runs") / "planted"
    argv = [
        "run",
        "--out",
        str(out),
        *QUICK,
        "--precision",
        "fp32",
        "--attention",
        "math",
        "--resolution",
        "256,384",
        "--optimizer",
        "adamw8bit",
    ]
    assert main(argv) == 0
    return load_record(out)


def test_a_real_run_with_planted_slow_downs_is_consistent(planted_run: RunRecord) -> None:
    assert_consistent(planted_run)
    # The run really asked each question.
    ids = {c.id for c in planted_run.all_checks()}
    assert any(i.startswith("attention.") for i in ids)
    assert any(i.startswith("dataloader.") for i in ids)
    assert any(i.startswith("optimizer.") for i in ids)
    # The tiny model's LoRA tensors are below bitsandbytes' 8-bit threshold, the real SD1.5's
    # are not: no advice drawn from the shrunk model.
    state = [c for c in planted_run.all_checks() if c.id == "optimizer.8bit_state_mostly_fp32"]
    assert [c.outcome for c in state] == ["ok"] and "artefact of the shrunk" in state[0].text


def test_the_default_run_is_consistent(default_run: Path) -> None:
    assert_consistent(load_record(default_run))


# --------------------------------------------------------------------------------------------
# Every threshold is held against its value's interval, through one helper

#: Why the Triton judge's factors need no interval.
_EXACT_ERROR_BOUND = (
    "the Triton judge holds an exact, seeded computation against an error bound derived from "
    "the formats: no sample spread to take an interval of (the bound is the interval)"
)
#: Comparisons with a catalog constant that decide no verdict: (file, constant) -> why.
NOT_A_VERDICT = {
    ("diagnose/trace/rules/launch.py", "LONG_GAP_US"): (
        "sorts each idle gap into short and long, one gap at a time: a classification"
    ),
    ("diagnose/catalogs/strict_catalog.py", "MAX_ROWS"): "how many table rows a finding lists",
    **{
        ("probes/triton/cases/judge.py", name): _EXACT_ERROR_BOUND
        for name in ("DRIFT_FACTOR", "HANDFUL", "ISOLATED_FACTOR")
    },
}
_CATALOGS = REPO_ROOT / "diagnose" / "catalogs"
_LINE_MODULES = {
    **{f"diagnose.catalogs.{p.stem}": p for p in _CATALOGS.glob("*_catalog.py")},
    "diagnose.verdicts": REPO_ROOT / "diagnose" / "verdicts.py",
}


@functools.cache
def _lines_of(path: Path) -> frozenset[str]:
    """The module's numeric constants (and those defined as another of them): its lines. Read
    once per module: every file the scan reads asks for every catalog's lines."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if not isinstance(target, ast.Name) or value is None or not target.id.isupper():
            continue
        if target.id.startswith("_"):
            continue  # a module's own slack (rounding), no line
        number = isinstance(value, ast.Constant) and type(value.value) in (int, float)
        if number or (isinstance(value, ast.Name) and value.id in found):
            found.add(target.id)
    return frozenset(found)


def _names_in(node: ast.AST, modules: dict[str, frozenset[str]], lines: set[str]) -> set[str]:
    """The lines ``node`` reads: a name imported from (or defined in) a catalog, or a catalog
    module's attribute (``catalog.RAISE_SHARE``)."""
    out: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and child.id in lines:
            out.add(child.id)
        elif (
            isinstance(child, ast.Attribute)
            and isinstance(child.value, ast.Name)
            and child.attr in modules.get(child.value.id, set())
        ):
            out.add(child.attr)
    return out


def threshold_comparisons(path: Path) -> list[tuple[int, str]]:
    """Comparisons (``<``, ``>=``...) in ``path`` that read a catalog line directly, or a
    parameter whose default is one: a threshold compared by hand."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    per_module = {name: _lines_of(p) for name, p in _LINE_MODULES.items()}
    modules: dict[str, frozenset[str]] = {}  # alias -> its lines
    lines: set[str] = set()  # names bound to a line here
    if path.parent == _CATALOGS or path == _LINE_MODULES["diagnose.verdicts"]:
        lines |= _lines_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in per_module:
                    modules[alias.asname or alias.name] = per_module[full]
                elif alias.name in per_module.get(node.module, set()):
                    lines.add(alias.asname or alias.name)
    found: list[tuple[int, str]] = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = function.args
        positional = args.posonlyargs + args.args
        with_default = positional[len(positional) - len(args.defaults) :]
        defaults = list(zip(with_default, args.defaults, strict=True))
        defaults += [
            (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
        ]
        params = {a.arg for a, d in defaults if _names_in(d, modules, lines)}
        for node in ast.walk(function):
            if isinstance(node, ast.Compare):
                hit = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & params
                found.extend((node.lineno, f"parameter {name}") for name in sorted(hit))
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found.extend((node.lineno, name) for name in sorted(_names_in(node, modules, lines)))
    return found


def test_no_threshold_is_compared_by_hand() -> None:
    """Every rule and probe holds a value against a catalog line with diagnose.stats.at_line
    (above, below or borderline, with the value's interval), never with a bare ``<``."""
    sources = sorted((REPO_ROOT / "diagnose").rglob("*.py")) + sorted(
        (REPO_ROOT / "probes").rglob("*.py")
    )
    by_hand = []
    for path in sources:
        where = path.relative_to(REPO_ROOT).as_posix()
        if where == "diagnose/stats.py":
            continue
        for line, name in threshold_comparisons(path):
            if (where, name) not in NOT_A_VERDICT:
                by_hand.append(f"{where}:{line}: {name}")
    assert not by_hand, by_hand


def test_the_scan_finds_a_threshold_compared_by_hand(tmp_path: Path) -> None:
    planted = tmp_path / "planted_rule.py"
    planted.write_text(
        "from diagnose.catalogs import dataloader_catalog as catalog\n"
        "from diagnose.catalogs.compute_catalog import RAISE_SHARE\n"
        "from diagnose.verdicts import WARN_SHARE\n\n"
        "def rule(share, least=catalog.STARVED_SHARE):\n"
        "    a = share >= catalog.STARVED_SHARE\n"
        "    b = share < RAISE_SHARE * 2\n"
        "    c = share > least\n"
        "    return a or b or c or WARN_SHARE <= share\n",
        encoding="utf-8",
    )
    found = {name for _, name in threshold_comparisons(planted)}
    assert found == {"STARVED_SHARE", "RAISE_SHARE", "WARN_SHARE", "parameter least"}
