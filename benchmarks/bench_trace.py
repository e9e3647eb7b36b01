"""Benchmark `diagnose trace` against the parse floor and HTA's trace loading.

    python benchmarks/bench_trace.py                 # real traces, a 62 MB gzip class, 200 MB
    python benchmarks/bench_trace.py --gigabyte      # also a ~1 GB synthetic trace
    python benchmarks/bench_trace.py --hta-python /path/to/venv/bin/python
    python benchmarks/bench_trace.py --gzip-bomb 4096  # only: peak memory refusing 4 GB bombs

Every measurement is a whole command in a fresh process, timed from outside (interpreter start
and imports included, as a user waits for it), and runs interleaved with the others, median of
``--repeat``:

- ``floor``: gunzip + ``orjson.loads`` of the whole file in one thread, nothing else: the
  single-threaded parse floor (``floor gc off``: the same with Python's cyclic GC paused);
- ``diagnose``: ``diagnose trace FILE --out DIR``, report and record written; its peak counts the
  second process that reads along with it (the sum of both peaks: shared pages count twice, so
  this is an upper bound);
- ``hta``: ``hta.trace_analysis.TraceAnalysis`` loading the file (HolisticTraceAnalysis, when
  this Python or ``--hta-python`` can import it).

Synthetic traces repeat the profiled steps of a real trace, shifted in time, with correlation and
External ids offset so links stay unique: the same phenomena, many more events. The 62 MB class
is the size of the traces people attach to tickets, gzipped as torch writes them.
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
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "gpu-traces"
METHODS = ("floor", "floor_nogc", "diagnose", "hta")
_NO_HTA = "HTA not importable (pip install HolisticTraceAnalysis failed or not done)"
_ID_KEYS = ("External id", "external id", "correlation", "Record function id", "Python id")


def largest_real_trace() -> Path | None:
    traces = sorted(SHARED.glob("*/*.json*"), key=_uncompressed_size)
    return traces[-1] if traces else None


def _uncompressed_size(path: Path) -> int:
    if path.suffix != ".gz":
        return path.stat().st_size
    with gzip.open(path, "rb") as stream:
        size = 0
        while chunk := stream.read(1 << 24):
            size += len(chunk)
    return size


def build_synthetic(source: Path, target_bytes: int, out: Path) -> Path:
    """Write ``out`` (plain JSON) by repeating ``source``'s events, shifted, until big enough."""
    import orjson  # here, not at the top: HTA's Python measures without it

    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rb") as stream:
        doc = orjson.loads(stream.read())
    events: list[dict[str, Any]] = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    start = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - start + 1000
    id_span = 1 + max(
        (v for e in events for k in _ID_KEYS if isinstance(v := (e.get("args") or {}).get(k), int)),
        default=0,
    )
    flow_span = 1 + max((e["id"] for e in events if isinstance(e.get("id"), int)), default=0)
    one_copy = len(orjson.dumps(events))
    copies = max(1, round(target_bytes / one_copy))
    header = orjson.dumps(doc)[:-1]  # "{...", closed after the events
    with out.open("wb") as f:
        f.write(header + (b',"traceEvents":[' if len(header) > 1 else b'"traceEvents":['))
        for copy in range(copies):
            shifted = []
            for e in events:
                if e.get("ph") == "M" and copy:
                    continue
                e2 = dict(e)
                if isinstance(e2.get("ts"), (int, float)):
                    e2["ts"] = e2["ts"] + copy * span
                if isinstance(e2.get("id"), int):
                    e2["id"] = e2["id"] + copy * flow_span
                args = e2.get("args")
                if isinstance(args, dict) and copy:
                    args = dict(args)
                    for key in _ID_KEYS:
                        if isinstance(args.get(key), int) and args[key] > 0:
                            args[key] += copy * id_span
                    e2["args"] = args
                name = e2.get("name")
                if isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{copy * 1000 + int(name.split('#')[1])}"
                shifted.append(e2)
            body = orjson.dumps(shifted)[1:-1]
            f.write((b"," if copy else b"") + body)
        f.write(b"]}")
    return out


def build_bomb(out: Path, megabytes: int, unit: bytes, head: bytes = b"") -> Path:
    """A gzip file that expands ~1000x to ``megabytes`` MB of ``unit``, written without ever
    holding more than 1 MB of it."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header
    block = unit * ((1 << 20) // len(unit))
    with out.open("wb") as f:
        f.write(squeeze.compress(head))
        for _ in range(megabytes):
            f.write(squeeze.compress(block))
        f.write(squeeze.flush())
    return out


#: Gzip bombs: what they expand to, the text before it.
_BOMBS: dict[str, tuple[bytes, bytes]] = {
    "blanks": (b" ", b""),
    "brackets": (b"[", b'{"traceEvents": '),
    "events": (
        b'{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1},',
        b'{"traceEvents": [',
    ),
}


def bench_bombs(megabytes: int, workdir: Path, timeout: float) -> int:
    """Peak memory and time to refuse gzip bombs with the default limits (each in a fresh
    process): bounded by the limits (the ratio's floor, 64 MB), not by the bomb."""
    print("| bomb | expands to | gzip size | wall | peak RSS | base | refused with |")
    print("|---|---|---|---|---|---|---|")
    for kind, (unit, head) in _BOMBS.items():
        path = workdir / f"bomb_{kind}_{megabytes}mb.json.gz"
        if not path.exists():
            print(f"building {path} ...", file=sys.stderr)
            build_bomb(path, megabytes, unit, head)
        r = run_measurement(sys.executable, "bomb", path, timeout)
        cells = [kind, f"{megabytes:,} MB", f"{path.stat().st_size / 2**20:.1f} MB"]
        if "error" in r:
            cells += ["-", "-", "-", r["error"]]
        else:
            cells += [f"{r['wall']:.2f} s", _mb(r["peak"]), _mb(r["base"]), r["refused"] or "read"]
        print("| " + " | ".join(cells) + " |")
    return 0


# -- measurements (each in a fresh process) ---------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as stream:
            return stream.read()
    return path.read_bytes()


def _measure(method: str, path: Path) -> dict[str, Any]:
    """One measurement, in this (fresh) process: what it read, and its peak memory."""
    extra: dict[str, Any] = {}
    if method in ("floor", "floor_nogc"):
        if method == "floor_nogc":
            import gc

            gc.disable()
        import orjson

        data = orjson.loads(_read_bytes(path))
        extra["events"] = len(data["traceEvents"])
    elif method == "bomb":
        from diagnose.errors import DiagnoseError
        from diagnose.trace.reader import read_trace

        try:
            read_trace(path)
            extra["refused"] = ""
        except DiagnoseError as exc:
            extra["refused"] = exc.message.split(": ", 1)[-1]
    elif method == "diagnose":
        import contextlib
        import io

        from diagnose.cli import main

        out = Path(tempfile.mkdtemp(prefix="bench_trace_out_"))
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(["trace", str(path), "--out", str(out / "o")])
            record = json.loads((out / "o" / "record.json").read_text())
        finally:
            shutil.rmtree(out, ignore_errors=True)
        extra["exit"] = code
        extra["findings"] = sorted(f["id"] for f in record.get("findings", []))
        probe = next((p for p in record.get("probes", []) if p.get("name") == "trace"), {})
        extra["read_processes"] = (
            (probe.get("data") or {}).get("metadata", {}).get("read_processes")
        )
    elif method == "hta":
        from hta.trace_analysis import TraceAnalysis

        folder = Path(tempfile.mkdtemp(prefix="hta_bench_"))
        try:
            os.symlink(path, folder / path.name)
            TraceAnalysis(trace_dir=str(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    # A process this one waited for (the trace's second reader) counts with its own peak.
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"peak": _peak_rss() + children, "children_peak": children, **extra}


def _peak_rss() -> int:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    from the parent across fork+exec, which would charge the benchmark driver's memory here."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_measurement(python: str, method: str, path: Path, timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh process; ``wall`` is the whole process, timed here."""
    cmd = [python, str(Path(__file__).resolve()), "--measure", method, str(path)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:120]}
    return {"wall": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def hta_python(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [sys.executable]
    for python in candidates:
        if not python:
            continue
        probe = subprocess.run(
            [python, "-c", "import hta.trace_analysis"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return python
    return None


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs=2, metavar=("METHOD", "FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--gigabyte", action="store_true", help="also build a ~1 GB trace")
    parser.add_argument("--size-mb", type=int, default=200, help="synthetic trace size")
    parser.add_argument("--hta-python", help="a Python that can import hta (HTA's venv)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_trace")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement (median; 1 above 512 MB)"
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=METHODS)
    parser.add_argument(
        "--gzip-bomb",
        type=int,
        metavar="MB",
        help="only measure refusing gzip bombs that expand to MB (blanks, brackets, events)",
    )
    args = parser.parse_args(argv)

    if args.measure:
        method, file = args.measure
        print(json.dumps(_measure(method, Path(file))))
        return 0
    if args.gzip_bomb:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return bench_bombs(args.gzip_bomb, args.workdir, args.timeout)

    source = largest_real_trace()
    if source is None:
        print(f"no real traces under {SHARED}", file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    files = trace_set(source, args.workdir, args.size_mb, gigabyte=args.gigabyte)
    hta = hta_python(args.hta_python)
    print(
        f"{args.repeat} interleaved runs each (1 above 512 MB); medians. Wall: the whole command, "
        f"interpreter start included. {_NO_HTA if hta is None else 'HTA: ' + hta}",
        file=sys.stderr,
    )
    rows = [measure_file(label, path, hta, args) for label, path in files]
    header = [
        "trace",
        "size",
        "floor",
        "floor gc off",
        "diagnose",
        "vs floor",
        "vs floor gc off",
        "HTA",
        "HTA / diagnose",
        "peak diagnose",
        "peak HTA",
        "peak / HTA's",
        "notes",
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return 0


def trace_set(
    source: Path, workdir: Path, size_mb: int, *, gigabyte: bool
) -> list[tuple[str, Path]]:
    """The real traces over 10 MB, the 62 MB gzip class, and the synthetic sizes asked for."""
    files = [
        (f"real: {p.name}", p)
        for p in sorted(SHARED.glob("*/*.json*"))
        if p.stat().st_size > 1 << 20
    ]
    ticket = workdir / "class_62mb.json.gz"
    if not ticket.exists():
        # The trace whose steps are most like a training job's: the DDP one when present.
        seed = next(iter(sorted(SHARED.glob("*/*ddp*.json.gz"))), source)
        print(f"building {ticket} from {seed.name} ...", file=sys.stderr)
        plain = build_synthetic(seed, 62 << 20, workdir / "class_62mb.json")
        with plain.open("rb") as raw, gzip.open(ticket, "wb", compresslevel=6) as packed:
            shutil.copyfileobj(raw, packed, 1 << 24)
        plain.unlink()
    files.append(("62 MB class (gzip)", ticket))
    for size in [size_mb] + ([1024] if gigabyte else []):
        out = workdir / f"synthetic_{size}mb.json"
        if not out.exists():
            print(f"building {out} ...", file=sys.stderr)
            build_synthetic(source, size << 20, out)
        files.append((f"synthetic {size} MB (x{source.stem.split('.')[0]})", out))
    return files


def measure_file(label: str, path: Path, hta: str | None, args: argparse.Namespace) -> list[str]:
    size = _uncompressed_size(path)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    # Methods alternate within each repeat, so a busy moment of the machine hits all alike.
    for _ in range(1 if size > 512 << 20 else args.repeat):
        for method in METHODS:
            if method in args.skip:
                runs[method].append({"error": "skipped"})
            elif method == "hta" and hta is None:
                runs[method].append({"error": "no HTA"})
            else:
                python = hta if method == "hta" and hta else sys.executable
                print(f"{label}: {method} ...", file=sys.stderr)
                runs[method].append(run_measurement(python, method, path, args.timeout))
    wall: dict[str, float | None] = {}
    peak: dict[str, float | None] = {}
    notes: list[str] = []
    for method, tries in runs.items():
        ok = [r for r in tries if "error" not in r]
        wall[method] = statistics.median(r["wall"] for r in ok) if ok else None
        peak[method] = statistics.median(r["peak"] for r in ok) if ok else None
        if not ok and tries[0]["error"] not in ("skipped", "no HTA"):
            notes.append(f"{method}: {tries[0]['error']}")
        if method == "diagnose" and ok:
            processes = sorted({r.get("read_processes") for r in ok}, key=str)
            notes.append(f"read by {'/'.join(map(str, processes))} process(es)")
            notes.append(", ".join(ok[0].get("findings", [])) or "no findings")

    def seconds(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else "-"

    def ratio(a: float | None, b: float | None, unit: str = "x") -> str:
        return f"{a / b:.2f}{unit}" if a is not None and b else "-"

    return [
        label,
        _mb(size),
        seconds(wall["floor"]),
        seconds(wall["floor_nogc"]),
        seconds(wall["diagnose"]),
        ratio(wall["diagnose"], wall["floor"]),
        ratio(wall["diagnose"], wall["floor_nogc"]),
        seconds(wall["hta"]),
        ratio(wall["hta"], wall["diagnose"]),
        _mb(peak["diagnose"]) if peak["diagnose"] else "-",
        _mb(peak["hta"]) if peak["hta"] else "-",
        ratio(peak["diagnose"], peak["hta"]),
        "; ".join(notes),
    ]


if __name__ == "__main__":
    sys.exit(main())
