"""``logitless bench --plot``: bars for one token count, lines for a sweep, floors as reference
lines, readable ticks, a title that says what was timed where; and redrawing a run from the
CSV. The figures are checked through their matplotlib objects, not by pixels."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from logitless.apps.bench.harness import Row, add_ratios, append_csv
from logitless.apps.bench.load import LoadReport
from logitless.apps.bench.plot import _short_reason, _title, rows_from_csv
from logitless.apps.bench.workload import Workload

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
GPU = "Linux-6; Intel(R) Xeon(R); 16 cpus; NVIDIA H100 80GB HBM3"
CPU = "Linux-6; AMD EPYC 7B13; 2 cpus"


def _work(tokens: int, **kw: object) -> Workload:
    base = dict(task="logprobs", tokens=tokens, hidden=64, vocab=4096, valid_frac=1.0)
    base |= dict(dtype="float32", device="cpu", threads=2, repeats=3)
    return Workload(**{**base, **kw})  # type: ignore[arg-type]


def _run(tokens: tuple[int, ...], naive_oom_at: int | None = None) -> list[Row]:
    """Rows of a made-up run: time and memory grow with tokens; floors hold no memory."""
    rows = []
    for n in tokens:
        k = n / 1024
        group = []
        for method, t, mb in (
            ("naive", 4.0, 300.0),
            ("logitless", 2.0, 20.0),
            ("floor3", 1.0, 0.0),
            ("floor4", 1.5, 0.0),
        ):
            w = _work(n)
            if method == "naive" and n == naive_oom_at:
                group.append(Row(method, w, "failed", reason="killed by SIGKILL (out of memory?)"))
                continue
            group.append(Row(method, w, "ok", "", t * k, t * k, t * k, mb * k))
        group.append(Row("liger", _work(n), "skipped", reason="liger-kernel is not installed"))
        add_ratios(group)
        rows += group
    return rows


def test_title_says_what_was_timed_and_where() -> None:
    w = _work(2048, dtype="bfloat16", device="cuda", valid_frac=0.25)
    title = _title(w, GPU, sweep=False)
    assert title.startswith("log-probs + entropy, forward + backward: 2048 tokens, H=64, V=4096")
    assert "bfloat16 (25% of rows trained on)" in title
    assert "NVIDIA H100 80GB HBM3; median of 3 timed repeats" in title
    cpu = _title(_work(2048, task="loss"), CPU, sweep=True)
    assert cpu.startswith("LM head + policy loss (DAPO), forward + backward: H=64")
    assert "AMD EPYC 7B13, 2 threads" in cpu and "tokens" not in cpu.split("\n")[0]


def test_short_reasons() -> None:
    rows = _run((1024,), naive_oom_at=1024)
    assert _short_reason(rows[0]) == "failed: out of memory"
    assert _short_reason(rows[-1]) == "skipped: not installed"
    timeout = Row("x", _work(1), "failed", reason="timed out after 3 s")
    assert _short_reason(timeout) == "failed: timed out"


def test_rows_from_csv_picks_one_run(tmp_path: Path) -> None:
    """A CSV holds several runs: the last one by default, or the one asked for by timestamp or
    task; ratios, status and reasons come back as written."""
    path = tmp_path / "bench.csv"
    first, second = _run((1024,)), _run((512, 2048), naive_oom_at=2048)
    append_csv(path, first, "t1")
    append_csv(path, second, "t2")
    rows, machine = rows_from_csv(path)
    assert [(r.method, r.work.tokens, r.status) for r in rows] == [
        (r.method, r.work.tokens, r.status) for r in second
    ]
    assert machine  # this machine's description, as append_csv wrote it
    naive = next(r for r in rows if r.method == "logitless" and r.work.tokens == 512)
    assert naive.time_p50_s == pytest.approx(1.0) and naive.ratios["time_vs_naive"] == 0.5
    assert next(r for r in rows if r.status == "failed").reason.startswith("killed by SIGKILL")
    assert len(rows_from_csv(path, run="t1")[0]) == len(first)
    with pytest.raises(ValueError, match="runs there: t1, t2"):
        rows_from_csv(path, run="t3")
    with pytest.raises(ValueError, match="task 'loss'"):
        rows_from_csv(path, task="loss")


needs_mpl = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib absent (extra 'bench')")


@needs_mpl
def test_one_shape_is_bars_with_floors_as_lines() -> None:
    from matplotlib.patches import Rectangle

    from logitless.apps.bench.plot import make_figure

    fig = make_figure(_run((1024,), naive_oom_at=None), GPU)
    ax_t, ax_m = fig.axes[:2]
    for ax in (ax_t, ax_m):  # one bar per real method (naive, logitless), none for the floors
        assert len([p for p in ax.patches if isinstance(p, Rectangle)]) == 2
        assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    ticks = sorted((t.get_position()[1], t.get_text()) for t in ax_t.get_yticklabels())
    assert [text for _, text in ticks[::-1]] == ["naive", "logitless"]  # run order; not skipped
    # floors: vertical reference lines at their times; memory: the gradients dW + dh
    assert sorted(line.get_xdata()[0] for line in ax_t.lines) == [1.0, 1.5]
    floor_mb = _work(1024).memory_floor_bytes() / 2**20
    assert [line.get_xdata()[0] for line in ax_m.lines] == [pytest.approx(floor_mb)]
    texts = " ".join(t.get_text() for ax in (ax_t, ax_m) for t in ax.texts)
    assert "2 s  (0.50x naive)" in texts and "20 MB  (0.07x naive)" in texts
    assert fig._supxlabel.get_text() == "liger: skipped: not installed"
    assert fig._suptitle.get_text().startswith("log-probs + entropy, forward + backward: 1024")


@needs_mpl
@pytest.mark.parametrize("tokens", [(1024,), (256, 1024)])
def test_every_floor_of_a_task_is_drawn_in_a_legend_under_the_panels(tokens) -> None:
    """The distillation task's floor is ``floor6``; the floors' legend is the figure's, below
    both panels, so it never covers a bar or an axis label."""
    from logitless.apps.bench.plot import make_figure

    rows = []
    for n in tokens:
        group = [
            Row(m, _work(n, task="distill"), "ok", "", t, t, t, mb)
            for m, t, mb in (("naive", 4.0, 300.0), ("logitless", 2.0, 20.0), ("floor6", 1.5, 0))
        ]
        add_ratios(group)
        rows += group
    fig = make_figure(rows, CPU)
    fig.canvas.draw()
    ax_t = fig.axes[0]
    floor6 = [line for line in ax_t.lines if line.get_label().startswith("floor6: 6 bare")]
    assert len(floor6) == 1 and floor6[0].get_linestyle() != "-"
    legend = fig.subfigs[0].legends[0].get_window_extent()
    for ax in fig.axes[:2]:
        assert not ax.get_legend()  # no legend inside an axis
        label = ax.xaxis.label.get_window_extent()
        assert legend.y1 <= label.y0 or legend.x1 <= label.x0 or legend.x0 >= label.x1


@needs_mpl
def test_sweep_is_lines_on_readable_log_axes() -> None:
    from logitless.apps.bench.plot import make_figure

    fig = make_figure(_run((256, 1024, 4096), naive_oom_at=4096), CPU)
    fig.canvas.draw()
    ax_t, ax_m = fig.axes[:2]
    for ax in (ax_t, ax_m):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "1024", "4096"]
        for tick in ax.get_yticklabels():  # 1, 2, 5 x 10^k written out: no mathtext powers
            assert "$" not in tick.get_text() and "10^" not in tick.get_text()
        for line in ax.lines:  # nothing at zero on a log axis (floors hold no memory)
            assert all(y > 0 for y in line.get_ydata())
    by_label = {line.get_label(): line for line in ax_t.lines}
    assert by_label["floor3: 3 bare matmuls\n(time floor)"].get_linestyle() != "-"
    assert list(by_label["naive"].get_xdata()) == [256, 1024]  # its failed point is no point
    mem_labels = [line.get_label() for line in ax_m.lines]
    assert "dW + dh: the gradients\n(memory floor)" in mem_labels
    assert not [lb for lb in mem_labels if lb.startswith("floor")]
    assert "out of memory" in " ".join(t.get_text() for t in ax_t.texts)
    assert fig._supxlabel.get_text() == (
        "liger: skipped: not installed; naive at 4096 tokens: failed: out of memory"
    )


@needs_mpl
def test_plot_script_redraws_a_csv_run(tmp_path: Path) -> None:
    path, png = tmp_path / "bench.csv", tmp_path / "out" / "plot.png"
    append_csv(path, _run((1024,)), "t1")
    cmd = [sys.executable, "-m", "logitless.apps.bench.plot", str(path), str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([*cmd, "--run", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no run 'nope'" in bad.stderr


BUSY = LoadReport(others=0.35, steal=0.01).note()


def _with_skipped_peers(rows: list[Row]) -> list[Row]:
    """``rows`` and the methods a default run on a machine without peers lists as skipped."""
    for n in dict.fromkeys(r.work.tokens for r in rows):
        for method, reason in (
            ("logitless_torch", "auto already runs the torch tiles here"),
            ("cce", "cut-cross-entropy is not installed"),
            ("trl", "trl is not installed"),
        ):
            rows.append(Row(method, _work(n), "skipped", reason=reason))
    return rows


@needs_mpl
@pytest.mark.parametrize("tokens", [(1024,), (256, 1024)])
@pytest.mark.parametrize("warning", ["", BUSY], ids=["quiet", "busy"])
def test_legend_footnote_and_warning_do_not_overlap(
    tmp_path: Path, monkeypatch, tokens, warning
) -> None:
    """Rendered to a PNG (Agg): the legend, the line of skipped methods under the plot and the
    title (with the busy-machine warning the table prints, when the run had one) are apart.
    The legend and the footnote once shared the figure's bottom margin and overlapped."""
    from matplotlib.figure import Figure

    from logitless.apps.bench import plot

    real_savefig = Figure.savefig
    seen: dict[str, object] = {}

    def keep(fig, *args, **kwargs):  # the boxes as written, after the layout ran
        real_savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        seen["fig"] = fig
        (legend,) = [*fig.legends, *(lg for sub in fig.subfigs for lg in sub.legends)]
        seen["legend"] = legend.get_window_extent(renderer)
        for name, text in (("footnote", fig._supxlabel), ("title", fig._suptitle)):
            seen[name] = text.get_window_extent(renderer)
        seen["axes"] = [ax.get_window_extent(renderer) for ax in fig.axes[:2]]

    monkeypatch.setattr(Figure, "savefig", keep)
    png = tmp_path / "p.png"
    plot.plot_rows(_with_skipped_peers(_run(tokens)), png, CPU, warning=warning)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig, legend, footnote, title = (seen[k] for k in ("fig", "legend", "footnote", "title"))
    assert "liger: skipped: not installed" in fig._supxlabel.get_text()
    assert not legend.overlaps(footnote) and not legend.overlaps(title)
    assert not footnote.overlaps(title)
    for box in seen["axes"]:
        assert not box.overlaps(footnote) and not box.overlaps(title)
    text = fig._suptitle.get_text()
    assert ("warning: machine busy during the run: other processes used 35%" in text) == bool(
        warning
    )
    assert "time ratios may be off" in text.replace("\n", " ") or not warning


@needs_mpl
def test_plot_script_carries_the_busy_warning_of_the_csv(tmp_path: Path, monkeypatch) -> None:
    """A run recorded as busy (its rows' notes end with the warning, as ``logitless bench``
    writes them) is redrawn with the warning in the title."""
    from logitless.apps.bench import plot

    rows = _run((1024,))
    for r in rows:
        r.reason = "; ".join(n for n in (r.reason, BUSY) if n)
    path = tmp_path / "bench.csv"
    append_csv(path, rows, "t1")
    figures = []
    monkeypatch.setattr(plot, "save_figure", lambda fig, png: figures.append(fig))
    assert plot.main([str(path), str(tmp_path / "out.png")]) == 0
    assert "warning: machine busy during the run" in figures[0]._suptitle.get_text()
