"""The one verdict rule: savings bounded by step and phases, one severity function, ranking, one
answer per check id, and the consistency check that catches a planted contradiction."""

from __future__ import annotations

import pytest

from diagnose.catalogs import specs
from diagnose.record import Check, Finding, ProbeResult, RunRecord, StepSample
from diagnose.stats import at_line
from diagnose.verdicts import borderline_at, contradictions, grade, ranked, settle
from tests.factories import timed_record


def _record(step: float, phases: dict[str, float] | None = None) -> RunRecord:
    return timed_record([step] * 5, phases=phases or {})


def _with(record: RunRecord, *findings: Finding, checks: list[Check] | None = None) -> RunRecord:
    probe = ProbeResult(name="p", checks=list(checks or []))
    for finding in findings:
        probe.add_finding(finding)
    probe.settle_checks("p")
    record.findings = list(probe.findings)
    probe.findings = []
    record.probes = [probe]
    return record


def test_grade_is_one_function_of_share_and_basis() -> None:
    assert grade(0.05, "measured") == "info"
    assert grade(0.10, "measured") == "warn"
    assert grade(0.30, "trace") == "critical"
    # An estimate is never critical: that takes a measurement.
    assert grade(0.90, "estimated") == "warn"
    # No saving: the severity the finding's kind carries.
    assert grade(None, "none", "critical") == "critical"


def test_a_saving_larger_than_the_step_is_capped_at_the_step() -> None:
    # The reported case: "saves about 2.08 s/it (148% of the step)" on a 1.41 s/it run.
    record = _with(_record(1.41), Finding(id="x.y", est_seconds_saved_per_it=2.08))
    settle(record, specs())
    finding = record.findings[0]
    assert finding.est_seconds_saved_per_it == pytest.approx(1.41)
    assert finding.evidence["saving_before_cap_seconds"] == 2.08
    assert not contradictions(record, specs())


def test_a_saving_is_capped_at_the_phases_it_lives_in() -> None:
    record = _with(
        _record(1.0, {"forward": 0.2, "backward": 0.3, "optimizer": 0.1, "data_wait": 0.4}),
        Finding(
            id="x.opt", est_seconds_saved_per_it=0.5, phases=["optimizer"], saving_basis="measured"
        ),
    )
    settle(record, specs())
    assert record.findings[0].est_seconds_saved_per_it == pytest.approx(0.1)
    assert "optimizer" in record.findings[0].evidence["saving_cap"]


def test_phase_bound_follows_the_headline_when_the_bar_was_measured_on_slower_steps() -> None:
    # Phases of profiled steps sum to 2 s while the headline step is 1 s: the bound scales.
    record = _with(
        _record(1.0, {"forward": 1.0, "backward": 1.0}),
        Finding(
            id="x.f", est_seconds_saved_per_it=0.9, phases=["forward"], saving_basis="measured"
        ),
    )
    settle(record, specs())
    assert record.findings[0].est_seconds_saved_per_it == pytest.approx(0.5)


def test_a_saving_within_its_bounds_is_left_alone() -> None:
    record = _with(_record(1.44), Finding(id="x.y", est_seconds_saved_per_it=0.6))
    settle(record, specs())
    assert record.findings[0].est_seconds_saved_per_it == 0.6
    assert "saving_before_cap_seconds" not in record.findings[0].evidence


def test_severity_is_graded_on_the_sure_saving() -> None:
    # Median saving 40% of the step but the interval's low end only 12%: warn, not critical.
    record = _with(
        _record(1.0),
        Finding(
            id="x.ab",
            severity="info",
            est_seconds_saved_per_it=0.4,
            sure_seconds_saved_per_it=0.12,
            saving_basis="measured",
        ),
    )
    settle(record, specs())
    assert record.findings[0].severity == "warn"


def test_critical_ranks_above_a_note_whatever_the_saving() -> None:
    # The reported case on mi250_minitoy_train: an info finding of 0.04 ms ranked above a
    # critical one with no saving figure.
    note = Finding(id="a.note", severity="info", est_seconds_saved_per_it=0.00004)
    stall = Finding(id="b.stall", severity="critical")
    warn = Finding(id="c.warn", severity="warn", est_seconds_saved_per_it=0.01)
    bigger_warn = Finding(id="d.warn", severity="warn", est_seconds_saved_per_it=0.02)
    assert [f.id for f in ranked([note, warn, stall, bigger_warn])] == [
        "b.stall",
        "d.warn",
        "c.warn",
        "a.note",
    ]


@pytest.mark.parametrize(
    ("question", "kept_as"),
    [
        # Two sources of equal standing: the stronger answer, a finding, stands.
        ("compute.launch_bound", "also_checked"),
        # The reported case: "waits for data 11% of each step" beside "compute is not waiting".
        # The catalog says the probe's answer stands; the trace rule's is set aside.
        ("dataloader.gpu_starved", "trace_profiled_steps_said"),
    ],
)
def test_one_answer_per_question(question: str, kept_as: str) -> None:
    record = _record(1.0, {"data_wait": 0.11, "forward": 0.89})
    probe = ProbeResult(name="dataloader")
    probe.add_finding(
        Finding(
            id=question,
            title="The training loop waits for data 11% of each step",
            est_seconds_saved_per_it=0.11,
            saving_basis="measured",
            severity="warn",
        )
    )
    probe.settle_checks("dataloader")
    trace = ProbeResult(name="trace")
    trace.add_ok(question, "data loading: 5% of the step; compute is not waiting")
    trace.add_not_judged("attention.math_fallback", "attention: no attention ops")
    trace.settle_checks("trace")
    record.findings = list(probe.findings)
    probe.findings = []
    record.probes = [probe, trace]
    assert contradictions(record, specs()), "the planted contradiction must be caught"
    settle(record, specs())
    assert not contradictions(record, specs())
    outcomes = {c.id: c.outcome for c in record.all_checks()}
    assert outcomes == {question: "finding", "attention.math_fallback": "not_judged"}
    # The overruled answer stays visible as evidence, not as a second verdict.
    assert record.findings[0].evidence[kept_as] == [
        "trace: data loading: 5% of the step; compute is not waiting"
    ]


def test_an_ok_overrules_a_not_judged_of_the_same_question() -> None:
    record = _record(1.0)
    a = ProbeResult(name="a", checks=[Check("q.one", "not_judged", "cannot see it here", "a")])
    b = ProbeResult(name="b", checks=[Check("q.one", "ok", "measured fine", "b")])
    record.probes = [a, b]
    settle(record, specs())
    assert [(c.id, c.outcome) for c in record.all_checks()] == [("q.one", "ok")]


@pytest.mark.parametrize(
    "plant",
    ["two_outcomes", "orphan_finding", "orphan_check", "saving_above_step", "wrong_severity"],
)
def test_contradictions_catch_each_planted_fault(plant: str) -> None:
    record = _with(
        _record(1.0, {"forward": 0.5, "backward": 0.5}),
        Finding(id="x.y", title="t", est_seconds_saved_per_it=0.2, saving_basis="measured"),
    )
    settle(record, specs())
    assert not contradictions(record, specs())
    probe = record.probes[0]
    if plant == "two_outcomes":
        probe.add_ok("x.y", "x is fine")
    elif plant == "orphan_finding":
        record.findings.append(Finding(id="z.new", title="no check"))
    elif plant == "orphan_check":
        probe.checks.append(Check("z.gone", "finding", "a finding that is not there", "p"))
    elif plant == "saving_above_step":
        record.findings[0].est_seconds_saved_per_it = 1.5
    else:
        record.findings[0].severity = "critical"
    assert contradictions(record, specs())


def test_what_settling_cannot_mend_is_said_on_the_page() -> None:
    record = _with(
        _record(1.0),
        Finding(id="x.y", title="one"),
        Finding(id="x.y", title="the same id again"),
    )
    settle(record, specs())
    assert any("Internal inconsistency" in note and "x.y" in note for note in record.notes)


def test_shares_are_of_the_bucket_mix() -> None:
    """With two buckets (four 1.4 s steps and three 0.2 s ones), a saving's share is of the mix's
    s/it, not of the median of all steps (which is one bucket's)."""
    record = RunRecord()
    record.timing.samples = [
        StepSample(
            index=i, seconds=0.2 if i % 2 else 1.4, bucket="512x512" if i % 2 else "1024x1024"
        )
        for i in range(7)
    ]
    record.timing.summarize()
    record = _with(record, Finding(id="x.y", est_seconds_saved_per_it=0.3, saving_basis="measured"))
    settle(record, specs())
    assert record.timing.headline.median == pytest.approx(1.4)
    assert record.timing.per_iteration == pytest.approx((4 * 1.4 + 3 * 0.2) / 7)
    assert record.findings[0].severity == "critical"  # 34% of the mix; 21% of the median


def test_a_borderline_share_never_reads_below_zero() -> None:
    """Three profiled steps' data-wait shares, one near zero: Student's interval of their mean
    reaches below 0, which no share can ("-5.2%-11.8% of the step" on a compare page)."""
    reading = at_line(0.033, 0.10, samples=[0.001, 0.02, 0.078])
    assert reading.borderline and reading.low < 0
    said = borderline_at(reading, "data wait", " of the step")
    assert said.low == 0.0 and said.high == reading.high
    assert said.text == "data wait 0%–13.3% of the step, at the 10% line"
