"""Redaction must take time linear in its input: time per MB on adversarial text, 1 KB to 100 MB.

    python benchmarks/bench_redact.py                        # every shape, 1 KB ... 100 MB
    python benchmarks/bench_redact.py --max-size 10MB        # quicker
    python benchmarks/bench_redact.py --module /tmp/old/redact.py --timeout 60   # another version

Profiler traces carry arbitrary kernel and op names, and everything written goes through
``diagnose.redact``; a regex that backtracks quadratically turned a 90 KB name (``'.-a' * 30000``)
into a 98 s trace analysis. Each shape below is built to defeat one pattern (a run of name
characters with a possible start at every step, a token prefix repeated, a BEGIN line without an
END, ...), plus ordinary text for reference.

Every shape is measured in its own subprocess, sizes in increasing order; a shape that runs past
``--timeout`` seconds is reported as such and its larger sizes skipped. Times are the process's
CPU time, not wall time, so that other work on a busy machine does not count; small sizes are
repeated until they take 50 ms and the best time is kept, so the timer's resolution does not. The
table prints milliseconds per MB; the last column is the ratio of the largest size's time per MB
to the smallest's. Exit status 1 when that ratio is over ``--max-growth`` (3) for any shape, or a
shape timed out: redaction is not linear.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MB = 1_000_000

#: Text that has no secrets and a bit of everything (options, assignments, URLs, JSON).
_PROSE = (
    "overlap the gradient all-reduce with the backward pass: DistributedDataParallel(model, "
    'bucket_cap_mb=25) --lr 1e-4 --rank 32 {"op": "aten::mm", "pass": "forward"} '
    "see https://pytorch.org/docs/stable/notes/cuda.html#memory-management for details.\n"
)


def _repeat(unit: str) -> Callable[[int], str]:
    return lambda size: unit * max(1, size // len(unit))


def _prefixed(prefix: str, unit: str) -> Callable[[int], str]:
    return lambda size: prefix + unit * max(1, (size - len(prefix)) // len(unit))


#: name -> builder of a string of about ``size`` characters.
SHAPES: dict[str, Callable[[int], str]] = {
    ".-a": _repeat(".-a"),  # the kernel name of the ticket: option and URL-scheme runs
    ".--a": _repeat(".--a"),
    "-": _repeat("-"),
    "a=": _repeat("a="),
    "a = ": _repeat("a = "),
    "a:": _repeat("a:"),
    "a+": _repeat("a+"),  # URL scheme characters, no "://"
    "x://": _repeat("x://"),
    "http://aaa": _prefixed("http://", "a"),
    "eyJa.": _prefixed("eyJ", "a."),
    "-eyJ": _repeat("-eyJ"),  # a JSON web token could start at every "eyJ"
    "--token ": _repeat("--token "),
    "token=": _repeat("token="),
    "BEGIN KEY": _repeat("-----BEGIN RSA PRIVATE KEY-----\n"),  # no END line
    "-glpat-": _repeat("-glpat-"),
    "bearer ": _repeat("bearer "),
    "a+spaces": _prefixed("a", " "),
    "one line": _repeat("x.y-z_w/Q9:"),  # one long line, no spaces
    "short lines": _repeat("a\n--t=1\nk: v\n"),  # many short lines
    "prose": _repeat(_PROSE),
}

#: 1 KB ... 100 MB.
SIZES = (1_000, 10_000, 100_000, MB, 10 * MB, 100 * MB)


def _parse_size(text: str) -> int:
    units = {"KB": 1_000, "MB": MB, "GB": 1000 * MB}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def _load_redactor(module: str | None) -> Callable[[str], str]:
    """The text redaction of ``diagnose.redact``, or of the file ``module`` (another version)."""
    import importlib
    import importlib.util

    if module is None:
        target: Any = importlib.import_module("diagnose.redact")
    else:
        spec = importlib.util.spec_from_file_location("bench_redact_target", module)
        assert spec is not None and spec.loader is not None
        target = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = target  # dataclasses look their module up
        spec.loader.exec_module(target)
    # Every stage on: literal secrets, home folder, user and host names.
    redactor = target.Redactor(
        secrets=["s3cr3t-literal-value"], home="/home/alice", user="alice", host="gpu-node-17"
    )
    # The uncached redaction: a redactor remembers short texts it saw (a trace repeats its keys
    # and op names), and the timer repeats the same text.
    text: Callable[[str], str] = getattr(redactor, "_text", redactor.text)
    return text


def _child(shape: str, sizes: list[int], module: str | None) -> None:
    """Measure one shape at each size; one JSON line per size, flushed as it comes."""
    redact = _load_redactor(module)
    build = SHAPES[shape]
    for size in sizes:
        text = build(size)
        best = float("inf")
        spent = 0.0
        while spent < 0.05:  # at least once; small sizes until 50 ms
            start = time.process_time()
            redact(text)
            took = time.process_time() - start
            best = min(best, took)
            spent += took
        print(json.dumps({"size": len(text), "seconds": best}), flush=True)


def _measure(
    shape: str, sizes: list[int], module: str | None, timeout: float
) -> tuple[list[tuple[int, float]], bool]:
    """(size, seconds) for each size measured, and whether the shape ran out of time."""
    command = [sys.executable, __file__, f"--child={shape}", f"--sizes={','.join(map(str, sizes))}"]
    if module is not None:
        command += ["--module", module]
    timed_out = False
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
        )
        stdout, stderr = done.stdout, done.stderr
        if done.returncode != 0:
            sys.stderr.write(stderr)
            raise SystemExit(f"{shape}: the measuring process failed ({done.returncode})")
    except subprocess.TimeoutExpired as expired:
        timed_out = True
        out = expired.stdout or b""
        stdout = out.decode() if isinstance(out, bytes) else out
    results = []
    for line in stdout.splitlines():
        row = json.loads(line)
        results.append((int(row["size"]), float(row["seconds"])))
    return results, timed_out


def _format_size(size: int) -> str:
    for unit, factor in (("MB", MB), ("KB", 1_000)):
        if size >= factor:
            return f"{size / factor:g} {unit}"
    return f"{size} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-size", default="100MB", help="largest size (default 100MB)")
    parser.add_argument("--module", help="path of a redact.py to time instead of diagnose.redact")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per shape")
    parser.add_argument("--max-growth", type=float, default=3.0, help="allowed ms/MB growth")
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        _child(args.child, [int(s) for s in args.sizes.split(",")], args.module)
        return 0

    largest = _parse_size(args.max_size)
    sizes = [s for s in SIZES if s <= largest] or [largest]
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {list(SHAPES)}")

    print(f"redaction time per MB (ms/MB), {args.module or 'diagnose.redact'}")
    header = f"{'shape':<12}" + "".join(f"{_format_size(s):>11}" for s in sizes) + "     growth"
    print(header)
    failed = []
    for shape in shapes:
        results, timed_out = _measure(shape, sizes, args.module, args.timeout)
        cells = [f"{seconds * 1000 / (size / MB):>11.1f}" for size, seconds in results]
        cells += [f"{'>' + format(args.timeout, 'g') + ' s':>11}"] if timed_out else []
        cells += [f"{'':>11}"] * (len(sizes) - len(cells))
        if timed_out or len(results) < 2:
            growth_text = "timed out" if timed_out else "n/a"
            if timed_out:
                failed.append(shape)
        else:
            (small, t_small), (big, t_big) = results[0], results[-1]
            growth = (t_big / big) / (t_small / small)
            growth_text = f"{growth:.2f}x"
            if growth > args.max_growth:
                failed.append(shape)
                growth_text += " NOT LINEAR"
        print(f"{shape:<12}" + "".join(cells) + f"  {growth_text:>9}", flush=True)
    if failed:
        print(f"not linear: {', '.join(failed)}")
        return 1
    print(f"linear: time per MB grew at most {args.max_growth:g}x from the smallest size")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
