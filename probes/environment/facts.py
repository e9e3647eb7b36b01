"""What the environment probe's rules judge, and the small helpers they share.

Each rule is a pure function of :class:`EnvironmentFacts` returning a :class:`ProbeResult` of
checks and findings, so it is tested on recorded inventories and telemetry
(``fixtures/inventory/``, ``fixtures/telemetry/``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diagnose.record import DeviceInfo, Finding, ProbeResult, Timing
from diagnose.telemetry import TelemetrySummary

GIB = 1024**3


@dataclass(frozen=True)
class FullSizeMemory:
    """The memory a run's real model holds before any activation, for a run that trained its
    shrunk stand-in: counted from the preset's full-size configs (their models counted on the
    meta device, :func:`diagnose.workload.presets.preset_counts`)."""

    preset: str
    #: Bytes of the frozen weights (denoiser, text encoders, VAE) in the run's weight dtype.
    frozen_bytes: int
    #: Bytes of the LoRA weights, their gradients and the optimizer's state.
    trainable_bytes: int
    #: How the numbers were obtained (parameter counts, bytes per parameter).
    basis: str = ""
    #: The peak of one step's activations, temporaries and gradients beyond the weights, without
    #: and with gradient checkpointing (diagnose.workload.memory); None when not counted.
    activation_bytes: int | None = None
    checkpointed_activation_bytes: int | None = None
    #: Where they were counted ("1024 px, batch 1"), or why they could not be.
    activations_at: str = ""

    @property
    def static_bytes(self) -> int:
        return self.frozen_bytes + self.trainable_bytes

    def peak_bytes(self, checkpointing: bool) -> int | None:
        """Weights and state plus the step's activations at their peak (None: not counted)."""
        step = self.checkpointed_activation_bytes if checkpointing else self.activation_bytes
        return None if step is None else self.static_bytes + step


@dataclass
class EnvironmentFacts:
    """Everything the rules judge: built by the environment probe's ``gather_facts`` in a run,
    or from fixtures in the tests."""

    device: DeviceInfo
    #: The inventory dict (diagnose.inventory.collect_inventory); missing keys mean "unknown".
    inventory: Mapping[str, Any] = field(default_factory=dict)
    #: Telemetry sampled during the timed steps; None when not sampled.
    telemetry: TelemetrySummary | None = None
    timing: Timing | None = None
    #: The precision the run trained in ("bf16-mixed", ...); None when unknown (trace mode).
    precision: str | None = None
    #: torch caching-allocator counters (num_alloc_retries, num_ooms...) and what they cover.
    allocator: dict[str, int] = field(default_factory=dict)
    allocator_scope: str = ""
    #: Resolution buckets the run cycled through.
    resolutions: list[int] = field(default_factory=list)
    #: For a run that trained a shrunk (tiny) stand-in on a GPU: the real model's memory before
    #: activations, which memory advice is judged on instead of the tiny model's peak.
    full_size: FullSizeMemory | None = None

    @property
    def env(self) -> Mapping[str, str]:
        env = self.inventory.get("env")
        return env if isinstance(env, Mapping) else {}

    def section(self, *path: str) -> Mapping[str, Any]:
        """inventory[path...] as a mapping ({} when absent)."""
        node: Any = self.inventory
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node if isinstance(node, Mapping) else {}

    @property
    def on_gpu(self) -> bool:
        return self.device.kind in ("cuda", "rocm")

    @property
    def seconds_per_it(self) -> float | None:
        if self.timing is None:
            return None
        median = self.timing.headline.median
        return median if median == median and median > 0 else None  # NaN-safe

    @property
    def sampled(self) -> TelemetrySummary | None:
        """The telemetry summary when it holds samples."""
        t = self.telemetry
        return t if t is not None and t.available and t.stats.n > 0 else None


#: A rule: the facts in, its checks and findings out (named "environment").
Rule = Callable[[EnvironmentFacts], ProbeResult]


def judged() -> ProbeResult:
    """An empty answer: the rule's questions do not apply here (a GPU rule on the CPU)."""
    return ProbeResult(name="environment")


def fine(check_id: str, text: str) -> ProbeResult:
    result = judged()
    result.add_ok(check_id, text)
    return result


def unknown(check_id: str, text: str) -> ProbeResult:
    result = judged()
    result.add_not_judged(check_id, text)
    return result


def found(finding: Finding) -> ProbeResult:
    result = judged()
    result.add_finding(finding)
    return result


_FALSY = frozenset({"", "0", "false", "no", "off", "none"})


def truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in _FALSY


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def device_label(device: DeviceInfo) -> str:
    name = device.name or device.kind
    return f"{name} ({device.arch})" if device.arch else name
