"""The machine's load from other work: measured, carried into every comparison, said on the page.

The real-process tests burn a core in a process that is not ours (a re-parented grandchild) and,
as the clean twin, the same burner as our own child, which is the job's work and not load.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from diagnose import contention, stats
from diagnose.contention import CpuReading, LoadWindow, summarize
from diagnose.gate import compare_records
from diagnose.record import HostLoad, RunRecord
from diagnose.reports.headline import build_headline
from tests.factories import timed_record

BURN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def _readings(own: float, others: float, cpus: int, n: int = 20) -> list[CpuReading]:
    """Readings of a window in which we use ``own`` cores and others ``others``, per second."""
    return [
        CpuReading(at=float(i), busy=(own + others) * i, steal=0.0, own=own * i) for i in range(n)
    ]


def _bursty(own: float, others: float, n: int = 40) -> list[CpuReading]:
    """Others take ``others`` cores every other second and none in between; we keep the rest."""
    readings, busy, mine = [], 0.0, 0.0
    for i in range(n):
        readings.append(CpuReading(at=float(i), busy=busy, steal=0.0, own=mine))
        taken = others if i % 2 else 0.0
        busy += 2.0 if taken else own
        mine += 2.0 - taken if taken else own
    return readings


def test_others_holding_a_core_of_a_busy_machine_are_contention() -> None:
    load = summarize(_readings(own=1.0, others=1.0, cpus=2), 2, "test")
    assert load.contended
    assert load.competing_share == pytest.approx(0.5)
    assert load.others_cores == pytest.approx(1.0)
    # A steady load slows both sides of an interleaved comparison alike: nothing to allow for.
    assert load.allowance == 0.0


def test_a_load_that_comes_and_goes_is_allowed_for_in_comparisons() -> None:
    load = summarize(_bursty(own=1.9, others=1.0), 2, "test")
    assert load.contended
    assert load.allowance == pytest.approx(0.5)
    # No load explains everything: a ten-fold gap stands on any machine.
    assert summarize(_bursty(own=0.1, others=2.0), 2, "test").allowance <= 0.9


def test_a_quiet_machine_or_spare_cores_are_not_contention() -> None:
    # The job alone, nearly all cores busy: nothing competes with it.
    assert not summarize(_readings(own=1.9, others=0.05, cpus=2), 2, "test").contended
    # Others busy on cores the job does not need: the machine is not short of cores.
    assert not summarize(_readings(own=2.0, others=4.0, cpus=16), 16, "test").contended


def test_steal_time_of_a_vm_counts_as_others() -> None:
    readings = [
        CpuReading(at=float(i), busy=1.2 * i, steal=0.8 * i, own=1.2 * i) for i in range(10)
    ]
    load = summarize(readings, 2, "test")
    assert load.others_cores == pytest.approx(0.8)
    assert load.contended


def _burner(seconds: float, *, ours: bool) -> tuple[psutil.Process, subprocess.Popen[bytes] | None]:
    code = BURN.format(seconds=seconds)
    if ours:
        child = subprocess.Popen([sys.executable, "-c", code])
        return psutil.Process(child.pid), child
    # A grandchild whose parent exits at once is re-parented away from us: not our process tree.
    launcher = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {code!r}], start_new_session=True,\n"
        "    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
    )
    done = subprocess.run([sys.executable, "-c", launcher], check=True, capture_output=True)
    return psutil.Process(int(done.stdout)), None


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _window_beside(seconds: float, *, ours: bool) -> tuple[HostLoad, float, float]:
    """The load of a window in which we burn a core and a burner does too; with the CPU seconds
    we and the burner spent in it, read from the processes themselves."""
    burner, child = _burner(seconds + 10.0, ours=ours)
    time.sleep(0.3)  # let it start burning before the window opens
    burner_before, ours_before = _cpu(burner), time.process_time()
    with LoadWindow() as window:
        end = time.time() + seconds
        while time.time() < end:
            pass
    burned, spent = _cpu(burner) - burner_before, time.process_time() - ours_before
    burner.kill()
    if child is not None:
        child.wait(timeout=30)
    assert window.load is not None
    return window.load, burned, spent


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")
def test_a_process_not_ours_is_measured_as_load_and_our_child_is_not() -> None:
    # Measured against what each process says it spent, so a busy machine cannot fail it.
    slack = 0.15  # CPU counters tick in 10 ms; the sampler and the window's edges cost a little
    planted, burned, spent = _window_beside(2.0, ours=False)
    assert planted.basis == "psutil"
    assert burned > 0.2, "the stranger did not run"
    assert planted.own_cores * planted.seconds <= spent + slack, (planted, spent)
    assert planted.others_cores * planted.seconds >= burned - slack, (planted, burned)
    if planted.cpus > 1 and burned / planted.seconds >= 0.6:
        # A stranger that held most of a core takes that core from a CPU run's threads.
        assert contention.threads_for_load(planted, planted.cpus) < planted.cpus
    twin, burned, spent = _window_beside(2.0, ours=True)
    assert burned > 0.2, "our child did not run"
    assert twin.own_cores * twin.seconds >= spent + burned - slack, (twin, spent, burned)


def _samples(median: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [median * (1 + rng.uniform(-0.03, 0.03)) for _ in range(n)]


@contextmanager
def _bursty_window() -> Iterator[LoadWindow]:
    """An open window that has already seen 40 s of a load that came and went."""
    readings = iter(_bursty(own=1.9, others=1.0, n=1000))
    with LoadWindow(reader=(lambda: next(readings), 2)) as window:
        for _ in range(40):
            window.so_far()
        yield window


def test_a_gap_the_load_could_explain_is_set_aside_and_counted() -> None:
    fast, slow = _samples(1.0, 9, 1), _samples(1.3, 9, 2)
    with contention.quiet_window():
        assert stats.clearly_faster(fast, slow)
    with _bursty_window() as window:
        assert not stats.clearly_faster(fast, slow)
        assert stats.sure_saving(fast, slow) == 0.0
    assert window.load is not None and window.load.comparisons_set_aside == 1
    # A gap far beyond what the load could explain stands on the same busy machine.
    with _bursty_window() as window:
        assert stats.clearly_faster(_samples(1.0, 9, 3), _samples(5.0, 9, 4))
    assert window.load is not None and window.load.comparisons_set_aside == 0


def _record(step: float, load: HostLoad | None, seed: int) -> RunRecord:
    return timed_record(_samples(step, 12, seed), host_load=load)


BUSY = HostLoad(
    basis="psutil", seconds=10, cpus=2, own_cores=1, others_cores=1, competing_share=0.5
)
QUIET = HostLoad(basis="psutil", seconds=10, cpus=2, own_cores=1.9, others_cores=0.05)


def test_the_gate_calls_a_slowdown_a_busy_machine_could_explain_inconclusive() -> None:
    baseline = _record(1.0, QUIET, 1)
    busy = compare_records(baseline, _record(1.3, BUSY, 2))
    assert busy.step is not None and busy.step.verdict == "inconclusive"
    assert "busy" in busy.step.reason
    quiet = compare_records(baseline, _record(1.3, QUIET, 2))
    assert quiet.step is not None and quiet.step.verdict == "slower"
    # Beyond what the load could add, a busy run's slowdown is still a regression.
    far = compare_records(baseline, _record(3.0, BUSY, 3))
    assert far.step is not None and far.step.verdict == "slower"


def test_the_report_says_the_machine_was_busy_and_what_it_means() -> None:
    busy = build_headline(_record(1.0, BUSY, 1))
    assert busy.busy and "1.0 of 2 cores" in busy.busy_text and "50%" in busy.busy_text
    quiet = build_headline(_record(1.0, QUIET, 1))
    assert not quiet.busy and quiet.busy_text == ""


def test_the_report_says_when_other_processes_shared_the_gpu() -> None:
    record = _record(1.0, QUIET, 1)
    record.inventory = {"telemetry": {"during_steps": {"stats": {"other_processes_max": 2}}}}
    headline = build_headline(record)
    assert headline.busy and "2 other processes had work on the GPU" in headline.busy_text
    record.inventory["telemetry"]["during_steps"]["stats"]["other_processes_max"] = 0
    assert not build_headline(record).busy


def test_an_interleaved_ab_verdict_allows_for_the_load_swings() -> None:
    slow, fast = _samples(1.3, 9, 5), _samples(1.0, 9, 6)
    with contention.quiet_window():
        assert stats.ab_verdict(slow, fast, min_relative=0.1).outcome == "faster"
    with _bursty_window():
        verdict = stats.ab_verdict(slow, fast, min_relative=0.1)
        assert verdict.outcome == "inconclusive" and verdict.set_aside
        # Far beyond the swings, the answer stands; a same-speed twin is never called faster.
        assert stats.ab_verdict(_samples(5.0, 9, 7), fast, min_relative=0.1).outcome == "faster"
        assert stats.ab_verdict(_samples(1.0, 9, 8), fast, min_relative=0.1).outcome != "faster"


def test_one_busy_blip_is_not_a_busy_machine_and_others_never_exceed_the_cores() -> None:
    readings = _readings(own=1.9, others=0.0, cpus=2, n=30)
    # One interval in which our own count dropped (a child gone before it was reaped): busy
    # time with no owner, more than the machine has.
    blip = readings[10]
    readings[10] = CpuReading(at=blip.at, busy=blip.busy + 3.0, steal=0.0, own=blip.own)
    load = summarize(readings, 2, "test")
    assert load.others_cores_high <= 2.0
    assert not load.contended


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")
def test_a_child_that_exits_before_it_is_reaped_stays_ours() -> None:
    made = contention.psutil_reader()
    assert not isinstance(made, str), made
    read, _ = made
    child = subprocess.Popen([sys.executable, "-c", BURN.format(seconds=0.8)])
    process = psutil.Process(child.pid)
    time.sleep(0.5)
    while_alive = read()
    burned = _cpu(process)
    while process.status() != psutil.STATUS_ZOMBIE:  # exited, not yet waited for
        time.sleep(0.05)
    as_zombie = read()
    child.wait(timeout=30)
    reaped = read()
    # Our CPU time never goes back: had the zombie's time vanished until it was reaped, the
    # machine's busy time would have been credited to others in between.
    assert burned > 0.1
    assert as_zombie.own >= while_alive.own
    assert reaped.own >= as_zombie.own


def test_readings_milliseconds_apart_do_not_read_a_counter_tick_as_cores() -> None:
    # Background readings every 0.25 s, plus comparisons asking 2 ms after one: the machine's
    # counter ticked once (10 ms) in those 2 ms, ours did not. Five cores in 2 ms is a tick.
    readings = []
    for i in range(40):
        at = i * 0.25
        readings.append(CpuReading(at=at, busy=1.9 * at, steal=0.0, own=1.9 * at))
        readings.append(CpuReading(at=at + 0.002, busy=1.9 * at + 0.01, steal=0.0, own=1.9 * at))
    load = summarize(readings, 2, "test")
    assert not load.contended
    assert load.others_cores_high < 0.1


@pytest.mark.parametrize(
    ("own", "others", "cpus", "threads", "expected"),
    [
        (1.0, 1.0, 2, 2, 1),  # one busy process on two cores: one thread left
        (1.9, 0.1, 2, 2, 2),  # a quiet machine keeps every thread
        (1.5, 0.4, 2, 2, 2),  # under half a core taken: not worth a thread
        (4.0, 3.0, 8, 8, 5),
        (4.0, 3.0, 8, 4, 4),  # never more threads than torch had
        (1.0, 7.9, 8, 8, 1),  # never fewer than one
        (1.0, 1.0, 1, 1, 1),
    ],
)
def test_a_cpu_run_gives_the_cores_others_hold_back(
    own: float, others: float, cpus: int, threads: int, expected: int
) -> None:
    load = summarize(_readings(own=own, others=others, cpus=cpus), cpus, "test")
    assert contention.threads_for_load(load, threads) == expected


def test_a_busy_machine_runs_the_steps_on_the_free_cores_and_says_so() -> None:
    import torch

    from diagnose.record import new_record
    from diagnose.run import _fit_threads_to_load

    before = torch.get_num_threads()
    record = new_record("run")
    try:
        torch.set_num_threads(2)
        busy = summarize(_readings(own=1.0, others=1.0, cpus=2), 2, "test")
        _fit_threads_to_load(busy, record)
        assert torch.get_num_threads() == 1
        assert record.device.extra["torch_threads"] == 1
        assert any("1 thread(s) instead of 2" in note for note in record.notes)
        quiet = summarize(_readings(own=1.9, others=0.0, cpus=2), 2, "test")
        twin = new_record("run")
        torch.set_num_threads(2)
        _fit_threads_to_load(quiet, twin)
        assert (
            torch.get_num_threads() == 2
            and not twin.notes
            and "torch_threads" not in twin.device.extra
        )
    finally:
        torch.set_num_threads(before)


class _Machine:
    """A fake machine read on demand: one reading per call, one second apart; others take a core
    every other second while ``bursty`` is set, and nothing otherwise."""

    def __init__(self) -> None:
        self.bursty = True
        self.at = self.busy = self.own = 0.0
        self.lock = threading.Lock()

    def read(self) -> CpuReading:
        with self.lock:
            reading = CpuReading(at=self.at, busy=self.busy, steal=0.0, own=self.own)
            taken = 1.0 if self.bursty and int(self.at) % 2 else 0.0
            self.busy += 2.0 if taken else 1.9
            self.own += 2.0 - taken if taken else 1.9
            self.at += 1.0
            return reading


@pytest.mark.parametrize("burst_during_rounds", [False, True])
def test_a_load_that_came_and_went_before_the_rounds_began_is_not_allowed_for(
    burst_during_rounds: bool,
) -> None:
    slow, fast = _samples(1.3, 9, 5), _samples(1.0, 9, 6)
    machine = _Machine()
    with LoadWindow(reader=(machine.read, 2)) as window:
        for _ in range(40):  # the probe's set-up, under a load that comes and goes
            window.so_far()
        assert stats.ab_verdict(slow, fast, min_relative=0.1).outcome == "inconclusive"
        machine.bursty = burst_during_rounds
        contention.mark_rounds()
        for _ in range(20):  # the rounds
            window.so_far()
        verdict = stats.ab_verdict(slow, fast, min_relative=0.1)
    # Only a swing the rounds saw can fake their difference; the window still reports it all.
    assert verdict.outcome == ("inconclusive" if burst_during_rounds else "faster")
    assert window.load is not None and window.load.allowance > 0


def test_a_second_ab_keeps_the_first_ones_rounds_weighed() -> None:
    slow, fast = _samples(1.3, 9, 5), _samples(1.0, 9, 6)
    machine = _Machine()
    with LoadWindow(reader=(machine.read, 2)) as window:
        machine.bursty = False
        for _ in range(10):  # set-up, quiet
            window.so_far()
        contention.mark_rounds()
        machine.bursty = True
        for _ in range(20):  # the first A/B's rounds, under a load that comes and goes
            window.so_far()
        machine.bursty = False
        contention.mark_rounds()  # a second A/B, judged together with the first afterwards
        for _ in range(5):
            window.so_far()
        assert stats.ab_verdict(slow, fast, min_relative=0.1).outcome == "inconclusive"
