"""Runs with a quantized base only: the same LoRA step with the base as stored and unquantized,
what expanding the stored weights costs and how far the output strays (:mod:`.probe` runs it, and
judges what :mod:`.ab` measures).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.quantization`; its
catalog is :mod:`diagnose.catalogs.quantization_catalog`; the stored layers are
:mod:`diagnose.workload.quantize`.

Empty on purpose: importing one module of the package imports no other.
"""
