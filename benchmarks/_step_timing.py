"""What the trainer-step benchmarks share (trl_step.py, verl_step.py, ...): time one variant's step
in this process, and run each variant in a fresh process of its own.

Imported by path: a script under benchmarks/ has this folder first on ``sys.path``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def time_step(variant: str, step: Callable[[], float], zero_grad: Callable[[], None],
              repeats: int) -> dict:  # fmt: skip
    """A warm-up ``step()`` (its loss is reported), then ``repeats`` timed steps under a peak
    memory probe: the median time, every time, the peak extra memory and the RSS high-water
    mark (MB)."""
    from logitless.apps.memory import CpuPeakMemory, _proc_status_kib

    loss = step()  # warm-up
    zero_grad()
    probe = CpuPeakMemory()
    probe.start()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "variant": variant,
        "loss": loss,
        "time_median_s": statistics.median(times),
        "times_s": times,
        "peak_extra_mb": probe.peak_extra_bytes() / 2**20,
        "hwm_mb": (_proc_status_kib("VmHWM") or 0) / 1024,
        "note": probe.note,
    }


def run_worker(script: str, marker: str, variant: str, argv: list[str]) -> dict:
    """``script --worker variant argv`` in a fresh Python process; its result is the last
    stdout line starting with ``marker`` (JSON). A worker that printed none stops the run with
    the tail of its stderr."""
    cmd = [sys.executable, script, "--worker", variant, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{variant} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(marker) :])


def append_rows(path, header: list[str], rows: list[list]) -> None:
    """Append ``rows`` to the CSV at ``path`` (made with ``header`` where it does not exist);
    a file with other columns stops the run."""
    import csv
    from pathlib import Path

    path = Path(path)
    new = not path.exists()
    if not new:
        with path.open(newline="") as f:
            if next(csv.reader(f), []) != header:
                raise SystemExit(f"{path} has other columns; use a new file")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerows(rows)
