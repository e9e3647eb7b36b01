"""What a tiny run's record says about the real model (diagnose.carry_over): pure, on records."""

from __future__ import annotations

from diagnose.carry_over import carry_over, shrunk_preset
from diagnose.catalogs import spec
from diagnose.config import RunConfig
from diagnose.record import Check, ProbeResult, RunRecord, new_record
from diagnose.record_io import record_from_dict


def _record(size: str, checks: list[Check], **config: object) -> RunRecord:
    record = new_record("run")
    record.config = {"preset": "sd15", "size": size, "model_dir": None, **config}
    record.probes = [ProbeResult(name="p", checks=checks)]
    return record


CHECKS = [
    Check("dataloader.gpu_starved", "finding", "The step waits 40% for data", "dataloader"),
    Check("attention.math_fallback", "finding", "Attention ran on the math path", "attention"),
    Check("attention.slower_backend", "not_judged", "not judged at full size", "attention"),
    Check("optimizer.8bit_state_mostly_fp32", "ok", "an artefact of the shrunk model", "o"),
    Check("precision.bf16_slower_than_fp32", "not_judged", "fp32 not measured", "precision"),
    Check("attention.benchmark_threads", "not_judged", "1 thread", "attention"),
    Check("attention.flash_attn_package", "ok", "flash_attn: not installed", "attention"),
]


def _kind(check_id: str) -> str:
    entry = spec(check_id)
    assert entry is not None and entry.at_full_size is not None
    return entry.at_full_size.kind


def test_a_tiny_run_sorts_its_verdicts_by_what_carries_over() -> None:
    result = carry_over(_record("tiny", CHECKS))
    assert result is not None and result.preset == "sd15" and result.size == "tiny"
    kinds = {item.check_id: item.kind for item in result.items}
    # Verdicts (findings and found fine) are sorted by their catalog entry's kind...
    assert kinds["dataloader.gpu_starved"] == _kind("dataloader.gpu_starved")
    assert kinds["attention.math_fallback"] == _kind("attention.math_fallback")
    assert kinds["optimizer.8bit_state_mostly_fp32"] == _kind("optimizer.8bit_state_mostly_fp32")
    # ...a question judged at full size that could not be answered there is withheld...
    assert _kind("attention.slower_backend") == "judged at full size"
    assert kinds["attention.slower_backend"] == "withheld"
    # ...a check not judged on the tiny model is no verdict either way, and a check the
    # catalog does not know is said to be unclassified rather than guessed.
    assert "precision.bf16_slower_than_fp32" not in kinds
    assert "attention.benchmark_threads" not in kinds
    assert kinds["attention.flash_attn_package"] == "unclassified"
    summary = result.summary()
    assert summary.startswith("This run trained a tiny stand-in of sd15")
    assert "attention.slower_backend" in summary  # withheld, named
    for item in result.tiny_only:
        assert item.check_id in summary
    # The line counts every verdict the list under it shows, the unclassified ones too.
    assert "1 the catalog does not classify (attention.flash_attn_package)" in summary
    assert len(result.lines()) == len(result.items)
    assert result.to_dict()["summary"] == summary


def test_a_run_at_the_size_it_trains_needs_no_carry_over() -> None:
    assert carry_over(_record("full", CHECKS)) is None
    folder = _record("tiny", CHECKS, model_dir="/models/sd15")
    assert carry_over(folder) is None
    trace = _record("tiny", CHECKS)
    trace.mode = "trace"
    assert carry_over(trace) is None
    # The same predicate reads a RunConfig and a saved record's config.
    assert shrunk_preset(RunConfig(preset="sdxl", size="tiny")) == "sdxl"
    assert shrunk_preset(RunConfig(preset="sdxl", size="full")) is None
    assert shrunk_preset({"preset": "flux", "size": "tiny"}) == "flux"


def test_an_old_record_without_checks_still_answers() -> None:
    record = record_from_dict(
        {"schema_version": 2, "mode": "run", "config": {"preset": "sd15", "size": "tiny"}}
    )
    result = carry_over(record)
    assert result is not None and result.items == ()
    assert "0 carry over" in result.summary()


def test_the_report_says_it_once_at_the_top_and_marks_tiny_only_findings() -> None:
    from diagnose.catalogs.dataloader_catalog import GPU_STARVED
    from diagnose.reports.headline import build_headline
    from diagnose.reports.ranked_findings import build_findings
    from diagnose.reports.terminal import terminal_summary

    finding = GPU_STARVED.build("The step waits 40% for data", evidence={})
    finding.severity = "warn"
    tiny = _record("tiny", [Check(finding.id, "finding", finding.title, "dataloader")])
    tiny.findings = [finding]
    headline = build_headline(tiny)
    assert headline.scale_text.startswith("This run trained a tiny stand-in of sd15")
    assert _kind(finding.id) == "tiny-model only"
    (view,) = build_findings(tiny)
    assert view.at_full_size.startswith("holds for the tiny model only")
    assert "(tiny model only)" in terminal_summary(tiny)
    # The twin at the real size says nothing about scale.
    real = _record("full", [Check(finding.id, "finding", finding.title, "dataloader")])
    real.findings = [finding]
    assert build_headline(real).scale_text == ""
    assert build_findings(real)[0].at_full_size == ""
