"""GPU telemetry of a profiled command: sampled by the parent for the GPU each rank names, cut to
each rank's timed steps, and recorded where the environment rules read it.

No GPU here: the rank files are written as the capture writes them, and the driver is played by
the recorded NVML values of ``fixtures/telemetry/`` (the Replay backend of test_telemetry.py). The
CPU half runs for real through ``diagnose profile`` (test_profile_command.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from diagnose.profile.capture_contract import FACTS_SUFFIX, STATUS_COMPLETE, STATUS_RUNNING
from diagnose.profile.device_telemetry import CommandTelemetry, rank_telemetry
from diagnose.profile.launch import LaunchResult, RankCapture
from diagnose.profile.record import profile_record
from diagnose.record import DeviceInfo
from diagnose.telemetry import TelemetrySampler
from tests.test_telemetry import Replay, fixture

GPU = {
    "kind": "cuda",
    "type": "cuda",
    "index": 0,
    "name": "NVIDIA GeForce RTX 3090",
    "pci_domain_id": 0,
    "pci_bus_id": 1,
    "pci_device_id": 0,
}


def _write(folder: Path, facts: dict[str, Any]) -> Path:
    path = folder / f"rank0{FACTS_SUFFIX}"
    path.write_text(json.dumps(facts))
    return path


def _captured(tmp_path: Path) -> tuple[dict[str, Any], CommandTelemetry, list[DeviceInfo]]:
    """A rank that steps, times its steps and finishes, watched as `diagnose profile` does."""
    opened: list[DeviceInfo] = []
    backend = Replay(fixture("nvml_rtx3090_thermal"))

    def sampler(info: DeviceInfo) -> TelemetrySampler:
        opened.append(info)
        return TelemetrySampler(info, interval_s=0.01, opener=lambda _: backend)

    watcher = CommandTelemetry(tmp_path, sampler)
    facts: dict[str, Any] = {"status": STATUS_RUNNING, "device": GPU}
    _write(tmp_path, facts)
    watcher.poll()  # the first step: the GPU is named, sampling starts
    time.sleep(0.1)  # skipped steps
    facts["timed_started_unix"] = time.time()
    time.sleep(0.2)
    facts["timed_ended_unix"] = time.time()
    time.sleep(0.1)  # probe and profiled steps
    watcher.poll()
    facts["status"] = STATUS_COMPLETE
    _write(tmp_path, facts)
    watcher.poll()  # every rank is final: sampling stops, the training after it is not ours
    return facts, watcher, opened


def test_the_gpu_a_rank_names_is_sampled_and_cut_to_its_timed_steps(tmp_path: Path) -> None:
    facts, watcher, opened = _captured(tmp_path)
    (info,) = opened
    assert info.kind == "cuda" and info.extra["pci_bus_id"] == "0000:01:00.0"
    windows = watcher.finish()
    assert list(windows) == ["cuda:0"]
    whole = windows["cuda:0"].summary
    steps = rank_telemetry(facts, windows)
    assert steps.available and 0 < len(steps.samples) < len(whole.samples)
    start = facts["timed_started_unix"] - windows["cuda:0"].started_unix
    end = facts["timed_ended_unix"] - windows["cuda:0"].started_unix
    assert all(start <= s.t <= end for s in steps.samples)
    assert steps.stats.n == len(steps.samples)
    # Sampling stopped when the rank's facts were final, not when finish() was called.
    time.sleep(0.05)
    assert len(watcher.finish()["cuda:0"].summary.samples) == len(whole.samples)


def test_the_record_holds_the_timed_steps_telemetry_where_the_rules_read_it(
    tmp_path: Path,
) -> None:
    facts, watcher, _ = _captured(tmp_path)
    facts.update(timed_step_s=[0.05, 0.05, 0.05], profiled_step_s=[], steps_seen=5)
    capture = RankCapture(
        rank=0,
        pid=1,
        status=STATUS_COMPLETE,
        facts_path=tmp_path / f"rank0{FACTS_SUFFIX}",
        trace_path=None,
        facts=facts,
    )
    result = LaunchResult(
        command=("python", "train.py"),
        returncode=0,
        captures=[capture],
        processes=[],
        timed_out=False,
        message=None,
        seconds=1.0,
        telemetry=watcher.finish(),
    )
    record = profile_record(result)
    during = record.inventory["telemetry"]["during_steps"]
    assert during["available"] and during["backend"] == "nvml"
    assert during["stats"]["n"] == len(during["samples"]) > 0
    rank = next(p for p in record.probes if p.name == "capture").data["ranks"]["0"]
    assert rank["telemetry"]["stats"] == during["stats"] and "samples" not in rank["telemetry"]


def test_a_rank_on_the_cpu_or_a_gpu_never_seen_says_why_there_is_no_telemetry() -> None:
    cpu = rank_telemetry({"device": {"kind": "cpu"}}, {})
    assert not cpu.available and cpu.reason == "no GPU telemetry for a cpu device"
    unseen = rank_telemetry({"device": GPU}, {})
    assert not unseen.available and "cuda:0 was not sampled" in unseen.reason
