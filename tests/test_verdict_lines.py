"""A verdict is a value held against its line with the interval its samples give it: above, below,
or borderline when the interval straddles the line (diagnose.stats.at_line). A value planted on
its line reads borderline on every seed, one clearly above reads warn on every seed, and the
severity rule grades a saving's interval the same way."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from diagnose.capture import phase_breakdown
from diagnose.catalogs import specs
from diagnose.catalogs.dataloader_catalog import GPU_STARVED, STARVED_SHARE
from diagnose.probes.dataloader.ab import VariantRow
from diagnose.probes.dataloader.facts import LoaderConfig, wait_summary
from diagnose.probes.dataloader.verdict import judge
from diagnose.record import Check, Finding, ProbeResult, RunRecord, StepSample, Timing, new_record
from diagnose.stats import FEW_SAMPLES_SIGNIFICANCE, at_line, location_interval, t_quantile
from diagnose.verdicts import CRITICAL_SHARE, WARN_SHARE, contradictions, graded, settle

# --------------------------------------------------------------------------------------------
# The statistics


def test_t_quantiles_match_the_published_table() -> None:
    # Two-sided: 95% with 1, 3 and 10 degrees of freedom; 99% with 2 and 29.
    for significance, df, table in (
        (0.05, 1, 12.706),
        (0.05, 3, 3.182),
        (0.05, 10, 2.228),
        (0.01, 2, 9.925),
        (0.01, 29, 2.756),
    ):
        assert t_quantile(significance, df) == pytest.approx(table, abs=1e-3)


@pytest.mark.parametrize("n", [3, 5, 12, 30])
def test_the_location_interval_covers_the_centre_as_often_as_it_says(n: int) -> None:
    """Few samples take Student's t (at the few samples' level), more the signed-rank interval
    at 99%; both must hold the true centre of normal noise as often as their level says (within
    5 standard errors of 1000 draws)."""
    rng = random.Random(n)
    covered = 0
    for _ in range(1000):
        values = [rng.gauss(0.1, 0.01) for _ in range(n)]
        interval = location_interval(values, 0.01)
        assert interval is not None
        covered += interval[0] <= 0.1 <= interval[1]
    level = 0.01 if n >= 8 else FEW_SAMPLES_SIGNIFICANCE
    assert covered >= 1000 * (1 - level) - 5 * math.sqrt(1000 * level * (1 - level))


def test_a_value_against_its_line() -> None:
    assert at_line(0.12, 0.10).above and at_line(0.10, 0.10).above  # at the line is on it
    assert at_line(0.09, 0.10).below
    assert at_line(0.11, 0.10, interval=(0.09, 0.12)).borderline
    assert at_line(0.11, 0.10, interval=(0.105, 0.12)).above
    assert at_line(float("nan"), 0.10).below  # nothing measured reaches a line
    # The interval always holds the value shown with it.
    reading = at_line(0.2, 0.10, interval=(0.05, 0.08))
    assert reading.low == 0.05 and reading.high == 0.2 and reading.borderline
    # Too few samples for any interval: judged as a single number.
    assert at_line(0.2, 0.1, samples=[0.2]).above
    # The words say the value's interval and the line.
    words = at_line(0.11, 0.10, interval=(0.096, 0.123)).words(
        "data wait", lambda v: f"{v:.1%}", " of the step"
    )
    assert words == "data wait 9.6%–12.3% of the step, at the 10.0% line"


def test_severity_is_graded_on_the_savings_interval() -> None:
    assert graded(0.12, "measured", low=0.11, high=0.14).severity == "warn"
    straddling = graded(0.12, "measured", low=0.08, high=0.14)
    assert straddling.severity == "info" and straddling.borderline is not None
    assert straddling.borderline.line_severity == "warn"
    assert "at the 10% line" in straddling.borderline.text
    critical = graded(0.33, "trace", low=0.25, high=0.4)
    assert critical.severity == "warn" and critical.borderline is not None
    assert critical.borderline.line_severity == "critical"
    assert graded(0.05, "measured", low=0.04, high=0.06).borderline is None
    # An estimate is never graded above warn, so it has no critical line to straddle.
    assert graded(0.33, "estimated", low=0.25, high=0.4) == graded(0.33, "estimated")
    assert WARN_SHARE < CRITICAL_SHARE


# --------------------------------------------------------------------------------------------
# A data wait planted on its line, and clearly above it

LOADER = LoaderConfig(0, False, False, None, 4, True, "ImageFolderDataset")
SEEDS = range(20)
STEPS = 30


def _run_with_wait(share: float, seed: int) -> RunRecord:
    """A run of ``STEPS`` timed steps whose data wait is ``share`` of each step, with the
    step-to-step spread of a real loader (each step and each wait vary by up to a fifth)."""
    rng = random.Random(seed)
    samples = []
    for index in range(STEPS):
        seconds = 0.15 * (1 + rng.uniform(-0.1, 0.1))
        wait = share * seconds * (1 + rng.uniform(-0.2, 0.2))
        phases = {"data_wait": wait, "forward": seconds - wait}
        samples.append(StepSample(index=index, seconds=seconds, phases=phases))
    timing = Timing(samples=samples)
    timing.summarize()
    record = new_record("run")
    record.timing = timing
    record.breakdown = phase_breakdown(timing)
    return record


def _judged(record: RunRecord) -> RunRecord:
    """The dataloader probe's verdict on ``record``'s wait, settled as a run settles it."""
    configured = VariantRow(
        key="configured",
        label="as configured (num_workers=0)",
        workers=0,
        pin_memory=False,
        persistent_workers=False,
        source="decode",
        seconds=[s.seconds for s in record.timing.samples],
    )
    verdict = judge(
        wait_summary(record),
        [configured],
        has_device=False,
        loader=LOADER,
        cores=2,
        facts={},
        frames=None,
    )
    result = ProbeResult(name="dataloader", findings=list(verdict.findings))
    result.checks = [Check(i, outcome, text) for i, outcome, text in verdict.checks]
    result.settle_checks("dataloader")
    record.findings = result.findings
    result.findings = []
    record.probes.append(result)
    settle(record, specs())
    return record


def _starved(record: RunRecord) -> list[Finding]:
    return [f for f in record.findings if f.id == GPU_STARVED.id]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_wait_on_its_line_is_borderline_never_warn(seed: int) -> None:
    record = _judged(_run_with_wait(STARVED_SHARE, seed))
    [finding] = _starved(record)
    assert finding.severity == "info"
    assert finding.borderline is not None
    assert finding.borderline.low < STARVED_SHARE <= finding.borderline.high
    assert finding.borderline.text.startswith("data wait ")
    assert finding.borderline.text.endswith("of the step, at the 10% line")
    assert not contradictions(record, specs())


@pytest.mark.parametrize("seed", SEEDS)
def test_a_wait_clearly_above_its_line_is_warn(seed: int) -> None:
    record = _judged(_run_with_wait(1.5 * STARVED_SHARE, seed))
    [finding] = _starved(record)
    assert finding.severity == "warn" and finding.borderline is None
    assert not contradictions(record, specs())


@pytest.mark.parametrize("seed", SEEDS)
def test_a_wait_clearly_below_its_line_is_fine(seed: int) -> None:
    record = _judged(_run_with_wait(0.5 * STARVED_SHARE, seed))
    assert not _starved(record)
    assert [c.outcome for c in record.all_checks() if c.id == GPU_STARVED.id] == ["ok"]


def test_the_interval_is_the_spread_of_the_steps_not_a_guess() -> None:
    """Without step-to-step spread there is nothing to be unsure of: a wait a hair above its
    line with every step alike is above it."""
    rng_free = [StepSample(index=i, seconds=0.1, phases={"data_wait": 0.0101}) for i in range(10)]
    timing = Timing(samples=rng_free)
    timing.summarize()
    record = new_record("run")
    record.timing = timing
    record.breakdown = phase_breakdown(timing)
    [finding] = _starved(_judged(record))
    assert finding.borderline is None and finding.severity == "warn"
    assert statistics.median(s.phases["data_wait"] for s in rng_free) > STARVED_SHARE * 0.1
