"""Worker subprocess: measure one method on one workload and print one JSON result line.

Run as ``python -m logitless.apps.bench.worker '<json>'`` with ``{"method": ..., "workload":
{...}}``. The last stdout line starting with :data:`RESULT_PREFIX` carries the result:
``status`` is ``ok`` (with times and memory), ``skipped`` or ``failed`` (with ``reason``).
A crash that kills the process (OOM killer, segfault) is reported by the parent instead.

Before it, lines starting with :data:`PROGRESS_PREFIX` report each phase as it ends, for the
parent's progress display: ``{"event": "ready"}`` (inputs built), ``{"event": "warmup",
"seconds": s}``, then ``{"event": "repeat", "index": j, "of": r, "seconds": s}`` per timed
step. The result carries every timed step (``times``), so the parent can merge the rounds
of a method run in several workers (``harness.run_bench``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from ..memory import peak_memory_meter
from .methods import get_method
from .workload import Workload, make_inputs

RESULT_PREFIX = "LOGITLESS_BENCH_RESULT "
PROGRESS_PREFIX = "LOGITLESS_BENCH_PROGRESS "

Report = Callable[[dict[str, object]], None]


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """Wall time of one ``step``, synchronizing the accelerator around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile, defined for a single value too."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _no_report(event: dict[str, object]) -> None:
    """Progress sink that drops every event."""


def measure(method_name: str, work: Workload, report: Report = _no_report) -> dict[str, object]:
    """Build inputs, warm up once, then time ``work.repeats`` steps and record peak memory.

    ``report`` is called with each progress event (see the module docstring) as it happens.
    """
    method = get_method(work.task, method_name)
    reason = method.unavailable(work)
    if reason:
        return {"status": "skipped", "reason": reason}
    torch.set_num_threads(work.threads)
    device = torch.device(work.device)
    inputs = make_inputs(work)
    step = method.build(work, inputs)
    report({"event": "ready"})
    warmup_s = _timed(step, device)  # warmup: lazy imports, compilation, allocator pools
    inputs.clear_grads()
    report({"event": "warmup", "seconds": warmup_s})
    probe = peak_memory_meter(device)
    probe.start()
    times = []
    for j in range(1, work.repeats + 1):
        times.append(_timed(step, device))
        inputs.clear_grads()
        report({"event": "repeat", "index": j, "of": work.repeats, "seconds": times[-1]})
    return {
        "status": "ok",
        "time_p50_s": statistics.median(times),
        "time_p20_s": _quantile(times, 0.2),
        "time_p80_s": _quantile(times, 0.8),
        "times": times,
        "peak_extra_bytes": probe.peak_extra_bytes(),
        "note": "; ".join(n for n in (method.note(work), probe.note) if n),
    }


def _print_progress(event: dict[str, object]) -> None:
    """Report one progress event to the parent (a line on stdout, flushed at once)."""
    sys.stdout.write(PROGRESS_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the subprocess; always prints a result line unless the process dies."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec = json.loads(argv[0])
        result = measure(spec["method"], Workload(**spec["workload"]), _print_progress)
    except Exception as exc:  # any failure is a result, not a crash of the whole run
        traceback.print_exc(file=sys.stderr)
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
