"""The probe contract and the runner that keeps one probe's failure from reaching the others.

A probe is an independent experiment: it may re-run parts of the training step with one thing
changed (an A/B toggle) and measure what that thing costs. It never takes the run down: an exception
becomes a ProbeResult with status ``error`` and the traceback; a missing package or device becomes
``skipped`` with the reason.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from diagnose import interrupts
from diagnose.contention import LoadWindow, describe
from diagnose.probes.budgets import budget_s, over_budget_text
from diagnose.record import DeviceInfo, ProbeResult, RunRecord

if TYPE_CHECKING:
    import torch

    from diagnose.config import RunConfig


class ProbeSkipped(Exception):
    """Raised by a probe that finds, once running, that it cannot judge anything here."""


@dataclass
class ProbeContext:
    """What a probe may use. Probes must leave global state (torch flags, env) as they found it."""

    config: RunConfig
    device: torch.device
    device_info: DeviceInfo
    #: The record as measured so far (timing, breakdown, trace findings): probes compare against it.
    record: RunRecord
    #: The built workload (diagnose.workload.Workload), or None in trace mode.
    workload: Any = None
    #: A folder the probe may write scratch files into (removed after the run).
    scratch_dir: Path | None = None
    #: Report progress of a long probe ("3/5 backends").
    progress: Callable[[str], None] = field(default=lambda message: None)
    #: When the running probe's time budget ends (``time.perf_counter()``), None without one: a
    #: probe with rounds to spare stops starting new ones after it (:mod:`diagnose.probes.budgets`).
    deadline: float | None = None

    def seconds_left(self) -> float | None:
        """Seconds left of the running probe's budget (negative once spent); None without one."""
        return None if self.deadline is None else self.deadline - time.perf_counter()


@runtime_checkable
class Probe(Protocol):
    """One experiment. Implementations are plain classes listed in ``diagnose.probes.REGISTRY``."""

    #: Stable short name, used by ``--skip NAME`` and in the record.
    name: str
    #: One line: what it looks for.
    description: str
    #: Import names of the packages it needs; a missing one makes it ``skipped``.
    requires_packages: tuple[str, ...]
    #: Device kinds it can judge ("cuda", "rocm", "cpu"); empty means any.
    device_kinds: tuple[str, ...]

    def run(self, ctx: ProbeContext) -> ProbeResult: ...


def _missing_packages(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


@contextmanager
def _torch_state_restored() -> Iterator[None]:
    """Put back the torch switches a probe may flip (SDPA backends, grad mode, TF32, threads)."""
    import torch

    sdpa_flags = {
        name: getattr(torch.backends.cuda, name)()
        for name in (
            "flash_sdp_enabled",
            "mem_efficient_sdp_enabled",
            "math_sdp_enabled",
            "cudnn_sdp_enabled",
        )
        if hasattr(torch.backends.cuda, name)
    }
    grad_enabled = torch.is_grad_enabled()
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        for name, value in sdpa_flags.items():
            # flash_sdp_enabled -> enable_flash_sdp, and likewise for the others.
            setter = getattr(torch.backends.cuda, "enable_" + name.removesuffix("_enabled"), None)
            if setter is not None:
                setter(value)
        torch.set_grad_enabled(grad_enabled)
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        torch.set_num_threads(threads)


def run_probe(
    probe: Probe, ctx: ProbeContext, *, budgets: Mapping[str, float] | None = None
) -> ProbeResult:
    """Run one probe in isolation; whatever happens, return a ProbeResult.

    The probe runs inside a load window: its comparisons are judged against how busy the
    machine was meanwhile, and a comparison the load could explain is said to be set aside. It
    runs within its time budget (``budgets``, default :func:`budgets.budget_s` for the device):
    a result that ended past it says so."""
    interrupts.check()
    kind = ctx.device_info.kind
    budget = budgets.get(probe.name) if budgets is not None else budget_s(probe.name, kind)
    ctx.deadline = None if budget is None else time.perf_counter() + budget
    try:
        with LoadWindow() as window:
            result = _run_alone(probe, ctx)
    finally:
        ctx.deadline = None
    if budget is not None and result.status != "skipped" and result.duration_seconds > budget:
        result.add_not_judged(
            f"{probe.name}.time_budget",
            over_budget_text(probe.name, result.duration_seconds, budget, kind),
            probe.name,
        )
    load = window.load
    if load is not None and result.status == "ok":
        result.host_load = load
        if load.comparisons_set_aside:
            result.add_not_judged(
                f"{probe.name}.machine_busy",
                f"{probe.name}: {describe(load)}; rerun on an idle machine to judge them",
                probe.name,
            )
    return result


def _run_alone(probe: Probe, ctx: ProbeContext) -> ProbeResult:
    start = time.perf_counter()

    def done(result: ProbeResult) -> ProbeResult:
        result.name = probe.name
        result.duration_seconds = time.perf_counter() - start
        result.settle_checks(probe.name)
        return result

    if probe.device_kinds and ctx.device_info.kind not in probe.device_kinds:
        return done(
            ProbeResult(
                status="skipped",
                reason=f"needs a {' or '.join(probe.device_kinds)} device; this run is on "
                f"{ctx.device_info.kind}",
            )
        )
    missing = _missing_packages(probe.requires_packages)
    if missing:
        return done(
            ProbeResult(status="skipped", reason=f"package not installed: {', '.join(missing)}")
        )
    from diagnose import torch_compat  # imports torch: only once a probe runs

    lacks: list[torch_compat.Lack] = []
    try:
        with _torch_state_restored(), torch_compat.lacks_met() as lacks:
            result = probe.run(ctx)
    except ProbeSkipped as exc:
        return done(ProbeResult(status="skipped", reason=str(exc) or "nothing to judge here"))
    except torch_compat.TorchLacks as exc:
        return done(_not_judged_for(probe, lacks, ProbeResult(status="skipped", reason=str(exc))))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a probe's SystemExit or MemoryError must not end the run either
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return done(
            ProbeResult(
                status="error",
                reason=f"{type(exc).__name__}: {first_line}".rstrip(": "),
                traceback=traceback.format_exc(),
            )
        )
    if not isinstance(result, ProbeResult):
        return done(
            ProbeResult(
                status="error",
                reason=f"probe returned {type(result).__name__}, not a ProbeResult",
            )
        )
    return done(_not_judged_for(probe, lacks, result))


def _not_judged_for(probe: Probe, lacks: Sequence[Any], result: ProbeResult) -> ProbeResult:
    """One ``not_judged`` check for each part of torch the probe needed and this torch lacks."""
    for lack in lacks:
        result.add_not_judged(f"{probe.name}.{lack.check_id}", f"{probe.name}: {lack.text()}")
    return result


def run_probes(
    probes: Sequence[Probe],
    ctx: ProbeContext,
    *,
    skip: Sequence[str] = (),
    on_start: Callable[[Probe], None] | None = None,
    budgets: Mapping[str, float] | None = None,
) -> list[ProbeResult]:
    """Run the probes in order; a probe named in ``skip`` is recorded as skipped by the user.
    ``budgets``: seconds per probe name in place of the device's (:mod:`.budgets`)."""
    results = []
    for probe in probes:
        if probe.name in skip:
            results.append(
                ProbeResult(name=probe.name, status="skipped", reason="turned off with --skip")
            )
            continue
        if on_start is not None:
            on_start(probe)
        results.append(run_probe(probe, ctx, budgets=budgets))
    return results


def run_workload_probes(
    probes: Sequence[Probe],
    *,
    config: RunConfig,
    device: torch.device,
    device_info: DeviceInfo,
    record: RunRecord,
    workload: Any,
    scratch_dir: Path,
    say: Callable[[str], None],
) -> list[ProbeResult]:
    """The probes of a run on its own workload (``diagnose run``, each rank of ``run --nproc``):
    ``--skip`` honoured, each announced through ``say``."""
    ctx = ProbeContext(
        config=config,
        device=device,
        device_info=device_info,
        record=record,
        workload=workload,
        scratch_dir=scratch_dir,
        progress=say,
    )
    return run_probes(
        probes, ctx, skip=config.skip_probes, on_start=lambda probe: say(f"probe {probe.name}")
    )
