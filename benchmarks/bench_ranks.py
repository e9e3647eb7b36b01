"""Benchmark ``diagnose trace DIR`` on folders of rank traces against HTA on the same folders.

    python benchmarks/bench_ranks.py --hta-python /tmp/hta-venv/bin/python
    python benchmarks/bench_ranks.py --quick --repeats 1          # a smaller folder b, one pass

HTA lives in its own virtualenv, never in the project's dependencies::

    python -m venv /tmp/hta-venv
    /tmp/hta-venv/bin/pip install HolisticTraceAnalysis "pandas<3"   # HTA 0.5.0 breaks on pandas 3

Folders (built under ``--workdir``, reused by later runs; ``--rebuild`` remakes them):

  a. the real DDP trace ``rocm/mi300x_resnet_ddp_bf16_train.json.gz`` (rank 0 of an 8-rank
     world) as 8 rank files ``rank0.json.gz`` .. ``rank7.json.gz``;
  b. ``--ranks-b`` ranks (default 4) of a synthetic trace of ``--size-mb`` uncompressed
     (default 64 MB; 24 MB with ``--quick``), grown from that same trace by
     ``bench_trace.build_synthetic``. ``--ranks-b 8`` doubles it: on a busy 2-core machine HTA
     then takes about 3 minutes a run, so the default keeps the whole benchmark near 7 minutes.

Each rank file has its own ``distributedInfo.rank`` and its timeline mapped by a per-rank affine
map (a clock offset and a stretch of 0.02 % per rank number), rounded to the nanosecond: the
files differ, every event keeps its order and nesting, flows stay linked. The files are written as
Kineto writes them: a pretty-printed header (HTA finds the rank with ``"rank":\\s+N`` line by line,
so it must not be one compact line), then one event per line, gzip-compressed.

Measurements, interleaved diagnose, HTA, diagnose, HTA ... ``--repeats`` times (default 3), each
in a fresh process started by a small wrapper process (this script with ``--wrap``):

  * diagnose: the whole command as a user runs it, ``diagnose trace FOLDER --out TMP --force``
    (imports, the parallel rank reading, the comparison, record and HTML report);
  * HTA: ``python -c`` that imports ``hta.trace_analysis``, runs
    ``TraceAnalysis(trace_dir=FOLDER)`` (HTA parses the ranks in a forked pool) and
    ``get_comm_comp_overlap()`` (per-rank communication/computation overlap).

"wall" is the subprocess's wall time, start to exit. "peak" is the peak of the process tree's
resident memory, the command's process plus its worker processes, summed: the wrapper polls
``/proc/PID/statm`` of every descendant (found through ``/proc/PID/task/TID/children``) every
``--poll-ms`` (default 10 ms). Pages a forked worker shares with its parent count in each
process that maps them, for both tools alike (both read the ranks in a forked pool). The notes
also give the largest single process, from the wrapper's
``getrusage(RUSAGE_CHILDREN).ru_maxrss`` (which Linux raises to the wrapper's own size at
fork+exec; the wrapper is a small Python), and the tree's CPU seconds (user + sys, same
getrusage): on a busy machine the CPU ratio moves less than the wall ratio. Medians over the
repeats, the range in brackets.

Targets (the issue's "done when"), for every folder: diagnose's median wall at least 4x shorter
than HTA's, and diagnose's median tree peak below HTA's. Exit status 0 when met, 1 when not (or a
measurement failed); 0 with diagnose's numbers alone when no HTA can be imported.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trace import SHARED, build_synthetic, hta_python

DDP_TRACE = SHARED / "rocm" / "mi300x_resnet_ddp_bf16_train.json.gz"
SPEED_TARGET = 4.0
#: Per rank: the clock offset (µs) and the stretch of the timeline.
OFFSET_US_PER_RANK = 137.013
STRETCH_PER_RANK = 2e-4
_BUILT = ".complete"
_HTA_TAG = "HTA_RESULT "

#: Runs in the HTA virtualenv: load the folder, one multi-rank analysis, report what it read.
HTA_SNIPPET = f"""
import json, sys, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
t2 = time.perf_counter()
overlap = analysis.get_comm_comp_overlap(visualize=False)
t3 = time.perf_counter()
print({_HTA_TAG!r} + json.dumps({{
    "import_s": t1 - t0, "load_s": t2 - t1, "analysis_s": t3 - t2,
    "ranks": len(analysis.t.get_ranks()), "overlap_rows": len(overlap),
}}))
"""


# -- building the folders ---------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        doc: dict[str, Any] = orjson.loads(stream.read())
    return doc


def _jittered(events: list[dict[str, Any]], rank: int, t0: float) -> Iterator[dict[str, Any]]:
    """The events on rank ``rank``'s clock: ``t0 + offset + (t - t0) * stretch``, rounded to the
    ns. The map is increasing and applied to both ends of each event, so order and nesting hold."""
    offset = rank * OFFSET_US_PER_RANK
    stretch = 1.0 + rank * STRETCH_PER_RANK
    for event in events:
        ts = event.get("ts")
        if rank == 0 or not isinstance(ts, (int, float)):
            yield event
            continue
        moved = dict(event)
        start = round(t0 + offset + (ts - t0) * stretch, 3)
        moved["ts"] = start
        dur = event.get("dur")
        if isinstance(dur, (int, float)):
            end = round(t0 + offset + (ts + dur - t0) * stretch, 3)
            moved["dur"] = round(end - start, 3)
        yield moved


def write_rank_file(
    doc: dict[str, Any], events: list[dict[str, Any]], rank: int, out: Path
) -> None:
    """``out`` (gzip): ``doc``'s header with ``distributedInfo.rank = rank``, Kineto's layout."""
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    info = dict(header.get("distributedInfo") or {})
    info["rank"] = rank
    info.setdefault("world_size", max(rank + 1, 1))
    header["distributedInfo"] = info
    head = json.dumps(header, indent=2)  # '"rank": 3', on its own line, as HTA looks for it
    t0 = min((e["ts"] for e in events if isinstance(e.get("ts"), (int, float))), default=0.0)
    with gzip.open(out, "wb", compresslevel=1) as f:
        f.write(head[: head.rindex("}")].rstrip().encode() + b',\n  "traceEvents": [\n')
        chunk: list[bytes] = []
        first = True
        for event in _jittered(events, rank, t0):
            chunk.append(orjson.dumps(event))
            if len(chunk) >= 20000:
                f.write((b"" if first else b",\n") + b",\n".join(chunk))
                chunk, first = [], False
        if chunk:
            f.write((b"" if first else b",\n") + b",\n".join(chunk))
        f.write(b"\n  ]\n}\n")


def build_folder(folder: Path, doc: dict[str, Any], ranks: int) -> None:
    """``rank0.json.gz`` .. in ``folder``, replacing what was there."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    events: list[dict[str, Any]] = doc["traceEvents"]
    info = doc.get("distributedInfo") or {}
    world = max(ranks, int(info.get("world_size") or 0))
    doc = {**doc, "distributedInfo": {**info, "world_size": world}}
    for rank in range(ranks):
        write_rank_file(doc, events, rank, folder / f"rank{rank}.json.gz")
    (folder / _BUILT).write_text("ok\n")


def prepared_folders(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """Folder a (real trace x 8) and folder b (synthetic), built unless already complete."""
    folders: list[tuple[str, Path]] = []
    real = args.workdir / "real_x8"
    if args.rebuild or not (real / _BUILT).exists():
        print(f"building {real} ...", file=sys.stderr)
        build_folder(real, _load(DDP_TRACE), 8)
    folders.append(("a: real DDP x8", real))
    synthetic = args.workdir / f"synthetic_{args.size_mb}mb_x{args.ranks_b}"
    if args.rebuild or not (synthetic / _BUILT).exists():
        print(f"building {synthetic} ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            one = build_synthetic(DDP_TRACE, args.size_mb << 20, Path(tmp) / "synthetic.json")
            doc = _load(one)
        build_folder(synthetic, doc, args.ranks_b)
        del doc
    folders.append((f"b: synthetic {args.size_mb} MB x{args.ranks_b}", synthetic))
    return folders


def folder_sizes(folder: Path) -> tuple[int, int, int]:
    """Rank files, compressed bytes, uncompressed bytes."""
    files = sorted(folder.glob("*.json.gz"))
    packed = sum(p.stat().st_size for p in files)
    unpacked = 0
    for path in files:
        with gzip.open(path, "rb") as stream:
            while chunk := stream.read(1 << 24):
                unpacked += len(chunk)
    return len(files), packed, unpacked


# -- the wrapper: one command, its wall time and its process tree's peak memory ----------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _tree_rss(root: int, page: int) -> int:
    """Resident bytes of ``root`` and all its descendants, now."""
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(_children(pid))
    return total


def wrap(command: Sequence[str], poll_s: float) -> dict[str, Any]:
    """Run ``command``: its wall time, the peak of its tree's summed RSS, its largest process and
    the CPU seconds (user + sys) of the tree (the processes it waited for)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid, page))
            time.sleep(poll_s)
        wall = time.perf_counter() - started
        log.seek(0)
        tail = log.read()[-4000:].decode(errors="replace")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    largest = usage.ru_maxrss * 1024
    return {
        "rc": proc.returncode,
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "tree_peak": max(peak, largest),
        "largest": largest,
        "tail": tail,
    }


def measure(command: Sequence[str], poll_ms: float, timeout: float) -> dict[str, Any]:
    """``command`` under a fresh wrapper process: its ``wrap`` result, or {"error": ...}."""
    wrapper = [sys.executable, str(Path(__file__).resolve()), "--wrap", str(poll_ms), "--"]
    try:
        proc = subprocess.run(
            wrapper + list(command), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["wrapper failed"])[-1]
        return {"error": last[:160]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        last = (result["tail"].strip().splitlines() or [f"exit {result['rc']}"])[-1]
        return {"error": f"exit {result['rc']}: {last[:160]}"}
    return result


def diagnose_command() -> list[str]:
    """The installed ``diagnose`` script of this Python (not a pyenv shim), else ``-m``."""
    script = Path(sys.executable).parent / "diagnose"
    return [str(script)] if script.exists() else [sys.executable, "-m", "diagnose"]


def diagnose_ranks(out: Path) -> int | None:
    """How many ranks diagnose's record lists."""
    try:
        record = json.loads((out / "record.json").read_text())
    except (OSError, ValueError):
        return None
    ranks = record.get("ranks")
    return len(ranks) if isinstance(ranks, list) else None


def _hta(explicit: str | None) -> str | None:
    """bench_trace's HTA probe, with a ``--hta-python`` that does not exist meaning no HTA."""
    try:
        return hta_python(explicit)
    except OSError:
        return None


# -- the table --------------------------------------------------------------------------------


@dataclass
class Runs:
    ok: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        return statistics.median(r[key] for r in self.ok) if self.ok else None

    def span(self, key: str, scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
        if not self.ok:
            return "failed (see below)" if self.errors else "-"
        values = [r[key] / scale for r in self.ok]
        text = f"{statistics.median(values):,.{digits}f} {unit}"
        if len(values) > 1:
            text += f" ({min(values):,.{digits}f}-{max(values):,.{digits}f})"
        return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wrap", type=float, metavar="POLL_MS", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--hta-python", help="a Python that can import hta (HTA's venv)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per tool")
    parser.add_argument("--quick", action="store_true", help="a smaller folder b (24 MB a rank)")
    parser.add_argument("--size-mb", type=int, help="folder b: MB a rank (default 64)")
    parser.add_argument("--ranks-b", type=int, help="folder b: rank files (default 4)")
    parser.add_argument("--poll-ms", type=float, default=10.0, help="memory polling interval")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_ranks")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the folders")
    parser.add_argument("--timeout", type=float, default=900, help="per measurement, seconds")
    parser.add_argument("--skip-hta", action="store_true", help="measure diagnose only")
    args = parser.parse_args(argv)

    if args.wrap is not None:
        print(json.dumps(wrap(args.command, args.wrap / 1000)))
        return 0

    args.size_mb = args.size_mb or (24 if args.quick else 64)
    args.ranks_b = args.ranks_b or 4
    if not DDP_TRACE.exists():
        print(f"no trace {DDP_TRACE}", file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    folders = prepared_folders(args)
    hta = None if args.skip_hta else _hta(args.hta_python)
    out = args.workdir / "diagnose_out"

    rows: list[list[str]] = []
    notes: list[str] = []
    verdicts: list[bool] = []
    for label, folder in folders:
        count, packed, unpacked = folder_sizes(folder)
        runs = {"diagnose": Runs(), "hta": Runs()}
        extra: dict[str, list[Any]] = {"diagnose_ranks": [], "hta": []}
        for _ in range(args.repeats):
            print(f"{label}: diagnose ...", file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)
            command = [*diagnose_command(), "trace", str(folder), "--out", str(out), "--force"]
            result = measure(command, args.poll_ms, args.timeout)
            if "error" in result:
                runs["diagnose"].errors.append(result["error"])
            else:
                runs["diagnose"].ok.append(result)
                extra["diagnose_ranks"].append(diagnose_ranks(out))
            if hta is None:
                continue
            print(f"{label}: HTA ...", file=sys.stderr)
            result = measure([hta, "-c", HTA_SNIPPET, str(folder)], args.poll_ms, args.timeout)
            if "error" in result:
                runs["hta"].errors.append(result["error"])
                continue
            runs["hta"].ok.append(result)
            line = next((x for x in result["tail"].splitlines() if x.startswith(_HTA_TAG)), None)
            extra["hta"].append(json.loads(line[len(_HTA_TAG) :]) if line else {})
        diag, hta_runs = runs["diagnose"], runs["hta"]
        d_wall, h_wall = diag.median("wall"), hta_runs.median("wall")
        d_peak, h_peak = diag.median("tree_peak"), hta_runs.median("tree_peak")
        ratio = h_wall / d_wall if d_wall and h_wall else None
        rows.append(
            [
                label,
                str(count),
                f"{packed / 2**20:,.0f} / {unpacked / 2**20:,.0f}",
                diag.span("wall"),
                hta_runs.span("wall") if hta else "HTA not importable",
                f"{ratio:.1f}x" if ratio else "-",
                diag.span("tree_peak", 2**20, "MB", 0),
                hta_runs.span("tree_peak", 2**20, "MB", 0) if hta else "-",
            ]
        )
        if diag.ok:
            notes.append(
                f"{label}: diagnose CPU {diag.span('cpu')}; largest process "
                f"{diag.span('largest', 2**20, 'MB', 0)}; "
                f"ranks in its record: {sorted(set(extra['diagnose_ranks']), key=str)}"
            )
        for tool, tries in runs.items():
            for error in dict.fromkeys(tries.errors):
                notes.append(f"{label}: {tool} failed {tries.errors.count(error)}x: {error}")
        if hta_runs.ok:
            parts = extra["hta"]
            inner = ", ".join(
                f"{key} {statistics.median(p.get(key, 0.0) for p in parts):.2f} s"
                for key in ("import_s", "load_s", "analysis_s")
            )
            notes.append(
                f"{label}: HTA CPU {hta_runs.span('cpu')}; largest process "
                f"{hta_runs.span('largest', 2**20, 'MB', 0)}; "
                f"ranks read {sorted({p.get('ranks') for p in parts}, key=str)}; inside: {inner}"
            )
        if hta:
            met = (
                ratio is not None
                and ratio >= SPEED_TARGET
                and d_peak is not None
                and h_peak is not None
                and d_peak < h_peak
            )
            verdicts.append(met)
        elif not diag.ok:
            verdicts.append(False)

    header = [
        "folder",
        "ranks",
        "total MB (gz / json)",
        "diagnose wall",
        "HTA wall",
        "HTA/diagnose",
        "diagnose peak",
        "HTA peak",
    ]
    print(_table(header, rows))
    print(
        f"\nwall: whole subprocess, median (min-max) of {args.repeats}, interleaved. peak: "
        f"process tree (command + workers) summed RSS, polled from /proc every {args.poll_ms:g} "
        "ms by a wrapper; median (min-max)."
    )
    for note in notes:
        print(f"  {note}")
    if hta is None:
        print("\nHTA not importable (see --hta-python): targets not judged, diagnose alone.")
        return 0 if all(verdicts) else 1
    met = bool(verdicts) and all(verdicts)
    print(
        f"\ntargets (every folder: >= {SPEED_TARGET:g}x faster than HTA, less peak memory): "
        + ("MET" if met else "NOT MET")
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
