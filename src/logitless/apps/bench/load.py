"""Was the machine quiet during a bench run? CPU time used by other processes, and steal.

A time ratio taken while something else runs can be off by 2x on a small machine. Interleaving
the methods' repeats (``harness.run_bench``) makes load hit every method alike; this module
says when there was load at all, so the run can be flagged instead of trusted.

Linux only (``/proc/stat``): over the run, the machine's busy CPU time minus this process
tree's own (the bench and its workers, from ``os.times()`` once the workers have exited) is
what other processes used; ``steal`` is what the hypervisor gave to other guests. Elsewhere
the report is empty and nothing is flagged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

# A run is flagged when other processes used more than this fraction of the machine's CPU
# time, or the hypervisor stole more than this fraction of it.
OTHERS_LIMIT = 0.10
STEAL_LIMIT = 0.05
# How a busy run's note starts (the table's warning; the CSV's note column ends with it).
BUSY = "machine busy during the run"


def read_proc_stat() -> list[int] | None:
    """The aggregate ``cpu`` line of /proc/stat (user, nice, system, idle, iowait, irq,
    softirq, steal, ...) in clock ticks, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    return [int(v) for v in first[1:]]


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass(frozen=True)
class LoadReport:
    """CPU use during a run. ``others`` and ``steal``: fractions of the machine's CPU time
    (all cores, the whole run) used by other processes and stolen by the hypervisor; None
    when unknown."""

    others: float | None
    steal: float | None

    @property
    def busy(self) -> bool:
        """Whether the run's time ratios should not be trusted."""
        return (self.others or 0.0) > OTHERS_LIMIT or (self.steal or 0.0) > STEAL_LIMIT

    def note(self) -> str:
        """A short note for the CSV and the table ('' when the machine was quiet)."""
        if not self.busy:
            return ""
        return (
            f"{BUSY}: other processes used {100 * (self.others or 0):.0f}% "
            f"of the CPU time, steal {100 * (self.steal or 0):.0f}%; time ratios may be off "
            "(rerun on a quiet machine)"
        )


def busy_note(text: str) -> str:
    """The busy-machine note in ``text`` (a CSV row's ``note``, which ends with it), or ''."""
    start = text.find(BUSY)
    return text[start:] if start >= 0 else ""


class LoadMonitor:
    """Call :meth:`report` after the run (once its workers have exited)."""

    def __init__(
        self,
        *,
        read_stat: Callable[[], list[int] | None] = read_proc_stat,
        own_cpu: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        cpus: int | None = None,
        ticks_per_s: float | None = None,
    ) -> None:
        self.read_stat, self.own_cpu, self.clock = read_stat, own_cpu, clock
        self.cpus = cpus or os.cpu_count() or 1
        self.ticks = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self.stat0, self.own0, self.t0 = read_stat(), own_cpu(), clock()

    def report(self) -> LoadReport:
        stat1, own1, t1 = self.read_stat(), self.own_cpu(), self.clock()
        if self.stat0 is None or stat1 is None or len(stat1) < 8:
            return LoadReport(None, None)
        delta = [b - a for a, b in zip(self.stat0, stat1, strict=False)]
        user, nice, system, idle, iowait, irq, softirq, steal = delta[:8]
        total = sum(delta[:8])
        if total <= 0 or t1 <= self.t0:
            return LoadReport(None, None)
        busy_s = (user + nice + system + irq + softirq) / self.ticks
        others = max(0.0, busy_s - (own1 - self.own0)) / ((t1 - self.t0) * self.cpus)
        return LoadReport(others=min(1.0, others), steal=steal / total)
