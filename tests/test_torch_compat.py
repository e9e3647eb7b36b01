"""torch's internals are reached through ``diagnose/torch_compat.py`` alone, and what a torch lacks
costs one ``not_judged`` answer, never the run.

The scan reads the code that ships and runs (``diagnose/``, ``probes/``, ``reports/``,
``benchmarks/``, ``tests/conftest.py``) token by token: comments and prose strings (a fix that
tells the user to call ``torch._dynamo.mark_dynamic``) are not accesses, a string that is a torch
module path (``sys.modules.get("torch._dynamo.utils")``) is. Other tests may hold diagnose's
readings against torch's own objects on purpose.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from diagnose import torch_compat
from diagnose.probes.attention.attribution import attribute, events_from_profiler
from diagnose.probes.attention.capture import AttentionRecorder
from diagnose.probes.base import ProbeContext, run_probe
from diagnose.record import DeviceInfo, ProbeResult, RunRecord

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("diagnose", "probes", "reports", "benchmarks")
ALLOWED = {REPO / "diagnose" / "torch_compat.py"}

#: In code (strings and comments removed): a private part of torch, reached by a dotted name
#: (``torch._C``, ``torch.utils._pytree``, ``torch.ops.aten._foo``, ``torch.autograd.profiler.
#: _is_profiler_enabled``) or imported by name from a torch module (``from torch.x import _y``).
PRIVATE_ATTRIBUTE = re.compile(r"\btorch(?:\.\w+)*\._(?!_)\w*")
PRIVATE_IMPORT = re.compile(r"\bfrom\s+torch(?:\.\w+)*\s+import\b[\w\s,(]*?[\s,(]_(?!_)")
#: Version-dependent public parts: the profiler's event objects and where they come from,
#: autocast's queries (their overloads changed), FSDP's entry points (FSDP2 moved).
VERSIONED_NAMES = re.compile(
    r"\b(?:FunctionEvent|_KinetoEvent|kineto_results|key_averages|function_events"
    r"|FullyShardedDataParallel|fully_shard)\b"
    r"|\.events\(\)"
    r"|\btorch\.(?:is_autocast_\w+|get_autocast_\w+|set_autocast_\w+)"
    r"|\btorch\.distributed\.fsdp\b"
)
#: A string that names a private torch module (``"torch._dynamo.utils"``).
PRIVATE_MODULE_STRING = re.compile(r"""^[rbuf]*['"]torch(?:\.\w+)*\._(?!_)\w*(?:\.\w+)*['"]$""")


def internals_accesses(source: str) -> list[tuple[int, str]]:
    """(line, text) of each access to torch's internals in ``source``."""
    found: list[tuple[int, str]] = []
    statements: list[tuple[int, list[str]]] = []  # each logical line: first line, code tokens
    parts: list[str] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NEWLINE:
            parts = []
            continue
        if not parts:
            statements.append((token.start[0], parts))
        if token.type == tokenize.STRING:
            if PRIVATE_MODULE_STRING.match(token.string):
                found.append((token.start[0], token.string))
            parts.append('""')
        elif token.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
            parts.append(token.string)
    for number, code_tokens in statements:
        # Rejoined without spaces around punctuation: ``torch . _C`` reads as ``torch._C``.
        code = re.sub(r"\s*([.()\[\],:])\s*", r"\1", " ".join(code_tokens))
        for pattern in (PRIVATE_ATTRIBUTE, PRIVATE_IMPORT, VERSIONED_NAMES):
            found.extend((number, m.group(0)) for m in pattern.finditer(code))
    return sorted(found)


def _scanned_files() -> list[Path]:
    files = [p for folder in SCANNED for p in sorted((REPO / folder).rglob("*.py"))]
    return [*files, REPO / "tests" / "conftest.py"]


def test_torch_internals_are_reached_only_through_the_compat_module() -> None:
    offending = [
        f"{path.relative_to(REPO)}:{line}: {text}"
        for path in _scanned_files()
        if path not in ALLOWED
        for line, text in internals_accesses(path.read_text(encoding="utf-8"))
    ]
    assert len(_scanned_files()) > 100
    assert not offending, "torch internals outside diagnose/torch_compat.py:\n" + "\n".join(
        offending
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "x = torch._C._current_autograd_node()",
        "from torch.utils._pytree import tree_leaves",
        "from torch.utils import _pytree as pytree",
        "from torch.utils import (\n    checkpoint,\n    _pytree,\n)",
        "import torch._dynamo",
        "op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "if torch.autograd.profiler._is_profiler_enabled: pass",
        "utils = sys.modules.get('torch._dynamo.utils')",
        "for e in prof.events(): pass",
        "raw = prof.profiler.kineto_results",
        "dtype = torch.get_autocast_gpu_dtype()",
        "from torch.distributed.fsdp import FullyShardedDataParallel",
        "torch . _C",
    ],
)
def test_the_scan_finds_each_kind_of_access(snippet: str) -> None:
    assert internals_accesses(snippet + "\n")


@pytest.mark.parametrize(
    "snippet",
    [
        "# torch._C is read through torch_compat\nx = 1",
        'fix = "mark the dimension dynamic (torch._dynamo.mark_dynamic)"',
        "version = torch.__version__",
        "from torch.nn.attention import SDPBackend, sdpa_kernel",
        "from diagnose.torch_compat import tree_leaves, is_autocast_enabled",
        "events = torch_compat.function_ops(prof, device=True)",
        "shapes = op.input_shapes  # our own copy's field",
    ],
)
def test_the_scan_leaves_prose_and_public_torch_alone(snippet: str) -> None:
    assert internals_accesses(snippet + "\n") == []


# --------------------------------------------------------------------------------------------
# The attention probe's device branch on torch's own FunctionEvents


class _Attention(torch.nn.Module):
    """Named like an attention module, so the recorder hooks it. Its q/k/v reach the call in
    float32 (no autocast op made them); autocast casts them to bfloat16 inside SDPA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def _profiled_under_autocast() -> tuple[Any, AttentionRecorder]:
    """A real CPU profile of one attention call whose q/k/v autocast casts to bfloat16 after
    the Python call (which sees float32): only the profiled op's dtypes tell the two apart."""
    model = _Attention()
    recorder = AttentionRecorder({"toy": model})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof, recorder, autocast, torch.no_grad():
        model(torch.randn(2, 16, 96))
    prof.events()  # torch builds its FunctionEvents once; the tests below edit those objects
    return prof, recorder


def _attention_dtype(prof: Any, recorder: AttentionRecorder) -> str:
    events = events_from_profiler(prof, on_device=True)
    (call,) = attribute(
        recorder.calls,
        events,
        op_owner=recorder.op_owner,
        module_spans=recorder.module_spans,
        on_device=True,
    )
    assert call.path and call.ops, "the device branch found the attention op under its range"
    assert call.signature is not None
    return call.signature.dtype


def _strip(prof: Any, attribute_name: str) -> int:
    """Delete ``attribute_name`` from every FunctionEvent that has it, as an older torch's
    events never had it; returns how many had it."""
    stripped = 0
    for event in prof.events():
        if attribute_name in vars(event):
            delattr(event, attribute_name)
            stripped += 1
    return stripped


def test_device_branch_reads_torchs_function_events() -> None:
    prof, recorder = _profiled_under_autocast()
    with torch_compat.lacks_met() as lacks:
        assert _attention_dtype(prof, recorder) == "bfloat16"
    assert lacks == []


def test_device_branch_without_input_dtypes_takes_them_from_the_raw_events() -> None:
    # torch before input_dtypes (2.11 on an H200 crashed here): the FunctionEvent was made from
    # a raw event that has them, found by thread, name and start.
    prof, recorder = _profiled_under_autocast()
    if not _strip(prof, "input_dtypes"):
        assert not hasattr(prof.events()[0], "input_dtypes")  # this torch never had them
    with torch_compat.lacks_met() as lacks:
        assert _attention_dtype(prof, recorder) == "bfloat16"
    assert lacks == []


def test_device_branch_without_any_dtypes_says_what_is_not_known() -> None:
    # No input_dtypes and no raw results to take them from: the call keeps the dtype its Python
    # call saw, and the lack is named instead of the run failing.
    prof, recorder = _profiled_under_autocast()
    _strip(prof, "input_dtypes")
    prof.profiler.kineto_results = None
    with torch_compat.lacks_met() as lacks:
        assert _attention_dtype(prof, recorder) == "float32"
    assert [lack.feature for lack in lacks] == ["FunctionEvent.input_dtypes"]
    assert torch.__version__ in lacks[0].text()


def test_device_branch_without_device_times_or_parents_data() -> None:
    # Attributes an older or newer torch may lack on its events degrade to defaults.
    prof, recorder = _profiled_under_autocast()
    for name in ("fwd_thread", "sequence_nr", "kernels"):
        _strip(prof, name)
    with torch_compat.lacks_met():
        assert _attention_dtype(prof, recorder) == "bfloat16"


# --------------------------------------------------------------------------------------------
# A lack met by a probe becomes that probe's not_judged check


class _NeedsDtypes:
    """A probe whose answer needs the attention op's dtypes from a profile with none."""

    name = "needs_dtypes"
    description = "reads attention dtypes from an older torch's events"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        prof, recorder = _profiled_under_autocast()
        _strip(prof, "input_dtypes")
        prof.profiler.kineto_results = None
        _attention_dtype(prof, recorder)
        return ProbeResult()


class _NeedsAMissingOp:
    name = "needs_op"
    description = "an experiment that cannot run at all without a part of torch"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        raise torch_compat.lacking("aten._an_op_of_a_future_torch", "what the op would measure")


def _context() -> ProbeContext:
    from diagnose.config import RunConfig

    return ProbeContext(
        config=RunConfig(),
        device=torch.device("cpu"),
        device_info=DeviceInfo(kind="cpu"),
        record=RunRecord(),
    )


def test_a_probe_that_meets_a_lack_says_so_in_a_not_judged_check() -> None:
    result = run_probe(_NeedsDtypes(), _context())
    assert result.status == "ok"
    (check,) = result.checks_with("not_judged")
    assert check.id == "needs_dtypes.torch_lacks.functionevent_input_dtypes"
    assert "FunctionEvent.input_dtypes" in check.text and torch.__version__ in check.text


def test_a_probe_that_cannot_run_without_a_part_is_skipped_with_the_reason() -> None:
    result = run_probe(_NeedsAMissingOp(), _context())
    assert result.status == "skipped"
    assert "aten._an_op_of_a_future_torch" in result.reason
    assert [c.id for c in result.checks_with("not_judged")] == [
        "needs_op.torch_lacks.aten_an_op_of_a_future_torch"
    ]


# --------------------------------------------------------------------------------------------
# The raw reading on this torch, and its older accessors


def test_raw_events_of_a_real_profile() -> None:
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
    events = torch_compat.raw_events(prof, inputs_of=lambda name: name == "aten::mm")
    assert events is not None
    (mm,) = [e for e in events if e.name == "aten::mm"]
    assert mm.on_cpu and mm.end_ns > mm.start_ns and mm.input_shapes == [[8, 8], [8, 8]]
    assert mm.input_dtypes == ["float", "float"]
    assert all(e.input_dtypes is None for e in events if e.name != "aten::mm")


def test_raw_events_absent_is_none_not_an_error() -> None:
    with torch.profiler.profile() as prof:
        torch.ones(2).sum()
    prof.events()  # parsed once from the raw results, which then go
    prof.profiler.kineto_results = None
    assert torch_compat.raw_events(prof) is None
    names = [e.name for e in torch_compat.function_ops(prof, device=False)]
    assert "aten::sum" in names


def test_autocast_state_and_profiler_state() -> None:
    assert torch_compat.is_autocast_enabled("cpu") is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_compat.is_autocast_enabled("cpu") is True
        assert torch_compat.autocast_dtype("cpu") == torch.bfloat16
    assert torch_compat.profiler_is_running() is False
    with torch.profiler.profile():
        assert torch_compat.profiler_is_running() is True


def test_a_diffusers_that_does_not_import_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # diffusers 0.37 on fails while importing under torch 2.4 (the matrix runs it for real); a
    # module that cannot be imported stands for it here.
    from diagnose.errors import DiagnoseError, ExitCode
    from diagnose.workload.models import build_scheduler

    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(DiagnoseError) as raised:
        build_scheduler("DDPMScheduler", {})
    assert raised.value.code == ExitCode.UNSUPPORTED
    message = str(raised.value)
    assert message.startswith("diffusers ") and f"under torch {torch.__version__}" in message
    assert "\n" not in message


def test_optimizer_sync_count_reads_torchs_events_when_the_raw_results_are_gone() -> None:
    # The optimizer probe counts scalar reads from the raw results; a torch without readable raw
    # results gives the same count from its FunctionEvents.
    from diagnose.probes.optimizer.syncs import PROBE_STEP_SPAN, _events_of, count_step_syncs

    weights = [torch.randn(4) for _ in range(3)]
    with torch.profiler.profile() as prof:
        for _ in range(2):
            with torch.profiler.record_function(PROBE_STEP_SPAN):
                for w in weights:
                    w.sum().item()
    prof.events()
    raw = count_step_syncs(_events_of(prof))
    prof.profiler.kineto_results = None
    fallback = count_step_syncs(_events_of(prof))
    assert (raw.steps, raw.scalar_reads) == (2, 2 * len(weights))
    assert (fallback.steps, fallback.scalar_reads) == (raw.steps, raw.scalar_reads)
