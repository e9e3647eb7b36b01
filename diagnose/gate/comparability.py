"""Whether two records can be compared: the device, mode, config and model differences that
refuse a comparison (:func:`record_differences`), and the other changes that are only listed
(:func:`environment_changes`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diagnose.record import RunRecord

#: Config keys that change what a step costs: records that differ in one are not comparable.
#: Not compared: steps/warmup/profiled_steps (sample counts), seed, learning_rate and alpha (same
#: cost per step), device ("cuda:0" vs "cuda:1": the device itself is compared by kind and name),
#: data_dir and model_dir paths (they differ between CI workspaces; the data and the model are
#: compared by what they hold), skip_probes (changes the findings, not the step).
COMPARED_CONFIG_KEYS: tuple[str, ...] = (
    "preset",
    "size",
    "precision",
    "optimizer",
    "batch",
    "resolution",
    "rank",
    "target_modules",
    "grad_checkpointing",
    "workers",
    "attention",
    "cache_latents",
    "cache_text_embeddings",
    "strategy",
)

#: Inventory packages whose version changes are listed (informational, never refused).
_PACKAGE_VERSION_LIMIT = 30


def _display(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)


def record_differences(baseline: RunRecord, current: RunRecord) -> list[str]:
    """Device, mode, config and model differences that make the step times incomparable, in the
    order the refusal names them (the first one is the message)."""
    from diagnose.config import RunConfig

    out: list[str] = []

    def differ(what: str, a: Any, b: Any) -> None:
        out.append(f"{what} differs (baseline {_display(a)}, current {_display(b)})")

    if baseline.mode != current.mode:
        differ("mode", baseline.mode, current.mode)
    if baseline.device.kind != current.device.kind:
        differ("device kind", baseline.device.kind, current.device.kind)
    if baseline.device.name != current.device.name:
        differ("device name", baseline.device.name, current.device.name)
    # The s/it of a multi-rank record is its pacing rank's: only a job of as many ranks compares.
    base_ranks, cur_ranks = max(len(baseline.ranks), 1), max(len(current.ranks), 1)
    if base_ranks != cur_ranks:
        differ("number of ranks", base_ranks, cur_ranks)
    # A step of N micro-batches (gradient accumulation) costs about N times one of a single batch.
    base_micro = baseline.breakdown.micro_batches_per_step
    cur_micro = current.breakdown.micro_batches_per_step
    if base_micro != cur_micro:
        differ("micro-batches per step", base_micro, cur_micro)
    defaults = RunConfig().to_dict()
    for key in COMPARED_CONFIG_KEYS:
        # A key an older record lacks reads as the default it ran with.
        a = baseline.config.get(key, defaults.get(key))
        b = current.config.get(key, defaults.get(key))
        if a != b:
            differ(f"config {key}", a, b)
    a_model, b_model = baseline.config.get("model_dir"), current.config.get("model_dir")
    if (a_model is None) != (b_model is None) or (
        a_model is not None and Path(str(a_model)).name != Path(str(b_model)).name
    ):
        differ("config model_dir", a_model, b_model)
    for name in ("class_name", "parameters", "trainable_parameters"):
        a, b = getattr(baseline.model, name), getattr(current.model, name)
        if a and b and a != b:  # empty/zero = not recorded (a trace), not a difference
            differ(f"model {name}", a, b)
    return out


def environment_changes(baseline: RunRecord, current: RunRecord) -> list[str]:
    """What else changed (tool, runtime, driver, package versions, data): listed, never refused."""
    out: list[str] = []

    def note(what: str, a: Any, b: Any) -> None:
        if a != b and (a not in (None, "") or b not in (None, "")):
            out.append(
                f"{what}: {a if a not in (None, '') else '—'} → {b if b not in (None, '') else '—'}"
            )

    note("diagnose", baseline.tool_version, current.tool_version)
    note("device runtime", baseline.device.runtime, current.device.runtime)
    note("device driver", baseline.device.driver, current.device.driver)
    note("device arch", baseline.device.arch, current.device.arch)
    note(
        "torch threads",
        baseline.device.extra.get("torch_threads"),
        current.device.extra.get("torch_threads"),
    )
    note(
        "torch",
        _dig(baseline.inventory, "torch", "version"),
        _dig(current.inventory, "torch", "version"),
    )
    packages_a = _dig(baseline.inventory, "packages") or {}
    packages_b = _dig(current.inventory, "packages") or {}
    if isinstance(packages_a, Mapping) and isinstance(packages_b, Mapping):
        names = sorted(set(packages_a) | set(packages_b))[:_PACKAGE_VERSION_LIMIT]
        for name in names:
            note(name, _dig(packages_a, name, "version"), _dig(packages_b, name, "version"))
    env_a = _dig(baseline.inventory, "env") or {}
    env_b = _dig(current.inventory, "env") or {}
    if isinstance(env_a, Mapping) and isinstance(env_b, Mapping):
        for name in sorted(set(env_a) | set(env_b)):
            note(f"${name}", env_a.get(name), env_b.get(name))
    for key in ("seed", "learning_rate", "alpha", "device", "skip_probes"):
        note(f"config {key}", baseline.config.get(key), current.config.get(key))
    data_a, data_b = baseline.config.get("data"), current.config.get("data")
    if isinstance(data_a, Mapping) and isinstance(data_b, Mapping):
        note("data images", data_a.get("images"), data_b.get("images"))
        note(
            "data median megapixels",
            _dig(data_a, "pixel_sizes", "megapixels_median"),
            _dig(data_b, "pixel_sizes", "megapixels_median"),
        )
        note("data bytes", data_a.get("total_bytes"), data_b.get("total_bytes"))
        note("data generated", data_a.get("generated"), data_b.get("generated"))
    return out


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value
