"""py-spy's output as the data-loading probe reads it: the recorded real samples of a loader
decoding on the main process and in two workers, the raw format, the frame categories, and
py-spy missing or failing (the probe end to end is ``test_dataloader_probe.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnose import sampling
from tests.conftest import FIXTURES

HERE = FIXTURES / "dataloader"
HAVE_PY_SPY = sampling.find_py_spy() is not None


def _profile(name: str) -> sampling.StackProfile:
    stacks = sampling.parse_raw((HERE / name).read_text(encoding="utf-8"))
    return sampling.summarize(stacks, keep=sampling.is_loader_work, top=8)


def test_recorded_single_process_loader_decodes_on_the_main_process() -> None:
    profile = _profile("pyspy_loader_workers0.txt")
    assert profile.samples_by_role == {"main": profile.samples}
    assert profile.dropped > 0  # interpreter start-up and imports are left out
    functions = {f.function: f for f in profile.top_frames}
    assert "ImageFile.load" in functions and "Image.resize" in functions
    assert functions["ImageFile.load"].category == "image decode"
    assert functions["ImageFile.load"].called_from.startswith(
        "load_image (diagnose/workload/data.py"
    )
    assert profile.categories["image decode"] > 0.2


def test_recorded_worker_loader_decodes_in_two_workers() -> None:
    profile = _profile("pyspy_loader_workers2.txt")
    assert profile.processes_by_role["worker"] == 2
    assert profile.samples_by_role["worker"] > 5 * profile.samples_by_role.get("main", 0)
    top = profile.top_frames[0]
    assert top.function == "ImageFile.load" and set(top.by_role) == {"worker"}
    assert profile.busy_categories["image decode"] > profile.busy_categories.get("other", 0)
    assert all(f.category != "waiting" for f in profile.top_frames)


def test_parse_raw_reads_processes_frames_and_counts() -> None:
    text = (
        'process 7:"python x.py";process 9:"python x.py";main (x.py:3);'
        "ImageFile.load (PIL/ImageFile.py:296) 12\n"
        "garbage line without count\n"
        "\n"
        "<module> (x.py) 3\n"
    )
    stacks = sampling.parse_raw(text)
    assert [s.count for s in stacks] == [12, 3]
    assert stacks[0].process == "9" and stacks[0].command == "python x.py"
    assert stacks[0].frames[-1] == sampling.Frame("ImageFile.load", "PIL/ImageFile.py", 296)
    assert stacks[1].frames[0] == sampling.Frame("<module>", "x.py", None)
    assert sampling.Frame("load_image", "mine/data.py", 3).is_library is False
    assert sampling.Frame("Image.resize", "PIL/Image.py", 1).is_library is True
    assert sampling.Frame("wait", "threading.py", 1).is_library is True


@pytest.mark.parametrize(
    ("function", "file", "category"),
    [
        ("ImageFile.load", "PIL/ImageFile.py", "image decode"),
        ("JpegImageFile.draft", "PIL/JpegImagePlugin.py", "image decode"),
        ("Image.resize", "PIL/Image.py", "image resize / crop / flip"),
        ("Image.convert", "PIL/Image.py", "colour convert"),
        ("Condition.wait", "threading.py", "waiting"),
        ("Connection._recv", "multiprocessing/connection.py", "waiting"),
        ("Encoder.forward", "diffusers/models/autoencoders/vae.py", "VAE / model on the CPU"),
        ("default_collate", "torch/utils/data/_utils/collate.py", "batch collate / transfer"),
        ("load_image", "diagnose/workload/data.py", "other"),
    ],
)
def test_categories(function: str, file: str, category: str) -> None:
    assert sampling.categorize(sampling.Frame(function, file, 1)) == category


def test_py_spy_missing_or_failing_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    assert sampling.find_py_spy(path=str(tmp_path)) is None
    missing = sampling.record(["true"], tmp_path / "out.txt", py_spy=str(tmp_path / "no-py-spy"))
    assert not missing.ok and "could not be started" in missing.reason
    if HAVE_PY_SPY:
        failing = sampling.record(["/nonexistent/python"], tmp_path / "out.txt")
        assert not failing.ok and failing.reason.startswith("py-spy recorded nothing")
