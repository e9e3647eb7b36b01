"""The device's own peak, measured (``torch.mm`` in each dtype the step's FLOPs need), the basis of
the measured MFU (:mod:`.probe` runs it).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.roofline`; its catalog
is :mod:`diagnose.catalogs.compute_catalog`; the counting and the vendors' peaks are
:mod:`diagnose.roofline`.

Empty on purpose: importing one module of the package imports no other.
"""
