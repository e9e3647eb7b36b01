"""What the optimizer is and what it holds: its key, its state bytes by dtype, how much of an
8-bit optimizer's state is really 8-bit, and what bitsandbytes loaded.

Keys name what an optimizer is (``adamw-fused``, ``adamw-foreach``, ``adamw8bit``, ...); the
catalog words fixes by key, so a fix never proposes the optimizer the run already uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diagnose import torch_compat
from diagnose.catalogs import optimizer_catalog as catalog
from diagnose.errors import first_line
from diagnose.quiet import capture_output
from diagnose.record import Finding
from diagnose.stats import at_line

# --------------------------------------------------------------------------------------------
# Optimizer state: bytes by dtype, and the 8-bit split (pure)


def _unique_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every state tensor, each storage once (bitsandbytes shares its maps)."""
    seen: set[tuple[int, int]] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
            if ident in seen and value.untyped_storage().data_ptr() != 0:
                continue
            seen.add(ident)
            yield key, value


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def state_bytes_by_dtype(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state tensors by dtype ("float32", "uint8", ...)."""
    totals: dict[str, int] = {}
    for _, tensor in _unique_state_tensors(optimizer):
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + _tensor_bytes(tensor)
    return dict(sorted(totals.items()))


@dataclass
class EightBitSplit:
    """How much of a bitsandbytes 8-bit optimizer's state is 8-bit, and what it saves."""

    optimizer: str = ""
    #: Its key (:func:`optimizer_key`).
    key: str = ""
    min_8bit_size: int | None = None
    tensors_8bit: int = 0
    tensors_fp32: int = 0
    tensors_without_state: int = 0
    elements_8bit: int = 0
    elements_fp32: int = 0
    #: uint8 moments.
    bytes_8bit: int = 0
    #: Block scales (absmax) and the shared code maps of the 8-bit tensors.
    bytes_8bit_overhead: int = 0
    #: fp32 moments of the tensors below min_8bit_size.
    bytes_fp32: int = 0
    smallest_tensor: int = 0
    largest_tensor: int = 0
    #: What torch AdamW would keep for the same tensors: two moments in the parameter dtype.
    adamw_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes_8bit + self.bytes_8bit_overhead + self.bytes_fp32

    @property
    def fp32_share(self) -> float:
        total = self.total_bytes
        return self.bytes_fp32 / total if total else 0.0

    @property
    def saved_bytes(self) -> int:
        return self.adamw_bytes - self.total_bytes

    @property
    def saved_share(self) -> float:
        return self.saved_bytes / self.adamw_bytes if self.adamw_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            total_bytes=self.total_bytes,
            fp32_share=round(self.fp32_share, 4),
            saved_bytes_vs_adamw=self.saved_bytes,
            saved_share_vs_adamw=round(self.saved_share, 4),
        )
        return out


def is_bnb_8bit(optimizer: object) -> bool:
    """A bitsandbytes optimizer configured for 8-bit state (AdamW8bit, PagedAdamW8bit, ...)."""
    args = getattr(optimizer, "args", None)
    return type(optimizer).__module__.startswith("bitsandbytes") and (
        getattr(args, "optim_bits", None) == 8
    )


def eight_bit_split(optimizer: torch.optim.Optimizer) -> EightBitSplit | None:
    """The byte split of a bitsandbytes 8-bit optimizer's state (None for other optimizers).

    Read from the state itself, so it says what the optimizer did after at least one step;
    parameters it has not stepped yet are counted in ``tensors_without_state``.
    """
    if not is_bnb_8bit(optimizer):
        return None
    args = getattr(optimizer, "args", None)
    minimum = getattr(args, "min_8bit_size", None)
    split = EightBitSplit(
        optimizer=optimizer_label(optimizer),
        key=optimizer_key(optimizer, torch.device("cpu")),
        min_8bit_size=int(minimum) if isinstance(minimum, int) else None,
    )
    sizes: list[int] = []
    shared_maps: dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            sizes.append(param.numel())
            state = optimizer.state.get(param) or {}
            split.adamw_bytes += 2 * _tensor_bytes(param)
            first = state.get("state1")
            if not isinstance(first, torch.Tensor):
                split.tensors_without_state += 1
                continue
            moments = [
                state[k] for k in ("state1", "state2") if isinstance(state.get(k), torch.Tensor)
            ]
            moment_bytes = sum(_tensor_bytes(t) for t in moments)
            if first.dtype == torch.uint8:
                split.tensors_8bit += 1
                split.elements_8bit += param.numel()
                split.bytes_8bit += moment_bytes
                for key in ("absmax1", "absmax2"):
                    value = state.get(key)
                    if isinstance(value, torch.Tensor):
                        split.bytes_8bit_overhead += _tensor_bytes(value)
                for key in ("qmap1", "qmap2"):
                    value = state.get(key)
                    if isinstance(value, torch.Tensor):
                        shared_maps[value.untyped_storage().data_ptr()] = _tensor_bytes(value)
            else:
                split.tensors_fp32 += 1
                split.elements_fp32 += param.numel()
                split.bytes_fp32 += moment_bytes
    split.bytes_8bit_overhead += sum(shared_maps.values())
    if sizes:
        split.smallest_tensor = min(sizes)
        split.largest_tensor = max(sizes)
    return split


def eight_bit_rule(split: EightBitSplit | None) -> Finding | None:
    """``optimizer.8bit_state_mostly_fp32`` when most of the 8-bit optimizer's state is fp32."""
    if (
        split is None
        or split.total_bytes == 0
        or at_line(split.fp32_share, catalog.FP32_SHARE_RAISED).below
    ):
        return None
    return catalog.state_mostly_fp32(
        running=split.key,
        fp32_share=split.fp32_share,
        tensors_fp32=split.tensors_fp32,
        tensors_total=split.tensors_fp32 + split.tensors_8bit,
        min_8bit_size=split.min_8bit_size,
        smallest_tensor=split.smallest_tensor,
        saved_bytes=split.saved_bytes,
        saved_share=split.saved_share,
        evidence={
            **split.to_dict(),
            "bytes_by_kind": {
                "uint8 moments": split.bytes_8bit,
                "block scales and code maps": split.bytes_8bit_overhead,
                "fp32 moments (below min_8bit_size)": split.bytes_fp32,
            },
        },
    )


def fp32_state_share(tensor_sizes: Sequence[int], min_8bit_size: int) -> float:
    """The share of an 8-bit AdamW's state bytes that stays fp32 for tensors of these sizes:
    two fp32 moments (8 bytes an element) below ``min_8bit_size``, two uint8 moments (2 bytes an
    element, block scales left out) from it up. Computed, for a model that was not built."""
    fp32 = 8 * sum(n for n in tensor_sizes if n < min_8bit_size)
    eight_bit = 2 * sum(n for n in tensor_sizes if n >= min_8bit_size)
    return fp32 / (fp32 + eight_bit) if fp32 + eight_bit else 0.0


# --------------------------------------------------------------------------------------------
# Identifying optimizers


def optimizer_key(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """A short name for the kind of optimizer, matching the A/B candidates' keys."""
    cls = type(optimizer)
    module = cls.__module__
    if module.startswith("torch.optim") and cls.__name__ == "AdamW":
        defaults = optimizer.defaults
        if defaults.get("fused"):
            return "adamw-fused"
        foreach = defaults.get("foreach")
        if foreach or (foreach is None and device.type == "cuda"):
            return "adamw-foreach"
        return "adamw-single"
    if is_bnb_8bit(optimizer) and "AdamW" in cls.__name__:
        return "adamw8bit-paged" if getattr(optimizer, "is_paged", False) else "adamw8bit"
    if module.startswith("transformers") and cls.__name__ == "Adafactor":
        return "adafactor"
    return f"custom:{cls.__name__}"


def optimizer_label(optimizer: torch.optim.Optimizer, device: torch.device | None = None) -> str:
    key = optimizer_key(optimizer, device or torch.device("cpu"))
    return catalog.LABELS.get(key, f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")


def describe_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """The configured optimizer's class, hyper-parameters and 8-bit settings."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    described: dict[str, Any] = {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "key": optimizer_key(optimizer, device),
        "label": optimizer_label(optimizer, device),
        "param_groups": len(optimizer.param_groups),
        "tensors": len(params),
        "elements": sum(p.numel() for p in params),
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
    }
    for name in ("lr", "betas", "eps", "weight_decay", "foreach", "fused"):
        value = group.get(name)
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else None
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, list)):
            described[name] = value
    args = getattr(optimizer, "args", None)
    if type(optimizer).__module__.startswith("bitsandbytes") and args is not None:
        described["optim_bits"] = getattr(args, "optim_bits", None)
        described["min_8bit_size"] = getattr(args, "min_8bit_size", None)
        described["is_paged"] = bool(getattr(optimizer, "is_paged", False))
    return described


# --------------------------------------------------------------------------------------------
# bitsandbytes inventory


def bitsandbytes_inventory(printed_at_import: str | None = None) -> dict[str, Any]:
    """Version, backend, native library and import messages of bitsandbytes.

    ``printed_at_import`` is what the run's inventory captured when it imported bitsandbytes
    (this process can capture it only when it is the first to import it).
    """
    info: dict[str, Any] = {"installed": False, "imports": False}
    try:
        # find_spec answers from sys.modules when it is imported (None there: blocked).
        present = importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        present = False
    if not present:
        info["reason"] = "bitsandbytes is not installed"
        return info
    info["installed"] = True
    already = "bitsandbytes" in sys.modules
    info["imported_before_probe"] = already
    module: Any = None
    with warnings.catch_warnings(record=True) as caught, capture_output() as captured:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module("bitsandbytes")
        except Exception as exc:  # a broken build may raise anything at import
            info["error"] = f"{type(exc).__name__}: {first_line(str(exc))}"
    printed = [line for line in captured.text.splitlines() if line.strip()]
    printed += [f"{w.category.__name__}: {w.message}" for w in caught]
    if already and printed_at_import:
        printed = [line for line in printed_at_import.splitlines() if line.strip()] + printed
    info["import_messages"] = list(dict.fromkeys(printed))[:20]
    if module is None:
        info["reason"] = info.get("error", "bitsandbytes did not import")
        return info
    info["imports"] = True
    info["version"] = str(getattr(module, "__version__", ""))
    info["torch_build"] = (
        f"rocm {torch.version.hip}"
        if torch.version.hip
        else (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu")
    )
    cext = sys.modules.get("bitsandbytes.cextension")
    if cext is not None:
        info["backend"] = str(getattr(cext, "BNB_BACKEND", ""))
        info["hip_environment"] = bool(getattr(cext, "HIP_ENVIRONMENT", False))
        info["rocm_gpu_arch"] = str(getattr(cext, "ROCM_GPU_ARCH", ""))
        info["native_library"] = _native_library(getattr(cext, "lib", None))
    info["kernels"] = _registered_kernels()
    return info


def _native_library(lib: object) -> dict[str, Any]:
    """Which native library bitsandbytes loaded, or why none loaded."""
    if lib is None:
        return {"loaded": False}
    kind = type(lib).__name__
    if "Mock" in kind or "ErrorHandler" in kind:
        # The stand-in bitsandbytes installs when its library did not load: calls raise later.
        error = lib.__dict__.get("error_msg", "")
        return {"loaded": False, "class": kind, "error": first_line(str(error))}
    handle = lib.__dict__.get("_lib")
    return {
        "loaded": True,
        "class": kind,
        "path": str(getattr(handle, "_name", "") or ""),
        "compiled_with_cuda": bool(getattr(type(lib), "compiled_with_cuda", False)),
    }


def _registered_kernels() -> dict[str, list[str]]:
    """Dispatch keys with a kernel for bitsandbytes' optimizer ops."""
    found: dict[str, list[str]] = {}
    for op in ("optimizer_update_8bit_blockwise", "optimizer_update_32bit"):
        found[op] = [
            key
            for key in ("CPU", "CUDA", "XPU", "MPS")
            if torch_compat.has_kernel_for(f"bitsandbytes::{op}", key)
        ]
    return found


__all__ = [
    "EightBitSplit",
    "bitsandbytes_inventory",
    "describe_optimizer",
    "eight_bit_rule",
    "eight_bit_split",
    "fp32_state_share",
    "is_bnb_8bit",
    "optimizer_key",
    "optimizer_label",
    "state_bytes_by_dtype",
]
