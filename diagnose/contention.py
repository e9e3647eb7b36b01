"""Contention: how much of the machine other work took while we measured, and what it may explain.

A report is a claim about the user's machine, and a busy machine makes every timing slower and
noisier: two runs of the same command on a shared 2-core machine once gave opposite advice. So the
timed steps and every probe run inside a :class:`LoadWindow` that samples, in a background thread,
the CPU time of the cores this process may use, split into ours (this process and its children:
DataLoader workers) and everyone else's (other processes, and a VM's steal time).

What a window concludes (:class:`diagnose.record.HostLoad`):

- ``others_cores``: the mean cores others took; ``others_cores_high``: the most they took in the
  busiest tenth of the window.
- ``competing_share``: the share of a measured time the load could explain. Others only slow us
  when they compete for cores, so an interval counts when the cores were nearly all busy and
  others held a real share of them; the share is what others took in the busiest tenth of such
  intervals, 0 on a quiet machine. A time measured in the window (the s/it) may be inflated by
  that much; two runs on differently loaded machines differ by up to that much.
- ``allowance``: how much of a time the load's *swings* could explain. An interleaved A/B runs
  both sides under the same load: a steady load slows both alike and leaves their ratio, so only
  a load that came and went can fake a difference between them. The allowance is the spread of
  the competing share (its busiest tenth against its quietest tenth) from the probe's first A/B
  rounds on (:func:`mark_rounds`: load during its set-up cannot favour either side), or over the
  whole window when the probe marks no rounds.

A comparison made while a window is open (:func:`diagnose.stats.sure_saving`) subtracts the
allowance times the slower side from the saving it is sure of, so a difference the load could
explain is not raised; the window counts the comparisons it set aside, and the report says so.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from diagnose.record import HostLoad

#: Seconds between readings: short enough to see bursts that hit one side of an A/B, long
#: enough that reading the process tree costs nothing measurable.
INTERVAL_S = 0.25
#: Readings closer than this are merged into one interval (counters tick in 10 ms steps).
MIN_SPAN_S = 0.2
#: Others compete with us only when the cores are nearly all busy (ours + theirs).
BUSY_SHARE = 0.75
#: ... and when they hold at least this share of the cores in that interval.
OTHERS_SHARE = 0.10
#: Shares are taken at the busiest (and quietest) tenth of the intervals, not the single extreme.
HIGH_QUANTILE = 0.9
#: Intervals with competing load a window needs before it counts as contended.
MIN_BUSY_INTERVALS = 2
#: No load can explain all of a time: a gap of ten times stands on any machine.
MAX_SHARE = 0.9


@dataclass(frozen=True)
class CpuReading:
    """One reading: a clock, and CPU seconds consumed so far on our cores."""

    at: float
    #: Busy seconds of the cores this process may use (all processes).
    busy: float
    #: Seconds a hypervisor ran other guests on those cores (0 outside a VM).
    steal: float
    #: CPU seconds of this process, its live descendants and its reaped children.
    own: float


Reader = Callable[[], CpuReading]


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return list(range(os.cpu_count() or 1))


def _job_root(psutil: Any) -> Any:
    """The process whose tree is "ours": this process, or, in one rank of a job started by a
    launcher (torchrun, ``diagnose run --nproc``), the launcher, so the sibling ranks on this
    machine count as the job's own work and not as other load."""
    me = psutil.Process()
    if os.environ.get("LOCAL_WORLD_SIZE", "1") not in ("", "0", "1"):
        try:
            return me.parent() or me
        except psutil.Error:
            return me
    return me


def job_pids() -> list[int]:
    """The pids of this job's process tree (empty when they cannot be read)."""
    try:
        import psutil

        root = _job_root(psutil)
        return sorted({root.pid, *(child.pid for child in root.children(recursive=True))})
    except Exception:
        return []


def psutil_reader() -> tuple[Reader, int] | str:
    """A reader of this machine's CPU times and the number of cores it covers, or why not."""
    try:
        import psutil
    except ImportError:
        return "psutil is not installed"
    cpus = _cpus()
    me = _job_root(psutil)

    # A child that has exited but is not yet reaped (a zombie) can no longer be read, and its
    # time reaches children_* only once reaped: in between it would vanish from ours and read
    # as another process's. So a child's last reading is kept until then; once reaped it is
    # counted twice, which only ever makes others' share smaller.
    last_seen: dict[int, float] = {}

    def own_seconds() -> float:
        times = me.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in me.children(recursive=True):
            try:
                child_times = child.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # its last reading stands in for it
            last_seen[child.pid] = child_times.user + child_times.system
        return float(total + sum(last_seen.values()))

    def read() -> CpuReading:
        per_cpu = psutil.cpu_times(percpu=True)
        busy = steal = 0.0
        for index in cpus:
            if index >= len(per_cpu):
                continue
            t = per_cpu[index]
            # guest time is already inside user on Linux; idle and iowait are not busy.
            busy += t.user + t.system + getattr(t, "nice", 0.0)
            busy += getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
            steal += getattr(t, "steal", 0.0)
        return CpuReading(time.perf_counter(), busy, steal, own_seconds())

    try:
        read()
    except Exception as exc:  # a sandbox without /proc, an unsupported platform
        return f"CPU times could not be read ({type(exc).__name__})"
    return read, len(cpus)


@dataclass(frozen=True)
class Interval:
    """Cores used over one interval between two readings."""

    seconds: float
    own: float
    others: float


def intervals(readings: list[CpuReading], cpus: int) -> list[Interval]:
    """Cores used between readings at least :data:`MIN_SPAN_S` apart. CPU counters tick in
    10 ms steps: over a few milliseconds (a comparison asks for the load so far between two
    background readings) one tick reads as several cores, so closer readings are merged, and a
    core count is clipped at zero and at the machine rather than trusted beyond it."""
    out = []
    kept = readings[:1]
    for reading in readings[1:]:
        if reading.at - kept[-1].at >= MIN_SPAN_S:
            kept.append(reading)
    if len(readings) > 1 and kept[-1] is not readings[-1]:
        # The window ends at its last reading: a short last piece joins the interval before it.
        if len(kept) > 1:
            kept[-1] = readings[-1]
        elif readings[-1].at > kept[0].at:
            kept.append(readings[-1])
    for before, after in itertools.pairwise(kept):
        seconds = after.at - before.at
        own = max(0.0, after.own - before.own) / seconds
        busy = max(0.0, after.busy - before.busy) / seconds
        steal = max(0.0, after.steal - before.steal) / seconds
        others = min(float(cpus), max(0.0, busy - own) + steal)
        out.append(Interval(seconds, own, others))
    return out


def _low(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[int((1 - HIGH_QUANTILE) * len(ordered))]


def _high(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(HIGH_QUANTILE * len(ordered)))]


def summarize(readings: list[CpuReading], cpus: int, basis: str) -> HostLoad:
    """The load of a window from its readings (pure)."""
    spans = intervals(readings, cpus)
    total = sum(s.seconds for s in spans)
    if not spans or total <= 0 or cpus <= 0:
        return HostLoad(basis=basis, seconds=total, cpus=cpus)
    own = sum(s.own * s.seconds for s in spans) / total
    others = sum(s.others * s.seconds for s in spans) / total
    # Others' share of the cores, counted only where the cores were nearly all busy.
    competing = [
        min(1.0, s.others / cpus)
        if (s.own + s.others) / cpus >= BUSY_SHARE and s.others / cpus >= OTHERS_SHARE
        else 0.0
        for s in spans
    ]
    high = min(MAX_SHARE, _high(competing))
    # One busy interval is a blip (or a counter's tick), not a machine others were using.
    contended = high >= OTHERS_SHARE and sum(c > 0 for c in competing) >= MIN_BUSY_INTERVALS
    return HostLoad(
        basis=basis,
        seconds=total,
        cpus=cpus,
        own_cores=own,
        others_cores=others,
        others_cores_high=_high([s.others for s in spans]),
        load_average=_load_average(),
        competing_share=high if contended else 0.0,
        allowance=max(0.0, high - _low(competing)) if contended else 0.0,
    )


def _load_average() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


class LoadWindow:
    """Samples the load from :meth:`open` to :meth:`close` in a background thread.

    Never raises: without psutil or CPU counters the window reads as quiet, with the reason in
    ``basis``. While open (``with window:``) it is the window that comparisons consult
    (:func:`current_allowance`, :func:`note_set_aside`).
    """

    def __init__(self, reader: tuple[Reader, int] | str | None = None) -> None:
        made = psutil_reader() if reader is None else reader
        self._reader: Reader | None = None
        self._cpus = 0
        self._basis = made if isinstance(made, str) else "psutil"
        if not isinstance(made, str):
            self._reader, self._cpus = made
        self._readings: list[CpuReading] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: contextvars.Token[LoadWindow | None] | None = None
        #: When the window's first A/B rounds began (:meth:`mark_rounds`); None: its start.
        self._rounds_from: float | None = None
        self.set_aside = 0
        self.load: HostLoad | None = None

    def _read(self) -> None:
        if self._reader is None:
            return
        try:
            reading = self._reader()
        except Exception:
            return  # a process vanished mid-walk: the next reading covers it
        with self._lock:
            self._readings.append(reading)

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._read()

    def open(self) -> LoadWindow:
        self._read()
        if self._reader is not None:
            self._thread = threading.Thread(target=self._loop, name="diagnose-load", daemon=True)
            self._thread.start()
        self._token = _ACTIVE.set(self)
        return self

    def so_far(self) -> HostLoad:
        """The load from the window's start to now (a reading is taken first)."""
        self._read()
        with self._lock:
            readings = list(self._readings)
        load = summarize(readings, self._cpus, self._basis)
        load.comparisons_set_aside = self.set_aside
        return load

    def mark_rounds(self) -> None:
        """The rounds of an A/B start now: comparisons weigh the load from the first rounds of
        the window on.

        A load that came and went while the probe built its twins or decoded its data cannot
        have favoured either side of rounds that had not begun; counting it would widen the
        comparisons' intervals by a swing none of their samples saw. Only the first mark
        counts: a probe that runs several A/Bs and judges them together afterwards still has
        every one of its rounds weighed."""
        if self._rounds_from is not None:
            return
        self._read()
        with self._lock:
            self._rounds_from = self._readings[-1].at if self._readings else None

    def rounds_so_far(self) -> HostLoad:
        """The load since the window's first A/B rounds began (:meth:`mark_rounds`), or since
        it opened when none is marked."""
        self._read()
        with self._lock:
            start = self._rounds_from
            readings = [r for r in self._readings if start is None or r.at >= start]
        return summarize(readings, self._cpus, self._basis)

    def close(self) -> HostLoad:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * INTERVAL_S + 1)
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        self.load = self.so_far()
        return self.load

    def __enter__(self) -> LoadWindow:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_ACTIVE: contextvars.ContextVar[LoadWindow | None] = contextvars.ContextVar(
    "diagnose_load_window", default=None
)


def current_allowance() -> float:
    """The allowance of the open window over its A/B rounds so far (the whole window when no
    rounds are marked; 0 without a window)."""
    window = _ACTIVE.get()
    return 0.0 if window is None else window.rounds_so_far().allowance


def mark_rounds() -> None:
    """The open window's A/B rounds start now (:meth:`LoadWindow.mark_rounds`); nothing without
    a window."""
    window = _ACTIVE.get()
    if window is not None:
        window.mark_rounds()


def note_set_aside() -> None:
    """A comparison the load could explain was not raised (counted by the open window)."""
    window = _ACTIVE.get()
    if window is not None:
        window.set_aside += 1


@contextmanager
def quiet_window() -> Iterator[None]:
    """No window for the comparisons inside (tests of the statistics themselves)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


#: Others must hold at least this many cores, steadily, before a CPU run gives theirs back.
YIELD_CORES = 0.5


def threads_for_load(load: HostLoad, threads: int) -> int:
    """The torch threads a CPU measurement should use beside the load others put on its cores.

    torch's CPU kernels split each op over all their threads and wait for the last: when other
    processes hold a core, the thread that shares it finishes late and every op waits for it,
    and a step on all the cores runs many times slower than on the cores left free. So the
    threads are the cores others leave free, counting a core they hold at least half the time as
    theirs; never fewer than one, never more than ``threads``.
    """
    if load.cpus <= 1 or threads <= 1 or load.others_cores < YIELD_CORES:
        return threads
    taken = math.floor(load.others_cores + YIELD_CORES)
    return max(1, min(threads, load.cpus - taken))


def describe(load: HostLoad) -> str:
    """One line for the reader: how busy the machine was and what it means for the numbers."""
    others = f"other processes took {load.others_cores:.1f} of {load.cpus} cores on average"
    if load.others_cores_high > load.others_cores + 0.05:
        others += f" (up to {load.others_cores_high:.1f})"
    if not load.contended:
        return f"{others}; the cores were not contended"
    line = f"{others}, up to {load.competing_share:.0%} of the cores while ours were busy"
    if load.allowance > 0:
        line += (
            f"; the load came and went by {load.allowance:.0%}, so differences smaller than "
            "that were not judged"
        )
        if load.comparisons_set_aside:
            line += f" ({load.comparisons_set_aside} set aside)"
    else:
        line += ", steadily (it slowed both sides of each comparison alike)"
    return line


__all__ = [
    "BUSY_SHARE",
    "INTERVAL_S",
    "OTHERS_SHARE",
    "CpuReading",
    "Interval",
    "LoadWindow",
    "current_allowance",
    "describe",
    "intervals",
    "job_pids",
    "mark_rounds",
    "note_set_aside",
    "psutil_reader",
    "quiet_window",
    "summarize",
    "threads_for_load",
]
