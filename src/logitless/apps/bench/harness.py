"""Run every selected method in a fresh subprocess, compute ratios, print and record rows."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, TextIO

import torch

from ..output import write_csv
from ..version import package_version
from .results import MIB, Row, progress_line
from .worker import PROGRESS_PREFIX, RESULT_PREFIX, _quantile
from .workload import Workload

CSV_COLUMNS = (
    "timestamp",
    "task",
    "method",
    "status",
    "tokens",
    "hidden",
    "vocab",
    "valid_frac",
    "dtype",
    "device",
    "threads",
    "repeats",
    "time_p50_s",
    "time_p20_s",
    "time_p80_s",
    "peak_extra_mb",
    "time_vs_naive",
    "time_vs_floor3",
    "time_vs_floor4",
    "mem_vs_naive",
    "mem_vs_floor",
    "mem_floor_mb",
    "time_vs_floor6",
    "note",
    "machine",
    "torch",
    "logitless",
)


def _unavailable(method: str, work: Workload) -> str | None:
    """Why ``method`` cannot run on ``work`` (a missing peer, no GPU), or None; a check that
    raises is left to the worker, which reports it as a failure."""
    from .methods import get_method

    try:
        return get_method(work.task, method).unavailable(work)
    except Exception:
        return None


def run_method(
    method: str,
    work: Workload,
    timeout_s: float | None = None,
    *,
    on_event: Callable[[dict[str, object]], None] | None = None,
    on_tick: Callable[[], None] | None = None,
) -> Row:
    """Measure ``method`` on ``work`` in a fresh Python subprocess.

    Whatever happens there -- an exception, the OOM killer, a timeout -- comes back as a
    ``failed`` row with the reason; it never propagates. ``on_event`` gets the worker's
    progress events as they arrive; ``on_tick`` is called about once a second in between.
    """
    skip = _unavailable(method, work)
    if skip:  # known here: no worker (its start-up alone takes seconds)
        return Row(method, work, "skipped", reason=skip)
    spec = json.dumps({"method": method, "workload": work.to_dict()})
    cmd = [sys.executable, "-m", "logitless.apps.bench.worker", spec]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    timed_out = Row(method, work, "failed", reason=f"timed out after {timeout_s or 0:g} s")
    out: list[str] = []
    with (
        tempfile.TemporaryFile(mode="w+") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        reader.start()
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                line = lines.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if on_tick is not None:
                    on_tick()
                continue
            if line is None:  # the worker closed its stdout: it is exiting
                break
            if line.startswith(PROGRESS_PREFIX):
                if on_event is not None:
                    on_event(json.loads(line[len(PROGRESS_PREFIX) :]))
            else:
                out.append(line)
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            returncode = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(timeout=10)  # the pipe ends with the worker (and any child of it)
            return timed_out
        reader.join()
        err.seek(0)
        stderr = err.read()
    results = [ln for ln in out if ln.startswith(RESULT_PREFIX)]
    if not results:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return Row(method, work, "failed", reason=_exit_reason(returncode) + f": {tail}")
    result = json.loads(results[-1][len(RESULT_PREFIX) :])
    if result["status"] != "ok":
        return Row(method, work, result["status"], reason=result["reason"])
    return Row(
        method,
        work,
        "ok",
        reason=result.get("note", ""),
        time_p50_s=result["time_p50_s"],
        time_p20_s=result["time_p20_s"],
        time_p80_s=result["time_p80_s"],
        peak_extra_mb=result["peak_extra_bytes"] / MIB,
        times=list(result.get("times", [])),
    )


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Copy ``stream``'s lines into ``lines`` (newline stripped), then None at its end."""
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _exit_reason(returncode: int) -> str:
    """Describe how a worker died (negative return codes are signals; -9 is the OOM killer)."""
    if returncode == -9:
        return "killed by SIGKILL (out of memory?)"
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exited with code {returncode} without a result"


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is zero."""
    if num is None or not den:
        return None
    return num / den


def add_ratios(rows: Sequence[Row]) -> None:
    """Fill each ok row's time and memory ratios vs naive, floor3/floor4 (floor6: the
    distillation task's six matmuls) and the memory floor.

    Ratios are taken against rows of the same workload in the same run; a missing reference
    (not selected, failed) leaves the ratio empty.
    """
    by_method = {r.method: r for r in rows if r.ok}
    naive, f3, f4, f6 = (by_method.get(m) for m in ("naive", "floor3", "floor4", "floor6"))
    for r in rows:
        if not r.ok:
            continue
        floor_mb = r.work.memory_floor_bytes() / MIB
        r.ratios = {
            "time_vs_naive": _ratio(r.time_p50_s, naive and naive.time_p50_s),
            "time_vs_floor3": _ratio(r.time_p50_s, f3 and f3.time_p50_s),
            "time_vs_floor4": _ratio(r.time_p50_s, f4 and f4.time_p50_s),
            "time_vs_floor6": _ratio(r.time_p50_s, f6 and f6.time_p50_s),
            "mem_vs_naive": _ratio(r.peak_extra_mb, naive and naive.peak_extra_mb),
            "mem_vs_floor": _ratio(r.peak_extra_mb, floor_mb),
        }


def split_repeats(repeats: int, rounds: int) -> list[int]:
    """``repeats`` timed steps cut into at most ``rounds`` rounds, as evenly as possible
    (``split_repeats(5, 3) == [2, 2, 1]``)."""
    rounds = max(1, min(rounds, repeats))
    base, extra = divmod(repeats, rounds)
    return [base + (1 if k < extra else 0) for k in range(rounds)]


def merge_rounds(parts: Sequence[Row]) -> Row:
    """One method's rows of several rounds -> its row: quantiles over every timed step, the
    largest peak memory; the first round that did not produce numbers decides otherwise."""
    bad = next((r for r in parts if not r.ok), None)
    if bad is not None or len(parts) == 1:
        return bad or parts[0]
    times = [t for r in parts for t in r.times]
    first = parts[0]
    return Row(
        first.method,
        replace(first.work, repeats=len(times)),
        "ok",
        reason=first.reason,
        time_p50_s=statistics.median(times),
        time_p20_s=_quantile(times, 0.2),
        time_p80_s=_quantile(times, 0.8),
        peak_extra_mb=max(r.peak_extra_mb or 0.0 for r in parts),
        times=times,
    )


def run_bench(
    method_names: Sequence[str],
    workloads: Sequence[Workload],
    *,
    log: TextIO,
    timeout_s: float | None = None,
    progress: bool = True,
    rounds: int = 1,
) -> list[Row]:
    """Measure every method at every workload, each in its own subprocess; add ratios.

    ``rounds``: each method's ``repeats`` timed steps are cut into up to this many rounds
    (:func:`split_repeats`), and each round runs every method once, each in a fresh worker
    that warms up, times its share of the steps and exits, in alternating order from round to
    round. A change of load during the run then hits every method alike, while one worker at
    a time holds memory (workers kept alive side by side change each other's allocation
    costs: the naive method's big buffers measured ~45% slower that way on CPU). The
    method's row merges its rounds (:func:`merge_rounds`). ``log`` gets one result line per
    method; with ``progress`` also method i of n, repeat j of r, the elapsed time and an
    estimate of the time left (:mod:`.progress`).
    """
    from .progress import BenchProgress

    def runs(name: str, work: Workload) -> bool:
        return _unavailable(name, work) is None

    plan = [(name, work) for work in workloads for name in method_names]
    shares = {id(w): split_repeats(w.repeats, rounds) for w in workloads}
    bar = None
    if progress:
        bar = BenchProgress(plan, log, runs=runs, warmups=lambda w: len(shares[id(w)]))
    rows: list[Row] = []
    try:
        for work in workloads:
            first = len(rows)
            parts: dict[str, list[Row]] = {name: [] for name in method_names}
            for k, share in enumerate(shares[id(work)]):
                order = list(enumerate(method_names))
                for i, name in order if k % 2 == 0 else order[::-1]:
                    if parts[name] and not parts[name][-1].ok:
                        continue  # skipped or failed: not again
                    round_work = replace(work, repeats=share)
                    if bar is None:
                        part = run_method(name, round_work, timeout_s)
                    else:
                        bar.start(first + i)
                        part = run_method(
                            name, round_work, timeout_s, on_event=bar.event, on_tick=bar.tick
                        )
                    parts[name].append(part)
            group = []
            for i, name in enumerate(method_names):
                row = merge_rounds(parts[name])
                if bar is None:
                    print(progress_line(first + i + 1, len(plan), row), file=log, flush=True)
                else:
                    bar.finish(first + i, row)
                group.append(row)
            add_ratios(group)
            rows.extend(group)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _fmt(value: float | None, spec: str) -> str:
    """Format a number, or '-' when missing."""
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row], warning: str = "") -> str:
    """Plain-text table of the run: times, peak extra memory and the ratios; ``warning``
    (e.g. a busy machine) is its last line."""
    header = (
        "tokens",
        "method",
        "median s",
        "p20-p80 s",
        "peak extra MB",
        "time/naive",
        "time/floor3",
        "time/floor4",
        "time/floor6",
        "mem/naive",
        "mem/memfloor",
    )
    body = []
    notes = []
    for r in rows:
        if r.ok:
            q = r.ratios
            body.append(
                (
                    str(r.work.tokens),
                    r.method,
                    _fmt(r.time_p50_s, ".4f"),
                    f"{r.time_p20_s:.4f}-{r.time_p80_s:.4f}",
                    _fmt(r.peak_extra_mb, ".1f"),
                    *(
                        _fmt(q.get(k), ".2f")
                        for k in (
                            "time_vs_naive",
                            "time_vs_floor3",
                            "time_vs_floor4",
                            "time_vs_floor6",
                            "mem_vs_naive",
                            "mem_vs_floor",
                        )
                    ),
                )
            )
            if r.reason:
                notes.append(f"  {r.method}: {r.reason}")
        else:
            body.append((str(r.work.tokens), r.method, r.status, *("-" * 8)))
            where = f" (tokens={r.work.tokens})" if r.status == "failed" else ""
            notes.append(f"  {r.method} {r.status}{where}: {r.reason}")
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i > 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in (header, *body)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        w = rows[0].work
        lines.append(
            f"memfloor = dW + dh = (V + N) * H * {w.element_size} B; "
            "MB = 2**20 bytes; ratios vs methods of the same run and tokens"
        )
    if notes:
        lines.append("notes:")
        lines.extend(dict.fromkeys(notes))
    if warning:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def machine_string() -> str:
    """Platform and processor, for the CSV (GPU name when on CUDA)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [platform.platform(), cpu, f"{os.cpu_count()} cpus"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return "; ".join(parts)


def check_csv_header(path: Path) -> None:
    """Raise ``ValueError`` if ``path`` exists with columns other than :data:`CSV_COLUMNS`."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open(newline="") as f:
        existing = next(csv.reader(f), [])
    if tuple(existing) != CSV_COLUMNS:
        raise ValueError(
            f"{path} has different columns (an older format?); pass another --csv path"
        )


def append_csv(path: Path, rows: Sequence[Row], timestamp: str) -> None:
    """Append ``rows`` to the CSV at ``path``, writing the header if the file is new."""
    machine = machine_string()
    write_csv(path, CSV_COLUMNS, (_csv_record(r, timestamp, machine) for r in rows), append=True)


def _csv_record(r: Row, timestamp: str, machine: str) -> dict[str, object]:
    """One :data:`CSV_COLUMNS` record of row ``r``."""
    w = r.work
    return {
        "timestamp": timestamp,
        "task": w.task,
        "method": r.method,
        "status": r.status,
        "tokens": w.tokens,
        "hidden": w.hidden,
        "vocab": w.vocab,
        "valid_frac": w.valid_frac,
        "dtype": w.dtype,
        "device": w.device,
        "threads": w.threads,
        "repeats": w.repeats,
        "time_p50_s": _csv_num(r.time_p50_s),
        "time_p20_s": _csv_num(r.time_p20_s),
        "time_p80_s": _csv_num(r.time_p80_s),
        "peak_extra_mb": _csv_num(r.peak_extra_mb),
        **{k: _csv_num(r.ratios.get(k)) for k in CSV_COLUMNS if "_vs_" in k},
        "mem_floor_mb": _csv_num(w.memory_floor_bytes() / MIB),
        "note": r.reason,
        "machine": machine,
        "torch": torch.__version__,
        "logitless": package_version(),
    }


def _csv_num(value: float | None) -> str:
    """Compact number for the CSV; empty when missing."""
    return "" if value is None else f"{value:.6g}"


def now_timestamp() -> str:
    """UTC run timestamp (all rows of one run share it, so it doubles as a run id)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def workloads_for(base: Workload, tokens: Sequence[int]) -> list[Workload]:
    """One workload per ``--tokens`` value."""
    return [replace(base, tokens=n) for n in tokens]
