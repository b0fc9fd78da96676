"""Several seeds: final rewards per mode, their spread, and the modes' difference paired by seed
with a Student's t interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import DemoResult


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def final_rewards(results: Sequence[DemoResult]) -> dict[str, list[float]]:
    """Per mode (in run order), the final reward of each run: the mean of its last
    :meth:`DemoResult.window` steps."""
    out: dict[str, list[float]] = {}
    for r in results:
        out.setdefault(r.config.mode, []).append(r.reward_window(False))
    return out


def seeds_summary(results: Sequence[DemoResult]) -> list[str]:
    """Lines comparing the modes over seeds: final reward mean ± standard deviation (and each
    seed's), run time per seed; with two modes, their difference seed by seed (mean ±
    standard deviation, and each)."""
    if not results:
        return []
    seeds = list(dict.fromkeys(r.config.seed for r in results))
    window = results[0].window()
    lines = [
        f"final reward (mean of the last {window} steps) over {len(seeds)} seed"
        f"{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))}): mean ± standard "
        "deviation across seeds [each seed]"
    ]
    finals = final_rewards(results)
    width = max(len(m) for m in finals)
    for mode, values in finals.items():
        mean, std = _mean_std(values)
        runs = [r for r in results if r.config.mode == mode]
        run_s = sum(r.run_seconds for r in runs) / len(runs)
        timed = f"  run time {run_s:.0f} s per seed" if run_s > 0 else ""  # 0: read from a CSV
        lines.append(
            f"  {mode:<{width}}  {mean:.3f} ± {std:.3f}  [{', '.join(f'{v:.2f}' for v in values)}]"
            f"{timed}"
        )
    modes = list(finals)
    if len(modes) == 2 and len(seeds) > 1:  # paired by seed: same init, warm-up data, prompts
        by_run = {(r.config.mode, r.config.seed): r for r in results}
        pairs = [(by_run[(modes[0], s)], by_run[(modes[1], s)]) for s in seeds]
        diffs = [a.reward_window(False) - b.reward_window(False) for a, b in pairs]
        mean, std = _mean_std(diffs)
        lines.append(
            f"  {modes[0]} - {modes[1]}, paired by seed: {mean:+.3f} ± {std:.3f} "
            f"[{', '.join(f'{d:+.2f}' for d in diffs)}]"
        )
        auc = paired_difference([a.reward_auc() - b.reward_auc() for a, b in pairs])
        lines.append(
            f"  area under the reward curve (mean reward over all steps), {modes[0]} - "
            f"{modes[1]} paired by seed: {auc.describe()}"
        )
    return lines


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def _t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (table up to 30, then
    the first-order Cornish-Fisher expansion around the normal's 1.96)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.37 / df


@dataclass(frozen=True)
class PairedDifference:
    """Mean of ``n`` paired differences with its 95% confidence interval (Student's t):
    ``mean ± t·std/√n``. ``significant``: the interval excludes 0."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def describe(self) -> str:
        if self.n < 2:
            return f"{self.mean:+.4f} (one seed: no interval)"
        verdict = "significant" if self.significant else "not significant"
        return (
            f"{self.mean:+.4f}, 95% CI [{self.low:+.4f}, {self.high:+.4f}] over {self.n} seeds "
            f"(std {self.std:.4f}; {verdict} at 5%)"
        )


def paired_difference(diffs: Sequence[float]) -> PairedDifference:
    """:class:`PairedDifference` of per-seed differences (a paired t interval)."""
    mean, std = _mean_std(diffs)
    n = len(diffs)
    half = _t975(n - 1) * std / math.sqrt(n) if n > 1 else float("nan")
    return PairedDifference(n, mean, std, mean - half, mean + half)
