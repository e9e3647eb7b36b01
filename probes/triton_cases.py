"""The Triton case API under the name case files were written against
(``from diagnose.probes.triton_cases import TritonCase``); it lives in
:mod:`diagnose.probes.triton.cases`."""

from diagnose.probes.triton.cases import *  # noqa: F403 - the public API, re-exported whole
from diagnose.probes.triton.cases import __all__  # noqa: F401
