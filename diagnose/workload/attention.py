"""The attention backend a step runs with (``--attention``).

``auto`` forces nothing: torch's scaled_dot_product_attention picks its kernel as it would in the
user's trainer. ``flash``/``efficient``/``cudnn``/``math`` force one SDPA kernel with
``torch.nn.attention.sdpa_kernel``; ``xformers`` swaps the model's attention processors for
diffusers' xformers ones. A backend that cannot run here is refused up front, by one tiny SDPA
call at each of the model's head dims, with a one-line error that says which backends this
device offers, instead of failing in the middle of the first step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from types import TracebackType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diagnose.config import ATTENTIONS
from diagnose.errors import DiagnoseError, ExitCode, first_line

#: The SDPA kernels ``--attention`` can force.
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


class AttentionBackend(contextlib.AbstractContextManager[None]):
    """A reusable context manager that forces one SDPA kernel (or nothing, for ``auto``).

    ``sdpa_kernel`` itself is a one-shot generator context; this object can be entered once per
    step for the whole run.
    """

    def __init__(self, name: str, backend: SDPBackend | None) -> None:
        self.name = name
        self.backend = backend
        self._stack: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        inner: contextlib.AbstractContextManager[None] = (
            sdpa_kernel(self.backend) if self.backend is not None else contextlib.nullcontext()
        )
        inner.__enter__()
        self._stack.append(inner)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.pop().__exit__(exc_type, exc, tb)


def probe_sdpa(
    backend: SDPBackend, device: torch.device, head_dim: int, dtype: torch.dtype
) -> str | None:
    """Run one tiny SDPA forced to ``backend``; None if it ran, else why not (one line)."""
    q = torch.randn(1, 2, 16, head_dim, device=device, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q)
        except RuntimeError as exc:
            # On CUDA, torch explains per kernel in warnings ("Flash attention requires ...");
            # the first one says more than the generic "No viable backend" error.
            reasons = [str(w.message).splitlines()[0] for w in caught]
            text = reasons[0] if reasons else str(exc).splitlines()[0]
            return text.strip()
    return None


def available_sdpa_backends(
    device: torch.device, head_dims: Iterable[int] = (64,), dtype: torch.dtype = torch.float32
) -> list[str]:
    """The ``--attention`` SDPA names that run on ``device`` at every one of ``head_dims``."""
    dims = sorted(set(head_dims)) or [64]
    return [
        name
        for name, backend in SDPA_BACKENDS.items()
        if all(probe_sdpa(backend, device, d, dtype) is None for d in dims)
    ]


def attention_context(
    name: str,
    device: torch.device,
    head_dims: Iterable[int] = (64,),
    dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """The context the step runs under for ``--attention name``, validated on ``device``.

    ``head_dims`` are the model's attention head sizes and ``dtype`` the dtype attention runs in
    (the autocast dtype in mixed precision): fused kernels accept only some of both.
    Raises DiagnoseError(UNSUPPORTED) when the backend cannot run here.
    """
    if name not in ATTENTIONS:
        raise DiagnoseError(
            f"unknown attention {name!r}; choose one of {', '.join(ATTENTIONS)}", ExitCode.USAGE
        )
    if name == "auto":
        return AttentionBackend(name, None)
    if name == "xformers":
        check_xformers(device)
        return AttentionBackend(name, None)  # the model's processors do the work
    backend = SDPA_BACKENDS[name]
    dims = sorted(set(head_dims)) or [64]
    for dim in dims:
        reason = probe_sdpa(backend, device, dim, dtype)
        if reason is not None:
            offered = available_sdpa_backends(device, dims, dtype)
            raise DiagnoseError(
                f"--attention {name} cannot run on {device.type} at head dim {dim} in "
                f"{str(dtype).removeprefix('torch.')} ({reason}); this device offers: "
                f"{', '.join(['auto', *offered])}",
                ExitCode.UNSUPPORTED,
            )
    return AttentionBackend(name, backend)


def check_xformers(device: torch.device) -> None:
    """Raise DiagnoseError(UNSUPPORTED) unless xformers imports and can run on ``device``."""
    if device.type != "cuda":
        raise DiagnoseError(
            f"--attention xformers needs a CUDA or ROCm GPU (this run is on {device.type})",
            ExitCode.UNSUPPORTED,
        )
    try:
        import xformers.ops  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising anything at import
        raise DiagnoseError(
            f"--attention xformers: xformers cannot be imported ({first_line(exc, limit=None)}); "
            "install the build matching your torch: pip install xformers",
            ExitCode.UNSUPPORTED,
        ) from None


def attention_head_dims(model: torch.nn.Module) -> list[int]:
    """The distinct head sizes of the diffusers attention modules in ``model``."""
    dims: set[int] = set()
    for module in model.modules():
        heads = getattr(module, "heads", None)
        to_q = getattr(module, "to_q", None)
        if isinstance(heads, int) and heads > 0 and isinstance(to_q, torch.nn.Linear):
            dims.add(to_q.out_features // heads)
    return sorted(dims)


def use_xformers(model: torch.nn.Module) -> None:
    """Switch ``model``'s attention to xformers through diffusers.

    Processors that dispatch through diffusers' attention backends (Flux, Z-Image) get the
    "xformers" backend; the classic processors (UNet, SD3) are replaced by diffusers' xformers
    processors. Z-Image's processor must not be replaced (it applies RoPE), hence the split.
    """
    processors = [getattr(m, "processor", None) for m in model.modules() if hasattr(m, "processor")]
    try:
        if any(hasattr(p, "_attention_backend") for p in processors):
            model.set_attention_backend("xformers")  # type: ignore[operator]
        else:
            model.enable_xformers_memory_efficient_attention()  # type: ignore[operator]
    except Exception as exc:  # ModuleNotFoundError, ValueError, a failing xformers self-test
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DiagnoseError(
            f"--attention xformers: diffusers cannot use xformers here ({first})",
            ExitCode.UNSUPPORTED,
        ) from None


__all__ = [
    "SDPA_BACKENDS",
    "AttentionBackend",
    "attention_context",
    "attention_head_dims",
    "available_sdpa_backends",
    "check_xformers",
    "probe_sdpa",
    "use_xformers",
]
