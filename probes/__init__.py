"""Probes: active experiments that measure what one suspected slow-down costs, one package per
concern. The registry of probes is :mod:`diagnose.probes.registry`; the contract is
:mod:`diagnose.probes.base`. Empty on purpose: importing one module imports no probe.
"""
