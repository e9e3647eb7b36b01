"""Environment rules about a CPU run: how many threads torch computes on, and how many cores the
machine has."""

from __future__ import annotations

from diagnose.catalogs import environment_catalog as cat
from diagnose.probes.environment.facts import EnvironmentFacts, judged, unknown
from diagnose.record import ProbeResult
from diagnose.stats import at_line


def rule_cpu_threads(facts: EnvironmentFacts) -> ProbeResult:
    """A CPU run on one thread, on few threads, or on a machine with few cores."""
    if facts.device.kind != "cpu":
        return judged()
    torch_info = facts.section("torch")
    cpu = facts.section("cpu")
    threads = torch_info.get("num_threads")
    usable = cpu.get("usable_cores") or cpu.get("logical_cores")
    physical = cpu.get("physical_cores") or usable
    if not threads or not usable or not physical:
        result = unknown(cat.CPU_THREADS_LOW.id, "CPU threads: not recorded")
        result.add_not_judged(cat.CPU_FEW_CORES.id, "CPU cores: not recorded")
        return result
    env = facts.env
    evidence = {
        "torch_threads": threads,
        "usable_cores": usable,
        "physical_cores": physical,
        **{k: env[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in env},
    }
    # A run on a busy machine gives the cores others hold back (diagnose.contention): the steps
    # then ran on fewer threads than torch is set to, which the line must say, as the notes do.
    ran = facts.device.extra.get("torch_threads")
    ran_on = (
        f"; the steps here ran on {ran}, leaving the cores other processes held"
        if isinstance(ran, int) and ran != threads
        else ""
    )
    if ran_on:
        evidence["steps_ran_on_threads"] = ran
    result = judged()
    # One question, two answers of different weight: one thread, or fewer than half the cores.
    if threads == 1 and usable > 1:
        result.add_finding(
            cat.cpu_one_thread_finding(usable=usable, physical=physical, evidence=evidence)
        )
    elif physical and at_line(threads / physical, cat.CPU_THREADS_LOW_SHARE).below:
        result.add_finding(
            cat.cpu_threads_low_finding(threads=threads, physical=physical, evidence=evidence)
        )
    else:
        # Enough threads answers both: recorded once, under the broader question.
        result.add_ok(
            cat.CPU_THREADS_LOW.id,
            f"torch is set to {threads} threads on {usable} usable cores{ran_on}",
        )
    if at_line(usable, cat.CPU_ENOUGH_CORES).below:
        result.add_finding(cat.cpu_few_cores_finding(usable=usable, evidence=evidence))
    else:
        result.add_ok(cat.CPU_FEW_CORES.id, f"{usable} usable CPU cores")
    return result
