"""Triton and ``torch.compile`` kernels checked against float64 references at their own precision.

The probe is :mod:`.probe`; the corpus, the harness and the judge are :mod:`.cases`. Catalog:
``diagnose/catalogs/triton_catalog.py``; command: ``diagnose/commands/triton.py``.
"""
