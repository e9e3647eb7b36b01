"""One story per finding: a fix never advises what its own evidence measured no faster, and no
line states other torch threads than the steps ran on. The consistency check
(:func:`diagnose.verdicts.contradictions`) covers both; each planted contradiction is caught."""

from __future__ import annotations

from diagnose.catalogs import specs
from diagnose.catalogs.dataloader_catalog import ADVICE_SETTING, BarWait
from diagnose.probes.dataloader.ab import VariantRow
from diagnose.probes.dataloader.facts import LoaderConfig, WaitSummary
from diagnose.probes.dataloader.verdict import judge
from diagnose.probes.environment.cpu import rule_cpu_threads
from diagnose.probes.environment.facts import EnvironmentFacts
from diagnose.record import Check, DeviceInfo, Finding, ProbeResult, RunRecord
from diagnose.verdicts import NO_FASTER_KEY, contradictions, settle
from tests.factories import timed_record

LOADER = LoaderConfig(0, False, False, None, 2, False, "ImageFolderDataset")


def _row(key: str, seconds: list[float]) -> VariantRow:
    return VariantRow(
        key=key,
        label={"configured": "as configured", "workers": "2 workers (persistent)"}.get(
            key, "cached latents"
        ),
        workers=2 if key == "workers" else 0,
        pin_memory=False,
        persistent_workers=key == "workers",
        source="decode",
        seconds=seconds,
    )


def _wait(share: float, step: float = 0.137) -> WaitSummary:
    per_step = [
        {"index": i, "seconds": step, "data_wait": share * step, "share": share} for i in range(10)
    ]
    return WaitSummary(
        bar=BarWait(share * step, step),
        steps=10,
        first_batch_seconds=None,
        phases={},
        per_step=per_step,
    )


def _record(findings: list[Finding]) -> RunRecord:
    record = timed_record([0.137] * 10, phases={"data_wait": 0.03, "forward": 0.107})
    probe = ProbeResult(name="dataloader", findings=list(findings))
    probe.settle_checks("dataloader")
    record.findings, probe.findings = probe.findings, []
    record.probes = [probe]
    settle(record, specs())
    return record


# The default CPU run the issue quotes: 2 workers took 0.148 s/it against 0.137 as configured.
CONFIGURED = _row("configured", [0.137, 0.135, 0.14, 0.136, 0.139])
WORKERS_SLOWER = _row("workers", [0.148, 0.15, 0.146, 0.149, 0.147])
LATENTS_NOT_SURE = _row("cached_latents", [0.119, 0.15, 0.09, 0.14, 0.1])


def _starved(rows: list[VariantRow]) -> Finding:
    verdict = judge(
        _wait(0.22), rows, has_device=False, loader=LOADER, cores=2, facts={}, frames=None
    )
    [finding] = verdict.findings
    return finding


def test_a_fix_never_advises_what_the_ab_measured_no_faster() -> None:
    finding = _starved([CONFIGURED, WORKERS_SLOWER, LATENTS_NOT_SURE])
    assert "2 workers (persistent): no clear gain" in finding.detail
    assert ADVICE_SETTING["workers"] not in finding.fix
    assert finding.evidence[NO_FASTER_KEY] == {"2 workers (persistent)": ADVICE_SETTING["workers"]}
    # What was measured faster but not surely so is advised with its numbers.
    assert finding.fix.lower().startswith(ADVICE_SETTING["cached_latents"])
    assert "0.119 against 0.137 s/it here, faster but not surely so" in finding.fix
    assert not contradictions(_record([finding]), specs())


def test_with_nothing_faster_the_fix_says_what_was_measured() -> None:
    # Untried, a change is still advised; measured no faster, it is not.
    only_workers = _starved([CONFIGURED, WORKERS_SLOWER])
    assert only_workers.fix.lower().startswith(ADVICE_SETTING["cached_latents"])
    latents_slower = _row("cached_latents", [0.14, 0.138, 0.141, 0.139, 0.142])
    finding = _starved([CONFIGURED, WORKERS_SLOWER, latents_slower])
    assert finding.fix.startswith("No loader change measured here was faster")
    assert "2 workers (persistent) 0.148" in finding.fix
    assert ADVICE_SETTING["workers"] not in finding.fix
    assert not contradictions(_record([finding]), specs())


def test_a_planted_contradicting_fix_is_caught() -> None:
    finding = _starved([CONFIGURED, WORKERS_SLOWER, LATENTS_NOT_SURE])
    finding.fix = "Load batches in background workers: DataLoader(num_workers=2)."
    problems = [str(p) for p in contradictions(_record([finding]), specs())]
    assert any("measured no faster (2 workers (persistent))" in p for p in problems), problems


def _cpu_facts(configured: int, ran: int) -> EnvironmentFacts:
    device = DeviceInfo(kind="cpu", torch_device="cpu", extra={"torch_threads": ran})
    inventory = {
        "torch": {"num_threads": configured},
        "cpu": {"usable_cores": 2, "logical_cores": 2, "physical_cores": 2},
    }
    return EnvironmentFacts(device=device, inventory=inventory)


def test_found_fine_says_the_threads_the_steps_ran_on() -> None:
    """Others held a core, so the run gave it back: torch is set to 2 threads, the steps ran
    on 1, and the found-fine line says both, as the run's notes do."""
    result = rule_cpu_threads(_cpu_facts(configured=2, ran=1))
    [line] = [c.text for c in result.checks if c.id == "environment.cpu_threads_low"]
    assert line == (
        "torch is set to 2 threads on 2 usable cores; the steps here ran on 1, leaving the cores "
        "other processes held"
    )
    record = RunRecord(mode="run", device=_cpu_facts(2, 1).device)
    probe = ProbeResult(name="environment", checks=list(result.checks))
    probe.findings = list(result.findings)
    probe.settle_checks("environment")
    record.findings, probe.findings = probe.findings, []
    record.probes = [probe]
    assert not [p for p in contradictions(record, specs()) if "threads" in str(p)]
    # On an idle machine the line says only what torch is set to.
    idle = rule_cpu_threads(_cpu_facts(configured=2, ran=2))
    assert "ran on" not in next(
        c.text for c in idle.checks if c.id == "environment.cpu_threads_low"
    )
    # The planted contradiction: a line that says 2 threads beside steps that ran on 1.
    record.probes[0].checks.append(
        Check("planted", "ok", "torch uses 2 threads on 2 usable cores", "planted")
    )
    assert any("while the steps ran on 1" in str(p) for p in contradictions(record, specs()))
