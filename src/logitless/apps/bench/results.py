"""One bench row: a method measured (or skipped, or failed) at one workload, with its ratios,
and its one-line report."""

from __future__ import annotations

from dataclasses import dataclass, field

from .workload import Workload

MIB = 1024 * 1024


@dataclass
class Row:
    """One measured (or skipped / failed) method at one workload, plus its ratios."""

    method: str
    work: Workload
    status: str
    reason: str = ""
    time_p50_s: float | None = None
    time_p20_s: float | None = None
    time_p80_s: float | None = None
    peak_extra_mb: float | None = None
    ratios: dict[str, float | None] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)  # every timed step

    @property
    def ok(self) -> bool:
        """Whether the method produced numbers."""
        return self.status == "ok"


def progress_line(index: int, total: int, row: Row) -> str:
    """One line per finished method, for the progress log."""
    head = f"[{index}/{total}] tokens={row.work.tokens} {row.method}:"
    if row.ok:
        return (
            f"{head} {row.time_p50_s:.4f} s (p20 {row.time_p20_s:.4f}, p80 {row.time_p80_s:.4f}),"
            f" peak extra {row.peak_extra_mb:.1f} MB"
        )
    return f"{head} {row.status} -- {row.reason}"
