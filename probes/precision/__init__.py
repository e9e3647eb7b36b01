"""A dtype audit of one extra step: which compute ran in fp32 under a bf16/fp16 request, where, and
what low precision saves here (:mod:`.probe` runs it).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.precision`; its catalog
is :mod:`diagnose.catalogs.precision_catalog`; what autocast keeps in fp32 is
:mod:`diagnose.precision_policy`.

Empty on purpose: importing one module of the package imports no other.
"""
