"""``--plot``: peak extra memory and time vs tokens, one line per method, as a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .harness import Row


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot_rows(rows: Sequence[Row], path: Path) -> None:
    """Write a two-panel PNG (memory, time vs tokens) of the ok rows of one run.

    Raises:
        PlotUnavailable: matplotlib is missing (``pip install 'logitless[bench]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'logitless[bench]'") from exc

    ok = [r for r in rows if r.ok]
    methods = list(dict.fromkeys(r.method for r in ok))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in methods:
        pts = sorted((r.work.tokens, r.peak_extra_mb, r.time_p50_s) for r in ok if r.method == name)
        xs = [p[0] for p in pts]
        style = "--" if name.startswith("floor") else "-"
        ax_mem.plot(xs, [p[1] for p in pts], style, marker="o", label=name)
        ax_time.plot(xs, [p[2] for p in pts], style, marker="o", label=name)
    if ok:
        w = ok[0].work
        floor = sorted({r.work.tokens: r.work.memory_floor_bytes() / 2**20 for r in ok}.items())
        ax_mem.plot(*zip(*floor, strict=True), ":", color="gray", label="memfloor (dW+dh)")
        title = (
            f"{w.task}: H={w.hidden} V={w.vocab} {w.dtype} {w.device}, "
            f"valid {w.valid_frac:g}, {w.threads} threads"
        )
        fig.suptitle(title)
    for ax, label in ((ax_mem, "peak extra memory (MB)"), (ax_time, "median time (s)")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if len({r.work.tokens for r in ok}) > 1:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
    ax_mem.legend(fontsize="small")
    ax_time.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
