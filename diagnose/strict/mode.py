"""Strict mode in one process: a dispatch-level watcher that stops the run at the op that left the
precision or the fused attention path the run asked for.

While the steps are watched, a ``TorchDispatchMode`` sees every aten op after autocast cast its
inputs (so an op's dtypes are the ones that ran) and hands the few that matter to the checks:

- **precision**: a matmul, convolution or attention op whose inputs are fp32 in a run that claimed
  bf16/fp16 (:mod:`diagnose.strict.claims`) is a violation, judged by the precision probe's own
  policy (:func:`diagnose.precision_policy.judge`: autocast's fp32 ops are never compute ops;
  rotary tables and matmuls inside an attention call are not judged one by one);
- **attention**: an SDPA call that ran its math path, or a hand-written ``softmax(QKᵀ)V``, where a
  fused kernel runs the same inputs here (:mod:`diagnose.strict.attention`).

Every other op is passed on after one dictionary lookup. Forward ops only: a backward op computes
in the dtypes its forward chose, and the forward is where the fix goes (on a GPU the backward runs
on the autograd engine's own threads, which a dispatch mode does not see anyway).

A violation raises :class:`~diagnose.strict.violations.StrictViolation` before the op runs (after
the call, for an SDPA call's math path), unless ``--strict warn`` or ``--strict-allow`` say to
record it and go on. Nothing of strict mode's own failing reaches the user's program: it is
written into the log and the checks stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from diagnose import attention_paths as ap
from diagnose.catalogs.attention_catalog import BACKEND_LABELS, MANUAL_FIX, math_fix
from diagnose.catalogs.strict_catalog import precision_fix
from diagnose.output import write_text_atomic
from diagnose.precision_policy import (
    COMPUTE_KINDS,
    deliberate_reason,
    judge,
    majority_dtype,
    normalize_dtype,
    op_base_name,
    op_kind,
)
from diagnose.strict.attention import (
    MANUAL_OP,
    SDPA_OP,
    FusedPaths,
    ManualChain,
    SdpaCall,
    is_fused_op,
)
from diagnose.strict.claims import AutocastWatch
from diagnose.strict.frames import describe_frame, install_exception_hooks, module_path, user_frame
from diagnose.strict.options import StrictOptions
from diagnose.strict.violations import Claim, StrictLog, StrictViolation, Violation
from diagnose.torch_compat import (
    DISPATCH_MODE_ERROR,
    TorchDispatchMode,
    autocast_dtype,
    in_backward,
    innermost_dispatch_mode,
    is_autocast_enabled,
)
from diagnose.trainers import speak_to

#: What the dispatch mode does with an op: judge it as one of these kinds, or pass it on (None).
_SOFTMAX = "softmax"
_UNSEEN = object()

#: How sure a claim is: --expect first, then a trainer's setting, then an autocast seen.
RANK_EXPECT, RANK_TRAINER, RANK_AUTOCAST = 0, 1, 2


def _float_tensors(args: Any) -> list[torch.Tensor]:
    """The floating-point tensors among an op's arguments (lists of them too)."""
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.is_floating_point():
                found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(t for t in arg if isinstance(t, torch.Tensor) and t.is_floating_point())
    return found


def _described(tensors: list[torch.Tensor]) -> list[str]:
    return [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast lowers to on ``device_type`` right now, or None when it is off."""
    try:
        if is_autocast_enabled(device_type):
            return autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # a torch without the device overloads
        return None
    return None


#: The base of the op watcher, untyped: torch's dispatch mode class is not annotated.
_DispatchBase: Any = TorchDispatchMode


class _StrictDispatch(_DispatchBase):  # type: ignore[misc]
    """Sees every aten op; hands the watched ones to the session before they run."""

    def __init__(self, session: StrictSession) -> None:
        super().__init__()
        self.session = session
        #: Set when the mode could not be popped (another mode lay on top): it passes ops on.
        self.retired = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        session = self.session
        kind: Any = session.kinds.get(func, _UNSEEN)
        if kind is _UNSEEN:
            kind = session.classify(func)
        if kind is not None and not (self.retired or session.busy or session.stopped):
            session.before_op(func, kind, args, kwargs)
        return func(*args, **kwargs)


class StrictSession:
    """The strict checks of one process: the claim, the watcher while installed, the log."""

    def __init__(
        self,
        options: StrictOptions,
        *,
        claim: Claim | None = None,
        claim_rank: int = RANK_EXPECT,
        log_path: str = "",
        trainer: str = "",
    ) -> None:
        self.options = options
        self.log = StrictLog(options=options, pid=os.getpid(), argv=list(sys.argv), claim=claim)
        self.log_path = log_path
        #: The trainer whose words a fix is written in when no claim names one.
        self.trainer = trainer
        self._claim_rank = claim_rank if claim is not None else RANK_AUTOCAST + 1
        self._watch = AutocastWatch(
            lambda c: self.set_claim(c, RANK_TRAINER if c.trainer else RANK_AUTOCAST)
        )
        self.precision = "precision" in options.checks
        self.attention = "attention" in options.checks
        self.kinds: dict[Any, str | None] = {}
        self._names: dict[Any, str] = {}
        self._mode: _StrictDispatch | None = None
        self._sdpa_original: Callable[..., Any] | None = None
        self._thread: int | None = None
        self._calls: list[SdpaCall] = []
        self._manual = ManualChain()
        self._fused = FusedPaths()
        self.installed = False
        #: True while strict mode runs torch ops of its own (a fused-kernel trial).
        self.busy = False
        #: True once the first violation stopped the run (fail mode) or strict mode failed.
        self.stopped = False

    # ------------------------------------------------------------------ the claim

    def begin(self) -> None:
        """Start learning the claim (autocast entries) and trimming violation tracebacks."""
        install_exception_hooks()
        if self._claim_rank > RANK_AUTOCAST:
            self._watch.start()

    def set_claim(self, claim: Claim | None, rank: int) -> None:
        """Take ``claim`` when it is surer than the one held (see the RANK_* constants)."""
        if claim is None or rank >= self._claim_rank:
            return
        self.log.claim = claim
        self._claim_rank = rank
        self._watch.stop()

    # ------------------------------------------------------------------ installing

    def install(self) -> None:
        """Watch the ops of this thread from now on."""
        if self.installed or self.stopped:
            return
        if DISPATCH_MODE_ERROR:
            self.fail(DISPATCH_MODE_ERROR)
            return
        self._thread = threading.get_ident()
        self._mode = _StrictDispatch(self)
        self._mode.__enter__()
        self._wrap_sdpa()
        self.installed = True

    def uninstall(self) -> None:
        """Stop watching (the mode is popped when it is the innermost one, else it retires)."""
        if not self.installed:
            return
        self.installed = False
        self._unwrap_sdpa()
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if innermost_dispatch_mode() is mode and threading.get_ident() == self._thread:
            mode.__exit__(None, None, None)
        else:
            mode.retired = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch every op of this thread in the block, counting its optimizer steps (how
        ``diagnose run`` watches the steps it measures)."""
        import torch.optim.optimizer as optimizer

        self.begin()
        handles = [
            optimizer.register_optimizer_step_pre_hook(lambda *_: self.step_reached()),
            optimizer.register_optimizer_step_post_hook(lambda *_: self.step_ended()),
        ]
        self.install()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.uninstall()

    def step_reached(self) -> None:
        """An optimizer step is about to update: its forward and backward ran, watched when the
        checks are installed now. (Counted here, not after the step: the window opens and
        closes at steps' ends, before or after any post hook of ours.)"""
        if self.installed:
            self.log.watched_steps += 1

    def step_ended(self) -> None:
        """An optimizer step ended: a run stopped by a violation is no longer watched."""
        if self.stopped:
            self.uninstall()

    def fail(self, error: str) -> None:
        """A failure of strict mode itself: recorded, the checks stop, the run goes on."""
        self.log.error = error[:300]
        self.stopped = True
        self._unwrap_sdpa()

    def write(self) -> None:
        """Write the log (atomically) where the parent reads it; never raises."""
        if not self.log_path:
            return
        try:
            text = json.dumps(self.log.to_dict(), indent=1, default=str)
            write_text_atomic(Path(self.log_path), text)
        except Exception:
            pass

    # ------------------------------------------------------------------ the dispatch side

    def classify(self, func: Any) -> str | None:
        """What the checks do with ``func`` (cached): a compute kind, softmax, or None."""
        kind: str | None = None
        try:
            name = str(func.name()) if hasattr(func, "name") else str(func)
            if getattr(func, "namespace", "aten") != "profiler":
                base_kind = op_kind(name)
                if base_kind in COMPUTE_KINDS:
                    kind = base_kind
                elif self.attention and name in ap.SOFTMAX_OPS:
                    kind = _SOFTMAX
            self._names[func] = name
        except Exception:
            kind = None
        self.kinds[func] = kind
        return kind

    def before_op(self, func: Any, kind: str, args: Any, kwargs: dict[str, Any]) -> None:
        """Judge one watched op before it runs; raises StrictViolation in fail mode."""
        try:
            if in_backward():
                return
            name = self._names[func]
            call = self._calls[-1] if self._calls else None
            self.log.ops_judged += 1
            if kind == _SOFTMAX:
                if call is None:
                    self._manual.softmax_op(name, args)
                return
            if kind == "attention" and call is not None and is_fused_op(name):
                call.fused = True
            claim = self.log.claim
            if self.precision and claim is not None:
                self._judge_precision(name, kind, args, claim, inside=call is not None)
            if self.attention and call is None and name in ap.MATMUL_OPS:
                ended = self._manual.matmul(name, args, kwargs)
                if ended is not None:
                    signature, sdpa_math = ended
                    # Below autograd here: the kernels are tried forward only.
                    tried = dataclasses.replace(signature, backward=False)
                    self._unfused(signature, args[0].device, manual=not sdpa_math, tried=tried)
        except StrictViolation:
            raise
        except Exception as exc:
            self.fail(f"strict check of {self._names.get(func, func)}: {type(exc).__name__}: {exc}")

    def _judge_precision(
        self, name: str, kind: str, args: Any, claim: Claim, *, inside: bool
    ) -> None:
        tensors = _float_tensors(args)
        dtype = majority_dtype(normalize_dtype(str(t.dtype)) for t in tensors)
        verdict = judge(kind, dtype, claim.dtype, None, inside_attention=inside)  # type: ignore[arg-type]
        if verdict == "unexpected":
            self._precision_violation(op_base_name(name), dtype or "", _described(tensors), claim)

    def _precision_violation(self, op: str, dtype: str, inputs: list[str], claim: Claim) -> None:
        violation = self._placed("precision", op, sys._getframe(1))
        reason = deliberate_reason(
            dtype=dtype, module_path=violation.module, module_class=violation.module_class
        )
        if reason:
            self.log.note("precision", f"{op} in {dtype} in {violation.module}: {reason}")
            return
        violation.inputs = inputs
        violation.ran = dtype
        violation.requested = claim.dtype
        violation.claimed_by = claim.by
        violation.fix = precision_fix(claim.trainer or self.trainer, claim.hand_cast)
        self.report(violation)

    def _placed(self, check: str, op: str, frame: FrameType) -> Violation:
        """A violation of ``check`` by ``op``, placed: its module, the user's line, the step."""
        module, module_class = module_path(frame)
        return Violation(
            check=check,
            op=op,
            module=module,
            module_class=module_class,
            code=describe_frame(user_frame(frame)),
            first_step=self.log.watched_steps + 1,
        )

    # ------------------------------------------------------------------ SDPA calls

    def _wrap_sdpa(self) -> None:
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention
        self._sdpa_original = original
        session = self

        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
            if session.busy or session.stopped or threading.get_ident() != session._thread:
                return original(*args, **kwargs)
            try:
                call = SdpaCall.of(args, kwargs)
            except Exception as exc:  # ours: never into the user's program
                session.fail(f"strict check of an SDPA call: {type(exc).__name__}: {exc}")
                return original(*args, **kwargs)
            session._calls.append(call)
            try:
                out = original(*args, **kwargs)
            finally:
                session._calls.pop()
            if not call.fused:
                session._math_call(call)
            return out

        scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
        scaled_dot_product_attention.__doc__ = original.__doc__
        F.scaled_dot_product_attention = scaled_dot_product_attention

    def _unwrap_sdpa(self) -> None:
        import torch.nn.functional as F

        original, self._sdpa_original = self._sdpa_original, None
        if (
            original is not None
            and getattr(F.scaled_dot_product_attention, "__wrapped__", None) is original
        ):
            F.scaled_dot_product_attention = original  # type: ignore[assignment]

    def _math_call(self, call: SdpaCall) -> None:
        """An SDPA call ran no fused op: judge its precision (as one attention op) and its path."""
        try:
            tensors = call.tensors()
            if tensors is None or in_backward():
                return
            query = tensors[0]
            dtype = _autocast_dtype(query.device.type) or query.dtype
            claim = self.log.claim
            if self.precision and claim is not None:
                short = normalize_dtype(str(dtype))
                if judge("attention", short, claim.dtype, None) == "unexpected":
                    inputs = _described(list(tensors))
                    if dtype != query.dtype:
                        inputs.append(f"(computed in {short} under autocast)")
                    self._precision_violation(SDPA_OP, short or "", inputs, claim)
            if self.attention:
                self._unfused(call.signature(dtype), query.device, manual=False, call=call)
        except StrictViolation:
            raise
        except Exception as exc:
            self.fail(f"strict check of an SDPA call: {type(exc).__name__}: {exc}")

    def _unfused(
        self,
        signature: Any,
        device: torch.device,
        *,
        manual: bool,
        tried: Any = None,
        call: SdpaCall | None = None,
    ) -> None:
        """Attention ran unfused (SDPA's math path, or by hand): a violation when a fused kernel
        runs the same inputs here (``tried``: the signature to try them at, default
        ``signature``; ``call``: an SDPA call, whose own layout is tried); otherwise noted as not
        judged, with why."""
        from diagnose.probes.attention.calls import sdpa_switches

        op = MANUAL_OP if manual else SDPA_OP
        self.busy = True
        try:
            verdict = self._fused.verdict(tried or signature, device, sdpa_switches(), call)
        finally:
            self.busy = False
        if not verdict.exists:
            why = "; ".join(verdict.reasons) or "every fused backend refused these inputs"
            self.log.note(
                "attention",
                f"{op} at {signature.label()}: no fused kernel runs these inputs on this "
                f"{verdict.kind} ({why}); not judged",
            )
            return
        violation = self._placed("attention", op, sys._getframe(1))
        reasons = (
            ["computed by hand (matmul → softmax → matmul) outside scaled_dot_product_attention"]
            if manual
            else list(verdict.reasons)
        )
        runs = ", ".join(BACKEND_LABELS.get(b, b) for b in verdict.runs)
        reasons.append(f"runs fused here at these inputs: {runs}")
        claim = self.log.claim
        fix = MANUAL_FIX
        if not manual:
            fix = math_fix(
                verdict.kind,
                verdict.arch,
                forced=verdict.forced,
                fp32_inputs=signature.dtype == "float32",
                dropout=signature.dropout_p > 0,
                rocm_experimental_missing=verdict.rocm_experimental_missing,
            )
        violation.inputs = [signature.label()]
        violation.ran = "hand-written" if manual else "math"
        violation.reasons = reasons
        violation.fix = speak_to(fix, (claim.trainer if claim is not None else "") or self.trainer)
        self.report(violation)

    # ------------------------------------------------------------------ a violation

    def report(self, violation: Violation) -> None:
        """Count ``violation``; in fail mode (and not allowed) stop the run with it."""
        violation.allowed_by = self.options.allowed_by(violation.op, violation.module) or ""
        entry = self.log.add(violation)
        if violation.allowed_by or self.options.mode == "warn":
            return
        self.stopped = True
        self.log.stopped = True
        self._unwrap_sdpa()
        self.write()
        raise StrictViolation(entry)


@contextlib.contextmanager
def strict_watch(options: StrictOptions | None, precision: str) -> Iterator[StrictLog | None]:
    """``diagnose run --strict``: its own steps watched, the claim its ``--precision``; yields the
    log (None without ``options``)."""
    if options is None:
        yield None
        return
    from diagnose.strict.claims import run_claim

    session = StrictSession(options, claim=run_claim(precision), claim_rank=RANK_TRAINER)
    with session.watching():
        yield session.log


__all__ = ["RANK_AUTOCAST", "RANK_EXPECT", "RANK_TRAINER", "StrictSession", "strict_watch"]
