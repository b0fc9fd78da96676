"""Peak extra memory of a code region: the meters of ``logitless bench`` and ``logitless demo``.

CUDA (:class:`CudaPeakMemory`): ``max_memory_allocated`` minus ``memory_allocated`` at start,
peak statistics reset. CPU (:class:`CpuPeakMemory`, Linux): the RSS high-water mark
(``VmHWM``), reset through ``/proc/self/clear_refs``, minus the RSS at start after returning
freed heap pages to the OS; without a resettable high-water mark it falls back to the lifetime
``ru_maxrss`` and says so in ``note``. Both have ``start()``, ``peak_extra_bytes()`` and
``note``; :func:`peak_memory_meter` picks the one for a device.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys

import torch


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


def peak_memory_meter(device: torch.device) -> CpuPeakMemory | CudaPeakMemory:
    """The meter for ``device``: :class:`CudaPeakMemory` on CUDA, else :class:`CpuPeakMemory`."""
    return CudaPeakMemory(device) if device.type == "cuda" else CpuPeakMemory()
