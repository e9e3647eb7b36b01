"""Output folders and files: nothing a user gave us is lost or overwritten without --force."""

from __future__ import annotations

import datetime as _dt
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from diagnose.errors import DiagnoseError, ExitCode

RECORD_NAME = "record.json"
REPORT_NAME = "report.html"
TRACE_NAME = "trace.json.gz"
#: gzip level of a trace diagnose writes. torch's own .gz export compresses at level 9 line by
#: line: several times slower for a file about 12% smaller than this level gives.
TRACE_GZIP_LEVEL = 6


def default_out_dir(prefix: str, base: Path | None = None) -> Path:
    """A new timestamped folder under ``base`` (the current folder), never an existing one."""
    base = base or Path.cwd()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = base / f"diagnose-{prefix}-{stamp}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = base / f"diagnose-{prefix}-{stamp}-{n}"
    return candidate


def prepare_out_dir(path: Path, *, force: bool) -> Path:
    """Create ``path``; refuse an existing non-empty folder unless ``force``.

    With ``force`` only the files diagnose writes are replaced: other files in the folder are left
    alone.
    """
    if path.exists() and not path.is_dir():
        raise DiagnoseError(f"--out {path}: exists and is not a folder", ExitCode.OUTPUT_EXISTS)
    if path.is_dir() and any(path.iterdir()) and not force:
        raise DiagnoseError(
            f"--out {path}: folder exists and is not empty; choose another or add --force",
            ExitCode.OUTPUT_EXISTS,
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DiagnoseError(
            f"--out {path}: cannot create: {exc.strerror}", ExitCode.BAD_INPUT
        ) from None
    return path


def remove_partial_outputs(out_dir: Path, *, created: bool, since: float) -> None:
    """After a run that did not finish: remove the files it wrote (those diagnose writes,
    changed since ``since``, a ``time.time()``), and the folder when this run created it and
    nothing else is in it. An earlier run's files in the folder are left as they were."""
    for path in [
        *(out_dir / n for n in (TRACE_NAME, RECORD_NAME, REPORT_NAME)),
        *out_dir.glob(".*.tmp"),
    ]:
        try:
            if path.stat().st_mtime >= since - 1.0:  # file systems keep coarse times
                path.unlink()
        except FileNotFoundError:
            continue
    if created and out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()


def check_writable_file(path: Path, *, force: bool, option: str) -> None:
    """Refuse to overwrite an existing file unless ``force``, or to write where no folder is."""
    if path.is_dir():
        raise DiagnoseError(f"{option} {path}: is a folder", ExitCode.BAD_INPUT)
    if not path.parent.is_dir():
        raise DiagnoseError(
            f"{option} {path}: the folder {path.parent} does not exist", ExitCode.BAD_INPUT
        )
    if path.exists() and not force:
        raise DiagnoseError(
            f"{option} {path}: file exists; choose another or add --force", ExitCode.OUTPUT_EXISTS
        )


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def refuse_outputs_over_inputs(
    outputs: Iterable[Path], inputs: Iterable[Path], what: str = "one of this command's inputs"
) -> None:
    """An output written over one of the command's own inputs would destroy it: refused,
    ``--force`` or not (ExitCode.USAGE)."""
    sources = list(inputs)
    for path in outputs:
        for source in sources:
            if _same_file(path, source):
                raise DiagnoseError(
                    f"{path}: that is {what}; write the output elsewhere",
                    ExitCode.USAGE,
                )


def _new_file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, so a crash never leaves half a file."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder, so a crash never leaves half a file. The
    rename replaces a symlink at ``path`` itself, never the file it points to."""
    write_stream_atomic(path, lambda handle: handle.write(data))


def write_stream_atomic(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """:func:`write_bytes_atomic` for content written piece by piece: ``fill`` writes it to the
    open temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private; a report is a file like any other the user writes.
        os.chmod(tmp, _new_file_mode())
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
