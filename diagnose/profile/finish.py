"""From a finished capture to the outputs of ``diagnose profile``: the traces moved into the output
folder, the record built and completed by the probes that need only the device, the record and
the report written (as ``diagnose run`` writes them)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from diagnose.output import TRACE_NAME, note_created
from diagnose.profile.capture_contract import TRACE_SUFFIX
from diagnose.profile.launch import LaunchResult
from diagnose.record import RunRecord

if TYPE_CHECKING:
    import torch

    from diagnose.finish import RunOutputs

#: Where the rank traces of a multi-process command go inside the output folder.
RANK_TRACES_FOLDER = "traces"
#: The probes that can run from a capture: they need the device, not diagnose's own workload.
PROFILE_PROBES = ("environment", "roofline")


def _keep_traces(result: LaunchResult, out_dir: Path) -> tuple[LaunchResult, Path | None]:
    """Move the traces out of the capture folder: one as ``trace.json.gz`` beside the record
    (as `diagnose run` leaves it), several into ``traces/`` (a folder `diagnose trace` reads)."""
    traced = [c for c in result.captures if c.trace_path is not None and c.trace_path.is_file()]
    if not traced:
        return result, None
    moved: dict[int, Path] = {}
    folder = out_dir / RANK_TRACES_FOLDER
    if len(traced) == 1:
        target = out_dir / TRACE_NAME
        shutil.move(str(traced[0].trace_path), target)
        note_created(target)
        moved[traced[0].pid] = target
        where: Path | None = target
        _remove_earlier_rank_traces(folder, keep=set())
    else:
        _remove_earlier_rank_traces(
            folder, keep={c.trace_path.name for c in traced if c.trace_path is not None}
        )
        if not folder.exists():
            folder.mkdir()
            note_created(folder)
        (out_dir / TRACE_NAME).unlink(missing_ok=True)
        for capture in traced:
            assert capture.trace_path is not None
            target = folder / capture.trace_path.name
            shutil.move(str(capture.trace_path), target)
            note_created(target)
            moved[capture.pid] = target
        where = folder
    captures = [
        dataclasses.replace(c, trace_path=moved.get(c.pid, c.trace_path)) for c in result.captures
    ]
    kept = dataclasses.replace(result, captures=captures)
    return kept, where


def _keep_separate_traces(result: LaunchResult, out_dir: Path) -> LaunchResult:
    """The traces of processes that are captures of their own (:attr:`LaunchResult.separate`)
    go beside the record as ``trace-pid<pid>.json.gz``: each a trace `diagnose trace` reads."""
    kept = []
    for capture in result.separate:
        if capture.trace_path is not None and capture.trace_path.is_file():
            target = out_dir / f"trace-pid{capture.pid}.json.gz"
            shutil.move(str(capture.trace_path), target)
            note_created(target)
            capture = dataclasses.replace(capture, trace_path=target)
        kept.append(capture)
    return dataclasses.replace(result, separate=kept)


def _remove_earlier_rank_traces(folder: Path, *, keep: set[str]) -> None:
    """An earlier profile's rank traces (``--force`` into its folder) that this one does not
    replace: left there, ``diagnose trace`` of the folder would read ranks this job never had.
    Only files of the capture's own naming go; anything else in the folder stays."""
    if not folder.is_dir():
        return
    for path in folder.glob(f"rank*{TRACE_SUFFIX}"):
        if path.name not in keep and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when that left it empty


def _same_python(record: RunRecord) -> bool:
    """Whether the command's processes ran this interpreter: only then does this process's
    inventory describe their packages."""
    capture = next((p for p in record.probes if p.name == "capture"), None)
    ranks = (capture.data.get("ranks") or {}) if capture is not None else {}
    executables = {str(f.get("executable") or "") for f in ranks.values()}
    here = os.path.realpath(sys.executable)
    return bool(executables) and all(os.path.realpath(e) == here for e in executables if e)


def _device_probes(record: RunRecord) -> tuple[torch.device, str]:
    """The environment doctor and the measured peak, on this machine's device (the command has
    ended: nothing of the user's runs on it any more)."""
    from diagnose.config import RunConfig
    from diagnose.device import describe_device, select_device
    from diagnose.inventory import collect_inventory
    from diagnose.probes.base import ProbeContext, run_probes
    from diagnose.probes.registry import REGISTRY
    from diagnose.profile.record import claimed_precision_of

    device = select_device("auto")
    device_info = describe_device(device)
    if record.device.kind in ("", "unknown"):
        record.device = device_info
    if _same_python(record):
        trace_fields = record.inventory.get("trace")
        during_steps = (record.inventory.get("telemetry") or {}).get("during_steps")
        record.inventory = collect_inventory(device_info.kind)
        if trace_fields:
            record.inventory["trace"] = trace_fields
        if during_steps:
            record.inventory.setdefault("telemetry", {})["during_steps"] = during_steps
    else:
        record.notes.append(
            "The command ran another Python than diagnose: the package inventory is not its own "
            "and was left out."
        )
    config = RunConfig(device=str(device), precision=claimed_precision_of(record))
    ctx = ProbeContext(config=config, device=device, device_info=device_info, record=record)
    chosen = [p for p in REGISTRY if p.name in PROFILE_PROBES]
    record.probes.extend(run_probes(chosen, ctx))
    return device, device_info.kind


def _measure_attention(record: RunRecord, device: torch.device, kind: str) -> None:
    """The trace's math-path estimate, measured here when this is the machine and the torch the
    command trained with."""
    import torch

    from diagnose.profile.attention_ab import measure_math_fallback

    here = _same_python(record) and record.device.kind == kind
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    measure_math_fallback(
        record,
        device,
        sync,
        not_here=""
        if here
        else ("the command ran another Python or device than diagnose, whose kernels may differ"),
    )


def finish_profile(
    result: LaunchResult,
    out_dir: Path,
    *,
    redact_paths: bool,
    amend: Callable[[RunRecord], None] | None = None,
) -> RunOutputs:
    """Write record.json, report.html and the traces of a capture into ``out_dir``; ``amend``
    adds what was gathered beside the capture (strict mode's logs) to the record."""
    from diagnose.finish import finish_run, redact_own_trace
    from diagnose.profile.record import profile_record

    result, traces = _keep_traces(_keep_separate_traces(result, out_dir), out_dir)
    record = profile_record(result)
    if amend is not None:
        amend(record)
    if traces is not None:
        record.trace_path = traces.name
    device, kind = _device_probes(record)
    _measure_attention(record, device, kind)
    if redact_paths:
        own = [] if traces is None else [traces] if traces.is_file() else sorted(traces.iterdir())
        separate = [c.trace_path for c in result.separate if c.trace_path is not None]
        for trace in [*own, *separate]:
            redact_own_trace(trace, record)
    return finish_run(
        record,
        out_dir,
        traces if traces is not None and traces.is_file() else None,
        redact_paths=redact_paths,
        say=lambda message: None,
    )


__all__ = ["PROFILE_PROBES", "RANK_TRACES_FOLDER", "finish_profile"]
