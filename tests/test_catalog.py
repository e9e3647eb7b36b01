"""The findings catalog: one entry per id, the findings page's table generated from it, and no
finding made anywhere but through a catalog entry."""

from __future__ import annotations

import re

from diagnose.catalogs import TRAINERS, in_trainers, markdown_table, spec, specs
from diagnose.catalogs.__main__ import BEGIN, END, replace_table
from tests.conftest import REPO_ROOT


def test_findings_page_table_is_the_catalog() -> None:
    page = (REPO_ROOT / "docs" / "findings.md").read_text()
    start = page.index("\n", page.index(BEGIN)) + 1
    table = page[start : page.index(END)].strip()
    assert table == markdown_table(), "run `python -m diagnose.catalogs --write docs/findings.md`"
    assert replace_table(page) == page


def test_every_id_is_in_its_category_and_declared_once() -> None:
    ids = [s.id for s in specs()]
    assert len(ids) == len(set(ids))
    for entry in specs():
        assert entry.id.startswith(entry.category + ".")
        assert entry.meaning and entry.found_by


def test_a_built_finding_carries_what_the_catalog_knows() -> None:
    entry = spec("optimizer.slower_than_alternative")
    assert entry is not None
    finding = entry.build("3 syncs per step", saving=0.2, basis="trace", fix="use fused AdamW")
    assert finding.category == "optimizer" and finding.phases == ["optimizer"]
    assert finding.saving_basis == "trace" and finding.est_seconds_saved_per_it == 0.2
    assert spec("no.such_id") is None


def test_fixes_name_the_trainers_in_one_order() -> None:
    text = in_trainers("Cache the latents", lightning="a", kohya="--cache_latents")
    assert text == "Cache the latents. kohya/sd-scripts: --cache_latents; Lightning: a"
    assert next(iter(TRAINERS)) == "kohya"


def test_findings_are_only_made_from_the_catalog() -> None:
    """A Finding(...) written by hand outside the catalog is an id the findings table and the gate
    do not know about; every probe and rule builds through FindingSpec.build."""
    offenders = []
    for folder in ("diagnose", "probes"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            if path.name == "record.py" or "catalogs" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(?<![\w.])Finding\(", line):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}")
    assert offenders == [], offenders


def test_every_finding_says_what_a_tiny_run_tells_of_the_real_model() -> None:
    """Each concern states, per question, whether a tiny run's answer carries over to the real
    model, is judged at full size, or holds for the tiny model only, and why."""
    from diagnose.catalogs import CARRY_OVER_KINDS

    missing = [s.id for s in specs() if s.at_full_size is None]
    assert missing == [], f"set at_full_size on {missing}"
    for entry in specs():
        assert entry.at_full_size is not None
        assert entry.at_full_size.kind in CARRY_OVER_KINDS
        assert entry.at_full_size.why and "\n" not in entry.at_full_size.why
    # The questions whose probes judge them on the preset's real shapes say so.
    judged = {
        s.id for s in specs() if s.at_full_size and s.at_full_size.kind == "judged at full size"
    }
    assert {"attention.slower_backend", "optimizer.8bit_state_mostly_fp32"} <= judged
