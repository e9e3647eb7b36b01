"""Compare diagnose's device-time shares with HTA's (Holistic Trace Analysis) on the real traces.

    python benchmarks/compare_hta_device_time.py                    # ../shared/gpu-traces
    python benchmarks/compare_hta_device_time.py --traces DIR more.json.gz
    python benchmarks/compare_hta_device_time.py --hta-python /path/to/venv/bin/python

For every trace (each ``*.json`` / ``*.json.gz`` under ``--traces``, default the shared real
traces, plus any files given as arguments) it prints one row: the share of time the device sat
idle, ran computation, communication and memory work, as diagnose measures it and as HTA does,
then a "Known differences" section that explains, from what each tool read on these traces,
why the numbers differ where they do.

- diagnose: ``analyze_trace`` in this process. Shares of its step windows (ProfilerStep ranges,
  else optimizer step to optimizer step, else the whole trace), every stream of the busiest
  device counted once. Its kernel classes map to HTA's kinds: communication -> communication;
  memcpy, memset -> memory; every other class -> computation.
- HTA: ``TraceAnalysis`` on a folder holding only that trace, in a subprocess of HTA's own
  interpreter running ``hta_reading.py`` (``--hta-python``, default ``/tmp/hta-venv/bin/python``),
  one trace at a time with a timeout. Idle and compute are ``get_temporal_breakdown``'s
  ``idle_time(us)`` and ``compute_time(us)`` over its ``kernel_time(us)`` (first to last GPU
  event); communication and memory are ``get_gpu_kernel_breakdown``'s kernel-type sums over the
  same span, the overlap rows ("COMPUTATION overlapping MEMORY", ...) given to the first of
  computation > memory > communication, the precedence diagnose counts overlapping work with. A
  trace HTA cannot read gets ``-`` and the first line of its error in the notes.

Writes nothing outside a temporary folder; needs no network. Exit status 0 when the table was
printed, 1 when there was no trace to compare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "gpu-traces"
DEFAULT_HTA_PYTHON = "/tmp/hta-venv/bin/python"
#: The script HTA's interpreter runs on each trace; it prints its reading after this mark.
HTA_READING = Path(__file__).resolve().parent / "hta_reading.py"
_MARK = "HTA-JSON "
#: Kernel names whose HTA kind and diagnose class are shown even when no trace holds them.
_PROBE_NAMES = ("multimem_all_reduce_kernel<float, 4>",)
#: Trace categories diagnose reads as device activity, with the kind ``classify_kernel`` takes.
_DEVICE_CATEGORIES = {
    "kernel": "kernel",
    "Kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "Memcpy": "memcpy",
    "gpu_memset": "memset",
    "Memset": "memset",
}
_KINDS = ("COMPUTATION", "COMMUNICATION", "MEMORY")


@dataclass
class Row:
    label: str
    path: Path
    #: Shares (0-1) of idle, computation, communication, memory; None where not measured.
    diag: dict[str, float | None] = field(default_factory=dict)
    hta: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    diag_window_s: float | None = None
    diag_window: str = ""
    diag_busy_s: float | None = None
    hta_result: dict[str, Any] = field(default_factory=dict)
    hta_window_s: float | None = None


# -- diagnose -------------------------------------------------------------------------------


def diagnose_side(row: Row) -> None:
    from diagnose.trace.analysis import analyze_trace

    try:
        a = analyze_trace(row.path)
    except Exception as exc:  # a row of the table, not the end of the script
        row.notes.append(f"diagnose: {type(exc).__name__}: {_first_line(exc)}")
        return
    b = a.breakdown
    steps = len(a.steps)
    row.diag_window_s = sum(s.wall_seconds for s in a.steps)
    if a.whole_trace_window:
        row.diag_window = "whole trace"
    elif a.steps and "optimizer step" in a.steps[0].label:
        row.diag_window = f"{steps} optimizer step{'s' * (steps != 1)}"
    else:
        row.diag_window = f"{steps} step{'s' * (steps != 1)}"
    busy, idle = b.device_busy_seconds, b.device_idle_seconds
    if busy is None or idle is None or busy + idle <= 0:
        row.notes.append("diagnose: no device activity")
        return
    total = busy + idle
    kinds = dict.fromkeys(_KINDS, 0.0)
    for cls, seconds in b.device_seconds_by_kernel_class.items():
        kinds[diagnose_kind(cls)] += seconds
    row.diag = {
        "idle": b.device_idle_share,
        "COMPUTATION": kinds["COMPUTATION"] / total,
        "COMMUNICATION": kinds["COMMUNICATION"] / total,
        "MEMORY": kinds["MEMORY"] / total,
    }
    row.diag_busy_s = busy * steps


def diagnose_kind(kernel_class: str) -> str:
    if kernel_class == "communication":
        return "COMMUNICATION"
    if kernel_class in ("memcpy", "memset"):
        return "MEMORY"
    return "COMPUTATION"


def _diagnose_class(name: str) -> str:
    from diagnose.trace.kernel_classes import classify_kernel

    return classify_kernel(name)


def diagnose_kind_of(name: str, category: str) -> str | None:
    """The HTA kind diagnose's class of one event amounts to; None: diagnose does not count it."""
    from diagnose.trace.columns import KERNEL, MEMCPY, MEMSET
    from diagnose.trace.kernel_classes import classify_kernel

    kind = _DEVICE_CATEGORIES.get(category)
    if kind is None:
        return None
    code = {"kernel": KERNEL, "memcpy": MEMCPY, "memset": MEMSET}[kind]
    return diagnose_kind(classify_kernel(name, code))


# -- HTA --------------------------------------------------------------------------------------


def hta_python(explicit: str | None) -> str | None:
    python = shutil.which(explicit or DEFAULT_HTA_PYTHON)
    if python is None:
        return None
    try:
        probe = subprocess.run(
            [python, "-c", "import hta.trace_analysis"],
            capture_output=True,
            check=False,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if probe.returncode == 0 else None


def run_hta(python: str, trace: Path, work: Path, timeout: float) -> dict[str, Any]:
    """HTA's reading of one trace, alone in a folder (HTA reads a folder of rank traces; the
    rank comes from the file's ``"rank"``, else 0, so the file name does not matter)."""
    folder = Path(tempfile.mkdtemp(prefix="trace_", dir=work))
    try:
        with trace.open("rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {_first_line(exc)}"}
    (folder / ("trace.json.gz" if gzipped else "trace.json")).symlink_to(trace.resolve())
    cmd = [python, str(HTA_READING), str(folder), *_PROBE_NAMES]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=work, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            result: dict[str, Any] = json.loads(line[len(_MARK) :])
            return result
    last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return {"error": f"HTA's Python failed: {last[:120]}"}


def hta_side(row: Row, result: dict[str, Any]) -> None:
    row.hta_result = result
    temporal = result.get("temporal")
    if temporal and temporal["kernel_time(us)"] > 0:
        span = temporal["kernel_time(us)"]
        row.hta_window_s = span / 1e6
        row.hta = {
            "idle": temporal["idle_time(us)"] / span,
            "COMPUTATION": temporal["compute_time(us)"] / span,
        }
        if "kinds" in result:
            once = hta_counted_once(result["kinds"])
            row.hta["COMMUNICATION"] = once["COMMUNICATION"] / span
            row.hta["MEMORY"] = once["MEMORY"] / span
            other = 1 - sum(v for v in row.hta.values() if v is not None)
            if other >= 0.0005:
                row.notes.append(f"HTA OTHER-kind busy {_pct(other)}%")
    if "error" in result:
        row.notes.append(f"HTA: {_clip(result['error'], 90)}")
        if result.get("events") == []:
            row.notes.append("HTA read no GPU events")
        return
    if result.get("profiler_step_names", 0) >= 2:
        row.notes.append("HTA cut the last step")
    extra = _extra_events(result)
    for cat, (n, us) in sorted(extra.items()):
        row.notes.append(f"HTA counts {n} {cat} ({_duration(us)})")
    rounding = result.get("rounding", {})
    if rounding.get("trimmed_us", 0) > 0:
        row.notes.append(
            f"HTA ns->us rounding trims {_duration(rounding['trimmed_us'])}"
            f" off {rounding['events']} events"
        )
    for (hta_kind, diag_kind), (n, us) in sorted(kind_disagreements(result).items()):
        row.notes.append(f"{n} names ({_duration(us)}) HTA {hta_kind}, diagnose {diag_kind}")


def hta_counted_once(kinds: dict[str, float]) -> dict[str, float]:
    """Microseconds per kind, each instant to one kind: get_gpu_kernel_breakdown's rows are the
    times exactly one set of kinds ran ("COMPUTATION overlapping MEMORY"); a set goes to its first
    kind in the order computation, memory, communication (diagnose's precedence)."""
    once = dict.fromkeys(_KINDS, 0.0)
    for label, us in kinds.items():
        present = set(label.split(" overlapping "))
        for kind in ("COMPUTATION", "MEMORY", "COMMUNICATION"):
            if kind in present:
                once[kind] += us
                break
    return once


def _extra_events(result: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """GPU events HTA counted (a stream in their args) of categories diagnose does not read."""
    extra: dict[str, tuple[int, float]] = {}
    for cat, _name, _kind, n, us in result.get("events", []):
        if cat not in _DEVICE_CATEGORIES:
            count, total = extra.get(cat, (0, 0.0))
            extra[cat] = (count + n, total + us)
    return extra


def kind_disagreements(result: dict[str, Any]) -> dict[tuple[str, str], tuple[int, float]]:
    """(HTA kind, diagnose kind) -> (distinct names, summed us) where the two type a device
    event (kernel, copy, memset) differently."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for cat, name, hta_kind, _n, us in result.get("events", []):
        diag_kind = diagnose_kind_of(name, cat)
        if diag_kind is not None and diag_kind != hta_kind:
            names, total = out.get((hta_kind, diag_kind), (0, 0.0))
            out[(hta_kind, diag_kind)] = (names + 1, total + us)
    return out


# -- output -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="more trace files to compare")
    parser.add_argument(
        "--traces", type=Path, default=SHARED, help=f"folder of traces (default {SHARED})"
    )
    parser.add_argument(
        "--hta-python",
        help=f"a Python that can import hta (default {DEFAULT_HTA_PYTHON})",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds HTA gets per trace")
    args = parser.parse_args(argv)

    rows = collect(args.traces, args.files)
    if not rows:
        print(f"no traces under {args.traces} and none given", file=sys.stderr)
        return 1
    python = hta_python(args.hta_python)
    for row in rows:
        diagnose_side(row)
    probes: dict[str, str] = {}
    if python is not None:
        with tempfile.TemporaryDirectory(prefix="compare_hta_") as work:
            for row in rows:
                print(f"HTA: {row.label} ...", file=sys.stderr)
                result = run_hta(python, row.path, Path(work), args.timeout)
                probes = probes or result.get("probes", {})
                hta_side(row, result)
    versions: dict[str, str] = next(
        (r.hta_result["versions"] for r in rows if "versions" in r.hta_result), {}
    )
    if python is None:
        print(
            f"HTA not found ({args.hta_python or DEFAULT_HTA_PYTHON} cannot import "
            "hta.trace_analysis): diagnose's columns only."
        )
    else:
        print(
            f"HTA {versions.get('hta', '?')} (pandas {versions.get('pandas', '?')}) at {python}."
            " Shares of each tool's own window: diagnose's steps, HTA's first-to-last GPU event."
        )
    print_table(rows, with_hta=python is not None)
    if python is not None:
        print()
        print("Known differences:")
        for item in known_differences(rows, probes):
            print(textwrap.fill(item, width=100, initial_indent="- ", subsequent_indent="  "))
    return 0


def collect(folder: Path, files: list[Path]) -> list[Row]:
    found: list[Row] = []
    if folder.is_dir():
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.name.endswith((".json", ".json.gz")):
                found.append(Row(_strip(path.relative_to(folder).as_posix()), path))
    for path in files:
        found.append(Row(_strip(path.name), path))
    return found


def print_table(rows: list[Row], *, with_hta: bool) -> None:
    """One row per trace; without HTA, diagnose's columns alone."""
    header = ["trace"]
    for title in ("idle", "compute", "comm", "memory"):
        header += [f"diag {title} %", f"HTA {title} %"] if with_hta else [f"diag {title} %"]
    header.append("notes")
    table = [header]
    for row in rows:
        cells = [row.label]
        for key in ("idle", *_KINDS):
            cells.append(_pct(row.diag.get(key)))
            if with_hta:
                cells.append(_pct(row.hta.get(key)))
        table.append([*cells, "; ".join(row.notes)])
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for i, cells in enumerate(table):
        line = [
            c.ljust(w) if j == 0 else c.rjust(w)
            for j, (c, w) in enumerate(zip(cells[:-1], widths, strict=True))
        ]
        print(" | ".join([*line, cells[-1]]).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)


def known_differences(rows: list[Row], probes: dict[str, str]) -> list[str]:
    """Each difference, with the traces of the table it shows on (left out where none does)."""
    items: list[str] = []
    read = [r for r in rows if r.hta_window_s is not None and r.diag_window_s]
    gaps = sorted(
        (r for r in read if r.hta_window_s and r.diag_window_s),
        key=lambda r: -abs((r.diag_window_s or 1) / (r.hta_window_s or 1) - 1),
    )
    gaps = [r for r in gaps if abs((r.diag_window_s or 1) / (r.hta_window_s or 1) - 1) > 0.1]
    cut = [r.label for r in read if r.hta_result.get("profiler_step_names", 0) >= 2]
    if read:
        shown = ", ".join(
            f"{r.label} diagnose {r.diag_window} {_duration((r.diag_window_s or 0) * 1e6)} vs HTA"
            f" {_duration((r.hta_window_s or 0) * 1e6)}"
            for r in gaps[:4]
        )
        items.append(
            "Time window. HTA's shares are of the span from its first GPU event's start to its "
            "last one's end (get_temporal_breakdown: kernel_time = that span, idle = span minus "
            "the union of GPU events), not of steps; when a trace holds two or more ProfilerStep "
            "names, TraceAnalysis first keeps only GPU events whose launch (matched by "
            "correlation) began before the last ProfilerStep started, dropping also GPU events "
            "whose launch is not in the trace. diagnose's shares are of its step windows "
            "(ProfilerStep ranges, else optimizer step to optimizer step, else the extent of "
            "the whole trace, host events included). "
            + (f"HTA cut the last step on {', '.join(cut)}. " if cut else "")
            + (f"Windows differing by over 10%: {shown}." if gaps else "")
        )
    extra = [(r.label, _extra_by_category(r.hta_result)) for r in rows]
    extra = [(label, e) for label, e in extra if e]
    unannotated = sum(r.hta_result.get("annotations_without_stream", 0) for r in rows)
    if extra or unannotated:
        listed = "; ".join(f"{label}: {', '.join(e)}" for label, e in extra)
        items.append(
            "What counts as GPU work. HTA takes every event whose args carry a stream other than "
            "-1, whatever its category; diagnose reads only kernel, memcpy and memset events. "
            + (f"HTA counts in addition: {listed}. " if extra else "")
            + (
                f"The {unannotated} gpu_user_annotation events HTA read here carry no stream, "
                "so neither tool counts them."
                if unannotated
                else ""
            )
        )
    triton = [(r, _triton_launch_us(r.hta_result)) for r in rows]
    triton = [(r, us) for r, us in triton if us]
    if triton:
        shown = ", ".join(
            f"{r.label} {_duration(us)} of launch ranges"
            + (f" against {_duration(r.diag_busy_s * 1e6)} of kernels" if r.diag_busy_s else "")
            for r, us in triton
        )
        items.append(
            "Triton launches. torch.compile's CPU-side range around each Triton launch (a cpu_op "
            "named after the kernel, with args.stream) is a GPU event to HTA, typed COMPUTATION: "
            f"{shown}: HTA's compute share includes that CPU time, and its idle share loses it."
        )
    disagree = {r.label: kind_disagreements(r.hta_result) for r in rows}
    disagree = {k: v for k, v in disagree.items() if v}
    probe_text = ", ".join(
        f"{name.split('<')[0]}: HTA {kind}, diagnose {_diagnose_class(name)}"
        for name, kind in probes.items()
    )
    if probes or disagree:
        found = "; ".join(
            f"{label}: "
            + ", ".join(
                f"{n} names {_duration(us)} HTA {h} vs diagnose {d}"
                for (h, d), (n, us) in v.items()
            )
            for label, v in disagree.items()
        )
        items.append(
            "Kernel kinds. HTA types by name alone: COMMUNICATION = ^nccl.*Kernel, MEMORY = "
            "^Memcpy|^Memset|^dma, OTHER = other names containing Sync or Memcpy (busy time, "
            "in no kind), COMPUTATION = the rest; diagnose types copies and memsets by event "
            "category and collectives by name. "
            + (
                f"On the traces read they differ on: {found}. "
                if disagree
                else "On every kernel, copy and memset HTA read here they agree. "
            )
            + (f"Asked of both directly: {probe_text}." if probe_text else "")
        )
    overlap = [
        f"{r.label} ({_duration(_overlap_us(r.hta_result))})"
        for r in rows
        if any(" overlapping " in k for k in r.hta_result.get("kinds", {}))
    ]
    items.append(
        "Overlap. Both count each busy instant once. HTA compute here is get_temporal_breakdown's "
        "compute_time (merged COMPUTATION intervals); comm and memory are get_gpu_kernel_breakdown "
        "rows (times exactly that set of kinds ran), an 'X overlapping Y' row going to the first "
        "of computation > memory > communication as in diagnose. That breakdown's own "
        "'percentage' is of the summed kind time, not of the span, so it is not shown. "
        + (f"Overlap rows appear on {', '.join(overlap)}." if overlap else "")
    )
    rounded = sorted(
        (r for r in rows if r.hta_result.get("rounding", {}).get("trimmed_us", 0) > 0),
        key=lambda r: -r.hta_result["rounding"]["trimmed_us"] / ((r.hta_window_s or 1) * 1e6),
    )
    if rounded:
        shown = ", ".join(
            f"{r.label} {_duration(r.hta_result['rounding']['trimmed_us'])} off "
            f"{r.hta_result['rounding']['events']} events"
            + (f" ({_pct(_trim_share(r))}% of HTA's span)" if _trim_share(r) else "")
            for r in rounded[:3]
        )
        top = rounded[0]
        if top.hta.get("idle") is not None and top.diag.get("idle") is not None:
            shown += (
                f"; on {top.label} HTA's idle share is {_pct(top.hta['idle'])}%, diagnose's "
                f"{_pct(top.diag['idle'])}%"
            )
        items.append(
            "Timestamps. On traces with fractional (ns) timestamps HTA rounds each event's start "
            "up and its end down to whole microseconds (round_down_time_stamps), so short "
            f"kernels lose up to 1 us each: most trimmed here {shown}. That lowers HTA's busy "
            "shares and raises its idle share."
        )
    failed = [r for r in rows if "error" in r.hta_result]
    if failed:
        items.append(
            "HTA failures. "
            + "; ".join(
                f"{r.label}: {_clip(r.hta_result['error'], 150)}"
                + (" (it read no GPU events)" if r.hta_result.get("events") == [] else "")
                for r in failed
            )
            + "."
            + (
                " The dtype errors: transform_correlation_to_index writes row indices into "
                "index_correlation, a column made from the correlation ids downcast to the "
                "smallest integer type; pandas 3 raises where pandas 2 warned and upcast "
                "(PDEP-6)."
                if any("for dtype 'int" in r.hta_result["error"] for r in failed)
                else ""
            )
        )
    return items


def _extra_by_category(result: dict[str, Any]) -> list[str]:
    """Per category diagnose does not read: how many events HTA counted, their time, and the
    kind HTA gave them by name."""
    per_cat: dict[str, list[Any]] = {}
    for cat, name, kind, n, us in result.get("events", []):
        if cat in _DEVICE_CATEGORIES:
            continue
        entry = per_cat.setdefault(cat, [0, 0.0, defaultdict(set)])
        entry[0] += n
        entry[1] += us
        entry[2][kind].add(_clip(name, 32))
    out = []
    for cat, (n, us, kinds) in sorted(per_cat.items()):
        typed = "; ".join(
            f"{', '.join(sorted(names)[:3])}{', ...' * (len(names) > 3)} as {kind}"
            for kind, names in sorted(kinds.items())
        )
        out.append(f"{n} {cat} event{'s' * (n != 1)}, {_duration(us)} ({typed})")
    return out


def _overlap_us(result: dict[str, Any]) -> float:
    kinds: dict[str, float] = result.get("kinds", {})
    return sum(us for label, us in kinds.items() if " overlapping " in label)


def _triton_launch_us(result: dict[str, Any]) -> float:
    """Microseconds of cpu_op ranges named triton_* that HTA counted as GPU events."""
    return sum(
        float(us)
        for cat, name, _kind, _n, us in result.get("events", [])
        if cat == "cpu_op" and name.startswith("triton")
    )


def _trim_share(row: Row) -> float | None:
    trimmed = row.hta_result.get("rounding", {}).get("trimmed_us", 0.0)
    return trimmed / (row.hta_window_s * 1e6) if row.hta_window_s else None


def _strip(name: str) -> str:
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.2f}"


def _duration(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.0f} us"


if __name__ == "__main__":
    raise SystemExit(main())
