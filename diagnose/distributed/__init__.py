"""Distributed training (DDP, FSDP): collectives in one trace, and several ranks read together.

- :mod:`.collectives`: the time each step spends in collectives, and how much of it no compute
  hides, read from one rank's trace (NCCL/RCCL kernels on a GPU, gloo ranges on a CPU);
- :mod:`.ranks`: a folder of rank traces read in parallel and compared step by step: each rank's
  wait for the others, the straggler and the phase it is slow in;
- :mod:`.catalog`: the concern's finding ids, thresholds, wording and fixes, shared by the trace
  analysis and ``diagnose run --nproc``.
"""
