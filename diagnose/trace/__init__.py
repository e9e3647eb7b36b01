"""Traces: reading any torch.profiler (Kineto/Chrome) trace, and analysing it.

- :mod:`.analysis`: the engine, ``analyze_trace`` and ``analysis_to_record``: steps, breakdown,
  kernels, findings (the rules are in :mod:`.rules`);
- :mod:`.reader`: the file into columnar tables (:mod:`.stream` cuts it, :mod:`.columns` builds the
  columns, :mod:`.parallel_read` shares the work with a second process).

Nothing is imported here: a command that reads a trace starts the reading before it imports the
analysis.
"""
