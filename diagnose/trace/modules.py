"""Which model component an event belongs to: text encoder, VAE, denoiser, optimizer.

A diffusion step runs several models, and a finding's fix depends on which one pays it: the
denoiser's attention processor does not change the text encoder's attention. Traces captured
with ``with_stack=True`` or ``with_modules=True`` hold an ``nn.Module: <Class>_<n>`` range around
every module's forward; a trainer may also mark components with ``record_function`` ranges
(``## text_encoder ##``, ``[Module] vae``, or a component's attribute name). An event's module
path is the chain of those ranges enclosing it on its thread; its role is that of the outermost
module whose class (or label) names a known component, so the ``Attention`` inside a
``UNet2DConditionModel`` is the denoiser's, and the ``T5Attention`` inside a ``T5EncoderModel``
the text encoder's. Ops inside ``Optimizer.step``/``zero_grad`` belong to the optimizer.

Trainers rarely call the VAE's ``forward``: ``vae.encode(pixels)`` runs its ``Encoder`` module
directly, so the trace's outermost range is ``nn.Module: Encoder_0``, a class name that says
nothing by itself. An encoder or decoder that holds convolutions and sits outside every named
component is the autoencoder's: the text encoders hold none, and the denoiser's blocks are inside
the denoiser's own range.

Backward ops run on the autograd thread outside any module range; they have no module here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from diagnose.trace.columns import MODULE_PREFIX
from diagnose.trace.intervals import Intervals, intersect, subtract, union, union_of
from diagnose.trace.reader import ParsedTrace
from diagnose.trace.structure import Structure, nesting

Role = Literal["text_encoder", "vae", "denoiser", "optimizer", "other"]

ROLE_LABELS: dict[str, str] = {
    "text_encoder": "text encoder",
    "vae": "VAE",
    "denoiser": "denoiser",
    "optimizer": "optimizer",
    "other": "other module",
}

#: Class-name patterns of each component (the instance suffix ``_<n>`` removed), most specific
#: first: an autoencoder is the VAE even when its class mentions a transformer.
_CLASS_ROLES: tuple[tuple[Role, re.Pattern[str]], ...] = (
    ("vae", re.compile(r"autoencoder|vae|^vqmodel", re.IGNORECASE)),
    (
        "denoiser",
        # Case matters: "DiT" is a denoiser, "edit" is not.
        re.compile(
            r"^UNet|^Unet|Transformer[123]DModel$|DiT|^ControlNet|Denoiser|^PriorTransformer"
            r"|^\w+TransformerModel$"
        ),
    ),
    (
        "text_encoder",
        re.compile(
            r"^(u?m?t5|cliptext|openclip|siglip\w*text|gemma|qwen|llama|mistral|phi\d?|chatglm|glm"
            r"|bert|roberta|xlmroberta|byt5)|text_?encoder|textmodel|encodermodel$|forcausallm$"
            r"|forconditionalgeneration$",
            re.IGNORECASE,
        ),
    ),
)
#: record_function labels a trainer may put around a component (the pipeline's attribute names).
_LABEL_ROLES: dict[str, Role] = {
    "text_encoder": "text_encoder",
    "text_encoder_2": "text_encoder",
    "text_encoder_3": "text_encoder",
    "vae": "vae",
    "unet": "denoiser",
    "transformer": "denoiser",
    "denoiser": "denoiser",
}
_DECORATION = re.compile(r"^\s*(##|\[module\]|nn\.module:)\s*|\s*##\s*$", re.IGNORECASE)
_INSTANCE = re.compile(r"_\d+$")
_OPTIMIZER = re.compile(r"^Optimizer\.(step|zero_grad)#")
#: An image/video autoencoder's halves (diffusers' ``Encoder``, ``DecoderTiny``,
#: ``WanEncoder3d``, ``EncoderCausal3D``...), recognised with :data:`_CONV` below them.
_CODER = re.compile(r"(?:En|De)coder(?:Causal)?(?:\d[dD]|Tiny)?$")
_CONV = re.compile(r"conv", re.IGNORECASE)
_ENCODER_PART = re.compile(r"encoder", re.IGNORECASE)
_DECODER_PART = re.compile(r"decoder", re.IGNORECASE)


def class_of(name: str) -> str:
    """``nn.Module: T5EncoderModel_0`` → ``T5EncoderModel``; ``## vae ##`` → ``vae``."""
    return _INSTANCE.sub("", _DECORATION.sub("", name).strip())


def classify(name: str) -> Role | None:
    """The component a module class or component label names, or None when it names none."""
    cls = class_of(name)
    label_role = _LABEL_ROLES.get(cls.lower().split(".")[0])
    if label_role is not None:
        return label_role
    for role, pattern in _CLASS_ROLES:
        if pattern.search(cls):
            return role
    return None


@dataclass
class ModuleScopes:
    """The module ranges of one trace with their nesting, for looking up any host event."""

    names: list[str]
    ts: npt.NDArray[np.float64]
    end: npt.NDArray[np.float64]
    thread: npt.NDArray[np.int32]
    parent: npt.NDArray[np.int64]
    #: Role of each range: of its outermost ancestor-or-self that names a component ("" if none).
    role: list[str]
    #: The outermost range that decided ``role`` (-1 when none did).
    owner: npt.NDArray[np.int64]
    optimizer: Intervals | None = None
    _by_thread: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = field(
        default_factory=dict, repr=False
    )

    @property
    def found(self) -> bool:
        """Whether the trace names any component (else findings cannot be attributed)."""
        return any(self.role)

    def innermost(self, thread: int, point: float) -> int:
        """The innermost range on ``thread`` that contains ``point`` (-1 if none)."""
        cached = self._by_thread.get(thread)
        if cached is None:
            ranges = np.flatnonzero(self.thread == thread)
            ranges = ranges[np.lexsort((-(self.end[ranges] - self.ts[ranges]), self.ts[ranges]))]
            cached = (ranges.astype(np.int64), self.ts[ranges])
            self._by_thread[thread] = cached
        ranges, starts = cached
        k = int(np.searchsorted(starts, point, side="right")) - 1
        if k < 0:
            return -1
        current = int(ranges[k])
        while current >= 0 and self.end[current] < point:
            current = int(self.parent[current])
        return current

    def classes(self, role: str) -> set[str]:
        """Module classes run inside ``role``'s ranges (``Encoder``, ``ResnetBlock2D``...)."""
        return {class_of(self.names[i]) for i, r in enumerate(self.role) if r == role}

    def vae_encodes_only(self) -> bool:
        """Whether the VAE ran its encoder and never its decoder: it only turns the batch into
        latents, which a LoRA run does with a frozen VAE whose output could be cached."""
        classes = self.classes("vae")
        encodes = any(_ENCODER_PART.search(c) for c in classes)
        return encodes and not any(_DECODER_PART.search(c) for c in classes)

    def path(self, index: int) -> list[str]:
        """Module names from the component (or the outermost module) down to ``index``."""
        chain: list[int] = []
        current = index
        while current >= 0:
            chain.append(current)
            if current == int(self.owner[index]):
                break
            current = int(self.parent[current])
        return [self.names[i] for i in reversed(chain)]


def module_scopes(trace: ParsedTrace, structure: Structure) -> ModuleScopes:
    """Module ranges (``nn.Module:`` events, and component labels among the host annotations)."""
    modules, host = trace.modules, trace.host
    labels = np.zeros(len(host), dtype=bool)
    if len(host):
        ids = [
            i
            for i in np.unique(host.name[structure.is_annotation]).tolist()
            if _is_component_label(trace.names[i])
        ]
        if ids:
            labels = structure.is_annotation & np.isin(host.name, np.asarray(ids, dtype=np.int32))
    names = [trace.names[i][len(MODULE_PREFIX) :] for i in modules.name.tolist()] + [
        trace.names[i] for i in host.name[labels].tolist()
    ]
    ts = np.concatenate([modules.ts, host.ts[labels]])
    dur = np.concatenate([modules.dur, host.dur[labels]])
    thread = np.concatenate([modules.thread, host.thread[labels]]).astype(np.int32)
    parent, depth = nesting(ts, dur, thread)
    own_role = _autoencoder_parts(names, parent, [classify(n) for n in names])
    role: list[str] = [""] * len(names)
    owner = np.full(len(names), -1, dtype=np.int64)
    # Parents first, so each range inherits its outermost component.
    for index in np.argsort(depth, kind="stable").tolist():
        up = int(parent[index])
        if up >= 0 and role[up]:
            role[index], owner[index] = role[up], owner[up]
        elif own_role[index] is not None:
            role[index], owner[index] = str(own_role[index]), index
    return ModuleScopes(
        names, ts, ts + dur, thread, parent, role, owner, optimizer=optimizer_ranges(trace)
    )


def _autoencoder_parts(
    names: list[str], parent: npt.NDArray[np.int64], own_role: list[Role | None]
) -> list[Role | None]:
    """``own_role`` with the VAE's encoder/decoder called outside its ``forward`` (see the module
    docstring) named the VAE's. A named ancestor still decides (parents come first), so this only
    reaches halves that run on their own."""
    has_conv = np.zeros(len(names), dtype=bool)
    for index, name in enumerate(names):
        if _CONV.search(class_of(name)):
            up = int(parent[index])
            while up >= 0 and not has_conv[up]:
                has_conv[up] = True
                up = int(parent[up])
    return [
        "vae" if role is None and has_conv[i] and _CODER.search(class_of(names[i])) else role
        for i, role in enumerate(own_role)
    ]


def _is_component_label(name: str) -> bool:
    decorated = _DECORATION.search(name) is not None
    return (decorated or class_of(name).lower() in _LABEL_ROLES) and classify(name) is not None


@dataclass
class ModuleShare:
    """The part of a cost paid inside one component."""

    role: str
    #: The component's module (``T5EncoderModel_0``), or "" for the optimizer / no module.
    module: str
    seconds: float = 0.0
    calls: int = 0
    #: The path of the costliest call, component first (``T5EncoderModel_0/…/T5Attention_0``).
    path: str = ""
    _best: float = -1.0

    @property
    def label(self) -> str:
        """``the text encoder (T5EncoderModel)``; ``unattributed code`` without a component."""
        if not self.role:
            return "code outside any known component"
        what = f"the {ROLE_LABELS.get(self.role, self.role)}"
        return f"{what} ({class_of(self.module)})" if self.module else what

    def as_evidence(self, n_steps: int) -> dict[str, object]:
        return {
            "component": self.role or "unknown",
            "module": self.module,
            "path": self.path,
            "calls_per_step": self.calls / max(n_steps, 1),
            "seconds_per_step": self.seconds / max(n_steps, 1),
        }


def attribute(
    scopes: ModuleScopes,
    trace: ParsedTrace,
    ops: Iterable[int],
    seconds: Iterable[float],
) -> list[ModuleShare]:
    """Split the cost of host ops (``seconds`` each) by the component that ran them, costliest
    first. Ops inside an optimizer step belong to the optimizer."""
    host = trace.host
    shares: dict[tuple[str, str], ModuleShare] = {}
    for op, cost in zip(ops, seconds, strict=True):
        point = float(host.ts[op])
        if scopes.optimizer is not None and bool(scopes.optimizer.contains(np.array([point]))[0]):
            key, path = ("optimizer", ""), ""
        else:
            inner = scopes.innermost(int(host.thread[op]), point)
            if inner >= 0 and scopes.role[inner]:
                top = int(scopes.owner[inner])
                key = (scopes.role[inner], scopes.names[top])
                path = "/".join(scopes.path(inner))
            else:
                key, path = ("", ""), "/".join(scopes.path(inner)) if inner >= 0 else ""
        share = shares.setdefault(key, ModuleShare(key[0], key[1]))
        share.seconds += cost
        share.calls += 1
        if cost > share._best:
            share.path, share._best = path, cost
    return sorted(shares.values(), key=lambda s: -s.seconds)


def attribute_time(scopes: ModuleScopes, intervals: Intervals, thread: int) -> list[ModuleShare]:
    """Split the time of ``intervals`` (microseconds) by the component ``thread`` was inside,
    costliest first, in seconds; ``calls`` counts the separate stretches. The optimizer's ranges
    come first, as in :func:`attribute`; time inside no component gets the role ""."""
    shares: list[ModuleShare] = []

    def add(role: str, module: str, part: Intervals) -> None:
        if not len(part):
            return
        longest = int(np.argmax(part.ends - part.starts))
        inner = scopes.innermost(thread, float(part.starts[longest] + part.ends[longest]) / 2)
        share = ModuleShare(role, module, part.total / 1e6, len(part))
        share.path = "/".join(scopes.path(inner)) if inner >= 0 else ""
        shares.append(share)

    rest = intervals
    if scopes.optimizer is not None and len(scopes.optimizer):
        add("optimizer", "", intersect(rest, scopes.optimizer))
        rest = subtract(rest, scopes.optimizer)
    owners: dict[tuple[str, str], list[int]] = {}
    decides = (scopes.owner == np.arange(len(scopes.names))) & (scopes.thread == thread)
    for index in np.flatnonzero(decides).tolist():
        owners.setdefault((scopes.role[index], scopes.names[index]), []).append(index)
    inside: list[Intervals] = []
    for (role, module), ranges in owners.items():
        spans = union(scopes.ts[ranges], scopes.end[ranges])
        inside.append(spans)
        add(role, module, intersect(rest, spans))
    add("", "", subtract(rest, union_of(inside)) if inside else rest)
    return sorted(shares, key=lambda s: -s.seconds)


def optimizer_ranges(trace: ParsedTrace) -> Intervals:
    """The optimizer's step and zero_grad ranges."""
    host = trace.host
    ids = [i for i in np.unique(host.name).tolist() if _OPTIMIZER.search(trace.names[i])]
    if not ids:
        return union(np.empty(0), np.empty(0))
    mask = np.isin(host.name, np.asarray(ids, dtype=np.int32))
    return union(host.ts[mask], host.ts[mask] + host.dur[mask])


__all__ = [
    "ROLE_LABELS",
    "ModuleScopes",
    "ModuleShare",
    "Role",
    "attribute",
    "attribute_time",
    "class_of",
    "classify",
    "module_scopes",
    "optimizer_ranges",
]
