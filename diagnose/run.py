"""`diagnose run`: inventory → workload step under the profiler → trace rules → probes → record.

Each stage after the measurement is guarded: a broken trace analysis or probe becomes a note or a
probe error in the record, and the report is still written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diagnose import torch_compat
from diagnose.capture import measure
from diagnose.config import MIN_BUDGETED_STEPS, RunConfig
from diagnose.contention import LoadWindow, threads_for_load
from diagnose.device import describe_device, select_device
from diagnose.entry import seconds_since_entry
from diagnose.errors import DiagnoseError, ExitCode, first_line
from diagnose.finish import Progress, RunOutputs, finish_run, redact_own_trace
from diagnose.inventory import collect_inventory
from diagnose.output import TRACE_NAME
from diagnose.probes.base import Probe, run_workload_probes
from diagnose.probes.environment.facts import FullSizeMemory
from diagnose.record import DeviceInfo, HostLoad, ProbeResult, RunRecord, new_record
from diagnose.strict import StrictOptions, StrictViolation
from diagnose.strict.mode import strict_watch
from diagnose.strict.result import add_strict
from diagnose.telemetry import TelemetrySampler


def resolve_config(config: RunConfig, device_kind: str, memory_bytes: int | None) -> RunConfig:
    """Fill in what the user left to the device: preset, size, resolution buckets."""
    from diagnose.workload import default_preset

    resolved = dataclasses.replace(config)
    if resolved.model_dir is None:
        if resolved.preset is None:
            preset, size = default_preset(device_kind, memory_bytes)
            resolved.preset = preset
            resolved.size = resolved.size or size  # type: ignore[assignment]
        if resolved.size is None:
            resolved.size = "tiny" if device_kind == "cpu" else "full"
    return resolved


def fit_before_running(config: RunConfig, device_kind: str, memory_bytes: int | None) -> str:
    """One line when a full-size model cannot fit the GPU before any activation (its weights as
    ``--base`` stores them, LoRA, gradients, optimizer state), else ''. Said before the model is
    built: building it would only end in an out-of-memory error or a spill. The same
    configuration on the same memory gives the same line: it is counted once and kept.

    One step's activations are not counted here: counting a full-size step on the meta device
    takes seconds before every first step, and on a GPU the step itself says whether they fit.
    When it runs out of memory, :func:`out_of_memory_error` counts them to say why."""
    if device_kind not in ("cuda", "rocm") or not memory_bytes or config.size != "full":
        return ""
    if config.preset is None or config.model_dir is not None:
        return ""
    from diagnose.user_cache import remembered_text

    key = {"config": config.to_dict(), "device_kind": device_kind, "memory_bytes": memory_bytes}
    return remembered_text("weights-fit", key, lambda: _fit_line(config, memory_bytes))


def out_of_memory_error(config: RunConfig, memory_bytes: int | None, error: str) -> DiagnoseError:
    """The error that ends a run whose training step ran out of the GPU's memory (``error``:
    torch's message): for a full-size preset, one step's peak counted on the meta device and
    whether gradient checkpointing would make it fit; else what to lower."""
    said = ""
    if config.size == "full" and config.preset and config.model_dir is None and memory_bytes:
        from diagnose.probes.environment.probe import preset_memory

        full = preset_memory(config, config.preset)
        if full is not None and full.static_bytes <= memory_bytes:
            said = _activations_will_not_fit(config, full, memory_bytes)
    if not said:
        first = first_line(error, 200)
        lower = "lower the batch or resolution"
        if not config.grad_checkpointing:
            lower += ", or train with --grad-checkpointing"
        said = f"{first}: {lower}" if first else lower
    return DiagnoseError(f"the training step ran out of GPU memory: {said}", ExitCode.UNSUPPORTED)


def _fit_line(config: RunConfig, memory_bytes: int) -> str:
    assert config.preset is not None
    from diagnose.probes.environment.probe import preset_memory

    full = preset_memory(config, config.preset)
    if full is None:
        return ""
    gib = 2**30
    if full.static_bytes <= memory_bytes:
        return ""
    said = (
        f"{config.preset} at full size needs {full.static_bytes / gib:.2f} GiB before any "
        f"activation ({full.basis}), more than the GPU's {memory_bytes / gib:.2f} GiB: expect an "
        "out-of-memory error or a spill into system memory"
    )
    # The least lossy stored base that would fit, in the order trainers reach for them.
    order = ("fp8", "nf4")
    tried = order[order.index(config.base) + 1 :] if config.base in order else order
    for kind in tried:
        stored = preset_memory(dataclasses.replace(config, base=kind), config.preset)
        if stored is not None and stored.static_bytes <= memory_bytes:
            needs = f"{stored.static_bytes / gib:.2f} GiB"
            return f"{said}; stored as {kind} it needs {needs}: --base {kind}"
    return f"{said}; no stored base makes it fit"


def _activations_will_not_fit(config: RunConfig, full: FullSizeMemory, memory_bytes: int) -> str:
    """One line when the weights fit but one step's peak (counted on the meta device) does not,
    with whether gradient checkpointing would make it fit; else ''. The run's own step is
    counted first; the checkpointed one only when that does not fit (each count is seconds)."""
    from diagnose.probes.environment.probe import with_activations

    full = with_activations(full, config, checkpointing=config.grad_checkpointing)
    peak = full.peak_bytes(checkpointing=config.grad_checkpointing)
    if peak is None or peak <= memory_bytes:
        return ""
    gib = 2**30
    said = (
        f"{config.preset} at full size peaks at about {peak / gib:.2f} GiB in one step at "
        f"{full.activations_at} (weights and state {full.static_bytes / gib:.2f} GiB, the rest "
        f"activations), more than the GPU's {memory_bytes / gib:.2f} GiB"
    )
    checkpointed = None
    if not config.grad_checkpointing:
        checkpointed = with_activations(full, config, checkpointing=True).peak_bytes(True)
    if checkpointed is None:
        return f"{said}: lower the batch or resolution"
    with_checkpointing = f"with gradient checkpointing about {checkpointed / gib:.2f} GiB"
    if checkpointed <= memory_bytes:
        return f"{said}; {with_checkpointing}: --grad-checkpointing"
    return f"{said}, and {with_checkpointing}: lower the batch or resolution"


def refuse_full_size_on_cpu(config: RunConfig, device_kind: str, force: bool) -> None:
    """A full-size model on a CPU takes hours per step: refuse it unless the user insists."""
    if device_kind != "cpu" or config.size != "full" or config.model_dir is not None or force:
        return
    from diagnose.workload import describe_preset

    assert config.preset is not None
    info = describe_preset(config.preset, "full")
    billions = info.parameters / 1e9
    raise DiagnoseError(
        f"full-size {config.preset} ({billions:.2f} B parameters) on a CPU would take hours per "
        "step; use --size tiny, run on a GPU, or add --force",
        ExitCode.UNSUPPORTED,
    )


def _analyze_own_trace(trace_path: Path, record: RunRecord) -> ProbeResult | None:
    """Apply the passive trace rules to the trace this run captured."""
    import time

    from diagnose.trace.analysis import analysis_to_record, analyze_trace, scale_savings

    start = time.perf_counter()
    plain = record.timing.unprofiled
    unprofiled = plain.median if plain.n and plain.median > 0 else None
    try:
        analysis = analyze_trace(trace_path, unprofiled_step_seconds=unprofiled)
        traced = analysis_to_record(analysis, trace_path)
    except Exception as exc:
        return ProbeResult(
            name="trace",
            status="error",
            reason=f"trace analysis failed: {type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
            duration_seconds=time.perf_counter() - start,
        )
    record.top_ops = traced.top_ops
    record.breakdown.take_device_time(traced.breakdown)
    profiled = traced.timing.profiled
    if unprofiled is not None and profiled.n and 0 < unprofiled < profiled.median:
        # The phase bar is the timed steps': the trace's savings become shares of that step.
        scale_savings(traced.findings, unprofiled / profiled.median)
    result = next((p for p in traced.probes if p.name == "trace"), None)
    if result is None:
        result = ProbeResult(name="trace", findings=traced.findings)
    else:
        result.findings = traced.findings
    result.duration_seconds = time.perf_counter() - start
    return result


def _fit_threads_to_load(load: HostLoad, record: RunRecord) -> None:
    """Give other processes' cores back before the steps are timed (see threads_for_load); the
    inventory keeps the threads torch would have used, which the environment rules judge."""
    threads = torch.get_num_threads()
    fitted = threads_for_load(load, threads)
    if fitted == threads:
        return
    torch.set_num_threads(fitted)
    record.device.extra["torch_threads"] = fitted  # what the steps ran on; compare lists it
    record.notes.append(
        f"Other processes held {load.others_cores:.1f} of the {load.cpus} cores before the "
        f"steps: torch computed on {fitted} thread(s) instead of {threads}, since a thread "
        "that shares a core with another process makes every op wait for it. The s/it is that "
        "of the cores left free; rerun on an idle machine for the whole machine's."
    )


@contextlib.contextmanager
def _stage(into: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into[name] = into.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class PreparedRun:
    """A run's configuration resolved against the device it will train on."""

    config: RunConfig
    device: torch.device
    device_info: DeviceInfo
    #: One line when a full-size model will not fit the GPU, else "".
    will_not_fit: str


def prepare_run(config: RunConfig, *, force: bool = False) -> PreparedRun:
    """Check ``config``, choose the device, fill in what the device decides, refuse what this
    machine cannot run, and say (stderr) when the model will not fit."""
    config.validate()
    device = select_device(config.device)
    device_info = describe_device(device)
    config = resolve_config(config, device_info.kind, device_info.memory_bytes)
    refuse_full_size_on_cpu(config, device_info.kind, force)
    will_not_fit = fit_before_running(config, device_info.kind, device_info.memory_bytes)
    if will_not_fit:
        print(f"diagnose: {will_not_fit}", file=sys.stderr, flush=True)
    return PreparedRun(config, device, device_info, will_not_fit)


def execute_run(
    config: RunConfig,
    out_dir: Path,
    *,
    force: bool = False,
    redact_paths: bool = False,
    probes: Sequence[Probe] | None = None,
    progress: Progress | None = None,
    strict: StrictOptions | None = None,
    prepared: PreparedRun | None = None,
) -> RunOutputs:
    """Measure, analyse and record one process's run into ``out_dir`` (which must already exist);
    ``strict``: the steps measured are watched by strict mode (``--strict``). ``--nproc`` runs
    are :func:`diagnose.commands.run.measure_run`'s to dispatch."""
    from diagnose.workload import build_workload

    say = progress or (lambda message: None)
    prepared = prepared or prepare_run(config, force=force)
    config, device, device_info = prepared.config, prepared.device, prepared.device_info
    will_not_fit = prepared.will_not_fit
    if config.nproc > 1:
        raise ValueError("execute_run measures one process; measure_run dispatches --nproc runs")

    record = new_record("run")
    if will_not_fit:
        record.notes.append(f"Said before running: {will_not_fit}.")
    wall = record.wall_seconds
    wall["start-up"] = seconds_since_entry()
    # On a CPU, the load others put on the cores decides how many threads the step may use; it
    # is read while the inventory and the model are built, which costs nothing extra.
    load = LoadWindow().open() if device_info.kind == "cpu" else None
    try:
        say("collecting the inventory")
        with _stage(wall, "inventory"):
            record.device = device_info
            record.inventory = collect_inventory(device_info.kind, redact_paths=redact_paths)
        record.command = config.command_line()
        torch.manual_seed(config.seed)

        say("building the model")
        with _stage(wall, "build"):
            try:
                workload = build_workload(config, device)
            except torch.cuda.OutOfMemoryError as exc:
                # The weights were held against the GPU before (fit_before_running); what does
                # not fit here is the rest the build makes on the device (the cached latents
                # and text embeddings among it), or memory another process holds.
                raise DiagnoseError(
                    f"building the model ran out of GPU memory: {first_line(str(exc), 200)}: "
                    "lower the batch or resolution, or free the GPU of other processes",
                    ExitCode.UNSUPPORTED,
                ) from None
    finally:
        # Closed on every path: an open window is the one every later comparison consults.
        seen = load.close() if load is not None else None
    threads_before = torch.get_num_threads()
    if seen is not None:
        _fit_threads_to_load(seen, record)
    trace_path = out_dir / TRACE_NAME
    scratch = Path(tempfile.mkdtemp(prefix="diagnose-scratch-"))
    try:
        record.model = workload.model_info
        record.config = config.to_dict()
        # The buckets the workload settled on (the preset's when --resolution was not given).
        record.config["resolution"] = list(workload.resolutions)
        record.config["data"] = dataclasses.asdict(workload.data_info)
        most_steps, budget_s = config.timed_step_plan()
        try:
            with strict_watch(strict, config.precision) as strict_log:
                measurement = measure(
                    workload,
                    steps=most_steps,
                    warmup=config.warmup,
                    profiled_steps=config.profiled_steps,
                    trace_path=trace_path,
                    progress=say,
                    telemetry=TelemetrySampler(device_info),
                    budget_s=budget_s,
                    min_steps=MIN_BUDGETED_STEPS,
                    cycle=len(workload.resolutions),
                )
        except TypeError as exc:
            if "enable_gqa" not in str(exc) or torch_compat.sdpa_takes_enable_gqa():
                raise
            raise DiagnoseError(
                f"{workload.model_info.class_name} cannot train under torch {torch.__version__}: "
                "diffusers' attention passes enable_gqa to scaled_dot_product_attention, which "
                "torch has from 2.5 on (install torch>=2.5, or use --preset sd15, sdxl or sd3)",
                ExitCode.UNSUPPORTED,
            ) from exc
        except torch.cuda.OutOfMemoryError as exc:
            # CUDA's and HIP's alike. Explained here, where the step's own peak is worth its
            # seconds of counting (fit_before_running leaves it out).
            raise out_of_memory_error(config, device_info.memory_bytes, str(exc)) from None
        except StrictViolation:
            assert strict is not None and strict_log is not None
            add_strict(record, strict, [strict_log])
            return finish_run(record, out_dir, None, redact_paths=redact_paths, say=say)
        record.timing = measurement.timing
        record.breakdown = measurement.breakdown
        wall.update(measurement.wall_seconds)
        if measurement.telemetry is not None:
            record.inventory.setdefault("telemetry", {})["during_steps"] = (
                measurement.telemetry.to_dict()
            )
        if measurement.trace_path is not None:
            record.trace_path = measurement.trace_path.name
            say("analysing the trace")
            with _stage(wall, "trace analysis"):
                trace_result = _analyze_own_trace(measurement.trace_path, record)
            if trace_result is not None:
                record.probes.append(trace_result)
        if record.timing.unprofiled.n < 5:
            record.notes.append(
                f"only {record.timing.unprofiled.n} timed steps: the spread is a rough guide; "
                "use --steps 10 or more for a firmer number"
            )
        if probes is None:
            # Imported once the steps are measured: the probes and what they lean on (the trace
            # rules among them) are not needed before the first step.
            from diagnose.probes.registry import REGISTRY

            probes = REGISTRY
        results = run_workload_probes(
            probes,
            config=config,
            device=device,
            device_info=device_info,
            record=record,
            workload=workload,
            scratch_dir=scratch,
            say=say,
        )
        record.probes.extend(results)
        for result in results:
            if result.duration_seconds:
                wall[f"probe {result.name}"] = result.duration_seconds
        if strict is not None and strict_log is not None:
            add_strict(record, strict, [strict_log])
    finally:
        workload.close()
        shutil.rmtree(scratch, ignore_errors=True)
        # The process's thread count is the caller's again (diagnose run as a library call).
        torch.set_num_threads(threads_before)

    saved_trace = measurement.trace_path
    if redact_paths and saved_trace is not None:
        saved_trace = redact_own_trace(saved_trace, record)
    return finish_run(record, out_dir, saved_trace, redact_paths=redact_paths, say=say)
