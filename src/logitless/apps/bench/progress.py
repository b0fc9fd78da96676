"""Progress of a ``logitless bench`` run on stderr: method i of n, repeat j of r, elapsed time
and an estimate of the time left for the whole run.

On a terminal one status line is redrawn in place (``\\r``) about once a second; into a file or
a pipe each phase is one line. Finished methods get their result line either way, so the log
reads the same. Nothing goes to stdout, where the table is printed.

The estimate is a model of the run, refined as it goes: a method's step costs what its
repeats cost so far (scaled by tokens when it was measured at another ``--tokens``), an
unmeasured method what the measured ones cost per token on average; a warm-up slower than the
repeats (compilation) is a one-off cost of that method; every subprocess pays the overhead
(Python and torch start-up, inputs, result, exit) the earlier ones paid. Methods that cannot
run (a peer that is not installed) count as overhead only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ..output import StatusLine
from .results import Row, progress_line
from .workload import Workload


def format_step(seconds: float) -> str:
    """A step time: ``"3.1 ms"`` below a second, ``"12.4 s"`` from one on."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def format_duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on (``75.4`` -> ``"1:15"``)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class _Unit:
    """One method at one workload: what the estimate knows of it."""

    method: str
    work: Workload
    rounds: int  # worker processes (each: start-up, a warm-up, its share of the repeats)
    runs: bool  # False when the method is known not to run here (skipped: overhead only)
    started: float | None = None
    ready: float | None = None  # inputs built, first step about to run
    finished: float | None = None
    warmup_s: list[float] = field(default_factory=list)  # one per round
    step_s: list[float] = field(default_factory=list)  # each timed repeat
    phase: str = ""
    busy: float = 0.0  # wall time this unit's workers held the machine so far


def _step(unit: _Unit) -> float:
    """A unit's step time so far: the mean repeat, or the warm-up before any repeat."""
    return statistics.mean(unit.step_s or unit.warmup_s)


class BenchProgress:
    """Progress display and time-left estimate of one bench run.

    ``plan``: the (method, workload) pairs in run order. ``runs(method, work)`` says whether a
    method will run its steps (False: it will be skipped); ``warmups(work)``: how many worker
    processes (each with its warm-up) a method runs at ``work`` (the bench's rounds); ``live``:
    redraw one status line (default: when ``stream`` is a terminal); ``clock``: seconds,
    monotonic.
    """

    def __init__(
        self,
        plan: Sequence[tuple[str, Workload]],
        stream: TextIO,
        *,
        runs: Callable[[str, Workload], bool] = lambda method, work: True,
        warmups: Callable[[Workload], int] = lambda work: 1,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.clock = stream, clock
        self.status = StatusLine(stream, live, indent="  ")
        self.live = self.status.live
        self.units = [_Unit(m, w, warmups(w), runs(m, w)) for m, w in plan]
        self.t0 = clock()
        self.current = -1
        self._since = self.t0  # when the current unit got the machine

    # ----------------------------------------------------------------------------- events

    def _switch(self, index: int) -> None:
        """The machine goes to unit ``index`` (-1: none): the time since the last switch is
        booked to the unit that had it."""
        now = self.clock()
        if 0 <= self.current < len(self.units) and self.units[self.current].finished is None:
            self.units[self.current].busy += now - self._since
        self.current, self._since = index, now

    def start(self, index: int) -> None:
        """Method ``index`` (0-based, in plan order) starts a subprocess (one per round)."""
        self._switch(index)
        unit = self.units[index]
        if unit.started is None:
            unit.started = self.clock()
        unit.phase = "starting"
        self._show(f"{self._label(index)}: starting")

    def event(self, event: dict[str, object]) -> None:
        """A progress event of the running method's worker (see ``worker.PROGRESS_PREFIX``)."""
        unit = self.units[self.current]
        now, kind = self.clock(), event.get("event")
        r = unit.work.repeats
        if kind == "ready":
            if unit.ready is None:
                unit.ready = now
            unit.phase = "warm-up"
            self._show(f"{self._label(self.current)}: warm-up", log=False)
        elif kind == "warmup":
            seconds = float(str(event["seconds"]))
            unit.warmup_s.append(seconds)
            unit.phase = f"repeat {len(unit.step_s) + 1}/{r}"
            self._show(f"{self._label(self.current)}: warm-up {format_step(seconds)}")
        elif kind == "repeat":  # counted over the unit's rounds
            seconds = float(str(event["seconds"]))
            unit.step_s.append(seconds)
            j = len(unit.step_s)
            unit.phase = f"repeat {j + 1}/{r}" if j < r else "finishing"
            self._show(f"{self._label(self.current)}: repeat {j}/{r} {format_step(seconds)}")

    def finish(self, index: int, row: Row) -> None:
        """Method ``index`` is done: print its result line with the elapsed and left times."""
        unit = self.units[index]
        if index == self.current:
            self._switch(-1)
        unit.finished, unit.phase = self.clock(), ""
        self.status.clear()
        line = progress_line(index + 1, len(self.units), row)
        self.stream.write(f"{line} | {self._times()}\n")
        self.stream.flush()

    def tick(self) -> None:
        """Redraw the live status line (elapsed and left move on between events)."""
        if self.live and 0 <= self.current < len(self.units):
            unit = self.units[self.current]
            if unit.finished is None:
                self._show(f"{self._label(self.current)}: {unit.phase}", log=False)

    def close(self) -> None:
        """Clear the live status line, leaving the terminal to the table."""
        self.status.clear()

    # ----------------------------------------------------------------------------- estimate

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return self.clock() - self.t0

    def remaining(self) -> float | None:
        """Estimated seconds until the whole run ends; None before any step was timed."""
        timed = [u for u in self.units if u.step_s or u.warmup_s]
        if not timed:
            return None
        per_token: dict[str, list[float]] = {}
        for u in timed:
            per_token.setdefault(u.method, []).append(_step(u) / u.work.tokens)
        mean_per_token = statistics.mean(statistics.mean(v) for v in per_token.values())
        # a warm-up longer than a step is a one-off per process (compilation, lazy imports)
        extra: dict[str, float] = {}
        for u in timed:
            if u.step_s and u.warmup_s:
                extra[u.method] = max(0.0, u.warmup_s[0] - _step(u))
        # everything but the steps, per worker: interpreter and torch start-up, inputs,
        # result, exit
        overheads = [
            (u.busy - sum(u.warmup_s) - sum(u.step_s)) / (u.rounds if u.runs else 1)
            for u in self.units
            if u.finished is not None and u.started is not None
        ]
        if not overheads:
            overheads = [
                u.ready - u.started
                for u in self.units
                if u.ready is not None and u.started is not None
            ]
        overhead = statistics.mean(overheads) if overheads else 0.0

        def expected(u: _Unit) -> float:
            if not u.runs:
                return overhead
            if u.step_s or u.warmup_s:
                step = _step(u)
            else:
                known = per_token.get(u.method)
                step = (statistics.mean(known) if known else mean_per_token) * u.work.tokens
            warm = step + extra.get(u.method, 0.0)
            return u.rounds * (overhead + warm) + u.work.repeats * step

        now, left = self.clock(), 0.0
        for i, u in enumerate(self.units):
            if u.finished is not None:
                continue
            spent = u.busy + (now - self._since if i == self.current else 0.0)
            left += max(0.0, expected(u) - spent)
        return left

    # ----------------------------------------------------------------------------- output

    def _label(self, index: int) -> str:
        unit = self.units[index]
        return f"method {index + 1}/{len(self.units)} {unit.method} (tokens={unit.work.tokens})"

    def _times(self) -> str:
        left = self.remaining()
        if all(u.finished is not None for u in self.units):
            tail = "done"
        elif left is None:
            tail = "estimating time left"
        else:
            tail = f"about {format_duration(left)} left"
        return f"elapsed {format_duration(self.elapsed())}, {tail}"

    def _show(self, text: str, log: bool = True) -> None:
        """The status: redrawn in place when live, else one line (if ``log``)."""
        if self.live or log:
            self.status.show(f"{text} | {self._times()}", log)
