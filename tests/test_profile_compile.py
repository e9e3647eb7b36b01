"""torch.compile that keeps compiling while ``diagnose profile`` times the steps: a loop whose
input shape changes every step (dynamic shapes off) recompiles in each timed step, and the
report says the s/it holds compilation; its twin, with one fixed shape, compiles once in its
warm-up and stays quiet."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from diagnose.cli import main

FINDING = "compute.compiled_during_steps"
TRAIN = textwrap.dedent(
    """
    import sys
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
    compiled = torch.compile(model, backend="eager", dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    changing = "--changing-shapes" in sys.argv
    for step in range(12):
        rows = 8 + step if changing else 8
        x = torch.randn(rows, 32)
        loss = (compiled(x) - x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print("trained")
    """
)


def _profile(folder: Path, *options: str) -> dict[str, Any]:
    script = folder / "train.py"
    script.write_text(TRAIN)
    out = folder / "out"
    code = main(
        [
            "profile",
            "--out",
            str(out),
            "--skip-steps",
            "2",
            "--steps",
            "4",
            "--profile-steps",
            "2",
            "--no-stacks",
            "--",
            sys.executable,
            str(script),
            *options,
        ]
    )
    assert code == 0
    return json.loads((out / "record.json").read_text())  # type: ignore[no-any-return]


def _check(record: dict[str, Any]) -> dict[str, Any]:
    capture = next(p for p in record["probes"] if p["name"] == "capture")
    return next(c for c in capture["checks"] if c["id"] == FINDING)


@pytest.mark.parametrize("changing", [True, False])
def test_recompiling_in_the_timed_steps_is_found_and_its_twin_stays_quiet(
    tmp_path: Path, changing: bool
) -> None:
    record = _profile(tmp_path, *(["--changing-shapes"] if changing else []))
    check = _check(record)
    found = [f for f in record["findings"] if f["id"] == FINDING]
    if changing:
        assert check["outcome"] == "finding", check
        (finding,) = found
        # A new shape in each of the 4 timed steps, each compiled once.
        assert finding["evidence"]["compiled_frames_during_timed_steps"] >= 4
        assert finding["severity"] == "warn"
        assert "TORCH_LOGS=recompiles" in finding["fix"]
    else:
        assert check["outcome"] == "ok", check
        assert "nothing was compiled during the 4 timed steps" in check["text"]
        assert not found
