"""What the optimizer step costs, whether it stalls, and what 8-bit buys (:mod:`.probe` runs it;
:mod:`.verdict` judges it).

The concern's other halves: its trace rule is :mod:`diagnose.trace.rules.syncs`
(``optimizer.sync_in_step``); its catalog is :mod:`diagnose.catalogs.optimizer_catalog`.

Empty on purpose: importing one module of the package imports no other.
"""
