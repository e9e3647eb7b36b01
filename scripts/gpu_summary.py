"""summary.md of a scripts/gpu_check call: what held and what did not, read from what it wrote.

    python scripts/gpu_summary.py --runs DIR --steps STEPS.tsv --out OUT --device DEVICE
                                  --elapsed S [--max-files N] [--max-bytes B]

Reads each step's exit status and seconds (STEPS.tsv: name, status, milliseconds), the runs'
records (DIR/run1, run2, quant: stage times, probes' statuses, findings), DIR/gate.md, the faults'
rows (DIR/faults.json) and OUT/triton.json; writes OUT/summary.md. Exit status 0, whatever held:
the summary is the verdict.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

#: What the issue asks of a default GPU run and of its probes together, in seconds.
RUN_SECONDS = 60.0
PROBES_SECONDS = 30.0
#: An estimate within this factor of the measured saving counts as right.
RATIO_RANGE = (0.5, 2.0)
RUNS = ("run1", "run2", "quant")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _steps(path: Path) -> dict[str, tuple[int, float]]:
    steps = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            name, rc, ms = line.split("\t")
            steps[name] = (int(rc), int(ms) / 1e3)
    return steps


def _mark(held: bool | None) -> str:
    return {True: "held", False: "**did not hold**", None: "not judged"}[held]


def _stage_times(record: dict[str, Any]) -> str:
    stages = record.get("wall_seconds") or {}
    probes = sum(v for k, v in stages.items() if k.startswith("probe "))
    parts = [f"{k} {v:.2f} s" for k, v in stages.items() if not k.startswith("probe ")]
    slow = sorted(((v, k[6:]) for k, v in stages.items() if k.startswith("probe ")), reverse=True)
    inside = ", ".join(f"{name} {v:.2f} s" for v, name in slow)
    return " · ".join(parts) + f" · probes {probes:.2f} s ({inside})"


def summarise(args: argparse.Namespace) -> str:
    runs: Path = args.runs
    out: Path = args.out
    steps = _steps(args.steps)
    on_gpu = args.device != "cpu"
    held: list[tuple[str, bool | None, str]] = []
    lines = ["# gpu_check summary", ""]
    records = {name: _json(runs / name / "record.json") for name in RUNS}
    torch_version = next(
        (
            r.get("device", {}).get("extra", {}).get("torch")
            for r in records.values()
            if isinstance(r, dict)
        ),
        None,
    )
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        pass
    lines += [
        f"device: {args.device} · torch {torch_version} · the whole check {args.elapsed:.0f} s",
        "",
    ]
    for name, (rc, seconds) in steps.items():
        held.append((f"step {name} ran (exit {rc}, {seconds:.1f} s)", rc in (0, 6, 9), ""))
    held.append(("the check within 8 minutes", args.elapsed <= 480, f"{args.elapsed:.0f} s"))

    triton = _json(out / "triton.json")
    if isinstance(triton, dict):
        counts = triton.get("counts", {})
        text = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        text += f"; {len(triton.get('seeds') or [])} of {args.triton_seeds} seeds"
        text += "".join(f"; {note}" for note in triton.get("notes") or [])
        held.append(("diagnose triton: no mismatch", not counts.get("mismatch"), text))
    else:
        held.append(("diagnose triton wrote triton.json", False, ""))

    for name, record in records.items():
        if not isinstance(record, dict):
            held.append((f"{name} wrote its record", False, ""))
            continue
        probes = record.get("probes", [])
        errors = [p["name"] for p in probes if p.get("status") == "error"]
        held.append((f"{name}: no probe in error", not errors, ", ".join(errors)))
        over = [
            check["text"]
            for probe in probes
            for check in probe.get("checks", [])
            if check.get("id", "").endswith(".time_budget")
        ]
        held.append((f"{name}: every probe within its time budget", not over, "; ".join(over)))
        stages = record.get("wall_seconds") or {}
        total = sum(stages.values())
        probe_total = sum(v for k, v in stages.items() if k.startswith("probe "))
        if name == "run1":
            judged = on_gpu and args.size_full
            held.append(
                (
                    f"{name} within {RUN_SECONDS:.0f} s",
                    total <= RUN_SECONDS if judged else None,
                    f"{total:.1f} s",
                )
            )
            held.append(
                (
                    f"{name}'s probes within {PROBES_SECONDS:.0f} s",
                    probe_total <= PROBES_SECONDS if judged else None,
                    f"{probe_total:.1f} s",
                )
            )
    first, second = records.get("run1"), records.get("run2")
    if isinstance(first, dict) and isinstance(second, dict):
        ids = [sorted({f["id"] for f in r.get("findings", [])}) for r in (first, second)]
        same = ids[0] == ids[1]
        moved = sorted(set(ids[0]) ^ set(ids[1]))
        held.append(("A/A: run2 has run1's findings", same, ", ".join(moved)))
    gate = runs / "gate.md"
    if gate.is_file():
        verdict = re.search(r"\b(PASS|FAIL|INCONCLUSIVE)\b", gate.read_text(encoding="utf-8"))
        word = verdict.group(1) if verdict else "no verdict"
        held.append(("A/A: compare finds no change", word == "PASS" if on_gpu else None, word))

    faults = _json(runs / "faults.json")
    low, high = RATIO_RANGE
    if isinstance(faults, list):
        for row in faults:
            ratio = row.get("ratio")
            right = None if ratio is None else low <= ratio <= high
            found = bool(row.get("found") and row.get("ran"))
            # A CPU has no device to sync with or to starve: a fault missed there is not judged.
            missed = "" if found or on_gpu else "a CPU run proves the loop, not the finding"
            held.append(
                (
                    f"fault {row['fault']}: found",
                    found if found or on_gpu else None,
                    row.get("note", "") or missed,
                )
            )
            held.append((f"fault {row['fault']}: its clean twin quiet", row.get("twin_quiet"), ""))
            if on_gpu:
                held.append(
                    (
                        f"fault {row['fault']}: estimate within {low}-{high}x of measured",
                        right,
                        "" if ratio is None else f"ratio {ratio:.2f}",
                    )
                )
    else:
        held.append(("the planted-fault suite wrote its rows", False, ""))

    lines += ["## What held and what did not", ""]
    lines += [f"- {_mark(ok)}: {what}" + (f" — {why}" if why else "") for what, ok, why in held]
    lines += ["", "## Stage times", ""]
    for name, record in records.items():
        if isinstance(record, dict):
            lines.append(f"- {name}: {_stage_times(record)}")
    lines += ["", "## Probes", ""]
    for name, record in records.items():
        if isinstance(record, dict):
            states = ", ".join(f"{p['name']} {p['status']}" for p in record.get("probes", []))
            lines.append(f"- {name}: {states}")
    faults_md = out / "faults.md"
    if faults_md.is_file():
        lines += ["", "## Planted faults", "", faults_md.read_text(encoding="utf-8").rstrip()]
    lines += ["", "## Outputs", ""]
    for path in sorted(out.iterdir()):
        if path.name != "summary.md":
            lines.append(f"- {path.name}: {path.stat().st_size} bytes")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--size-full", action="store_true", help="the runs were full size")
    parser.add_argument("--elapsed", type=float, default=0.0)
    parser.add_argument("--triton-seeds", type=int, default=1, help="the seeds asked for")
    args = parser.parse_args(argv)
    (args.out / "summary.md").write_text(summarise(args), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
