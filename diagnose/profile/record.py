"""A RunRecord (mode "profile") from the capture of the user's own command.

The trace analysis is the one ``diagnose trace`` runs (one rank, or the ranks compared); what a
capture adds is what a trace cannot say: the s/it from steps timed without the profiler, and what
the trainer really ran (autocast, dtypes, optimizer state, loaders), held against what its command
line claims.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from diagnose.catalogs.compute_catalog import COMPILED_DURING_STEPS, compiled_during_steps_finding
from diagnose.catalogs.precision_catalog import (
    FP32_TRAINING_ID,
    LOW_PRECISION_RUN_SHARE,
    UPCAST_ID,
    claim_not_applied_fix,
    fp32_training_finding,
)
from diagnose.config import Precision
from diagnose.precision_policy import normalize_dtype
from diagnose.profile.claims import PrecisionClaim, precision_claim
from diagnose.profile.device_telemetry import rank_telemetry
from diagnose.profile.launch import LaunchResult, RankCapture
from diagnose.profile.stacks import name_loading_frames, read_stacks
from diagnose.record import Finding, ProbeResult, RunRecord, Stats, StepSample, new_record
from diagnose.redact import redact_command
from diagnose.sampling import INSTALL_HINT
from diagnose.stats import at_line
from diagnose.trainers import SIGNS, speak_to_record, trainer_in_packages, trainer_in_script

#: The ProbeResult that carries the capture's facts and its claimed-vs-actual checks.
CAPTURE_PROBE = "capture"
PRECISION_CLAIM_ID = "profile.precision_claim"
STEPS_ID = "profile.steps_captured"
#: The low-precision dtypes, by the project's short names (diagnose.precision_policy).
_LOW = ("bf16", "fp16")


def profile_record(result: LaunchResult, *, jobs: int | None = None) -> RunRecord:
    """The record of a capture in which at least one process stepped an optimizer."""
    if not result.captures:
        raise ValueError("no capture: the command never completed an optimizer step")
    traced = [c for c in result.captures if c.trace_path is not None and c.trace_path.is_file()]
    record = _analysed(traced, jobs, _unprofiled_step(traced))
    record.mode = "profile"
    pacing_rank = next((s.rank for s in record.ranks if s.paces), None)
    pacing = next(
        (c for c in result.captures if c.rank == pacing_rank),
        traced[0] if traced else result.captures[0],
    )
    _timing_from(record, pacing)
    record.timing.host_load = result.host_load
    # As in `diagnose run`, findings travel with the result that raised them until the record
    # merges them (diagnose.finish.finish_run): the trace's with the "trace" result.
    trace_probe = next((p for p in record.probes if p.name == "trace"), None)
    _scale_to_unprofiled(record)
    if trace_probe is not None:
        trace_probe.findings = record.findings
        record.findings = []
    # Quoted for a shell after each element is redacted (a secret option masks the element after
    # it), as the record's own redaction could not see through shell quotes.
    record.command = redact_command(result.command)
    traced_trainer = record.config.get("trainer")
    record.config = _setup_seen(pacing.facts)
    record.notes += [_separate_note(c, result.captures) for c in result.separate]
    if len(result.captures) > 1 and not record.ranks:
        record.notes.append(
            f"{len(result.captures)} processes stepped an optimizer but "
            f"{'only one' if traced else 'none'} reached its profiled steps: the timing is "
            f"rank {pacing.rank}'s"
        )
    rules = (trace_probe.data.get("rules") or {}) if trace_probe is not None else {}
    record.probes.append(
        capture_result(
            result, pacing, trace_probe.findings if trace_probe else [], rules.get("precision")
        )
    )
    _speak_to_trainer(record, traced_trainer, pacing.facts)
    # What the GPU did during the steps the s/it was timed in, read by the environment rules.
    record.inventory.setdefault("telemetry", {})["during_steps"] = rank_telemetry(
        pacing.facts, result.telemetry
    ).to_dict()
    return record


def _separate_note(capture: RankCapture, job: Sequence[RankCapture]) -> str:
    """One line on a process that stepped as a rank another process holds (see
    :func:`diagnose.profile.launch.one_capture_per_rank`)."""
    holder = next((c for c in job if c.rank == capture.rank), None)
    beside = ""
    if holder is not None:
        how = "forked by" if capture.facts.get("ppid") == holder.pid else "started beside"
        beside = f", a process {how} pid {holder.pid}"
    timed = capture.timed_step_s
    measured = f"{len(timed)} step(s) timed" + (
        f", median {Stats.of(timed).median * 1e3:.3g} ms" if timed else ""
    )
    trace = (
        f"; its trace is {capture.trace_path.name} (diagnose trace reads it alone)"
        if capture.trace_path is not None
        else ""
    )
    return (
        f"pid {capture.pid}{beside}, stepped an optimizer as rank {capture.rank} too, outside any "
        f"torch.distributed job: its own capture, kept apart, not a second rank {capture.rank} "
        f"({measured}){trace}. This record is pid {holder.pid if holder else '?'}'s steps."
    )


def _speak_to_trainer(record: RunRecord, traced: object, facts: Mapping[str, Any]) -> None:
    """The fixes in the words of the trainer the trace showed, or else the one a module of whose
    the trainer's process imported, or else the one whose script it ran; in every trainer's words
    (the generic form) when none of them shows."""
    if isinstance(traced, str) and traced in SIGNS:
        speak_to_record(record, traced, f"the trace holds {SIGNS[traced].ranges_seen_as}")
        return
    loaded = facts.get("packages_loaded") or []
    trainer = trainer_in_packages(str(p) for p in loaded if isinstance(p, str))
    if trainer is not None:
        packages = [p for p in SIGNS[trainer].packages if p in loaded]
        speak_to_record(record, trainer, f"the profiled process imported {', '.join(packages)}")
        return
    argv = facts.get("argv") or []
    script = argv[0] if argv and isinstance(argv[0], str) else ""
    trainer = trainer_in_script(script) if script else None
    if trainer is not None:
        name = PurePath(script).name
        speak_to_record(record, trainer, f"it ran {name}, {SIGNS[trainer].script_seen_as}")


def _unprofiled_step(traced: Sequence[RankCapture]) -> float | None:
    """The median step the one traced process timed without the profiler (None with several
    ranks, or none timed): the trace rules judge host time on it."""
    if len(traced) != 1:
        return None
    timed = [s for s in traced[0].timed_step_s if s > 0]
    return statistics.median(timed) if timed else None


def _analysed(
    traced: Sequence[RankCapture], jobs: int | None, unprofiled: float | None = None
) -> RunRecord:
    from diagnose.trace.analysis import analysis_to_record, analyze_trace

    if not traced:
        record = new_record("profile")
        record.notes.append(
            "No step reached the profiler (the command ended or was stopped during the timed "
            "steps): the step time is measured, its breakdown is not."
        )
        return record
    if len(traced) == 1:
        path = traced[0].trace_path
        assert path is not None
        return analysis_to_record(analyze_trace(path, unprofiled_step_seconds=unprofiled), path)
    from diagnose.distributed.ranks import compare_ranks, comparison_record, read_ranks

    ranks, notes = read_ranks([c.trace_path for c in traced if c.trace_path], jobs=jobs)
    comparison = compare_ranks(ranks)
    comparison.notes.extend(notes)
    return comparison_record(comparison)


def _timing_from(record: RunRecord, pacing: RankCapture) -> None:
    """The steps timed without the profiler lead; the trace's steps stay as profiled samples."""
    options = pacing.facts.get("options") or {}
    skipped = int(options.get("skip_steps") or 0)
    timed = [
        StepSample(index=skipped + i, seconds=seconds, profiled=False)
        for i, seconds in enumerate(pacing.timed_step_s)
        if seconds > 0
    ]
    # In run order: the profiled steps come after the timed ones and the probe step between.
    first_profiled = skipped + len(timed) + 1
    profiled = [
        dataclasses.replace(s, index=first_profiled + i)
        for i, s in enumerate(s for s in record.timing.samples if s.profiled)
    ]
    if not profiled:
        profiled = [
            StepSample(index=first_profiled + i, seconds=float(s), profiled=True)
            for i, s in enumerate(pacing.facts.get("profiled_step_s") or [])
            if float(s) > 0
        ]
    record.timing.samples = timed + profiled
    record.timing.warmup_steps = skipped
    record.timing.summarize()


def _scale_to_unprofiled(record: RunRecord) -> None:
    """The trace's seconds as shares of the step the report leads with.

    The s/it is the median of the steps timed without the profiler; the trace's phases and the
    savings its rules read off it come from the profiled steps, which the profiler slows (on a
    CPU, or a host-bound GPU loop, by tens of percent or more). Each is kept as the same share of
    the step, so no phase or saving is larger than the step it is part of. Device time per
    kernel class is not slowed by the host-side profiler and stays as traced.
    """
    plain, traced = record.timing.unprofiled, record.timing.profiled
    if not (plain.n and traced.n) or record.breakdown.basis != "trace":
        return
    if not 0 < plain.median < traced.median:
        return
    from diagnose.trace.analysis import scale_savings

    scale = plain.median / traced.median
    record.breakdown.seconds = {k: v * scale for k, v in record.breakdown.seconds.items()}
    scale_savings(record.findings, scale)
    record.notes.append(
        f"The profiled steps took {traced.median * 1e3:.3g} ms against {plain.median * 1e3:.3g} ms "
        f"without the profiler: the phases and the savings read off the trace are scaled by "
        f"{scale:.2f} to the unprofiled step (each keeps its share), but for the rules that "
        "judged on the unprofiled step themselves (syncs, launch gaps); a title says which "
        "steps its times are on."
    )


def _setup_seen(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a run's configuration the capture saw, under the keys ``diagnose run``
    records them with (the report's one-line setup reads them)."""
    config: dict[str, Any] = {}
    seen = low_precision_seen(facts)
    if seen:
        dtype = max(seen, key=lambda d: seen[d])
        config["precision"] = _mixed_precision(dtype)
    elif int((facts.get("autocast") or {}).get("sampled_steps") or 0):
        config["precision"] = (
            "bf16-full" if _low_weight_share(weight_elements(facts)) >= 0.5 else "fp32"
        )
    optimizer = (facts.get("optimizer") or {}).get("class")
    if isinstance(optimizer, str) and optimizer:
        config["optimizer"] = optimizer.rsplit(".", 1)[-1]
    loaders = [
        d
        for d in facts.get("dataloaders") or []
        if isinstance(d, dict) and d.get("iterated_during_capture")
    ]
    if len(loaders) == 1 and isinstance(loaders[0].get("batch_size"), int):
        config["batch"] = loaders[0]["batch_size"]
    return config


# --------------------------------------------------------------------------------------------
# What the trainer ran, against what its command line says


def _short_dtype(name: object) -> str | None:
    return normalize_dtype(name) if isinstance(name, str) else None


def _mixed_precision(dtype: str | None) -> Precision:
    """The ``RunConfig.precision`` of a run whose low-precision dtype is ``dtype`` (None: fp32)."""
    if dtype == "bf16":
        return "bf16-mixed"
    return "fp16" if dtype == "fp16" else "fp32"


def _low_autocast(state: Mapping[str, Any]) -> tuple[str, ...]:
    """The low-precision dtypes ("bf16"/"fp16") autocast was on with, on any device, in one
    sampled state of the capture (``{"cuda": {...}, "cpu": {...}}``)."""
    on = [state.get(device) for device in ("cuda", "cpu")]
    dtypes = {_short_dtype(s.get("dtype")) for s in on if isinstance(s, dict) and s.get("enabled")}
    return tuple(d for d in _LOW if d in dtypes)


def low_precision_seen(facts: Mapping[str, Any]) -> dict[str, int]:
    """Sampled steps per low-precision autocast dtype ("bf16"/"fp16") on any device."""
    seen: dict[str, int] = {}
    for state in (facts.get("autocast") or {}).get("states") or []:
        for dtype in _low_autocast(state):
            seen[dtype] = seen.get(dtype, 0) + int(state.get("steps") or 0)
    return seen


def weight_elements(facts: Mapping[str, Any]) -> dict[str, int]:
    """Elements per dtype of the trainable and the frozen parameters together."""
    parameters = facts.get("parameters") or {}
    tables = [
        (parameters.get("trainable") or {}).get("params") or {},
        parameters.get("frozen_in_roots") or {},
    ]
    elements: dict[str, int] = {}
    for table in tables:
        for dtype, row in table.items():
            elements[dtype] = elements.get(dtype, 0) + int((row or {}).get("elements") or 0)
    return elements


def claimed_precision_of(record: RunRecord) -> Precision:
    """The ``RunConfig.precision`` that says what the command asked for (what the environment
    rules judge against): its claim, else what its steps ran."""
    capture = next((p for p in record.probes if p.name == CAPTURE_PROBE), None)
    if capture is None:
        return "fp32"
    claimed = capture.data.get("precision_claim")
    if isinstance(claimed, dict):
        return _mixed_precision(claimed.get("dtype"))
    # No claim: the low-precision autocast the steps ran under (the record's setup), else fp32.
    ran = record.config.get("precision")
    return _mixed_precision("bf16" if ran == "bf16-mixed" else "fp16" if ran == "fp16" else None)


def _low_weight_share(elements: Mapping[str, int]) -> float:
    total = sum(elements.values())
    return sum(v for k, v in elements.items() if _short_dtype(k) in _LOW) / total if total else 0.0


def _rank_key(capture: RankCapture, captures: Sequence[RankCapture]) -> str:
    """The rank number, with the process id when two processes claimed the same rank."""
    twins = sum(1 for c in captures if c.rank == capture.rank)
    return str(capture.rank) if twins == 1 else f"{capture.rank}-pid{capture.pid}"


def capture_result(
    result: LaunchResult,
    pacing: RankCapture,
    trace_findings: Sequence[Finding],
    trace_precision: Mapping[str, Any] | None = None,
) -> ProbeResult:
    """The facts of every rank, and the checks that hold them against the command line (a
    finding of the trace that says the same is amended rather than repeated)."""
    probe = ProbeResult(name=CAPTURE_PROBE, status="ok")
    facts = pacing.facts
    options = facts.get("options") or {}
    probe.data = {
        "command": list(result.command),
        "exit_code": result.exit_code,
        "seconds": result.seconds,
        "pacing_rank": pacing.rank,
        "ranks": {_rank_key(c, result.captures): _read_samples(c, result) for c in result.captures},
        "processes": len(result.processes),
        "separate_captures": [
            {
                "pid": c.pid,
                "rank_claimed": c.rank,
                "status": c.status,
                "timed_step_s": c.timed_step_s,
                "trace": c.trace_path.name if c.trace_path is not None else None,
            }
            for c in result.separate
        ],
    }
    pacing_facts = probe.data["ranks"][_rank_key(pacing, result.captures)]
    stacks = pacing_facts.get("stacks")
    if stacks is not None:
        probe.data["stacks"] = stacks
        name_loading_frames(list(trace_findings), stacks)
    else:
        probe.data["stacks"] = {
            "error": f"not sampled: py-spy is not installed ({INSTALL_HINT}) or --no-stacks "
            "was given"
        }
    timed, profiled = len(pacing.timed_step_s), len(facts.get("profiled_step_s") or [])
    text = (
        f"rank {pacing.rank}: {timed} step(s) timed without the profiler and {profiled} "
        f"profiled, after {options.get('skip_steps', 0)} skipped (status: {pacing.status})"
    )
    if pacing.complete:
        probe.add_ok(STEPS_ID, text)
    else:
        probe.add_not_judged(STEPS_ID, text)
    argv = [*result.command, *[str(w) for w in facts.get("argv") or []]]
    claim = precision_claim(argv)
    if claim is not None:
        probe.data["precision_claim"] = {"dtype": claim.dtype, "said": claim.said}
    _judge_precision_claim(probe, claim, facts, trace_findings, trace_precision)
    _judge_compilation(probe, facts, len(pacing.timed_step_s))
    return probe


def _judge_compilation(probe: ProbeResult, facts: Mapping[str, Any], timed: int) -> None:
    """Whether torch.compile compiled anything while the s/it was timed (dynamo's counters at the
    first and the last timed step)."""
    check = COMPILED_DURING_STEPS.id
    dynamo = facts.get("dynamo") or {}
    ever = _count(dynamo.get("counters"), "frames", "total")
    during = dynamo.get("during_timed_steps")
    if not ever:
        probe.add_ok(check, "compile: no code was compiled by torch.compile in this process")
        return
    if not isinstance(during, Mapping) or not timed:
        probe.add_not_judged(
            check, "compile: the capture has no count of compilation during the timed steps"
        )
        return
    frames = _count(during, "frames", "total")
    if not frames:
        probe.add_ok(
            check,
            f"compile: nothing was compiled during the {timed} timed steps (torch.compile had "
            f"compiled {ever} frame(s) before them)",
        )
        return
    breaks = during.get("graph_break")
    graph_breaks = (
        {str(k): int(v) for k, v in breaks.items() if isinstance(v, int)}
        if isinstance(breaks, Mapping)
        else {}
    )
    probe.add_finding(
        compiled_during_steps_finding(
            frames=frames,
            graphs=_count(during, "stats", "unique_graphs"),
            timed_steps=timed,
            graph_breaks=graph_breaks,
            evidence={
                "compiled_frames_during_timed_steps": frames,
                "timed_steps": timed,
                "dynamo_counters_during_timed_steps": dict(during),
            },
            source=CAPTURE_PROBE,
        )
    )


def _count(counters: object, group: str, key: str) -> int:
    """One of dynamo's counters as the capture recorded them (0 when absent)."""
    table = counters.get(group) if isinstance(counters, Mapping) else None
    value = table.get(key) if isinstance(table, Mapping) else None
    return value if isinstance(value, int) and value > 0 else 0


def _read_samples(capture: RankCapture, result: LaunchResult) -> dict[str, Any]:
    """The rank's facts, with py-spy's file read into ranked frames and its GPU's telemetry cut
    to its timed steps."""
    facts = dict(capture.facts)
    if facts.get("stacks") is not None:
        facts["stacks"] = read_stacks(facts, capture.facts_path.parent)
    telemetry = rank_telemetry(facts, result.telemetry).to_dict()
    # The samples themselves only for the pacing rank, in the inventory (as a run has them).
    facts["telemetry"] = {key: value for key, value in telemetry.items() if key != "samples"}
    return facts


def _computed_share(trace_precision: Mapping[str, Any] | None) -> float | None:
    """The precision rule's share of the traced matmul/conv/attention calls that ran in low
    precision (None: the trace judged no call)."""
    share = (trace_precision or {}).get("low_precision_share")
    return float(share) if isinstance(share, (int, float)) else None


def _trainable_autocast(facts: Mapping[str, Any]) -> tuple[int, int, list[str]]:
    """Of the trained modules the probe step called: how many ran under low-precision
    autocast, how many in all, and examples of those that ran with it off."""
    low = total = 0
    off: list[str] = []
    for group in (facts.get("autocast") or {}).get("trainable_modules") or []:
        count = int(group.get("modules") or 0)
        total += count
        if _low_autocast(group):
            low += count
        else:
            off.extend(str(e) for e in group.get("examples") or [])
    return low, total, off


def _judge_precision_claim(
    probe: ProbeResult,
    claim: PrecisionClaim | None,
    facts: Mapping[str, Any],
    trace_findings: Sequence[Finding],
    trace_precision: Mapping[str, Any] | None,
) -> None:
    if claim is None:
        probe.add_not_judged(
            PRECISION_CLAIM_ID,
            "precision: the command line names none (--mixed_precision, --precision, --bf16 …): "
            "no claim to hold the steps against",
        )
        return
    sampled = int((facts.get("autocast") or {}).get("sampled_steps") or 0)
    autocast = low_precision_seen(facts)
    weights = weight_elements(facts)
    low_weights = _low_weight_share(weights)
    computed = _computed_share(trace_precision)
    low_modules, trained_modules, _ = _trainable_autocast(facts)
    per_dtype = ", ".join(f"{d} at {n} of {sampled} sampled step(s)" for d, n in autocast.items())
    seen = [
        f"autocast {per_dtype}"
        if autocast
        else f"no low-precision autocast at any of {sampled} sampled step(s)"
    ]
    if trained_modules:
        seen.append(
            f"{low_modules} of {trained_modules} trained module(s) ran under it"
            if autocast
            else f"{low_modules} of {trained_modules} trained module(s) under low-precision "
            "autocast"
        )
    seen.append(f"{low_weights:.0%} of the parameters' elements in bf16/fp16")
    if computed is not None:
        # What computed is the trace's to say; the samples say why.
        seen.insert(0, f"{computed:.0%} of the traced matmul/conv/attention calls in bf16/fp16")
    ran = "; ".join(seen)
    if claim.dtype == "fp32":
        probe.add_ok(PRECISION_CLAIM_ID, f"precision: `{claim.said}` asks for fp32; {ran}")
        return
    if not sampled and not weights and computed is None:
        probe.add_not_judged(
            PRECISION_CLAIM_ID,
            f"precision: `{claim.said}` asks for {claim.dtype}; no step was sampled to check it",
        )
        return
    applied = (
        at_line(computed, LOW_PRECISION_RUN_SHARE).above
        if computed is not None
        else bool(autocast) or low_weights >= 0.5
    )
    if applied:
        other = sorted(set(autocast) - {claim.dtype})
        probe.add_ok(
            PRECISION_CLAIM_ID,
            f"precision: `{claim.said}` asks for {claim.dtype}; {ran}"
            + (f" (also {', '.join(other)})" if other else ""),
        )
        _name_autocast_off(facts, trace_findings)
        return
    # The claim did not apply: the steps computed in fp32 whatever the flag says.
    said = f"the command asks for {claim.dtype} (`{claim.said}`) but its steps ran with {ran}"
    evidence = {
        "claimed": claim.said,
        "claimed_dtype": claim.dtype,
        "autocast": autocast,
        "weight_elements": weights,
        "sampled_steps": sampled,
        "trained_modules_under_autocast": [low_modules, trained_modules],
        "traced_low_precision_share": computed,
    }
    existing = next((f for f in trace_findings if f.id == FP32_TRAINING_ID), None)
    fix = claim_not_applied_fix(claim.said, claim.dtype)
    if existing is not None:
        existing.title = f"{existing.title}; {said}"
        existing.evidence = {**existing.evidence, "claim": evidence}
        existing.fix = fix
        return
    finding: Finding = fp32_training_finding(
        how_known=said,
        low=claim.dtype,
        evidence=evidence,
        saving=None,
        basis="none",
        detail=(
            "The capture sampled autocast at the trained modules' forward in the timed, probe "
            "and profiled steps and read the dtypes of the optimizer's and the called modules' "
            "parameters. A precision flag the script does not pass to its autocast (or to "
            "accelerate) leaves the whole step in fp32."
        ),
        source=CAPTURE_PROBE,
    )
    finding.fix = fix
    probe.add_finding(finding)


def _name_autocast_off(facts: Mapping[str, Any], trace_findings: Sequence[Finding]) -> None:
    """An upcast the trace found, in a step that ran under autocast: name the trained modules
    that ran with autocast turned off, which is where to look for the upcast."""
    upcast = next((f for f in trace_findings if f.id == UPCAST_ID), None)
    low, total, off = _trainable_autocast(facts)
    if upcast is None or not low or low == total:
        return
    upcast.evidence = {
        **upcast.evidence,
        "autocast_off_in_trained_modules": {"modules": total - low, "of": total, "examples": off},
    }
    said = (
        f"The capture saw autocast turned off in {total - low} of the {total} trained modules "
        f"of a step, e.g. {', '.join(off[:3])}: the code around them disables it or casts to "
        "fp32."
    )
    upcast.detail = f"{upcast.detail} {said}".strip()


__all__ = [
    "CAPTURE_PROBE",
    "PRECISION_CLAIM_ID",
    "STEPS_ID",
    "capture_result",
    "claimed_precision_of",
    "low_precision_seen",
    "profile_record",
    "weight_elements",
]
