"""What ``logitless bench`` and ``logitless demo`` write besides their text: CSV files,
matplotlib figures, and a status line that a terminal redraws in place.

Both apps import it (the demo imports nothing from :mod:`.bench`), so a rule of the output --
how a figure is saved, what a missing matplotlib says, how a status line is redrawn -- is
written once.
"""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

# What to install for a plot, in every message that says matplotlib is missing.
PLOT_HINT = "pip install -e '.[bench]' in a logitless checkout"
DPI = 110


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot(what: str = "--plot") -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display).

    Raises:
        PlotUnavailable: matplotlib is missing; the message says ``what`` needs it and how to
            install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(f"{what} needs matplotlib: {PLOT_HINT}") from exc
    return plt


def save_figure(fig: Any, path: Path | str) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder created), then close it; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def plain_axes(ax: Any) -> None:
    """No top or right spine: the apps' plots draw only the axes a reader reads."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def write_csv(
    path: Path | str,
    columns: Sequence[str],
    records: Iterable[Mapping[str, object]],
    *,
    append: bool = False,
) -> None:
    """Write ``records`` (dicts keyed by ``columns``) to the CSV at ``path``, its folder
    created; ``append`` adds them to the file, with the header only when the file is new or
    empty, otherwise the file is overwritten."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not append or not path.exists() or path.stat().st_size == 0
    with path.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerows(records)


class StatusLine:
    """A status on ``stream``: on a terminal (``live``, by default when ``stream`` is one) one
    line redrawn in place, cut to the terminal's width (a wrapped line cannot be redrawn);
    elsewhere (a file, a pipe) one line per :meth:`show` that asks to be logged, after
    ``indent``."""

    def __init__(self, stream: TextIO, live: bool | None = None, indent: str = "") -> None:
        self.stream, self.indent = stream, indent
        self.live = stream.isatty() if live is None else live
        self._shown = False

    def show(self, text: str, log: bool = True) -> None:
        """Redraw the line with ``text`` when live, else write it as a line if ``log``."""
        if self.live:
            width = shutil.get_terminal_size().columns
            self.stream.write(f"\r\033[K{text[: width - 1]}")
            self._shown = True
        elif log:
            self.stream.write(f"{self.indent}{text}\n")
        else:
            return
        self.stream.flush()

    def clear(self) -> None:
        """Erase the live line, so what is written next starts on a clean line."""
        self._end("\r\033[K")

    def keep(self) -> None:
        """End the live line where it is, so it stays on the screen above what comes next."""
        self._end("\n")

    def _end(self, text: str) -> None:
        if self._shown:
            self.stream.write(text)
            self.stream.flush()
            self._shown = False
