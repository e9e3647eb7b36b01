"""Which attention path and kernel each call really ran, why no fused kernel could, and what a
faster backend saves here (:mod:`.probe` runs it).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.attention`; its catalog
(ids, wording, fixes) is :mod:`diagnose.catalogs.attention_catalog`. Strict mode's live check is
:mod:`diagnose.strict.attention`.

Empty on purpose: importing one module of the package imports no other.
"""
