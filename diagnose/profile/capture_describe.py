"""What the in-process capture says about the user's objects: modules, optimizer, device, loaders.

Pure functions over what the capture hands them (the probe step's called modules, the stepping
optimizer, a DataLoader, torch's autocast and dynamo state read through ``torch_compat``); the
state machine that decides when each runs is :mod:`diagnose.profile.capture`. Like it, this file
is loaded by path inside the user's processes, so it imports nothing from ``diagnose`` and torch
only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diagnose.profile.capture import _Capture

#: Per-dtype and per-key tables are cut at this many entries (a corrupt state must not make the
#: facts file huge); dynamo counter names (graph-break reasons) at this many characters.
MAX_KEYS = 64
MAX_NAME = 200
#: DataLoaders remembered per process (one per distinct loader object).
MAX_LOADERS = 32
#: Training frameworks whose import is recorded: which one drives the loop decides the words a
#: fix is written in (diagnose.trainers reads them; its SIGNS' modules are all here, which a test
#: holds: this file cannot import diagnose, which the trainer's Python may lack).
FRAMEWORK_PACKAGES = (
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "diffusers",
    "peft",
    "bitsandbytes",
    # Modules of the trainers' own source trees (kohya's sd-scripts, OneTrainer, ai-toolkit,
    # SimpleTuner), imported from the folder their scripts run in.
    "library.train_util",
    "modules.trainer.GenericTrainer",
    "modules.trainer.BaseTrainer",
    "toolkit.job",
    "jobs.process.BaseSDTrainProcess",
    "simpletuner",
    "helpers.training.state_tracker",
    "helpers.training.trainer",
)

#: The probe step's called modules: ``id(module)`` -> (the module, the autocast state it ran under).
Called = dict[int, tuple[Any, dict[str, dict[str, Any]]]]


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def qualified(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


class Tally:
    """Counts and element counts per key (a dtype name, usually)."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, int]] = {}

    def add(self, key: str, elements: int) -> None:
        row = self.table.get(key)
        if row is None:
            if len(self.table) >= MAX_KEYS:
                return
            row = self.table[key] = {"count": 0, "elements": 0}
        row["count"] += 1
        row["elements"] += elements


# -- the process ----------------------------------------------------------------------------


def describe_rank() -> dict[str, Any]:
    """This process's rank, local rank and world size: torch.distributed's when it is
    initialised, else the launcher's environment, else rank 0 of 1."""

    def env_int(name: str) -> int | None:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    source = "environment" if rank is not None else "default"
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
            source = "torch.distributed"
    return {
        "rank": rank if rank is not None else 0,
        "local_rank": env_int("LOCAL_RANK"),
        "world_size": world if world is not None else 1,
        "rank_source": source,
    }


def describe_process() -> dict[str, Any]:
    """This process's parent, command line and interpreter, as the process file lists them."""
    # A spawn/forkserver child: its sys.argv is the parent's by now, its command line not.
    original = list(getattr(sys, "orig_argv", []))
    parent = sys.modules.get("multiprocessing.process")
    child = "--multiprocessing-fork" in original or bool(
        parent and getattr(parent, "_parent_process", None) is not None
    )
    return {
        "ppid": os.getppid(),
        "argv": list(sys.argv),
        "orig_argv": original,
        "executable": sys.executable,
        "multiprocessing_child": child,
    }


def packages_loaded() -> list[str]:
    """The training frameworks this process has imported."""
    return [name for name in FRAMEWORK_PACKAGES if name in sys.modules]


def capture_facts(
    capture: _Capture, dynamo_now: dict[str, dict[str, int]] | None
) -> dict[str, Any]:
    """What ``capture`` has measured and seen, as its facts file says it (``dynamo_now``: the
    dynamo counters at this moment)."""
    import torch

    s = capture.settings
    return {
        **capture.identity,
        "pid": capture.pid,
        "ppid": os.getppid(),
        "argv": list(sys.argv),
        "executable": sys.executable,
        "python": sys.version.split()[0],
        "torch": getattr(torch, "__version__", None),
        "device": capture.device,
        "options": {
            "skip_steps": s.skip_steps,
            "timed_steps": s.timed_steps,
            "profiled_steps": s.profiled_steps,
            "stop_after": s.stop_after,
        },
        "steps_seen": capture.steps,
        "first_step_s": capture.first_step_s,
        "process_started_unix": capture.started_unix,
        "timed_started_unix": capture.timed_started_unix,
        "timed_ended_unix": capture.timed_ended_unix,
        "timed_step_s": list(capture.timed),
        "profiled_step_s": list(capture.profiled),
        "trace": capture.trace_name,
        "profiler_note": capture.profiler_note,
        "stacks": capture.stacks,
        "autocast": {
            "sampled_steps": len(capture.autocast_samples),
            "states": autocast_states(capture.autocast_samples),
            "roots": capture.root_autocast,
            "trainable_modules": capture.trainable_autocast,
        },
        "parameters": capture.parameters,
        "optimizer": capture.optimizer_facts,
        "other_optimizer_steps": dict(capture.other_steps),
        "packages_loaded": packages_loaded(),
        "dataloaders": capture.loaders.facts(),
        "dynamo": {
            "loaded": dynamo_now is not None,
            "counters": dynamo_now or {},
            "during_capture": counter_delta(capture.dynamo_before, dynamo_now),
            # The steps the s/it is timed in: what compiled there is in the s/it.
            "during_timed_steps": counter_delta(capture.dynamo_before, capture.dynamo_timed_end),
        },
    }


# -- autocast and dynamo ----------------------------------------------------------------------


def autocast_state(compat: ModuleType) -> dict[str, dict[str, Any]]:
    """Whether autocast is on for CUDA (ROCm too) and CPU, and its dtype, right now (``compat``:
    diagnose's ``torch_compat`` module)."""
    state: dict[str, dict[str, Any]] = {}
    for device in ("cuda", "cpu"):
        enabled = compat.is_autocast_enabled(device)
        dtype = compat.autocast_dtype(device) if enabled else None
        state[device] = {"enabled": enabled, "dtype": dtype_name(dtype) if enabled else None}
    return state


def state_group(
    groups: list[dict[str, Any]], state: Mapping[str, Any], counters: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The group of ``groups`` with ``state``'s autocast (CUDA and CPU alike), made with
    ``counters`` when there is none; None when ``groups`` is full."""
    for group in groups:
        if group["cuda"] == state["cuda"] and group["cpu"] == state["cpu"]:
            return group
    if len(groups) >= MAX_KEYS:
        return None
    group = {**state, **counters}
    groups.append(group)
    return group


def autocast_states(samples: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The distinct autocast states of the sampled steps, each with its number of steps."""
    states: list[dict[str, Any]] = []
    for sample in samples:
        state = state_group(states, sample, {"steps": 0})
        if state is not None:
            state["steps"] += 1
    return states


def dynamo_counters(compat: ModuleType) -> dict[str, dict[str, int]] | None:
    """``torch._dynamo``'s counters when dynamo is loaded (never imported here)."""
    counters = compat.dynamo_counters()
    if counters is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for group, table in list(counters.items())[:MAX_KEYS]:
        rows = {}
        for key, value in list(table.items())[:MAX_KEYS]:
            try:
                rows[str(key)[:MAX_NAME]] = int(value)
            except (TypeError, ValueError):
                continue
        out[str(group)] = rows
    return out


def counter_delta(
    before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None
) -> dict[str, dict[str, int]]:
    if after is None:
        return {}
    before = before or {}
    delta: dict[str, dict[str, int]] = {}
    for group, rows in after.items():
        changed = {
            key: value - before.get(group, {}).get(key, 0)
            for key, value in rows.items()
            if value != before.get(group, {}).get(key, 0)
        }
        if changed:
            delta[group] = changed
    return delta


# -- the probe step's modules -----------------------------------------------------------------


def holds_any(module: Any, parameter_ids: frozenset[int]) -> bool:
    """Whether ``module`` itself (not a submodule) holds one of the parameters."""
    return any(id(p) in parameter_ids for p in getattr(module, "_parameters", {}).values())


def module_names(called: Called) -> dict[int, str]:
    """Dotted names of the called modules, from the first called module that holds each (its
    class name first): ``UNet2DConditionModel.mid_block.attentions.0...``."""
    names: dict[int, str] = {}
    for key, (module, _) in called.items():
        if key in names:
            continue
        with contextlib.suppress(Exception):
            prefix = type(module).__name__
            for name, sub in module.named_modules():
                names.setdefault(id(sub), f"{prefix}.{name}" if name else prefix)
    return names


def distinguishing(names: list[str], others: list[str]) -> list[str]:
    """The shortest dotted prefixes that cover ``names`` and no name of ``others``, in order:
    the modules of one autocast state as the blocks that hold them (``UNet.mid_block``)."""
    found: list[str] = []
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if not any(o == prefix or o.startswith(prefix + ".") for o in others):
                break
        if not any(prefix == f or prefix.startswith(f + ".") for f in found):
            found.append(prefix)
    return found


def trainable_autocast(called: Called, trainable: frozenset[int]) -> list[dict[str, Any]]:
    """The probe step's modules that hold trained parameters (ids in ``trainable``), grouped by
    autocast state: where a block ran with autocast off inside an autocast step, its group
    names it."""
    groups: list[dict[str, Any]] = []
    if not trainable:
        return groups
    names = module_names(called)
    for key, (module, autocast) in called.items():
        if not holds_any(module, trainable):
            continue
        group = state_group(groups, autocast, {"modules": 0, "examples": []})
        if group is None:
            continue
        group["modules"] += 1
        group["examples"].append(names.get(key) or qualified(type(module)))
    for group in groups:
        others = [n for g in groups if g is not group for n in g["examples"]]
        group["examples"] = [
            name[:MAX_NAME] for name in distinguishing(group["examples"], others)[:3]
        ]
    return groups


def root_modules(called: Called) -> list[tuple[Any, dict[str, dict[str, Any]]]]:
    """The probe step's root modules, with the autocast state each ran under: those called that
    are no submodule of a module called before them (a module called while no other module's
    forward runs, for ordinary models)."""
    covered: set[int] = set()
    roots = []
    fx = sys.modules.get("torch.fx")
    graph_module = getattr(fx, "GraphModule", None) if fx is not None else None
    for key, (module, autocast) in called.items():
        if key in covered:
            continue
        if graph_module is not None and isinstance(module, graph_module):
            continue  # a torch.compile graph, run inside a compiled module's forward
        roots.append((module, autocast))
        for sub in module.modules():
            covered.add(id(sub))
    return roots


def frozen_in_roots(roots: list[Any]) -> dict[str, dict[str, int]]:
    """The frozen parameters of the root modules, per dtype (each parameter once)."""
    frozen_params, frozen_seen = Tally(), set()
    for root in roots:
        for parameter in root.parameters():
            if id(parameter) in frozen_seen or parameter.requires_grad:
                continue
            frozen_seen.add(id(parameter))
            frozen_params.add(dtype_name(parameter.dtype), parameter.numel())
    return frozen_params.table


# -- the optimizer and its device -------------------------------------------------------------


def describe_trainable(optimizer: Any) -> dict[str, Any]:
    params, grads = Tally(), Tally()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            params.add(dtype_name(parameter.dtype), parameter.numel())
            grad = parameter.grad
            grads.add("none" if grad is None else dtype_name(grad.dtype), parameter.numel())
    return {"params": params.table, "grads": grads.table}


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    import torch

    state_dtypes: dict[str, Tally] = {}
    count = elements = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            count += 1
            elements += parameter.numel()
            for key, value in optimizer.state.get(parameter, {}).items():
                name = str(key)[:MAX_NAME]
                if name not in state_dtypes:
                    if len(state_dtypes) >= MAX_KEYS:
                        continue
                    state_dtypes[name] = Tally()
                if isinstance(value, torch.Tensor):
                    state_dtypes[name].add(dtype_name(value.dtype), value.numel())
                else:
                    state_dtypes[name].add(type(value).__name__, 0)
    hyper: dict[str, Any] = {}
    groups = optimizer.param_groups
    for key, value in groups[0].items() if groups else ():
        if key == "params":
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            hyper[str(key)] = value
        elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
            hyper[str(key)] = list(value)
    return {
        "class": qualified(type(optimizer)),
        "param_groups": len(groups),
        "params": count,
        "elements": elements,
        "state_dtypes": {key: tally.table for key, tally in state_dtypes.items()},
        "hyperparameters": hyper,
    }


def describe_device(optimizer: Any) -> dict[str, Any]:
    import torch

    device: Any = None
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            device = parameter.device
            break
        break
    kind = "unknown" if device is None else str(device.type)
    facts: dict[str, Any] = {"kind": kind, "type": kind}
    if kind == "cuda":
        if getattr(torch.version, "hip", None):
            facts["kind"] = "rocm"
        with contextlib.suppress(Exception):
            index = device.index
            index = torch.cuda.current_device() if index is None else index
            facts["index"] = int(index)
            props = torch.cuda.get_device_properties(index)
            facts["name"] = str(props.name)
            # Which GPU the driver's telemetry must read (the parent matches it by bus).
            for key in ("pci_domain_id", "pci_bus_id", "pci_device_id"):
                value = getattr(props, key, None)
                if isinstance(value, int):
                    facts[key] = value
    return facts


# -- DataLoaders ------------------------------------------------------------------------------


class LoaderLog:
    """The DataLoaders a process iterated (one entry per loader object, the first few), and the
    batches each yielded while the capture watched."""

    def __init__(self) -> None:
        self.entries: dict[int, dict[str, Any]] = {}
        #: Batches each loader's iterator had yielded when the capture's window opened.
        self.yielded_before: dict[int, int] = {}

    def note(self, loader: Any, iterator: Any, step: int, *, watching: bool) -> None:
        """``loader`` made ``iterator`` at ``step``; ``watching``: inside the capture's window."""
        key = id(loader)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= MAX_LOADERS:
                return
            entry = self.entries[key] = {
                **_describe_loader(loader),
                "iterations": 0,
                "first_iterated_at_step": step,
                "iterated_during_capture": False,
            }
        entry["iterations"] += 1
        if watching:
            entry["iterated_during_capture"] = True
            self.yielded_before.setdefault(key, 0)
        try:
            entry["_iterator"] = weakref.ref(iterator)
        except TypeError:
            entry["_iterator"] = None

    def open_window(self) -> None:
        """The capture's first timed step starts: count each loader's batches from here."""
        self.yielded_before = {
            key: count
            for key, entry in self.entries.items()
            if (count := _yielded(entry)) is not None
        }

    def close_window(self) -> None:
        """The probe step ended: each loader's batches since the window opened."""
        for key, entry in self.entries.items():
            count = _yielded(entry)
            before = self.yielded_before.get(key, 0)
            entry["batches_during_capture"] = None if count is None else max(0, count - before)
            entry["iterated_during_capture"] = bool(
                entry.get("iterated_during_capture") or (count or 0) > before
            )

    def facts(self) -> list[dict[str, Any]]:
        return [
            {key: value for key, value in entry.items() if not key.startswith("_")}
            for entry in self.entries.values()
        ]


def _describe_loader(loader: Any) -> dict[str, Any]:
    """A DataLoader's settings, as the facts file lists them."""
    context = getattr(loader, "multiprocessing_context", None)
    return {
        "class": qualified(type(loader)),
        "dataset": type(getattr(loader, "dataset", None)).__name__,
        "num_workers": getattr(loader, "num_workers", None),
        "pin_memory": getattr(loader, "pin_memory", None),
        "persistent_workers": getattr(loader, "persistent_workers", None),
        "batch_size": getattr(loader, "batch_size", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
        "drop_last": getattr(loader, "drop_last", None),
        "multiprocessing_context": (
            None if context is None else getattr(context, "_name", str(context))
        ),
    }


def _yielded(entry: dict[str, Any]) -> int | None:
    """Batches the loader's latest iterator (a weak reference in ``entry``) has yielded so far."""
    ref = entry.get("_iterator")
    iterator = ref() if ref is not None else None
    count = getattr(iterator, "_num_yielded", None)
    return count if isinstance(count, int) else None


__all__ = [
    "FRAMEWORK_PACKAGES",
    "MAX_KEYS",
    "MAX_LOADERS",
    "MAX_NAME",
    "Called",
    "LoaderLog",
    "Tally",
    "autocast_state",
    "autocast_states",
    "capture_facts",
    "counter_delta",
    "describe_device",
    "describe_optimizer",
    "describe_process",
    "describe_rank",
    "describe_trainable",
    "distinguishing",
    "dtype_name",
    "dynamo_counters",
    "frozen_in_roots",
    "holds_any",
    "module_names",
    "packages_loaded",
    "qualified",
    "root_modules",
    "state_group",
    "trainable_autocast",
]
