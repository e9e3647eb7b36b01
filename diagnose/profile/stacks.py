"""What py-spy saw of the user's Python during the profiled steps, read into the record.

The capture (``stack_sampler.py``) leaves one file of collapsed stacks per rank. Here they are
ranked by the frame they were running (``diagnose.sampling``), our own frames left out (the probe
step's hooks), and the loading frames (DataLoader workers, and the training thread inside
``torch.utils.data``) ranked apart: those name the code that makes a data-starved step wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diagnose import sampling
from diagnose.catalogs.dataloader_catalog import GPU_STARVED
from diagnose.record import Finding
from diagnose.units import pct

#: Frames shown per ranking.
TOP_FRAMES = 8
#: Fewer samples than this say too little to name a frame (a fraction of a second of sampling).
MIN_SAMPLES = 20
#: Frames below this share of the samples are not named in a finding (one sample of many).
MIN_SHARE = 0.05
#: Where the capture's own code runs in the user's process (the bootstrap and the capture).
_OWN_CODE = ("diagnose/profile/",)
#: Frames of the DataLoader machinery in the training process.
_LOADER_FILES = ("torch/utils/data/",)


def _is_own(frame: sampling.Frame) -> bool:
    return any(own in frame.file.replace("\\", "/") for own in _OWN_CODE)


def _ours(stack: sampling.Stack) -> bool:
    """A sample of the capture's own work: the innermost frame of non-library code is ours (a
    forward hook of the probe step). Our frames nearer the root stay: the DataLoader ``__iter__``
    wrapper is on the stack of every worker it forks, and of the training loop that iterates."""
    for frame in reversed(stack.frames):
        if _is_own(frame):
            return True
        if not frame.is_library:
            return False
    return False


def _theirs(stack: sampling.Stack) -> bool:
    return not _ours(stack)


def is_loading(stack: sampling.Stack) -> bool:
    """A sample of data loading: in a DataLoader worker, or in the DataLoader's code on the
    training thread (``num_workers=0`` loads there)."""
    if _ours(stack):
        return False
    if stack.role == "worker":
        return True
    return any(
        marker in frame.file.replace("\\", "/")
        for frame in stack.frames
        for marker in _LOADER_FILES
    )


def _ranking(profile: sampling.StackProfile, *, loading: bool) -> dict[str, Any]:
    frames = [dataclasses.asdict(f) for f in profile.top_frames]
    if not loading:
        # The categories name data-loading work (decode, resize, collate); on the training
        # thread a torch.nn frame is the model, not a loader's VAE.
        for frame in frames:
            frame.pop("category", None)
    ranking: dict[str, Any] = {
        "samples": profile.samples,
        "samples_by_process": profile.samples_by_role,
        "processes": profile.processes_by_role,
        "top_frames": frames,
    }
    if loading:
        ranking["categories"] = profile.categories
    return ranking


def read_stacks(facts: Mapping[str, Any], folder: Path) -> dict[str, Any] | None:
    """The stacks of one rank, ranked; None when the capture did not sample (no py-spy)."""
    sampled = facts.get("stacks")
    if not isinstance(sampled, Mapping):
        return None
    summary: dict[str, Any] = {
        key: sampled[key] for key in ("tool", "rate_hz", "seconds") if key in sampled
    }
    path = folder / str(sampled.get("file") or "")
    text = ""
    if sampled.get("file") and path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
    stacks = sampling.parse_raw(text)
    if not stacks:
        error = str(sampled.get("error") or "py-spy recorded no sample")
        # py-spy's last words say why (permission denied, the process ended ...).
        printed = [line for line in str(sampled.get("printed") or "").splitlines() if line]
        summary["error"] = f"{error}: {printed[-1].strip()}" if printed else error
        return summary
    everything = sampling.summarize(stacks, keep=_theirs, top=TOP_FRAMES)
    loading = sampling.summarize(stacks, keep=is_loading, top=TOP_FRAMES)
    summary["all"] = _ranking(everything, loading=False)
    summary["loading"] = _ranking(loading, loading=True)
    summary["own_samples_left_out"] = everything.dropped
    if everything.samples < MIN_SAMPLES:
        summary["note"] = (
            f"only {everything.samples} samples in {sampled.get('seconds', '?')} s of sampling: "
            "too few to rank frames"
        )
    return summary


def loading_headline(summary: Mapping[str, Any] | None, top: int = 3) -> str:
    """``__getitem__ (train.py:31) 64%, ...``: the loading frames a reader should look at, or ''
    when too few loading samples were taken."""
    if not summary:
        return ""
    loading = summary.get("loading") or {}
    if int(loading.get("samples") or 0) < MIN_SAMPLES:
        return ""
    frames = [f for f in loading.get("top_frames") or [] if float(f["share"]) >= MIN_SHARE]
    return ", ".join(f"{f['frame']} {pct(float(f['share']))}" for f in frames[:top])


def name_loading_frames(findings: list[Finding], summary: Mapping[str, Any] | None) -> None:
    """A data-starved step: say which loading code py-spy found running."""
    starved = next((f for f in findings if f.id == GPU_STARVED.id), None)
    headline = loading_headline(summary)
    if starved is None or not headline or summary is None:
        return
    loading = summary["loading"]
    starved.evidence = {**starved.evidence, "hot_frames": loading["top_frames"][:5]}
    said = (
        f"Sampled with py-spy during the profiled steps, data loading ran in {headline} "
        f"({loading['samples']} samples)."
    )
    starved.detail = f"{starved.detail} {said}".strip()


__all__ = ["MIN_SAMPLES", "is_loading", "loading_headline", "name_loading_frames", "read_stacks"]
