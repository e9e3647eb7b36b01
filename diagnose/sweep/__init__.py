"""`diagnose sweep`: a grid of `diagnose run` points, each in its own process, resumable.

- :mod:`.grid`: the swept settings, the points and their stable ids, the settings every point
  shares, and the command line of one point;
- :mod:`.results`: what became of each point and its numbers, and what ``sweep.json`` holds;
- :mod:`.run_points`: which points a previous invocation measured (resume), and running each
  pending one in a child process with a timeout and Ctrl-C handling.

The sweep never measures anything itself: every number comes from the point's own
``record.json``. No torch import. Rendering (table, charts, VRAM fits, CSV, HTML) is
:mod:`diagnose.reports.sweep`'s job.
"""
