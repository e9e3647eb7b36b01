"""The corpus's float64 references are kept once computed: a hit is the same reference, a miss
computes it, a corrupted or foreign entry is never trusted, and the folder is the user's cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from diagnose.probes.triton.cases import reference_cache
from diagnose.probes.triton.cases.api import CheckEnv, TritonCase
from diagnose.probes.triton.cases.check import check_seed
from diagnose.probes.triton.cases.loading import load_cases
from diagnose.probes.triton.cases.numerics import Bounded
from diagnose.probes.triton.cases.reference_cache import cache_folder, cached_reference

ENV = CheckEnv("interpreter", "interpreter", "", torch.device("cpu"))


def _matmul() -> TritonCase:
    return next(c for c in load_cases("diagnose.probes.triton.cases.matmul") if c.shapes)


def _check(seed_run: int = 1) -> tuple[TritonCase, dict[str, int], torch.dtype, int, Any]:
    case = _matmul()
    shape, dtype = dict(case.shapes[0]), case.dtypes[0]
    seed = check_seed(seed_run, case.name, shape, dtype)
    inputs = case.make_inputs(shape, dtype, torch.Generator().manual_seed(seed))
    return case, shape, dtype, seed, inputs


def _same(a: dict[str, Bounded], b: dict[str, Bounded]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].value, b[k].value) and torch.equal(a[k].err, b[k].err) for k in a
    )


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each reference the harness really computes, by case name."""
    calls: list[str] = []
    real = reference_cache.reference_of

    def counting(case: TritonCase, *args: Any, **kwargs: Any) -> Any:
        calls.append(case.name)
        return real(case, *args, **kwargs)

    monkeypatch.setattr(reference_cache, "reference_of", counting)
    return calls


def test_miss_then_hit_gives_the_same_reference(tmp_path: Path, computed: list[str]) -> None:
    case, shape, dtype, seed, inputs = _check()
    kwargs: dict[str, Any] = {"shape": shape, "seed": seed, "folder": tmp_path, "min_seconds": 0}
    first, first_how = cached_reference(case, inputs, dtype, ENV, **kwargs)
    assert computed == [case.name] and len(list(tmp_path.glob("*.pt"))) == 1
    again, again_how = cached_reference(case, inputs, dtype, ENV, **kwargs)
    assert computed == [case.name]  # read, not computed
    assert _same(first, again) and first_how == again_how
    direct, _ = reference_cache.reference_of(case, inputs, dtype, ENV)
    assert _same(first, direct)


def test_another_seed_or_rounding_is_a_miss(tmp_path: Path, computed: list[str]) -> None:
    case, shape, dtype, seed, inputs = _check(1)
    cached_reference(
        case, inputs, dtype, ENV, shape=shape, seed=seed, folder=tmp_path, min_seconds=0
    )
    _, _, _, other_seed, other_inputs = _check(2)
    cached_reference(
        case, other_inputs, dtype, ENV, shape=shape, seed=other_seed, folder=tmp_path, min_seconds=0
    )
    device = CheckEnv("device", "cuda", "sm_90", torch.device("cpu"))
    assert reference_cache.entry_key(case, shape, dtype, seed, device) != (
        reference_cache.entry_key(case, shape, dtype, seed, ENV)
    )
    assert computed == [case.name, case.name] and len(list(tmp_path.glob("*.pt"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_damaged_entry_is_computed_again_and_rewritten(
    tmp_path: Path, computed: list[str], damage: str
) -> None:
    case, shape, dtype, seed, inputs = _check()
    kwargs: dict[str, Any] = {"shape": shape, "seed": seed, "folder": tmp_path, "min_seconds": 0}
    first, _ = cached_reference(case, inputs, dtype, ENV, **kwargs)
    [entry] = tmp_path.glob("*.pt")
    whole = entry.read_bytes()
    if damage == "garbage":
        entry.write_bytes(b"not a reference" * 10)
    elif damage == "truncated":
        entry.write_bytes(whole[: len(whole) // 2])
    else:  # a whole entry of another check under this check's name
        _, _, _, other_seed, other_inputs = _check(2)
        other = tmp_path / "other"
        cached_reference(
            case, other_inputs, dtype, ENV, shape=shape, seed=other_seed, folder=other,
            min_seconds=0,
        )  # fmt: skip
        entry.write_bytes(next(other.glob("*.pt")).read_bytes())
    again, _ = cached_reference(case, inputs, dtype, ENV, **kwargs)
    assert computed == [case.name] * (3 if damage == "foreign" else 2)
    assert _same(first, again)
    assert entry.read_bytes() != b"not a reference" * 10 and entry.stat().st_size == len(whole)
    cached_reference(case, inputs, dtype, ENV, **kwargs)
    assert len(computed) == (3 if damage == "foreign" else 2)  # the rewritten entry is a hit


def test_a_quick_reference_is_not_kept_and_the_folder_is_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case, shape, dtype, seed, inputs = _check()
    cached_reference(
        case, inputs, dtype, ENV, shape=shape, seed=seed, folder=tmp_path, min_seconds=3600
    )
    assert not list(tmp_path.glob("*.pt"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "diagnose" / "triton-references"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder() == tmp_path / "home" / ".cache" / "diagnose" / "triton-references"


def test_the_folder_is_kept_under_its_cap_least_recently_used_first(tmp_path: Path) -> None:
    paths = []
    cap = 0
    for run_seed in (1, 2, 3):
        case, shape, dtype, seed, inputs = _check(run_seed)
        cached_reference(
            case, inputs, dtype, ENV, shape=shape, seed=seed, folder=tmp_path, min_seconds=0,
            max_bytes=cap or 1 << 40,
        )  # fmt: skip
        key = reference_cache.entry_key(case, shape, dtype, seed, ENV)
        paths.append(tmp_path / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt")
        os.utime(paths[-1], (1000.0 * run_seed, 1000.0 * run_seed))
        cap = cap or int(2.5 * paths[0].stat().st_size)  # room for two entries
    assert [p.is_file() for p in paths] == [False, True, True]
