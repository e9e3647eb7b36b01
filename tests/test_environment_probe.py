"""The environment rules on recorded inventories and telemetry, and the probe in a real context.

Every case in ``fixtures/inventory/cases.json`` plants one fault (or none, for the clean twins)
on a base inventory and must produce exactly the listed finding ids. The bases and the telemetry
are constructed (no GPU was available), except ``captured_cpu_vm``, captured on the CI VM; each
file says which.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from diagnose.catalogs import spec
from diagnose.config import RunConfig
from diagnose.device import cpu_info
from diagnose.inventory import collect_inventory
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.probes.environment.probe import (
    RULES,
    EnvironmentFacts,
    EnvironmentProbe,
    evaluate,
    hipblaslt_supported,
    hsa_override_target,
    telemetry_from_record,
)
from diagnose.record import (
    CATEGORIES,
    SEVERITIES,
    DeviceInfo,
    ProbeResult,
    RunRecord,
    StepSample,
    Timing,
    new_record,
)
from diagnose.telemetry import TelemetrySummary, summary_from_raw
from tests.conftest import FIXTURES, ok_lines, unjudged_lines

INVENTORIES = FIXTURES / "inventory"
TELEMETRY = FIXTURES / "telemetry"


def _merge(base: Any, patch: Any) -> Any:
    """Deep merge: dicts merge, None deletes, anything else replaces."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_telemetry(name: str) -> TelemetrySummary:
    doc = json.loads((TELEMETRY / f"{name}.json").read_text(encoding="utf-8"))
    return summary_from_raw(
        doc["backend"], doc["static"], [(s["t"], s["raw"]) for s in doc["samples"]]
    )


def make_timing(spec: dict[str, Any]) -> Timing:
    warmup = list(spec.get("warmup_seconds", []))
    timing = Timing(
        warmup_steps=len(warmup),
        warmup_seconds=warmup,
        samples=[
            StepSample(index=len(warmup) + i, seconds=s) for i, s in enumerate(spec["samples"])
        ],
        peak_reserved_bytes=spec.get("peak_reserved_bytes"),
        peak_allocated_bytes=spec.get("peak_allocated_bytes"),
    )
    timing.summarize()
    return timing


def facts_for(case: dict[str, Any]) -> EnvironmentFacts:
    base = json.loads((INVENTORIES / f"{case['base']}.json").read_text(encoding="utf-8"))
    device = case.get("device") or _merge(base["device"], case.get("device_patch") or {})
    inventory = _merge(base["inventory"], case.get("inventory_patch") or {})
    return EnvironmentFacts(
        device=DeviceInfo(**device),
        inventory=inventory,
        telemetry=load_telemetry(case["telemetry"]) if case.get("telemetry") else None,
        timing=make_timing(case["timing"]) if case.get("timing") else None,
        precision=case.get("precision"),
        allocator=case.get("allocator") or {},
        allocator_scope=case.get("allocator_scope", ""),
        resolutions=case.get("resolutions") or [],
    )


CASES: list[dict[str, Any]] = json.loads((INVENTORIES / "cases.json").read_text("utf-8"))["cases"]


def planted_ids(case: dict[str, Any]) -> list[str]:
    """The ids a case plants for this probe. Whether bf16 is native is the precision probe's
    question (it measures the cost): the bf16 cases are clean twins here."""
    return sorted(case["expect"])


def failed_rules(result: ProbeResult) -> list[str]:
    return [line for line in unjudged_lines(result) if " failed: " in line]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_rules_on_recorded_cases(case: dict[str, Any]) -> None:
    result = evaluate(facts_for(case))
    assert not failed_rules(result)
    ids = sorted(f.id for f in result.findings)
    assert ids == planted_ids(case), [f.title for f in result.findings]
    by_id = {f.id: f for f in result.findings}
    for finding_id, severity in (case.get("severity") or {}).items():
        assert by_id[finding_id].severity == severity
    for finding_id, text in (case.get("fix_contains") or {}).items():
        if finding_id in by_id or finding_id in planted_ids(case):
            assert text in by_id[finding_id].fix, by_id[finding_id].fix
    for finding in result.findings:
        # What the report needs from every finding.
        assert finding.category in CATEGORIES and finding.severity in SEVERITIES
        assert finding.title and finding.fix and finding.evidence
        assert finding.source == "environment"
        json.dumps(finding.evidence, allow_nan=False)


def test_every_rule_has_a_planted_fault_and_the_clean_twins_cover_all_rules() -> None:
    fired = {i for c in CASES for i in planted_ids(c)}
    expected_ids = {
        "environment.cpu_with_gpu_present",
        "environment.integrated_gpu",
        "memory.vram_spill",
        "memory.vram_near_capacity",
        "memory.allocator_retries",
        "memory.allocator_conf_conflict",
        "memory.caching_allocator_off",
        "environment.rocm_kernel_search_warmup",
        "environment.tunableop_tuning",
        "environment.hsa_override",
        "environment.hipblaslt_unsupported",
        "environment.hipblaslt_off",
        "environment.launch_blocking",
        "environment.amd_log_level",
        "environment.gpu_throttled",
        "environment.power_limited",
        "environment.clocks_low",
        "environment.pcie_link_degraded",
        "environment.driver_old",
        "environment.cpu_one_thread",
        "environment.cpu_few_cores",
    }
    assert expected_ids <= fired
    # On a healthy GPU machine every rule judged something: it either passed or said why not.
    for name in ("healthy_nvidia", "healthy_amd"):
        case = next(c for c in CASES if c["name"] == name)
        result = evaluate(facts_for(case))
        assert not result.findings
        assert len(ok_lines(result)) >= 8, ok_lines(result)


def test_healthy_cases_say_what_was_checked() -> None:
    case = next(c for c in CASES if c["name"] == "healthy_nvidia")
    ok = " | ".join(ok_lines(evaluate(facts_for(case))))
    for expected in ("peak VRAM", "no allocator retries", "no throttling", "PCIe link x16 Gen4"):
        assert expected in ok


def test_spill_evidence_has_the_numbers() -> None:
    case = next(c for c in CASES if c["name"] == "vram_spill_on_windows")
    finding = evaluate(facts_for(case)).findings[0]
    assert finding.evidence["torch_peak_reserved"] == "29.2 GiB"
    assert finding.evidence["vram_total"] == "24.0 GiB"
    assert finding.evidence["seconds_per_it"] == pytest.approx(89.1, abs=0.1)
    assert finding.evidence["pcie_rx_median_bytes_per_s"] > 9e9


def test_warmup_evidence_has_the_numbers() -> None:
    case = next(c for c in CASES if c["name"] == "rocm_first_step_miopen_search")
    finding = evaluate(facts_for(case)).findings[0]
    assert finding.evidence["first_step_seconds"] == 112.4
    assert finding.evidence["median_seconds_per_it"] == pytest.approx(1.615)
    assert finding.evidence["ratio"] == pytest.approx(69.6)
    assert "unset" in finding.evidence["MIOPEN_FIND_MODE"]
    assert "112.4 s against 1.62 s/it" in finding.title
    assert "2 resolution buckets" in finding.fix


def test_a_broken_rule_is_reported_not_fatal() -> None:
    def rule_broken(facts: EnvironmentFacts) -> ProbeResult:
        raise KeyError("gpu")

    case = next(c for c in CASES if c["name"] == "cuda_launch_blocking_left_set")
    result = evaluate(facts_for(case), (rule_broken, *RULES))
    [check] = [c for c in result.checks if c.id == "environment.broken"]
    assert check.outcome == "not_judged" and check.text.startswith("rule_broken failed: KeyError")
    assert [f.id for f in result.findings] == ["environment.launch_blocking"]


def test_missing_inventory_keys_mean_unknown_not_a_crash() -> None:
    for device in (
        DeviceInfo(kind="cuda", torch_device="cuda:0"),
        DeviceInfo(kind="rocm", torch_device="cuda:0"),
        DeviceInfo(kind="cpu", torch_device="cpu"),
        DeviceInfo(),
    ):
        result = evaluate(EnvironmentFacts(device=device, precision="bf16-mixed"))
        assert not failed_rules(result)
        assert not result.findings


def test_hsa_override_target() -> None:
    assert hsa_override_target("11.0.0") == "gfx1100"
    assert hsa_override_target("10.3.0") == "gfx1030"
    assert hsa_override_target("9.4.2") == "gfx942"
    assert hsa_override_target("9.0.10") == "gfx90a"
    assert hsa_override_target("gfx1100") is None
    assert hsa_override_target("11") is None


def test_hipblaslt_supported_follows_torch_and_the_rocm_version() -> None:
    assert hipblaslt_supported("gfx942", "6.2.41133") is True
    assert hipblaslt_supported("gfx1100", "6.2.41133") is False
    assert hipblaslt_supported("gfx1100", "6.4.43482-0f2d60242") is True
    assert hipblaslt_supported("gfx1151", "6.4.43482") is False
    assert hipblaslt_supported("gfx1151", "7.0.51831") is True
    assert hipblaslt_supported("gfx1030", "7.1.0") is False
    assert hipblaslt_supported("gfx90a:sramecc+:xnack-", "6.0") is True
    assert hipblaslt_supported("gfx1100", None) is None


def test_telemetry_is_read_from_where_the_run_stores_it() -> None:
    summary = load_telemetry("nvml_rtx4090_healthy")
    inventory = {"telemetry": {"available": True, "during_steps": summary.to_dict()}}
    restored = telemetry_from_record(inventory)
    assert restored is not None
    assert restored.stats == summary.stats and restored.limits == summary.limits
    assert len(restored.samples) == len(summary.samples)
    assert telemetry_from_record({"telemetry": {"available": False}}) is None
    assert telemetry_from_record({}) is None


# --- the probe in a real context ------------------------------------------------------------------


def _context(record: RunRecord) -> ProbeContext:
    return ProbeContext(
        config=RunConfig(precision="bf16-mixed"),
        device=torch.device("cpu"),
        device_info=record.device,
        record=record,
    )


def test_probe_on_this_machine(capfd: pytest.CaptureFixture[str]) -> None:
    record = new_record("run")
    record.device = cpu_info()
    # packages=(): the rules read no package entry, and importing diffusers & co. costs seconds.
    record.inventory = collect_inventory("cpu", packages=())
    record.timing = make_timing({"warmup_seconds": [2.1], "samples": [1.8, 1.7, 1.9]})
    probe = EnvironmentProbe()
    assert probe.requires_packages == () and probe.device_kinds == ()
    result = run_probe(probe, _context(record))
    assert result.status == "ok", result.traceback
    assert result.name == "environment"
    assert result.data["telemetry"] == "not sampled"
    ids = {f.id for f in result.findings}
    assert "environment.cpu_with_gpu_present" not in ids  # no GPU on this VM's PCI bus
    if (record.inventory["cpu"]["usable_cores"] or 0) <= 4:
        assert "environment.cpu_few_cores" in ids
    assert ok_lines(result)
    # Every question has a named check: no transitional lines, no side channel the report skips.
    assert all(".unnamed_" not in c.id for c in result.checks)
    assert "not_checked" not in result.data
    json.dumps(result.data, allow_nan=False)
    assert capfd.readouterr() == ("", "")


def test_probe_reads_telemetry_and_allocator_counters_stored_by_the_run() -> None:
    base = json.loads((INVENTORIES / "nvidia_rtx4090_linux.json").read_text("utf-8"))
    summary = load_telemetry("nvml_pcie_x4")
    summary.allocator = {"num_alloc_retries": 2, "num_ooms": 0}
    record = new_record("run")
    record.device = DeviceInfo(**base["device"])
    record.inventory = dict(base["inventory"], telemetry={"during_steps": summary.to_dict()})
    record.timing = make_timing({"samples": [1.2, 1.21, 1.19]})
    result = EnvironmentProbe().run(_context(record))
    assert {f.id for f in result.findings} == {
        "environment.pcie_link_degraded",
        "memory.allocator_retries",
    }
    assert result.data["allocator_scope"] == "timed steps"
    assert result.data["telemetry"] == "nvml: 11 samples"


# --- one answer per question ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_question_has_one_answer_under_a_catalog_id(case: dict[str, Any]) -> None:
    """A check id is a finding id of the environment or memory catalog, and has one outcome; a
    finding's check is its finding, and a finding's severity is the catalog's (no saving is
    measured here, so settle leaves it as the catalog declared it)."""
    result = evaluate(facts_for(case))
    outcomes: dict[str, set[str]] = {}
    for check in result.checks:
        outcomes.setdefault(check.id, set()).add(check.outcome)
        assert check.source == "environment" and check.text
        if not check.id.startswith("environment.") or " failed: " not in check.text:
            entry = spec(check.id)
            assert entry is not None and entry.category in ("environment", "memory"), check.id
    assert all(len(found) == 1 for found in outcomes.values()), outcomes
    for finding in result.findings:
        assert outcomes[finding.id] == {"finding"}
        assert finding.est_seconds_saved_per_it is None and finding.saving_basis == "none"


def test_every_catalog_question_is_answered_somewhere() -> None:
    """Each environment and memory id is raised by some planted case, and answered fine or not
    judged by some other: no question the probe cannot answer sits in the catalog."""
    answered: dict[str, set[str]] = {}
    for case in CASES:
        for check in evaluate(facts_for(case)).checks:
            answered.setdefault(check.id, set()).add(check.outcome)
    from diagnose.catalogs import environment_catalog, memory_catalog

    for entry in (*environment_catalog.SPECS, *memory_catalog.SPECS):
        assert "finding" in answered.get(entry.id, set()) or entry.id in {
            "environment.cpu_threads_low"
        }, entry.id


def test_memory_advice_of_a_tiny_run_is_judged_on_the_full_size_model() -> None:
    """A tiny stand-in's peak memory says nothing about the real model's: on a tiny run the VRAM
    questions are withheld with the real model's memory before activations (SD1.5 at full
    size, built on the meta device). Planted: the same recorded facts as a run at the size it
    trains give their measured answers (the clean twin of each case is its full-size self)."""
    import dataclasses

    from diagnose.probes.environment.probe import full_size_memory

    full = full_size_memory(RunConfig(preset="sd15", size="tiny", precision="bf16-mixed"))
    assert full is not None and full.preset == "sd15"
    # The real SD1.5 (UNet, CLIP-L, VAE: about a billion parameters) is over 1 GiB in bf16.
    assert full.frozen_bytes > 2**30 and 0 < full.trainable_bytes < full.frozen_bytes
    assert full_size_memory(RunConfig(preset="sd15", size="full")) is None
    for name in ("healthy_nvidia", "vram_spill_on_windows"):
        facts = facts_for(next(c for c in CASES if c["name"] == name))
        as_measured = evaluate(facts)
        tiny = evaluate(dataclasses.replace(facts, full_size=full))
        memory = {"memory.vram_spill", "memory.vram_near_capacity"}
        assert not [f for f in tiny.findings if f.id in memory]
        answers = {c.id: c for c in tiny.checks if c.id in memory}
        assert {c.outcome for c in answers.values()} == {"not_judged"}
        assert "says nothing about sd15's" in answers["memory.vram_spill"].text
        # The measured answers stand for a run at its real size.
        assert {c.id for c in as_measured.checks if c.outcome != "not_judged"} & memory
    # A GPU smaller than the real model's weights: withheld, and said not to fit.
    small = dataclasses.replace(
        facts_for(next(c for c in CASES if c["name"] == "healthy_nvidia")), full_size=full
    )
    small.device = dataclasses.replace(small.device, memory_bytes=full.static_bytes // 2)
    [spill] = [c for c in evaluate(small).checks if c.id == "memory.vram_spill"]
    assert "more than it has" in spill.text
