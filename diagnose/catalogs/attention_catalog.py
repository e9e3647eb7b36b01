"""What the project knows about attention: finding ids, thresholds, wording, fixes."""

from __future__ import annotations

from diagnose.catalogs import FindingSpec

#: The phases in which attention runs.
ATTENTION_PHASES = ("encode", "forward", "backward")

MATH_FALLBACK = FindingSpec(
    "attention.math_fallback",
    "attention",
    "attention ran SDPA's unfused math path",
    ("probe", "trace"),
    phases=ATTENTION_PHASES,
)
UNFUSED_MANUAL = FindingSpec(
    "attention.unfused_manual",
    "attention",
    "attention is computed by hand with `bmm → softmax → bmm`",
    ("probe", "trace"),
    phases=ATTENTION_PHASES,
)
SLOWER_BACKEND = FindingSpec(
    "attention.slower_backend",
    "attention",
    "a fused backend ran, and another one that runs here was measured faster",
    ("probe",),
    phases=ATTENTION_PHASES,
)
XFORMERS_UNAVAILABLE = FindingSpec(
    "attention.xformers_unavailable",
    "attention",
    "the run asked for xFormers, which does not import here",
    ("probe",),
    phases=ATTENTION_PHASES,
)
SPECS = (MATH_FALLBACK, UNFUSED_MANUAL, SLOWER_BACKEND, XFORMERS_UNAVAILABLE)
