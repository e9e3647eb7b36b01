"""One rank of `diagnose run --nproc N`: ``python -m diagnose.distributed.worker SPEC``.

Started by :class:`diagnose.distributed.launch.RankJob` with torchrun's environment. The rank
joins the process group (gloo on the CPU, NCCL/RCCL on ``cuda:LOCAL_RANK``), builds the same
workload as every other rank (same config, same seed), wraps the LoRA-wrapped denoiser for the
strategy, and runs the single-process measurement (warm-up, timed steps, profiled steps) with its
collectives in it. It writes its trace and a small record; on failure, a one-line error and the
exit code that goes with it, which the parent shows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diagnose.config import RunConfig
from diagnose.distributed.launch import RankSpec
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import new_record
from diagnose.torch_compat import fsdp1_class, fsdp2_fully_shard


class _DenoiserDDP(DistributedDataParallel):
    """DDP that still answers the wrapped model's attributes (``.config``, ``.dtype``...), which
    the workload's families read from the denoiser, as accelerate's unwrap would give them."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def _is_block(module: torch.nn.Module) -> bool:
    """The transformer blocks FSDP shards one by one (accelerate's transformer-based wrap):
    diffusers' BasicTransformerBlock, FluxTransformerBlock, JointTransformerBlock, ..."""
    return type(module).__name__.endswith("TransformerBlock")


def wrap_denoiser(
    module: torch.nn.Module, strategy: str, device: torch.device, world_size: int
) -> tuple[torch.nn.Module, str]:
    """The denoiser wrapped for ``strategy`` ("ddp" or "fsdp"), and a line saying how."""
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return _DenoiserDDP(module, device_ids=device_ids), "DistributedDataParallel"
    if strategy != "fsdp":
        raise DiagnoseError(f"unknown strategy {strategy!r}", ExitCode.USAGE)
    shard = fsdp2_fully_shard()
    if shard is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size,))
        blocks = [m for m in module.modules() if _is_block(m)]
        for block in blocks:
            shard(block, mesh=mesh)
        shard(module, mesh=mesh)
        return module, f"FSDP2 fully_shard ({len(blocks)} transformer blocks, then the root)"
    wrapped = fsdp1_class()(
        module,
        use_orig_params=True,
        device_id=device if device.type == "cuda" else None,
    )
    return wrapped, "FSDP1 FullyShardedDataParallel (use_orig_params=True)"


def run_rank(spec: RankSpec) -> None:
    """Join the group, build, wrap, measure, write the result."""
    from diagnose.capture import measure
    from diagnose.workload import build_workload

    def say(message: str) -> None:
        with open(spec.progress_path, "a", encoding="utf-8") as progress:
            progress.write(message.replace("\n", " ") + "\n")

    config = RunConfig(**spec.config)
    config.validate()
    local_rank = int(os.environ.get("LOCAL_RANK", spec.rank))
    if spec.device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
    say(f"joining the {backend} process group")
    dist.init_process_group(
        backend,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    try:
        torch.manual_seed(config.seed)
        say("building the model")
        workload = build_workload(config, device)
        try:
            how: list[str] = []

            def wrap(module: torch.nn.Module) -> torch.nn.Module:
                wrapped, line = wrap_denoiser(module, config.strategy, device, spec.world_size)
                how.append(line)
                return wrapped

            workload.wrap_denoiser(wrap)
            measurement = measure(
                workload,
                steps=config.timed_step_plan()[0],
                warmup=config.warmup,
                profiled_steps=config.profiled_steps,
                trace_path=Path(spec.trace_path) if spec.trace_path else None,
                progress=say,
            )
            say("waiting for the other ranks")
            dist.barrier()
            record = new_record("run")
            record.timing = measurement.timing
            record.breakdown = measurement.breakdown
            record.model = workload.model_info
            record.config = config.to_dict()
            record.config["resolution"] = list(workload.resolutions)
            record.config["data"] = dataclasses.asdict(workload.data_info)
            record.notes.extend(how)
            record.save(Path(spec.result_path))
        finally:
            workload.close()
    finally:
        dist.destroy_process_group()


def _write_error(spec: RankSpec, message: str, code: ExitCode) -> None:
    Path(spec.error_path).write_text(
        json.dumps({"message": message, "code": int(code)}), encoding="utf-8"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m diagnose.distributed.worker SPEC.json", file=sys.stderr)
        return int(ExitCode.USAGE)
    spec = RankSpec.load(Path(args[0]))
    try:
        run_rank(spec)
    except DiagnoseError as exc:
        _write_error(spec, exc.message, exc.code)
        return int(exc.code)
    except BaseException as exc:  # the parent shows it in one line; the log keeps the traceback
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        _write_error(spec, f"{type(exc).__name__}: {first}".rstrip(": "), ExitCode.INTERNAL_ERROR)
        return int(ExitCode.INTERNAL_ERROR)
    return int(ExitCode.OK)


if __name__ == "__main__":
    code = main()
    if code == ExitCode.OK:
        # The result is written and the process group destroyed: nothing is left to do. torch's
        # gloo process group now and then aborts a process while its interpreter shuts down
        # ("terminate called without an active exception", plain torchrun scripts too), which
        # would fail the run after its work was done; the rank leaves without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
