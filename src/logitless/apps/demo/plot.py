"""The demo's plot: reward and peak step memory per GRPO step, one curve (or band of seeds) per
mode."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from ..output import PlotUnavailable, plain_axes, pyplot, save_figure
from .config import DemoConfig, DemoResult
from .stats import _mean_std


def _moving_mean(values: Sequence[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


MODE_COLORS = {"logitless": "#1f5fb4", "naive": "#e6862e"}


def _plot_mode(ax_r, ax_m, mode: str, runs: list[DemoResult]) -> None:
    """One mode's curves of :func:`plot_demo`: its reward (a moving mean; with several seeds
    their mean in a min-max band) and its peak step memory (the median over seeds)."""
    color = MODE_COLORS.get(mode)
    steps = [r.step for r in runs[0].rows[: min(len(r.rows) for r in runs)]]
    n = len(steps)
    k = runs[0].window()  # 10 steps, or half a shorter run: what the final reward averages
    curves = [_moving_mean([r.reward for r in run.rows[:n]], k) for run in runs]
    mems = [[r.peak_mem_mb for r in run.rows[:n]] for run in runs]
    mean_final, std_final = _mean_std([run.reward_window(False) for run in runs])
    if len(runs) == 1:
        ax_r.plot(steps, [r.reward for r in runs[0].rows], color=color, alpha=0.25, lw=0.8)
        label = f"{mode}: {k}-step moving mean (final {mean_final:.2f})"
    else:
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        ax_r.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        label = (
            f"{mode}: mean of {len(runs)} seeds, band min-max "
            f"(final {mean_final:.2f} ± {std_final:.2f})"
        )
    ax_r.plot(
        steps,
        [sum(c[i] for c in curves) / len(curves) for i in range(n)],
        color=color,
        label=label,
    )
    median = [statistics.median(m[i] for m in mems) for i in range(n)]
    if len(runs) > 1:
        ax_m.fill_between(
            steps,
            [min(m[i] for m in mems) for i in range(n)],
            [max(m[i] for m in mems) for i in range(n)],
            color=color,
            alpha=0.2,
            lw=0,
        )
    ax_m.plot(
        steps, median, color=color, label=f"{mode}: median {statistics.median(median):.0f} MB"
    )


def plot_demo(results: Sequence[DemoResult], path: Path | str) -> bool:
    """PNG of reward and peak step memory per step, one curve per mode.

    With one seed per mode: the reward of each step (faint) and its moving mean over
    :meth:`DemoResult.window` steps (10, or half a shorter run). With several: the mean over
    seeds of that moving mean, in a band from the lowest to the
    highest seed; the legend gives the final reward, mean ± standard deviation across seeds.
    Memory: the median over seeds of each step's peak, in the same kind of band.

    Returns False, writing nothing, when matplotlib is not installed (the caller prints a
    note: ``pip install -e '.[bench]'`` in a logitless checkout).
    """
    try:
        plt = pyplot()
    except PlotUnavailable:
        return False
    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    by_mode: dict[str, list[DemoResult]] = {}
    for result in results:
        by_mode.setdefault(result.config.mode, []).append(result)
    for mode, runs in by_mode.items():
        _plot_mode(ax_r, ax_m, mode, runs)
    c = results[0].config if results else DemoConfig()
    seeds = sorted({r.config.seed for r in results})
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} seeds"
    ax_r.set(
        xlabel="GRPO step",
        ylabel="mean reward of the step's samples",
        ylim=(0, 1.02),
        title=f"reward (chance: 0.1), {seed_text}",
    )
    ax_m.set(
        xlabel="GRPO step",
        ylabel="MB",
        title=f"peak extra memory of each step ({c.device})",
    )
    ax_m.set_ylim(bottom=0)
    fig.suptitle(
        f"GRPO on a random-init Llama (V={c.vocab}, H={c.hidden}, {c.layers} layers): echo the "
        f"last of {c.digits} digits; {c.prompts} prompts x {c.group} samples per step"
    )
    for ax in (ax_r, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower right" if ax is ax_r else "best")
        plain_axes(ax)
    save_figure(fig, path)
    return True
