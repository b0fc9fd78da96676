"""Worker subprocess: measure one method on one workload and print one JSON result line.

Run as ``python -m logitless.apps.bench.worker '<json>'`` with ``{"method": ..., "workload":
{...}}``. The last stdout line starting with :data:`RESULT_PREFIX` carries the result:
``status`` is ``ok`` (with times and memory), ``skipped`` or ``failed`` (with ``reason``).
A crash that kills the process (OOM killer, segfault) is reported by the parent instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from .methods import get_method
from .workload import Workload, make_inputs

RESULT_PREFIX = "LOGITLESS_BENCH_RESULT "


def _proc_status_kib(field: str) -> int | None:
    """A ``kB`` field (``VmRSS``, ``VmHWM``) of /proc/self/status, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), so RSS reflects live data."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _ru_maxrss_kib() -> int:
    """Lifetime peak RSS of this process in KiB (``ru_maxrss`` is bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


class CpuPeakMemory:
    """Peak extra resident memory of a code region, from the process RSS high-water mark.

    Resets the high-water mark by writing ``5`` to /proc/self/clear_refs (Linux >= 4.0).
    Without it, falls back to ``ru_maxrss``, which cannot be reset: the peak then includes
    everything since process start (noted in ``self.note``).
    """

    def __init__(self) -> None:
        self.note = ""
        self.baseline_kib = 0

    def start(self) -> None:
        """Record the baseline RSS and reset the high-water mark."""
        _release_free_heap()
        rss = _proc_status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            rss = None
        if rss is None:
            self.note = "RSS high-water mark not resettable; peak is ru_maxrss since start"
            rss = _ru_maxrss_kib()
        self.baseline_kib = rss

    def peak_extra_bytes(self) -> int:
        """High-water mark since :meth:`start`, minus the baseline."""
        hwm = None if self.note else _proc_status_kib("VmHWM")
        if hwm is None:
            hwm = _ru_maxrss_kib()
        return max(0, hwm - self.baseline_kib) * 1024


class CudaPeakMemory:
    """Peak extra allocated CUDA memory, from the caching allocator's statistics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.note = ""
        self.baseline = 0

    def start(self) -> None:
        """Record allocated bytes and reset the peak statistic."""
        gc.collect()
        torch.cuda.synchronize(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_extra_bytes(self) -> int:
        """Peak allocated since :meth:`start`, minus the baseline."""
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)


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


def measure(method_name: str, work: Workload) -> dict[str, object]:
    """Build inputs, warm up once, then time ``work.repeats`` steps and record peak memory."""
    method = get_method(work.task, method_name)
    reason = method.unavailable(work)
    if reason:
        return {"status": "skipped", "reason": reason}
    torch.set_num_threads(work.threads)
    device = torch.device(work.device)
    inputs = make_inputs(work)
    step = method.build(work, inputs)
    step()  # warmup: lazy imports, compilation, allocator pools
    inputs.clear_grads()
    probe = CudaPeakMemory(device) if device.type == "cuda" else CpuPeakMemory()
    probe.start()
    times = []
    for _ in range(work.repeats):
        times.append(_timed(step, device))
        inputs.clear_grads()
    return {
        "status": "ok",
        "time_p50_s": statistics.median(times),
        "time_p20_s": _quantile(times, 0.2),
        "time_p80_s": _quantile(times, 0.8),
        "peak_extra_bytes": probe.peak_extra_bytes(),
        "note": "; ".join(n for n in (method.note(work), probe.note) if n),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the subprocess; always prints a result line unless the process dies."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec = json.loads(argv[0])
        result = measure(spec["method"], Workload(**spec["workload"]))
    except Exception as exc:  # any failure is a result, not a crash of the whole run
        traceback.print_exc(file=sys.stderr)
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
