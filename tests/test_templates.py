"""The rendered page: structure, escaping of hostile strings, no external reference of any kind."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from diagnose.record import (
    Breakdown,
    Check,
    DeviceInfo,
    Finding,
    ModelInfo,
    OpStat,
    ProbeResult,
    RunRecord,
    StepSample,
    Timing,
)
from diagnose.record_io import load_record
from diagnose.reports import render_html

SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(2)>'
HOSTILE = f"{SCRIPT} {IMG}"


def _timing(unprofiled: list[float], profiled: list[float]) -> Timing:
    samples = [StepSample(index=i, seconds=s) for i, s in enumerate(unprofiled)]
    samples += [StepSample(index=100 + i, seconds=s, profiled=True) for i, s in enumerate(profiled)]
    timing = Timing(samples=samples, warmup_seconds=[9.0])
    timing.summarize()
    return timing


def run_record() -> RunRecord:
    return RunRecord(
        created="2025-02-03T04:05:06+00:00",
        device=DeviceInfo(
            kind="cuda", vendor="NVIDIA", name="NVIDIA GeForce RTX 4090", memory_bytes=24 * 2**30
        ),
        config={
            "preset": "sd15",
            "precision": "fp16",
            "optimizer": "adamw",
            "resolution": [512, 768],
            "batch": 2,
            "rank": 16,
        },
        model=ModelInfo(preset="sd15", size="tiny"),
        timing=_timing([0.0456, 0.0460, 0.0452, 0.0458], [0.051]),
        breakdown=Breakdown(seconds={"forward": 0.015, "backward": 0.025, "optimizer": 0.005}),
        findings=[
            Finding(
                id="b.second",
                severity="warn",
                title="Second biggest cost",
                est_seconds_saved_per_it=0.004,
                saving_basis="estimated",
                fix="do B",
            ),
            Finding(id="a.third", severity="critical", title="Third: not quantified", fix="do C"),
            Finding(
                id="c.first",
                severity="info",
                title="First biggest cost",
                est_seconds_saved_per_it=0.01,
                saving_basis="measured",
                fix="do A",
                evidence={"nested": {"list": [1, 2.5, "x"], "deeper": {"k": True}}},
            ),
        ],
        probes=[
            ProbeResult(
                name="precision",
                status="ok",
                checks=[Check("precision.fp32_training", "ok", "GEMMs run in fp16")],
            ),
            ProbeResult(
                name="bnb",
                status="error",
                reason="ImportError: no libbitsandbytes",
                traceback="Traceback (most recent call last):\nImportError: <lib> & co",
            ),
        ],
        top_ops=[OpStat(name="aten::mm", calls_per_step=12, self_cpu_seconds=0.001)],
        command="diagnose run --preset sd15 --size tiny",
        trace_path="trace.json.gz",
    )


def hostile_record() -> RunRecord:
    """Every string the record carries into the page is hostile."""
    record = run_record()
    record.device.name = HOSTILE
    record.device.extra = {HOSTILE: HOSTILE}
    record.inventory = {"env": {HOSTILE: HOSTILE}, "list": [HOSTILE, {"k": HOSTILE}]}
    record.config[HOSTILE] = HOSTILE
    record.config["precision"] = HOSTILE
    record.model.class_name = HOSTILE
    record.breakdown.seconds[HOSTILE] = 0.01
    record.breakdown.device_seconds_by_kernel_class = {HOSTILE: 0.01}
    record.findings.append(
        Finding(
            id=HOSTILE,
            category=HOSTILE,
            severity=HOSTILE,
            title=HOSTILE,  # type: ignore[arg-type]
            evidence={HOSTILE: [HOSTILE], "n": {HOSTILE: HOSTILE}},
            fix=HOSTILE,
            detail=HOSTILE,
            source=HOSTILE,
            est_seconds_saved_per_it=1.0,
            saving_basis=HOSTILE,  # type: ignore[arg-type]
        )
    )
    record.probes.append(
        ProbeResult(
            name=HOSTILE,
            status="error",
            reason=HOSTILE,
            traceback=HOSTILE,
            checks=[Check(HOSTILE, "ok", HOSTILE, HOSTILE)],
            data={HOSTILE: HOSTILE},
        )
    )
    record.probes.append(ProbeResult(name="s", status="skipped", reason=HOSTILE))
    record.top_ops.append(OpStat(name=HOSTILE, input_shapes=HOSTILE, input_dtypes=HOSTILE))
    record.notes.append(HOSTILE)
    record.command = HOSTILE
    record.trace_path = HOSTILE
    record.created = HOSTILE
    record.tool_version = HOSTILE
    return record


@dataclass
class Page(HTMLParser):
    """The parts of a page the tests look at."""

    tags: list[str] = field(default_factory=list)
    attrs: list[tuple[str, str, str]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    title: str = ""
    _in_title: bool = False

    def __post_init__(self) -> None:
        super().__init__(convert_charrefs=True)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend((tag, name, value or "") for name, value in attrs)
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._in_title:
            self.title += data


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


# ---------------------------------------------------------------------------------------------


def test_title_and_headline_come_first() -> None:
    html = render_html(run_record())
    page = parse(html)
    assert page.title == "diagnose: 45.7 ms/it on NVIDIA GeForce RTX 4090"
    assert html.startswith("<!DOCTYPE html>")
    headline = html.index('class="headline"')
    assert "45.7 ms/it" in html[headline : headline + 200]
    assert "median of 4 unprofiled steps, IQR 45.5–45.9 ms" in html
    assert "SD 1.5 (tiny) LoRA rank 16, fp16, AdamW, 512/768 px, batch 2" in html
    # The first screen in the order DESIGN.md asks for.
    order = [html.index(f'id="{section}"') for section in ("number", "where", "why", "checked")]
    assert order == sorted(order)
    assert html.index('id="checked"') < html.index('id="steps"')


def test_findings_appear_in_ranked_order() -> None:
    html = render_html(run_record())
    positions = [
        html.index(t)
        # Critical first, then warn, then info, whatever the saving.
        for t in ("Third: not quantified", "Second biggest cost", "First biggest cost")
    ]
    assert positions == sorted(positions)
    assert "measured (A/B)" in html and "estimated" in html and "not quantified" in html
    assert "No slow-down found" not in html


def test_empty_state_names_what_ran() -> None:
    record = run_record()
    record.findings = []
    html = render_html(record)
    assert "No slow-down found by the checks that ran." in html
    assert "Ran: precision." in html


def test_error_probe_shows_reason_and_escaped_traceback() -> None:
    html = render_html(run_record())
    assert "ImportError: no libbitsandbytes" in html
    assert re.search(
        r"<details class=\"traceback\"><summary>Traceback</summary><pre>"
        r"Traceback \(most recent call last\):\nImportError: &lt;lib&gt; &amp; co"
        r"</pre></details>",
        html,
    )
    assert "GEMMs run in fp16" in html


def test_nested_evidence_is_a_table() -> None:
    html = render_html(run_record())
    assert "1, 2.5, x" in html
    assert '<table class="kv nested">' in html


@pytest.mark.parametrize("make", [run_record, hostile_record, RunRecord])
def test_no_external_reference(make: type[RunRecord]) -> None:
    html = render_html(make())
    assert "http://" not in html and "https://" not in html
    page = parse(html)
    assert not {"script", "link", "iframe", "object", "embed", "img", "base", "form"} & set(
        page.tags
    )
    for tag, name, value in page.attrs:
        assert not name.startswith("on"), (tag, name)
        if name in {"src", "href", "xlink:href", "action", "data", "poster", "srcset"}:
            assert value.startswith("#"), (tag, name, value)
        assert "url(" not in value or re.fullmatch(r"url\(#[\w-]+\)", value), (tag, name, value)
    assert not re.search(r"url\((?!#)", html)
    assert "@import" not in html and "@font-face" not in html


def test_hostile_strings_are_escaped() -> None:
    html = render_html(hostile_record())
    page = parse(html)
    # Nothing from the record became a tag or an attribute.
    assert "script" not in page.tags and "img" not in page.tags
    assert not any(name.startswith("on") for _, name, _ in page.attrs)
    assert "<script" not in html.lower() and "<img" not in html.lower()
    # ...and it is all still there, as text.
    text = "".join(page.text)
    assert text.count(SCRIPT) >= 10
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&#34;&gt;&lt;img src=x onerror=alert(2)&gt;" in html


def test_an_empty_record_renders_not_measured() -> None:
    html = render_html(RunRecord())
    assert parse(html).title == "diagnose: no step time"
    assert '<strong class="big">Not measured</strong>' in html
    assert "Not measured: the record holds no per-phase breakdown." in html
    assert "Not measured: the record holds no step samples." in html
    assert "No slow-down found by the checks that ran." in html
    assert "No probe ran to completion" in html


def test_trace_record_without_model() -> None:
    record = RunRecord(
        mode="trace",
        timing=_timing([], [0.2, 0.21, 0.19]),
        breakdown=Breakdown(seconds={"forward": 0.05, "idle": 0.12}, basis="trace"),
    )
    html = render_html(record)
    assert "trace analysis" in html
    assert "200 ms/it" in html
    assert "3 steps in the trace" in html
    assert "step time read from the profiler trace" in html
    assert "a trace does not say which model ran" in html
    assert "from the trace: phase spans read off the profiler trace" in html
    assert "The trace rules read the trace and none of them found a cost." in html
    assert "a trace analysis reads the trace, it runs no experiment" in html


def test_the_oldest_saved_record_still_renders() -> None:
    path = Path(__file__).resolve().parent.parent / "fixtures" / "records" / "v1_minimal.json"
    html = render_html(load_record(path))
    assert "1.84 s/it" in html
    assert "Attention fell back to the math path in 70 of 70 calls" in html
    assert "how obtained not recorded" in html  # a saving with no basis says so
    assert "package not installed: bitsandbytes" in html
