"""Sampling Python stacks with py-spy: which frames a process (and its workers) spend time in.

py-spy is optional (``pip install py-spy``, or the ``pyspy`` extra). It is run as the *parent* of
the program it samples (``py-spy record ... -- python ...``): a parent may read its child's memory
under the usual ``kernel.yama.ptrace_scope=1``, where attaching to an unrelated running process
needs root. ``--subprocesses`` follows the DataLoader's worker processes, ``--nonblocking`` never
pauses the sampled program, and ``--format raw`` writes one collapsed stack per line::

    process 41:"python -m x";process 57:"python -m x";f (a.py:3);g (PIL/ImageFile.py:425) 17

The pure half of this module parses that text and ranks frames; the other half finds py-spy,
runs it, and hosts the small program sampled for the data-loading probe
(``python -m diagnose.sampling loader SPEC.json``), which iterates a DataLoader described by a
JSON spec and nothing else, so every sample is loader work.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PY_SPY = "py-spy"
#: How py-spy is installed, for the "missing" message.
INSTALL_HINT = "pip install py-spy (or pip install 'diagnose[pyspy]')"
#: The function the sampled loader program iterates in: stacks that pass through it (or through
#: a DataLoader worker's loop) are loader work; the rest is interpreter start-up and imports.
LOADER_MARKER = "sampled_loader_iteration"
WORKER_LOOP = "_worker_loop"

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_PROCESS = re.compile(r'^process (?P<pid>\d+):"(?P<cmd>.*)"$')

#: Top-level names of library code: a frame in one of these is not "your code".
_LIBRARIES = frozenset(
    {
        "PIL",
        "torch",
        "torchvision",
        "numpy",
        "diffusers",
        "transformers",
        "tokenizers",
        "safetensors",
        "accelerate",
        "cv2",
        "albumentations",
        "datasets",
        "<frozen importlib._bootstrap>",
        "<frozen importlib._bootstrap_external>",
    }
)

#: (category, function regex, file regex): the first match names a leaf frame's category.
#: Python frames only (py-spy without --native): the leaf is the last Python function, inside
#: which the native work (libjpeg, zlib, resampling) runs.
_CATEGORIES: tuple[tuple[str, str, str], ...] = (
    # Idle: a worker waiting for an index, the main process waiting for a batch.
    (
        "waiting",
        r"(select|poll|wait|sleep|accept|_recv|recv_bytes|get)$",
        r"^(selectors|threading|queue|socket)\.py$|^multiprocessing/",
    ),
    ("image decode", r"", r"^PIL/\w+ImagePlugin\.py$"),
    (
        "image decode",
        r"(ImageFile\.load|load_prepare|load_end|decode|_open|draft|open|verify)$",
        r"^PIL/",
    ),
    (
        "image resize / crop / flip",
        r"(resize|reduce|thumbnail|transform|crop|rotate|transpose)$",
        r"^(PIL|torchvision)/",
    ),
    ("colour convert", r"convert$", r"^PIL/"),
    (
        "pixels to array / tensor",
        r"(tobytes|__array_interface__|getdata|from_numpy|to_tensor|normalize)",
        r"^(PIL|numpy|torchvision)/",
    ),
    ("VAE / model on the CPU", r"", r"^(diffusers|torch/nn)/"),
    ("tokenizer", r"", r"^(tokenizers|transformers/tokenization)"),
    (
        "batch collate / transfer",
        r"",
        r"^(torch/utils/data|torch/multiprocessing|torch/storage|multiprocessing/)",
    ),
    ("file read", r"(read|readinto|read_bytes|open)$", r"^(io|pathlib|_pyio)\.py$"),
)
_CATEGORY_RULES = tuple(
    (name, re.compile(fn) if fn else None, re.compile(path)) for name, fn, path in _CATEGORIES
)


# --------------------------------------------------------------------------------------------
# Parsing (pure)


@dataclass(frozen=True)
class Frame:
    """One Python frame as py-spy prints it: ``ImageFile.load (PIL/ImageFile.py:425)``."""

    function: str
    file: str
    line: int | None = None

    @classmethod
    def parse(cls, text: str) -> Frame:
        match = _FRAME.match(text.strip())
        if match is None:
            return cls(function=text.strip(), file="")
        line = match.group("line")
        return cls(match.group("function"), match.group("file"), int(line) if line else None)

    @property
    def label(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{self.function} ({where})" if where else self.function

    @property
    def is_library(self) -> bool:
        """Library or standard-library code (py-spy shortens paths to the package part)."""
        top = self.file.split("/", 1)[0]
        stem = top.removesuffix(".py")
        return (
            top in _LIBRARIES
            or stem in sys.stdlib_module_names
            or self.file.startswith("<frozen")
            or self.file.startswith("<built-in")
            or not self.file
        )


@dataclass(frozen=True)
class Stack:
    """One collapsed stack and how many samples it got. ``process`` is the innermost process
    (``"57"``), ``command`` its command line; frames run outermost first."""

    frames: tuple[Frame, ...]
    count: int
    process: str = ""
    command: str = ""

    def has_function(self, suffix: str) -> bool:
        return any(f.function == suffix or f.function.endswith("." + suffix) for f in self.frames)

    @property
    def role(self) -> str:
        """``worker`` for a DataLoader worker process, else ``main``."""
        return "worker" if self.has_function(WORKER_LOOP) else "main"


def parse_raw(text: str) -> list[Stack]:
    """Parse py-spy's ``--format raw`` output (collapsed stacks, one per line, count last)."""
    stacks: list[Stack] = []
    for raw_line in text.splitlines():
        line = raw_line.rstrip()
        if not line:
            continue
        body, _, count_text = line.rpartition(" ")
        if not body or not count_text.isdigit():
            continue
        process = command = ""
        frames: list[Frame] = []
        for part in body.split(";"):
            match = _PROCESS.match(part)
            if match is not None:
                process, command = match.group("pid"), match.group("cmd")
                continue
            frames.append(Frame.parse(part))
        if frames:
            stacks.append(Stack(tuple(frames), int(count_text), process, command))
    return stacks


def categorize(frame: Frame) -> str:
    """The kind of work a leaf frame is doing (``image decode``, ``waiting`` ...) or ``other``."""
    for name, function_rule, file_rule in _CATEGORY_RULES:
        if file_rule.search(frame.file) and (
            function_rule is None or function_rule.search(frame.function)
        ):
            return name
    return "other"


def _owner(stack: Stack) -> Frame | None:
    """The innermost frame of non-library code: whose code called into the hot frame."""
    for frame in reversed(stack.frames):
        if not frame.is_library:
            return frame
    return None


@dataclass
class FrameShare:
    """A leaf (self-time) frame and its share of the kept samples."""

    frame: str
    function: str
    file: str
    samples: int
    share: float
    category: str
    #: The non-library function that most often called into it ("load_image (x.py:209)").
    called_from: str = ""
    #: Samples by process role ("main", "worker").
    by_role: dict[str, int] = field(default_factory=dict)


@dataclass
class StackProfile:
    """What the sampled program spent its time on."""

    #: Samples that passed the filter (loader work), and those dropped (start-up, imports).
    samples: int
    dropped: int
    #: Samples by process role, and how many distinct processes of each were seen.
    samples_by_role: dict[str, int]
    processes_by_role: dict[str, int]
    #: Leaf frames by samples, largest first (``top`` of them).
    top_frames: list[FrameShare]
    #: Share of the kept samples by category of the leaf frame, largest first.
    categories: dict[str, float]
    #: The same, leaving out the ``waiting`` category (share of busy samples).
    busy_categories: dict[str, float]

    @property
    def busy_samples(self) -> int:
        waiting = self.categories.get("waiting", 0.0) * self.samples
        return max(0, round(self.samples - waiting))


def summarize(
    stacks: Iterable[Stack],
    *,
    keep: Callable[[Stack], bool] | None = None,
    top: int = 10,
    include_waiting: bool = False,
) -> StackProfile:
    """Rank leaf frames and categories over the stacks that pass ``keep``.

    ``top_frames`` leaves out frames that only wait (``select``, ``Condition.wait`` ...) unless
    ``include_waiting``: they say a process was idle, not what made the loader slow.
    """
    leaf_samples: Counter[Frame] = Counter()
    leaf_roles: dict[Frame, Counter[str]] = {}
    leaf_owners: dict[Frame, Counter[str]] = {}
    category_samples: Counter[str] = Counter()
    role_samples: Counter[str] = Counter()
    role_processes: dict[str, set[str]] = {}
    kept = dropped = 0
    for stack in stacks:
        if keep is not None and not keep(stack):
            dropped += stack.count
            continue
        kept += stack.count
        leaf = stack.frames[-1]
        role = stack.role
        leaf_samples[leaf] += stack.count
        leaf_roles.setdefault(leaf, Counter())[role] += stack.count
        owner = _owner(stack)
        if owner is not None and owner != leaf:
            leaf_owners.setdefault(leaf, Counter())[owner.label] += stack.count
        category_samples[categorize(leaf)] += stack.count
        role_samples[role] += stack.count
        role_processes.setdefault(role, set()).add(stack.process)

    def shares(counter: Counter[str], total: int) -> dict[str, float]:
        return {k: round(v / total, 4) for k, v in counter.most_common()} if total else {}

    frames: list[FrameShare] = []
    for leaf, count in leaf_samples.most_common():
        category = categorize(leaf)
        if category == "waiting" and not include_waiting:
            continue
        owners = leaf_owners.get(leaf)
        frames.append(
            FrameShare(
                frame=leaf.label,
                function=leaf.function,
                file=leaf.file,
                samples=count,
                share=round(count / kept, 4) if kept else 0.0,
                category=category,
                called_from=owners.most_common(1)[0][0] if owners else "",
                by_role=dict(leaf_roles[leaf]),
            )
        )
        if len(frames) >= top:
            break
    busy = Counter({k: v for k, v in category_samples.items() if k != "waiting"})
    return StackProfile(
        samples=kept,
        dropped=dropped,
        samples_by_role=dict(role_samples),
        processes_by_role={role: len(pids) for role, pids in role_processes.items()},
        top_frames=frames,
        categories=shares(category_samples, kept),
        busy_categories=shares(busy, sum(busy.values())),
    )


def is_loader_work(stack: Stack) -> bool:
    """Samples of the loader program's iteration (main process) or of its workers."""
    return stack.has_function(LOADER_MARKER) or stack.has_function(WORKER_LOOP)


# --------------------------------------------------------------------------------------------
# Running py-spy


def find_py_spy(path: str | None = None) -> str | None:
    """The py-spy executable on ``PATH`` (or on ``path``), or None."""
    return shutil.which(PY_SPY, path=path)


@dataclass
class Recording:
    """The outcome of one ``py-spy record`` run."""

    ok: bool
    #: Why there are no samples, when not ``ok`` (one line).
    reason: str = ""
    stacks: list[Stack] = field(default_factory=list)
    wall_seconds: float = 0.0
    returncode: int | None = None
    #: py-spy's own summary line ("Samples: 498 Errors: 7"), when printed.
    summary: str = ""
    command: list[str] = field(default_factory=list)


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        lowered = line.lower()
        if "error" in lowered or "permission" in lowered or "denied" in lowered:
            return line.removeprefix("py-spy> ").strip()
    return lines[-1].removeprefix("py-spy> ").strip() if lines else ""


def _summary_line(text: str) -> str:
    """``Samples: 388 Errors: 3`` from py-spy's closing message (without the output path)."""
    for line in text.splitlines():
        at = line.find("Samples:")
        if at >= 0:
            return line[at:].strip()
    return ""


def record(
    argv: Sequence[str],
    output: Path,
    *,
    rate: int = 100,
    subprocesses: bool = True,
    nonblocking: bool = True,
    by_function: bool = True,
    timeout: float = 120.0,
    py_spy: str | None = None,
    env: dict[str, str] | None = None,
) -> Recording:
    """Run ``argv`` under ``py-spy record --format raw`` and parse what it sampled.

    ``by_function`` aggregates samples by function (``--function``), so one hot function is one
    row however many of its lines the samples land on. Never raises for py-spy's own failures
    (missing, not permitted, the program failing): the returned :class:`Recording` says why
    there are no samples.
    """
    exe = py_spy or find_py_spy()
    if exe is None:
        return Recording(
            ok=False, reason=f"py-spy is not installed or not on PATH ({INSTALL_HINT})"
        )
    command = [exe, "record", "--format", "raw", "--output", str(output), "--rate", str(rate)]
    if subprocesses:
        command.append("--subprocesses")
    if nonblocking:
        command.append("--nonblocking")
    if by_function:
        # One entry per function (its first line) instead of one per line executed.
        command.append("--function")
    command += ["--", *argv]
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        # A session of its own, so a timeout can end py-spy and the program it started together.
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            text=True,
        )
    except OSError as exc:
        return Recording(ok=False, reason=f"py-spy could not be started: {exc}", command=command)
    try:
        printed, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        printed, _ = proc.communicate()
        return Recording(
            ok=False,
            reason=f"py-spy did not finish within {timeout:.0f} s",
            wall_seconds=time.perf_counter() - start,
            command=command,
        )
    wall = time.perf_counter() - start
    text = output.read_text(encoding="utf-8", errors="replace") if output.is_file() else ""
    stacks = parse_raw(text)
    summary = _summary_line(printed or "")
    if not stacks:
        detail = _first_error_line(printed or "") or "no samples were written"
        return Recording(
            ok=False,
            reason=f"py-spy recorded nothing (exit {proc.returncode}): {detail}",
            wall_seconds=wall,
            returncode=proc.returncode,
            summary=summary,
            command=command,
        )
    return Recording(
        ok=True,
        stacks=stacks,
        wall_seconds=wall,
        returncode=proc.returncode,
        summary=summary,
        command=command,
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session made for this py-spy only
    except (ProcessLookupError, PermissionError):
        proc.kill()


# --------------------------------------------------------------------------------------------
# The sampled loader program (runs in the child that py-spy starts)


@dataclass
class LoaderSpec:
    """What the child needs to rebuild the run's DataLoader (JSON-serialisable)."""

    paths: list[str]
    captions: list[str]
    buckets: list[int]
    batch: int
    workers: int
    seed: int
    decode: bool
    #: Iterate for this long (seconds), or until ``max_batches``.
    seconds: float
    max_batches: int
    #: Where the child writes its counts (JSON).
    result_path: str
    #: DatasetInfo as a dict, to rebuild the PreparedData that make_loader takes.
    info: dict[str, Any]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> LoaderSpec:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def loader_command(spec_path: Path) -> list[str]:
    """The command py-spy starts: this interpreter, this module, the spec."""
    return [sys.executable, "-m", "diagnose.sampling", "loader", str(spec_path)]


def sampled_loader_iteration(loader: Iterable[object], seconds: float, max_batches: int) -> int:
    """Iterate ``loader`` (re-starting epochs) for ``seconds`` or ``max_batches`` batches.

    Its name is the marker :func:`is_loader_work` looks for: keep it.
    """
    deadline = time.perf_counter() + seconds
    batches = 0
    while batches < max_batches and time.perf_counter() < deadline:
        yielded = False
        for _batch in loader:
            yielded = True
            batches += 1
            if batches >= max_batches or time.perf_counter() >= deadline:
                break
        if not yielded:
            break
    return batches


def _run_loader(spec: LoaderSpec) -> dict[str, Any]:
    from diagnose.workload.data import (
        DatasetInfo,
        ImageFolderDataset,
        PixelSizes,
        PreparedData,
        make_loader,
    )

    info = DatasetInfo(**{**spec.info, "pixel_sizes": PixelSizes(**spec.info["pixel_sizes"])})
    dataset = ImageFolderDataset(spec.paths, spec.captions, spec.buckets, decode=spec.decode)
    data = PreparedData(info, dataset, [])  # no temp_dir: owns and removes nothing
    loader = make_loader(data, spec.batch, spec.workers, pin_memory=False, seed=spec.seed)
    start = time.perf_counter()
    batches = sampled_loader_iteration(loader, spec.seconds, spec.max_batches)
    seconds = time.perf_counter() - start
    iterator = getattr(loader, "_iterator", None)  # persistent workers: stop them now
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    return {"batches": batches, "seconds": seconds}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "loader":
        print("usage: python -m diagnose.sampling loader SPEC.json", file=sys.stderr)
        return 2
    spec = LoaderSpec.load(Path(args[1]))
    result = _run_loader(spec)
    Path(spec.result_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
