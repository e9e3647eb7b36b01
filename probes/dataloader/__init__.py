"""How long the step waits for data, the loader's settings and the dataset's facts, and an A/B of
the loader changes trainers offer (:mod:`.probe` runs it; :mod:`.verdict` judges it).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.dataloader`; its
catalog is :mod:`diagnose.catalogs.dataloader_catalog`.

Empty on purpose: importing one module of the package imports no other.
"""
