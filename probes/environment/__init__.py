"""Machine-level causes: the device, its memory, ROCm's switches, the CPU's threads, telemetry
(:mod:`.probe` runs it; :mod:`.facts` holds what it reads, torch-free).

The concern's other halves: it has no trace rule; its catalogs are
:mod:`diagnose.catalogs.environment_catalog` and :mod:`diagnose.catalogs.memory_catalog`.

Empty on purpose: importing one module of the package imports no other.
"""
