"""``diagnose profile``'s capture layer: run the user's unmodified training command with a
bootstrap injected into every Python process, and collect per-process step timings, a profiler
trace and facts (see :mod:`diagnose.profile.launch` and :mod:`diagnose.profile.capture`)."""

from diagnose.profile.launch import (
    BOOTSTRAP_DIR,
    CaptureOptions,
    LaunchResult,
    ProcessSeen,
    RankCapture,
    capture_environment,
    launch_profiled,
    read_captures,
    read_processes,
)

__all__ = [
    "BOOTSTRAP_DIR",
    "CaptureOptions",
    "LaunchResult",
    "ProcessSeen",
    "RankCapture",
    "capture_environment",
    "launch_profiled",
    "read_captures",
    "read_processes",
]
