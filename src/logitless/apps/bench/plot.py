"""``--plot``: the time and peak extra memory of one bench run as a PNG a person reads at a glance.

One token count (one shape): horizontal bars, time and memory side by side, one bar per method;
the time floors (``floor3``, ``floor4``, ``floor6``) and the memory floor (the gradients
``dW + dh``) are reference lines, not bars, named in one legend under both panels. Several
token counts (a sweep): time and memory against tokens on log axes, one line per method, the
floors dashed. The title says what was timed, the shape, dtype and device, then the
busy-machine warning when the run had one (the table's last line); methods that failed or were
skipped are named under the plot, below the legend.

Also a script, to redraw a run recorded in a bench CSV::

    python -m logitless.apps.bench.plot bench-results/bench.csv out.png [--task T] [--run TS]
"""

from __future__ import annotations

import argparse
import csv
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..output import PlotUnavailable, plain_axes, pyplot, save_figure
from .load import busy_note
from .results import MIB, Row
from .workload import Workload

TASK_TITLES = {
    "logprobs": "log-probs + entropy, forward + backward",
    "loss": "LM head + policy loss (DAPO), forward + backward",
    "capturable": "log-probs + entropy, capturable vs default mode, forward + backward",
}
BASELINE_COLOR = "#8c8c8c"  # naive
OP_COLORS = ("#1f5fb4", "#4aa3df", "#0b3a75", "#7fb8e6")  # logitless's methods: blues
PEER_COLORS = {"liger": "#e6862e", "cce": "#9a6fc0"}  # the same colour in every plot
OTHER_COLORS = ("#59a14f", "#b07aa1", "#9c755f")
FLOOR_STYLES = {"floor3": (0, (5, 3)), "floor4": (0, (1.5, 2)), "floor6": (0, (6, 2, 1, 2))}


def _floors(methods: Sequence[str]) -> list[str]:
    """The time floors among ``methods`` (``floor3``, ``floor4``, ``floor6``, ...), in order."""
    return sorted({m for m in methods if m.startswith("floor")}, key=lambda m: int(m[5:] or 0))


def _floor_label(name: str) -> str:
    """``floor4`` -> ``floor4: 4 bare matmuls``."""
    return f"{name}: {name.removeprefix('floor')} bare matmuls"


def _roles(task: str, methods: Sequence[str]) -> dict[str, str]:
    """Each method's role in the registry (``baseline``, ``op``, ``floor``, ``peer``)."""
    from .methods import TASKS

    known = TASKS.get(task, {})
    return {
        m: known[m].role if m in known else ("floor" if m.startswith("floor") else "peer")
        for m in methods
    }


def _colors(roles: dict[str, str]) -> dict[str, str]:
    """Gray for naive, blues for logitless's methods, other colours for peers."""
    ops, others = iter(OP_COLORS * 4), iter(OTHER_COLORS * 4)
    out = {}
    for m, role in roles.items():
        if role == "baseline":
            out[m] = BASELINE_COLOR
        elif role == "op":
            out[m] = next(ops)
        else:
            out[m] = PEER_COLORS.get(m) or next(others)
    return out


def _short_reason(row: Row) -> str:
    """A few words on why a method has no numbers (the table and the CSV have the rest)."""
    reason = row.reason.lower()
    if row.status == "failed":
        if "out of memory" in reason or "sigkill" in reason:
            return "failed: out of memory"
        return "failed: timed out" if "timed out" in reason else "failed"
    if "not installed" in reason:
        return "skipped: not installed"
    if "already runs" in reason:  # logitless_torch where auto picks the tiles anyway
        return "skipped: the same as logitless here"
    if "gpu" in reason:
        return "skipped: needs a GPU"
    return "skipped"


def _caveat(row: Row) -> str:
    """What a peer leaves out, shown under its name."""
    if "log-probs only" in row.reason:
        return "log-probs only"
    if "all rows computed" in row.reason:
        return "all rows computed"
    return ""


def _device_label(work: Workload, machine: str) -> str:
    """``NVIDIA H100 80GB HBM3`` on CUDA, ``cpu: <model>, N threads`` on CPU."""
    parts = [p.strip() for p in machine.split(";")] if machine else []
    if work.device.startswith("cuda"):
        return parts[3] if len(parts) > 3 else work.device
    cpu = parts[1] if len(parts) > 1 else "cpu"
    return f"{cpu}, {work.threads} thread{'s' if work.threads != 1 else ''}"


def _title(work: Workload, machine: str, sweep: bool) -> str:
    what = TASK_TITLES.get(work.task, work.task)
    tokens = "" if sweep else f"{work.tokens} tokens, "
    valid = "" if work.valid_frac == 1 else f" ({work.valid_frac:.0%} of rows trained on)"
    return (
        f"{what}: {tokens}H={work.hidden}, V={work.vocab}, {work.dtype}{valid}\n"
        f"{_device_label(work, machine)}; median of {work.repeats} timed repeats"
    )


def _time_unit(seconds: Sequence[float]) -> tuple[str, float]:
    return ("ms", 1e3) if max(seconds, default=0) < 2 else ("s", 1.0)


def _mem_unit(mbs: Sequence[float]) -> tuple[str, float]:
    return ("GB", 1 / 1024) if max(mbs, default=0) >= 10240 else ("MB", 1.0)


def _num(value: float) -> str:
    """A readable number: ``0.0423``, ``47.5``, ``1392``, ``47,520``."""
    if value >= 10000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def plot_rows(rows: Sequence[Row], path: Path, machine: str = "", warning: str = "") -> None:
    """Write the PNG of one run's rows (see :func:`make_figure`).

    Raises:
        PlotUnavailable: matplotlib is missing (``pip install -e '.[bench]'`` in a logitless
            checkout).
    """
    save_figure(make_figure(rows, machine, warning), path)


def make_figure(rows: Sequence[Row], machine: str = "", warning: str = "") -> Any:
    """The matplotlib figure of one run: bars for one token count, lines for several.

    ``machine`` (as in the CSV's ``machine`` column) names the GPU or CPU in the title;
    ``warning`` (the busy-machine note the table ends with, :mod:`.load`) is printed under it.
    The figure has two axes, time then memory.

    Raises:
        PlotUnavailable: matplotlib is missing.
        ValueError: ``rows`` is empty.
    """
    plt = pyplot()
    if not rows:
        raise ValueError("no rows to plot")
    sweep = len({r.work.tokens for r in rows}) > 1
    fig = _plot_sweep(plt, rows, machine) if sweep else _plot_bars(plt, rows, machine)
    title = _title(rows[0].work, machine, sweep)
    if warning:  # what qualifies every number of the plot goes where it is read first
        title += "\n" + _wrap(fig, f"warning: {warning}", points=11)
    fig.suptitle(title, fontsize=11)
    _footnote(fig, rows)
    return fig


def _figure(plt: Any, size: tuple[float, float]) -> tuple[Any, Any]:
    """A figure and the one subfigure that holds its two panels and their legend.

    The figure's title (and warning) and its footnote sit around the subfigure: the layout
    gives each side's margin to one thing only (the largest), so a legend and a footnote both
    in the figure's bottom margin would overlap; in the subfigure, the legend is laid out
    inside it, above the footnote.
    """
    fig = plt.figure(figsize=size, layout="constrained")
    return fig, fig.subfigures(1, 1)


def _wrap(fig: Any, text: str, points: float) -> str:
    """``text`` cut into lines as wide as ``fig`` at a font of ``points`` (about 0.55 em a
    character)."""
    return textwrap.fill(text, width=int(fig.get_figwidth() * 72 / (0.55 * points)))


def _footnote(fig: Any, rows: Sequence[Row]) -> None:
    """Under the plot: the methods without numbers, and why (token counts where it varies).

    It is the figure's ``supxlabel``, under the subfigure of the panels and their legend
    (:func:`_figure`).
    """
    tokens = {r.work.tokens for r in rows}
    missing: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if not r.ok and not r.method.startswith("floor"):
            missing.setdefault((r.method, _short_reason(r)), []).append(r.work.tokens)
    notes = [
        f"{method}{'' if set(at) == tokens else ' at ' + ', '.join(map(str, at)) + ' tokens'}: "
        f"{reason}"
        for (method, reason), at in missing.items()
    ]
    if notes:
        fig.supxlabel(_wrap(fig, "; ".join(notes), points=9), fontsize=9, color="#555555")


def _plot_bars(plt: Any, rows: Sequence[Row], machine: str) -> Any:
    """One shape: a bar per method for time and for memory; floors as vertical lines."""
    ok = {r.method: r for r in rows if r.ok}
    # a bar (or the reason it has none) per method that ran; skipped ones only in the footnote
    shown = [r for r in rows if not r.method.startswith("floor") and r.status != "skipped"]
    roles = _roles(rows[0].work.task, [r.method for r in shown])
    colors = _colors(roles)
    naive = ok.get("naive")
    t_unit, t_scale = _time_unit([r.time_p50_s or 0 for r in ok.values()])
    m_vals = [r.peak_extra_mb or 0 for r in ok.values()]
    m_floor = rows[0].work.memory_floor_bytes() / MIB
    m_unit, m_scale = _mem_unit([*m_vals, m_floor])

    height = 1.6 + 0.55 * max(1, len(shown))
    fig, panels = _figure(plt, (12, height + 0.6))
    ax_t, ax_m = panels.subplots(1, 2, sharey=True)
    ys = list(range(len(shown)))[::-1]  # first method on top
    labels = []
    for y, r in zip(ys, shown, strict=True):
        caveat = _caveat(r)
        labels.append(f"{r.method}\n({caveat})" if caveat else r.method)
        for ax, value, scale, unit, ratio_key in (
            (ax_t, r.time_p50_s, t_scale, t_unit, "time_vs_naive"),
            (ax_m, r.peak_extra_mb, m_scale, m_unit, "mem_vs_naive"),
        ):
            ratio = None if r is naive else r.ratios.get(ratio_key)
            _bar(ax, y, r, value, (scale, unit), ratio, colors[r.method])
    # reference lines: the time floors and the memory floor
    for name in _floors(list(ok)):
        r = ok[name]
        if r.time_p50_s is not None:
            ax_t.axvline(
                r.time_p50_s * t_scale,
                color="black",
                linestyle=FLOOR_STYLES.get(name, "dashdot"),
                linewidth=1.2,
                label=f"{_floor_label(name)}, {_num(r.time_p50_s * t_scale)} {t_unit}",
            )
    if m_floor:
        ax_m.axvline(
            m_floor * m_scale,
            color="black",
            linestyle=FLOOR_STYLES["floor3"],
            linewidth=1.2,
            label=f"dW + dh (the gradients): {_num(m_floor * m_scale)} {m_unit}",
        )
    ax_t.set_yticks(ys, labels)
    _bar_axes(
        panels,
        (
            ax_t,
            "time",
            "median step time",
            t_unit,
            t_scale,
            [r.time_p50_s or 0 for r in ok.values()],
        ),
        (ax_m, "memory", "peak extra memory", m_unit, m_scale, [*m_vals, m_floor]),
    )
    return fig


def _bar(ax: Any, y: int, r: Row, value: float | None, unit: tuple, ratio, color) -> None:
    """Row ``r``'s bar at ``y`` (``value`` times ``unit``'s scale), labelled with its value
    and its ``ratio`` to naive; a row without numbers: the reason instead."""
    scale, name = unit
    if not r.ok or value is None:
        ax.text(0, y, f"  {_short_reason(r)}", va="center", fontsize=9, color="#777777")
        return
    ax.barh(y, value * scale, color=color, height=0.6)
    extra = ""
    if ratio is not None:
        extra = f"  ({ratio:.2f}x naive)" if ratio < 10 else f"  ({ratio:.1f}x naive)"
    ax.annotate(
        f"{_num(value * scale)} {name}{extra}",
        (value * scale, y),
        xytext=(4, 0),
        textcoords="offset points",
        va="center",
        fontsize=9,
        bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.85),
    )


def _bar_axes(panels_figure: Any, *panels: tuple) -> None:
    """Each ``(ax, title, xlabel, unit, scale, values)`` panel's axis, then the reference lines'
    legend under both panels (in ``panels_figure``, the subfigure that holds them), where the
    layout keeps it clear of the axis labels and it never hides a bar."""
    for ax, title, xlabel, unit, scale, values in panels:
        ax.set_xlabel(f"{xlabel} ({unit}), lower is better")
        ax.set_xlim(0, max(values, default=1) * scale * 1.45 or 1)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        plain_axes(ax)
        ax.set_title(title, fontsize=11)
    handles, names = (
        sum(x, []) for x in zip(*(p[0].get_legend_handles_labels() for p in panels), strict=True)
    )
    if handles:
        panels_figure.legend(
            handles,
            names,
            loc="outside lower center",
            fontsize=8.5,
            ncol=len(handles),
            frameon=False,
        )


def _plot_sweep(plt: Any, rows: Sequence[Row], machine: str) -> Any:
    """Several token counts: time and memory vs tokens, one line per method, floors dashed."""
    ok = [r for r in rows if r.ok]
    tokens = sorted({r.work.tokens for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows if not r.method.startswith("floor")))
    roles = _roles(rows[0].work.task, methods)
    colors = _colors(roles)
    t_unit, t_scale = _time_unit([r.time_p50_s or 0 for r in ok])
    floors_mb = {
        n: w.memory_floor_bytes() / MIB for n, w in ((r.work.tokens, r.work) for r in rows)
    }
    m_unit, m_scale = _mem_unit([*(r.peak_extra_mb or 0 for r in ok), *floors_mb.values()])

    fig, panels = _figure(plt, (13.5, 5))
    ax_t, ax_m = panels.subplots(1, 2)
    for name in methods:
        pts = sorted(((r.work.tokens, r) for r in ok if r.method == name), key=lambda p: p[0])
        style = dict(color=colors[name], marker="o", linewidth=2 if roles[name] == "op" else 1.5)
        if pts:
            xs = [n for n, _ in pts]
            ax_t.plot(xs, [r.time_p50_s * t_scale for _, r in pts], label=name, **style)
            mem = [(n, r.peak_extra_mb * m_scale) for n, r in pts if r.peak_extra_mb]
            if mem:  # a zero (a meter that saw nothing) has no place on a log axis
                ax_m.plot(*zip(*mem, strict=True), **style)
        for r in rows:  # a point without numbers: an x at the top, named under the plot
            if r.method == name and not r.ok and r.status == "failed":
                for ax in (ax_t, ax_m):
                    _mark_failed(ax, r, colors[name])
    for name in _floors([r.method for r in ok]):
        pts = sorted((r.work.tokens, r.time_p50_s) for r in ok if r.method == name)
        ax_t.plot(
            [n for n, _ in pts],
            [t * t_scale for _, t in pts],
            color="black",
            linestyle=FLOOR_STYLES.get(name, "dashdot"),
            linewidth=1.2,
            label=f"{_floor_label(name)}\n(time floor)",
        )
    xs = sorted(floors_mb)
    ax_m.plot(
        xs,
        [floors_mb[n] * m_scale for n in xs],
        color="#555555",
        linestyle=(0, (3, 1.5, 1, 1.5)),
        linewidth=1.2,
        label="dW + dh: the gradients\n(memory floor)",
    )
    _log_axes(ax_t, tokens, f"median step time ({t_unit})")
    _log_axes(ax_m, tokens, f"peak extra memory ({m_unit})")
    ax_t.set_title("time (lower is better)", fontsize=11)
    ax_m.set_title("memory (lower is better)", fontsize=11)
    # one legend for both panels, under them: methods, then the reference lines
    handles, labels = ax_t.get_legend_handles_labels()
    more = ax_m.get_legend_handles_labels()
    panels.legend(
        handles + more[0], labels + more[1], loc="outside right upper", fontsize=9, frameon=False
    )
    return fig


def _mark_failed(ax: Any, r: Row, color) -> None:
    """A point without numbers: an x at the top of ``ax`` at its token count, and the reason."""
    from matplotlib.transforms import blended_transform_factory

    top = blended_transform_factory(ax.transData, ax.transAxes)
    ax.plot(r.work.tokens, 0.97, "x", color=color, ms=9, mew=2, transform=top, clip_on=False)
    ax.annotate(
        _short_reason(r).removeprefix("failed: "),
        (r.work.tokens, 0.97),
        xycoords=top,
        xytext=(-8, 0),
        textcoords="offset points",
        ha="right",
        va="center",
        fontsize=8,
        color=color,
    )


def _log_axes(ax: Any, tokens: list[int], ylabel: str) -> None:
    """A sweep panel's log-log axes: the token counts on x; ticks at 1, 2, 5 x 10^k on y,
    written out (no 6x10^0), light grid lines in between."""
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        LogLocator,
        NullFormatter,
        NullLocator,
    )

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(tokens))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _num(v) if v > 0 else ""))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    plain_axes(ax)


# ---------------------------------------------------------------------------------------------
# redraw a run from a bench CSV


def _float(text: str) -> float | None:
    return float(text) if text else None


def rows_from_csv(
    path: Path, task: str | None = None, run: str | None = None
) -> tuple[list[Row], str]:
    """The rows of one run recorded in a bench CSV, and the run's ``machine`` string.

    The run is the one whose ``timestamp`` is ``run``; by default the last one in the file (of
    ``task``, when given).

    Raises:
        ValueError: no such run in the file.
    """
    with path.open(newline="") as f:
        records = [r for r in csv.DictReader(f) if task is None or r["task"] == task]
    stamps = list(dict.fromkeys(r["timestamp"] for r in records))
    if not stamps or (run is not None and run not in stamps):
        what = f"run {run!r}" if run else "rows" + (f" of task {task!r}" if task else "")
        raise ValueError(f"{path}: no {what}; runs there: {', '.join(stamps) or 'none'}")
    run = run or stamps[-1]
    rows = []
    for r in (r for r in records if r["timestamp"] == run):
        work = Workload(
            task=r["task"],
            tokens=int(r["tokens"]),
            hidden=int(r["hidden"]),
            vocab=int(r["vocab"]),
            valid_frac=float(r["valid_frac"]),
            dtype=r["dtype"],
            device=r["device"],
            threads=int(r["threads"]),
            repeats=int(r["repeats"]),
        )
        rows.append(
            Row(
                r["method"],
                work,
                r["status"],
                reason=r["note"],
                time_p50_s=_float(r["time_p50_s"]),
                time_p20_s=_float(r["time_p20_s"]),
                time_p80_s=_float(r["time_p80_s"]),
                peak_extra_mb=_float(r["peak_extra_mb"]),
                ratios={k: _float(r[k]) for k in r if "_vs_" in k},
            )
        )
    machine = next((r["machine"] for r in records if r["timestamp"] == run), "")
    return rows, machine


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m logitless.apps.bench.plot CSV PNG [--task T] [--run TIMESTAMP]``."""
    parser = argparse.ArgumentParser(
        prog="python -m logitless.apps.bench.plot",
        description="Draw one run of a logitless bench CSV (default: its last run).",
    )
    parser.add_argument("csv", type=Path, help="a CSV written by logitless bench")
    parser.add_argument("png", type=Path, help="where to write the plot")
    parser.add_argument("--task", help="the last run of this task (logprobs, loss)")
    parser.add_argument("--run", metavar="TIMESTAMP", help="the run with this timestamp")
    args = parser.parse_args(argv)
    try:
        rows, machine = rows_from_csv(args.csv, task=args.task, run=args.run)
        warning = next((n for n in (busy_note(r.reason) for r in rows) if n), "")
        plot_rows(rows, args.png, machine, warning)
    except (OSError, ValueError, KeyError, PlotUnavailable) as exc:
        parser.error(str(exc))
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
