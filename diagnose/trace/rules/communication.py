"""Communication on one rank's trace: collective time with nothing else running.

A data-parallel step spends time in collectives (all-reduce for DDP, all-gather and
reduce-scatter for FSDP). The part no compute runs beside (on a GPU no other kernel or copy on
the device, on a CPU no operator on the training or autograd threads; see
:mod:`diagnose.distributed.collectives`) is exposed: the step waits for it. One rank's trace
cannot tell a transfer from a wait for a slower rank, so the finding says both; every rank's
trace read together (:mod:`diagnose.distributed.ranks`) refines it on the rank that waits least.
Ids, lines and wording live in :mod:`diagnose.catalogs.distributed_catalog`.
"""

from __future__ import annotations

import statistics

from diagnose.catalogs import distributed_catalog as catalog
from diagnose.distributed.collectives import communication_of
from diagnose.record import ProbeResult
from diagnose.stats import at_line
from diagnose.trace.context import TraceContext

RULE = "communication"


def check(ctx: TraceContext) -> ProbeResult:
    result = ProbeResult(name=RULE)
    comm = communication_of(ctx)
    steps = [s for s in comm.steps if s.wall_seconds > 0]
    if not comm.found or not steps:
        return result  # no collectives: not a distributed step, nothing to ask
    step = statistics.median(s.wall_seconds for s in steps)
    exposed = comm.median("exposed_seconds")
    in_collectives = comm.median("comm_seconds")
    reading = at_line(
        exposed / step,
        catalog.RAISE_SHARE,
        samples=[s.exposed_seconds / s.wall_seconds for s in steps],
    )
    kinds = sorted({k for s in steps for k in s.by_kind})
    by_kind = {k: statistics.median(s.by_kind.get(k, 0.0) for s in steps) for k in kinds}
    evidence: dict[str, object] = {
        "exposed_seconds_per_step": exposed,
        "comm_seconds_per_step": in_collectives,
        "share_of_step": reading.value,
        "share_interval": reading.share_interval(),
        "interval_note": catalog.INTERVAL_NOTE,
        "by_kind_seconds": by_kind,
        "collectives_read_from": (
            "NCCL/RCCL kernels on the device" if comm.where == "device" else "gloo host ranges"
        ),
        "steps": [
            {
                "step": s.number,
                "comm_ms": round(s.comm_seconds * 1e3, 3),
                "exposed_ms": round(s.exposed_seconds * 1e3, 3),
            }
            for s in steps
        ],
    }
    result.data = evidence
    if reading.below:
        result.add_ok(
            catalog.EXPOSED_COMM_ID, catalog.hidden_comm_line(exposed, in_collectives, step)
        )
        return result
    result.add_finding(
        catalog.exposed_finding(
            rank=ctx.device.rank,
            exposed=exposed,
            reading=reading,
            step_seconds=step,
            by_kind=by_kind,
            evidence=evidence,
            source=f"trace:{RULE}",
            single_rank=True,
        )
    )
    return result


__all__ = ["RULE", "check"]
