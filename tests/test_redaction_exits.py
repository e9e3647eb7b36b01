"""One redaction at every exit: secrets a trainer takes on its command line, and secrets in a
record diagnose did not just make, reach no file diagnose writes and no line it prints.

Three ways in: ``diagnose profile`` of a real trainer whose command line holds a hub token, a
``--password``, a database URL with a password and an AWS key (the trainer's own output, which
prints them, passes through untouched); ``diagnose report`` of a record from elsewhere whose
command, notes, device name, probe traceback and argv hold tokens; ``diagnose compare`` with
``--html --markdown --junit`` of such records, one given by a path that names a token.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from tests.conftest import FIXTURES
from tests.fuzz_corpus import AWS, DB_PASSWORD, HF, PASSWORD, SECRET_PARTS
from tests.fuzz_records import plant_secrets

#: What must never reach a file diagnose writes or a line of its own.
SECRETS = SECRET_PARTS

TRAINER_ARGS = [
    "--hub_token",
    HF,
    "--password",
    PASSWORD,
    "--db",
    f"postgres://admin:{DB_PASSWORD}@db/x",
    "--aws-key",
    AWS,
]

#: A small real loop that prints its own arguments (a trainer echoing its config does).
TRAINER = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(8):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("TRAINER", " ".join(sys.argv[1:]), flush=True)
    print("TRAINER", " ".join(sys.argv[1:]), file=sys.stderr, flush=True)
    """
)


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (gzip trace left out: the profiler's own output)."""
    return {
        str(p.relative_to(folder)): p.read_text(errors="replace")
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".gz")
    }


def test_profile_writes_and_prints_no_secret_of_the_trainers_command_line(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    out = tmp_path / "out"
    process = subprocess.run(
        [
            *(sys.executable, "-m", "diagnose", "profile", "--out", str(out)),
            *("--skip-steps", "1", "--steps", "3", "--profile-steps", "2", "--no-stacks"),
            *("--", sys.executable, str(script), *TRAINER_ARGS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    written = _files(out)
    assert {"record.json", "report.html"} <= set(written)
    for name, text in written.items():
        assert not _leaks(text), f"{_leaks(text)} in {name}"
    trainer_lines = []
    for stream in (process.stdout, process.stderr):
        for line in stream.splitlines():
            if line.startswith("TRAINER"):
                trainer_lines.append(line)
            else:
                assert not _leaks(line), f"diagnose printed {_leaks(line)}: {line!r}"
    # The trainer's own output is its own: passed through as it printed it.
    assert len(trainer_lines) == 2
    planted = [s for s in SECRETS if s in " ".join(TRAINER_ARGS)]
    for line in trainer_lines:
        assert _leaks(line) == planted, line
    # What the record keeps of the command still reads as a command, with the values masked.
    record = json.loads(written["record.json"])
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    argv = capture["data"]["command"]
    assert argv[argv.index("--password") + 1] == "***"
    assert "--db" in record["command"] and "--aws-key" in record["command"]


def _planted_record(source: Path) -> dict[str, Any]:
    """A record from elsewhere (another machine, an older diagnose, a hand edit): secrets in the
    command line, a note, the device name, a probe's error and traceback, an argv list."""
    doc: dict[str, Any] = json.loads(source.read_text())
    plant_secrets(doc)
    return doc


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


def test_report_of_a_record_from_elsewhere_writes_and_prints_no_secret(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    record.write_text(json.dumps(_planted_record(FIXTURES / "compare" / "same_config.json")))
    html = tmp_path / "page.html"
    code, printed = _run(["report", str(record), "-o", str(html)])
    assert code == 0, printed
    assert not _leaks(printed), printed
    page = html.read_text()
    assert not _leaks(page)
    assert "pushed with ghp_***" in page  # masked in place, the note kept


def test_compare_outputs_hold_no_secret_of_either_record_or_its_path(tmp_path: Path) -> None:
    folder = tmp_path / f"runs-{HF}"  # people name folders after what they hold
    folder.mkdir()
    baseline, current = folder / "baseline.json", folder / "current.json"
    baseline.write_text(json.dumps(_planted_record(FIXTURES / "compare" / "baseline.json")))
    current.write_text(json.dumps(_planted_record(FIXTURES / "compare" / "same_config.json")))
    outputs = {name: tmp_path / name for name in ("page.html", "gate.md", "gate.xml")}
    code, printed = _run(
        [
            *("compare", str(baseline), str(current)),
            *("--html", str(outputs["page.html"]), "--markdown", str(outputs["gate.md"])),
            *("--junit", str(outputs["gate.xml"])),
        ]
    )
    assert code in (0, 6, 9), printed  # a verdict: pass, regression or inconclusive
    assert not _leaks(printed), printed
    for name, path in outputs.items():
        text = path.read_text()
        assert not _leaks(text), f"{_leaks(text)} in {name}"
    assert "runs-hf_***" in printed  # the path, masked in place


@pytest.mark.parametrize("command", ["report", "compare"])
def test_an_error_line_names_the_file_without_its_secret(tmp_path: Path, command: str) -> None:
    missing = tmp_path / f"token-{HF}" / "record.json"
    argv = (
        ["report", str(missing)] if command == "report" else [command, str(missing), str(missing)]
    )
    code, printed = _run(argv)
    assert code == 3
    assert "token-hf_***" in printed and not _leaks(printed), printed
