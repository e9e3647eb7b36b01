"""Nothing a user gave us is lost: no command writes over its own inputs, outputs are written
whole or not at all, a symlink is replaced rather than followed, and only regular files are read.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main
from diagnose.errors import ExitCode
from diagnose.output import write_bytes_atomic, write_text_atomic
from tests.conftest import FIXTURES
from tests.fuzz_corpus import special_file

TRACE = FIXTURES / "traces" / "cpu_train_loop.json.gz"


@pytest.fixture
def record(tmp_path: Path) -> Path:
    """A real record, written by ``diagnose trace`` of a real CPU trace."""
    out = tmp_path / "traced"
    assert main(["trace", str(TRACE), "--out", str(out)]) == 0
    return out / "record.json"


def _one_line(capsys: Any, needle: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and err.count("\n") == 1, err
    assert needle in err


def test_report_over_its_own_record_is_refused_even_with_force(record: Path, capsys: Any) -> None:
    before = record.read_bytes()
    capsys.readouterr()
    assert main(["report", str(record), "-o", str(record), "--force"]) == ExitCode.USAGE
    _one_line(capsys, "inputs")
    # Through a symlink or a hard link to it, too.
    link = record.parent / "link.html"
    link.symlink_to(record)
    assert main(["report", str(record), "-o", str(link), "--force"]) == ExitCode.USAGE
    hard = record.parent / "hard.html"
    os.link(record, hard)
    assert main(["report", str(record.parent), "-o", str(hard), "--force"]) == ExitCode.USAGE
    assert record.read_bytes() == before


def test_trace_into_the_folder_of_its_input_named_record_json_is_refused(
    tmp_path: Path, capsys: Any
) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    trace = folder / "record.json"
    shutil.copy(TRACE, trace)
    before = trace.read_bytes()
    assert main(["trace", str(trace), "--out", str(folder), "--force"]) == ExitCode.USAGE
    _one_line(capsys, "inputs")
    assert trace.read_bytes() == before
    # The twin: another output folder is fine.
    assert main(["trace", str(trace), "--out", str(tmp_path / "elsewhere")]) == 0


def test_a_symlinked_report_is_replaced_not_followed(record: Path) -> None:
    victim = record.parent / "victim.txt"
    victim.write_text("keep me")
    link = record.parent / "report-link.html"
    link.symlink_to(victim)
    assert main(["report", str(record), "-o", str(link), "--force"]) == 0
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and "<html" in link.read_text()


def test_outputs_are_whole_and_readable_like_any_file(tmp_path: Path) -> None:
    path = tmp_path / "out.html"
    write_text_atomic(path, "x" * 1000)
    assert path.read_text() == "x" * 1000
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    # A failed write leaves the old file and no temporary behind.
    with pytest.raises(TypeError):
        write_bytes_atomic(path, object())  # type: ignore[arg-type]
    assert path.read_text() == "x" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["out.html"]


def test_an_output_in_a_missing_folder_is_bad_input(record: Path, capsys: Any) -> None:
    missing = record.parent / "no-such-folder" / "r.html"
    assert main(["report", str(record), "-o", str(missing)]) == ExitCode.BAD_INPUT
    _one_line(capsys, "does not exist")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_not_read(tmp_path: Path, capsys: Any) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    assert main(["trace", str(fifo), "--out", str(tmp_path / "out")]) == ExitCode.BAD_INPUT
    _one_line(capsys, "not a regular file")
    assert not (tmp_path / "out").exists()


# --- outputs only to regular files or new paths ------------------------------------------------


def _special(tmp_path: Path, kind: str) -> Path:
    path = special_file(tmp_path, kind)
    if path is None:
        pytest.skip("this user cannot make a device node")
    return path


def _kind(path: Path) -> int:
    return stat.S_IFMT(path.lstat().st_mode)


SPECIAL = ["device", "fifo", "socket"]


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("force", [False, True])
def test_an_output_is_never_a_device_fifo_or_socket(
    tmp_path: Path, record: Path, capsys: Any, kind: str, force: bool
) -> None:
    target = _special(tmp_path, kind)
    before = _kind(target)
    extra = ["--force"] if force else []
    capsys.readouterr()
    assert main(["report", str(record), "-o", str(target), *extra]) == ExitCode.USAGE
    _one_line(capsys, "not a regular file")
    for option in ("--html", "--junit", "--markdown"):
        argv = ["compare", str(record), str(record), option, str(target), *extra]
        assert main(argv) == ExitCode.USAGE, option
        _one_line(capsys, "not a regular file")
    assert _kind(target) == before  # still what it was


@pytest.mark.parametrize("kind", SPECIAL)
def test_an_output_folder_holding_a_special_file_by_an_output_name_is_refused(
    tmp_path: Path, capsys: Any, kind: str
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    special = _special(tmp_path, kind)
    special.rename(folder / "report.html")
    capsys.readouterr()
    assert main(["trace", str(TRACE), "--out", str(folder), "--force"]) == ExitCode.USAGE
    _one_line(capsys, "not a regular file")
    assert _kind(folder / "report.html") != stat.S_IFREG
    assert sorted(p.name for p in folder.iterdir()) == ["report.html"]  # nothing else written
