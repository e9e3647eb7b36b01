"""What a run keeps between runs: computed once per key, read back on a hit, a damaged or foreign
entry computed again and rewritten, in the user's cache folder; the memory fit said before a
full-size GPU run is kept so."""

from __future__ import annotations

from pathlib import Path

import pytest

import diagnose.run as run
from diagnose.config import RunConfig
from diagnose.user_cache import cache_root, remembered_text


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "diagnose"


def _counted(calls: list[str], text: str) -> str:
    calls.append(text)
    return text


def test_miss_hit_and_another_key(folder: Path) -> None:
    calls: list[str] = []
    assert remembered_text("kind", {"a": 1}, lambda: _counted(calls, "one")) == "one"
    assert remembered_text("kind", {"a": 1}, lambda: _counted(calls, "other")) == "one"
    assert remembered_text("kind", {"a": 2}, lambda: _counted(calls, "two")) == "two"
    assert calls == ["one", "two"]
    assert len(list((folder / "kind").glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "half", "another key", "not text"])
def test_a_damaged_entry_is_computed_again_and_rewritten(folder: Path, damage: str) -> None:
    calls: list[str] = []
    remembered_text("kind", {"a": 1}, lambda: _counted(calls, "one"))
    [entry] = (folder / "kind").glob("*.json")
    whole = entry.read_text()
    damaged = {
        "garbage": "\x00not json",
        "half": whole[: len(whole) // 2],
        "another key": whole.replace('\\"a\\": 1', '\\"a\\": 3'),
        "not text": whole.replace('"value": "one"', '"value": 5'),
    }[damage]
    assert damaged != whole
    entry.write_text(damaged)
    assert remembered_text("kind", {"a": 1}, lambda: _counted(calls, "one again")) == "one again"
    assert calls == ["one", "one again"] and entry.read_text() != damaged
    assert remembered_text("kind", {"a": 1}, lambda: _counted(calls, "third")) == "one again"


def test_the_folder_is_the_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "diagnose"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "diagnose"


def test_the_memory_fit_is_counted_once_per_configuration_and_memory(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted: list[tuple[str | None, int]] = []

    def fit_line(config: RunConfig, memory_bytes: int) -> str:
        counted.append((config.base, memory_bytes))
        return f"needs more than {memory_bytes}"

    monkeypatch.setattr(run, "_fit_line", fit_line)
    sd15 = RunConfig(preset="sd15", size="full")
    assert run.fit_before_running(sd15, "cuda", 8 << 30) == f"needs more than {8 << 30}"
    assert run.fit_before_running(sd15, "cuda", 8 << 30) == f"needs more than {8 << 30}"
    run.fit_before_running(sd15, "cuda", 16 << 30)
    run.fit_before_running(RunConfig(preset="sd15", size="full", base="nf4"), "cuda", 8 << 30)
    assert run.fit_before_running(sd15, "cpu", 8 << 30) == ""  # nothing to fit on a CPU
    assert counted == [(None, 8 << 30), (None, 16 << 30), ("nf4", 8 << 30)]
