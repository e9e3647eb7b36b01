"""What a profiler trace records about one operator call, in typed form: the dims and types of
its inputs (``record_shapes``: "Input Dims", "Input type") and, in recent torch, the values of its
int, bool and list arguments ("Concrete Inputs": stride, padding, output_mask...).

Pure: no torch import. The texts are those the trace reader keeps per op (a JSON list of dims, the
types joined with ", ", a JSON list of concrete values).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

Shape = tuple[int, ...]

#: The most elements a recorded tensor can have: far beyond the memory of any device (at one byte
#: an element, 256 TiB). A larger shape is a misread of the trace (a corrupt or hand-edited
#: ``Input Dims``), and arithmetic on it would give FLOP counts no step can have.
MAX_ELEMENTS = 1 << 48

#: The "Input type" torch records for a tensor -> (torch dtype name, bytes per element).
#: Anything else ("Scalar", "ScalarList", "GenericList", "Int", "" ...) is not a tensor.
TENSOR_TYPES: dict[str, tuple[str, int]] = {
    "float": ("float32", 4),
    "double": ("float64", 8),
    "c10::Half": ("float16", 2),
    "c10::BFloat16": ("bfloat16", 2),
    "c10::Float8_e4m3fn": ("float8_e4m3fn", 1),
    "c10::Float8_e5m2": ("float8_e5m2", 1),
    "c10::Float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
    "c10::Float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
    "c10::Float8_e8m0fnu": ("float8_e8m0fnu", 1),
    "c10::Float4_e2m1fn_x2": ("float4_e2m1fn_x2", 1),
    "c10::complex<float>": ("complex64", 8),
    "c10::complex<double>": ("complex128", 16),
    "c10::complex<c10::Half>": ("complex32", 4),
    "long int": ("int64", 8),
    "int": ("int32", 4),
    "short int": ("int16", 2),
    "signed char": ("int8", 1),
    "unsigned char": ("uint8", 1),
    "unsigned short": ("uint16", 2),
    "unsigned int": ("uint32", 4),
    "long unsigned int": ("uint64", 8),
    "bool": ("bool", 1),
    "c10::qint8": ("qint8", 1),
    "c10::quint8": ("quint8", 1),
    "c10::qint32": ("qint32", 4),
}


@dataclass(frozen=True)
class OpInputs:
    """One recorded call: per input, a tensor's dims, a tensor list's dims, its type and value."""

    name: str
    #: A tensor input's dims (``()`` for a 0-d tensor); None for anything that is not one tensor.
    shapes: tuple[Shape | None, ...]
    #: A tensor-list input's dims (``aten::cat``, ``_foreach_*``); None elsewhere.
    lists: tuple[tuple[Shape, ...] | None, ...]
    #: The recorded "Input type" per input ("c10::BFloat16", "Scalar", "" ...).
    types: tuple[str, ...]
    #: The recorded "Concrete Inputs" per input ("[2, 2]", "1", "False", "" for tensors), or None
    #: when the trace does not record them.
    concrete: tuple[str, ...] | None = None
    #: True when an input's recorded shape has more than :data:`MAX_ELEMENTS` elements: no work
    #: is counted from such a call.
    oversized: bool = False

    @property
    def recorded(self) -> bool:
        """Whether the call's input shapes were recorded at all."""
        return bool(self.shapes)

    def shape(self, index: int) -> Shape | None:
        return self.shapes[index] if 0 <= index < len(self.shapes) else None

    def dtype(self, index: int) -> str:
        """Torch name of input ``index``'s dtype ("bfloat16"), "" when unknown."""
        if not 0 <= index < len(self.types):
            return ""
        known = TENSOR_TYPES.get(self.types[index])
        return known[0] if known else ""

    def value(self, index: int) -> str | None:
        """Input ``index``'s concrete value as recorded, None when not recorded."""
        if self.concrete is None or not 0 <= index < len(self.concrete):
            return None
        text = self.concrete[index].strip()
        return text or None


def op_inputs(name: str, dims_json: str, types_text: str, concrete_json: str = "") -> OpInputs:
    """An :class:`OpInputs` from the texts the trace reader keeps: the JSON of "Input Dims", the
    comma-joined "Input type" and the JSON of "Concrete Inputs" ("" when not recorded)."""
    try:
        raw = json.loads(dims_json) if dims_json else []
    except ValueError:
        raw = []
    raw = raw if isinstance(raw, list) else []
    types = tuple(types_text.split(", ")) if types_text else ()
    shapes: list[Shape | None] = []
    lists: list[tuple[Shape, ...] | None] = []
    for index, entry in enumerate(raw):
        kind = types[index] if index < len(types) else ""
        shapes.append(_shape(entry) if kind in TENSOR_TYPES else None)
        lists.append(_list_of_shapes(entry) if kind not in TENSOR_TYPES else None)
    concrete: tuple[str, ...] | None = None
    if concrete_json:
        try:
            values = json.loads(concrete_json)
        except ValueError:
            values = None
        if isinstance(values, list):
            concrete = tuple(v if isinstance(v, str) else json.dumps(v) for v in values)
    oversized = any(s is not None and _too_large(s) for s in shapes) or any(
        items is not None and any(_too_large(s) for s in items) for items in lists
    )
    return OpInputs(name, tuple(shapes), tuple(lists), types, concrete, oversized)


def _too_large(shape: Shape) -> bool:
    """Whether ``shape`` has more than :data:`MAX_ELEMENTS` elements (stops multiplying once it
    has: a shape of a thousand huge dims costs no big-number arithmetic)."""
    elements = 1
    for dim in shape:
        elements *= dim
        if elements > MAX_ELEMENTS:
            return True
    return False


def _shape(entry: object) -> Shape | None:
    if isinstance(entry, list) and all(isinstance(d, int) and d >= 0 for d in entry):
        return tuple(entry)
    return None


def _list_of_shapes(entry: object) -> tuple[Shape, ...] | None:
    if isinstance(entry, list) and entry and all(isinstance(e, list) for e in entry):
        shapes = [_shape(e) for e in entry]
        if all(s is not None for s in shapes):
            return tuple(s for s in shapes if s is not None)
    return None


def parse_ints(text: str | None) -> tuple[int, ...] | None:
    """A recorded int or int list ("[2, 2]", "1") as a tuple; None for anything else."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    return None


def parse_bools(text: str | None) -> tuple[bool, ...] | None:
    """A recorded bool or bool list ("False", "[True, True, False]") as a tuple; else None."""
    if text is None:
        return None
    parts = [p.strip() for p in text.strip().strip("[]").split(",")]
    if not parts or any(p not in ("True", "False") for p in parts):
        return None
    return tuple(p == "True" for p in parts)
