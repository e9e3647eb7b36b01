"""The profiled process's own py-spy (stack_sampler.py) and the reading of what it left.

Real py-spy on real child processes; the capture end to end is in test_profile_command.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diagnose.profile.stacks import read_stacks
from diagnose.sampling import find_py_spy

SAMPLER = Path(__file__).resolve().parent.parent / "diagnose" / "profile" / "stack_sampler.py"

# A process that samples itself while it spins in one function, and prints the sampler's facts.
PROGRAM = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    spec = importlib.util.spec_from_file_location("sampler", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def spin_here(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    sampler = module.StackSampler(sys.argv[2], sys.argv[3])
    sampler.start()
    spin_here(float(sys.argv[4]))
    print(json.dumps(sampler.stop()))
    """
)


def _sample(tmp_path: Path, py_spy: str, seconds: float) -> tuple[dict[str, object], Path]:
    program = tmp_path / "spinner.py"
    program.write_text(PROGRAM)
    output = tmp_path / "rank0.pyspy.txt"
    done = subprocess.run(
        [sys.executable, str(program), str(SAMPLER), py_spy, str(output), str(seconds)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout), output


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_a_process_samples_itself_and_the_spinning_function_leads(tmp_path: Path) -> None:
    py_spy = find_py_spy()
    assert py_spy is not None
    facts, _ = _sample(tmp_path, py_spy, 1.5)
    assert "error" not in facts and facts["exit_code"] == 0, facts
    summary = read_stacks({"stacks": facts}, tmp_path)
    assert summary is not None and "error" not in summary
    top = summary["all"]["top_frames"][0]
    assert top["function"] == "spin_here" and top["file"] == "spinner.py"
    assert top["share"] > 0.8 and summary["all"]["samples"] >= 50
    assert summary["loading"]["samples"] == 0  # no DataLoader anywhere
    assert not (tmp_path / "rank0.pyspy.txt.log").exists()  # py-spy's chatter is not left


def test_a_sampler_that_cannot_start_says_why_and_the_program_runs_on(tmp_path: Path) -> None:
    facts, _ = _sample(tmp_path, str(tmp_path / "no-such-py-spy"), 0.1)
    assert facts["exit_code"] != 0 and facts["error"] == "py-spy wrote no samples"
    summary = read_stacks({"stacks": facts}, tmp_path)
    assert summary is not None and summary["error"].startswith("py-spy wrote no samples")
    assert "all" not in summary


def test_a_capture_without_sampling_has_no_stacks(tmp_path: Path) -> None:
    assert read_stacks({"stacks": None}, tmp_path) is None
