"""Strict mode (``--strict``): a silent upcast or attention fallback stops the run at the op.

- :mod:`diagnose.strict.options`: what ``--strict`` asks for (torch-free);
- :mod:`diagnose.strict.violations`: what was found, the error raised, the log a process writes
  (torch-free);
- :mod:`diagnose.strict.claims`, :mod:`~diagnose.strict.frames`, :mod:`~diagnose.strict.attention`
  and :mod:`~diagnose.strict.mode`: the checks inside the trainer's process;
- :mod:`diagnose.strict.runtime`: the glue ``diagnose profile``'s capture loads into every process;
- :mod:`diagnose.strict.result`: the logs read back into the record.

The finding ids, wording and fixes are in :mod:`diagnose.catalogs.strict_catalog`. This module
stays light: importing it imports no torch.
"""

from diagnose.strict.options import StrictOptions
from diagnose.strict.violations import StrictViolation

__all__ = ["StrictOptions", "StrictViolation"]
