"""How a launch failed: a compile error, a launch error, or something this machine cannot run,
from the exception it raised; and which failures leave a GPU context unusable."""

from __future__ import annotations

import traceback
from typing import Literal

from diagnose.probes.triton.cases.api import Mode

#: The verdicts a failed launch can get (a subset of the check's verdicts).
Failure = Literal["compile_error", "launch_error", "unsupported"]

#: Messages after which a GPU context is unusable: every later launch in the process would fail.
_FATAL_DEVICE_ERRORS = (
    "illegal memory access",
    "illegal address",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "memory access fault",
    "device-side assert",
    "hiperrorillegaladdress",
    "hiperrorlaunchfailure",
)
_COMPILE_ERROR_TYPES = {
    "CompilationError",
    "CompileTimeAssertionFailure",
    "UnsupportedLanguageConstruct",
    "PTXASError",
    "BackendCompilerFailed",
    "InductorError",
    "LoweringException",
    "CppCompileError",
    "CUDACompileError",
}
#: The interpreter's stand-ins for tl.static_assert / tl.device_assert at compile time.
_STATIC_ASSERTS = {"_new_static_assert", "static_assert"}
_COMPILER_PATHS = (
    "/triton/compiler/",
    "/triton/language/",
    # The backends' compiler.py, not their driver.py: the driver launches.
    "/triton/backends/nvidia/compiler.py",
    "/triton/backends/amd/compiler.py",
)


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, at most 500 characters."""
    detail = getattr(exc, "error_message", None)
    if "CompilationError" in _type_names(exc) and isinstance(detail, str) and detail.strip():
        # Triton's message starts with the source excerpt; the reason is its error_message.
        text = detail.strip()
    else:
        text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    message = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return message[:500]


def _type_names(exc: BaseException) -> set[str]:
    return {klass.__name__ for klass in type(exc).__mro__}


def classify_exception(exc: BaseException, mode: Mode, kind: str) -> tuple[Failure, str]:
    """Which verdict an exception raised by a launch means, and the one-line message."""
    if "InterpreterError" in _type_names(exc) and exc.__cause__ is not None:
        # The interpreter wraps what the kernel raised; judge that.
        exc = exc.__cause__
    message = first_line(exc)
    names = _type_names(exc)
    if "OutOfResources" in names:
        return "unsupported", f"needs more on-chip resources than this device has: {message}"
    if "InvalidCxxCompiler" in names:
        return "unsupported", f"inductor's CPU backend has no C++ compiler: {message}"
    if mode == "interpreter" and "NotImplementedError" in names:
        return "unsupported", f"Triton's interpreter does not implement this: {message}"
    if names & _COMPILE_ERROR_TYPES:
        return "compile_error", message
    frames = traceback.extract_tb(exc.__traceback__)
    # The innermost frame decides: raised by the compiler (or, interpreted, by the language's
    # semantic checks or a static_assert, which the compiler would reject) or while running.
    if frames:
        innermost = frames[-1]
        path = innermost.filename.replace("\\", "/")
        if any(part in path for part in _COMPILER_PATHS) or innermost.name in _STATIC_ASSERTS:
            return "compile_error", message
    return "launch_error", message


def is_fatal_device_error(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _FATAL_DEVICE_ERRORS)
