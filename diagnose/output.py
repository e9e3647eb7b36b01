"""Output folders and files: nothing a user gave us is lost or overwritten without --force."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from diagnose.errors import DiagnoseError, ExitCode

RECORD_NAME = "record.json"
REPORT_NAME = "report.html"
TRACE_NAME = "trace.json.gz"
#: The files diagnose writes into an output folder.
OUTPUT_NAMES = (RECORD_NAME, REPORT_NAME, TRACE_NAME)
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


def refuse_special_file(path: Path, option: str) -> None:
    """An output replaces only a regular file (or a symlink, replaced and not followed): a device
    node, a FIFO or a socket at ``path`` is refused, ``--force`` or not (ExitCode.USAGE). The
    atomic rename would otherwise put a file where ``/dev/...`` or a pipe's reader was."""
    try:
        mode = path.lstat().st_mode
    except OSError:  # nothing there (or nothing this user may see): a new path
        return
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
        return
    raise DiagnoseError(
        f"{option} {path}: not a regular file (a device, FIFO or socket); "
        "write the output to a file",
        ExitCode.USAGE,
    )


def prepare_out_dir(path: Path, *, force: bool) -> Path:
    """Create ``path``; refuse an existing non-empty folder unless ``force``.

    With ``force`` only the files diagnose writes are replaced: other files in the folder are left
    alone, and a device, FIFO or socket by the name of one of diagnose's files is refused.
    """
    if path.exists() and not path.is_dir():
        raise DiagnoseError(f"--out {path}: exists and is not a folder", ExitCode.OUTPUT_EXISTS)
    if path.is_dir() and any(path.iterdir()) and not force:
        raise DiagnoseError(
            f"--out {path}: folder exists and is not empty; choose another or add --force",
            ExitCode.OUTPUT_EXISTS,
        )
    for name in OUTPUT_NAMES:
        refuse_special_file(path / name, "--out")
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DiagnoseError(
            f"--out {path}: cannot create: {exc.strerror}", ExitCode.BAD_INPUT
        ) from None
    for folder in reversed(missing):  # outermost first, so clean-up removes it last
        note_created(folder)
    return path


class CreatedFiles:
    """What one command created: the files it wrote (each with the identity of the file it
    wrote, so a file someone else put there since is not taken for it) and the folders it made.

    Clean-up after a failure or a signal (:meth:`remove`) removes exactly these; a file the
    command found, whatever its name or age (a trainer's checkpoint ``.tmp`` in ``--out``, an
    earlier run's record), is never removed. Filled by :func:`note_created`, which the writers
    here call while the ledger is open (:func:`created_files`)."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, ...]] = {}
        self._folders: list[Path] = []

    def add(self, path: Path) -> None:
        try:
            info = path.lstat()
        except OSError:
            return
        if stat.S_ISDIR(info.st_mode):
            self._folders.append(path)
        else:
            self._files[path] = _identity(info)

    def remove(self) -> None:
        """Remove the files still as written, then the folders left empty, newest first."""
        for path, identity in reversed(self._files.items()):
            try:
                if _identity(path.lstat()) == identity:
                    path.unlink()
            except OSError:
                continue
        for folder in reversed(self._folders):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: another's file inside keeps it


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """Which file this is: its inode, and its size and time, since a freed inode is soon reused."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


_open_ledgers: list[CreatedFiles] = []


@contextlib.contextmanager
def created_files() -> Iterator[CreatedFiles]:
    """Meanwhile, every file and folder this process creates through :mod:`diagnose.output` (and
    every path given to :func:`note_created`) is noted in the ledger yielded."""
    ledger = CreatedFiles()
    _open_ledgers.append(ledger)
    try:
        yield ledger
    finally:
        _open_ledgers.remove(ledger)


def note_created(path: Path) -> None:
    """``path`` (a file or a folder) was just made by this command: the open ledgers note it."""
    for ledger in _open_ledgers:
        ledger.add(path)


def check_writable_file(path: Path, *, force: bool, option: str) -> None:
    """Refuse to overwrite an existing file unless ``force``, to write where no folder is, or
    to replace anything but a regular file (:func:`refuse_special_file`)."""
    refuse_special_file(path, option)
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
    try:
        if a.resolve() == b.resolve():
            return True
        return os.path.samefile(a, b)  # hard links
    except (OSError, RuntimeError):  # a symlink loop: resolve raises RuntimeError
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
        note_created(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
