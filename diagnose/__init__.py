"""diagnose: explain the seconds per iteration of a LoRA training run on a GPU or CPU."""

import time as _time

#: When this package was first imported, on the performance counter: for the ``diagnose``
#: command the first thing its process does once the interpreter is up (its start-up is timed
#: from here, see :mod:`diagnose.entry`).
IMPORTED_AT = _time.perf_counter()

__version__ = "0.1.0"
