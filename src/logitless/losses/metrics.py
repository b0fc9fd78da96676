"""The metrics of a policy-loss call: weighted means and extremes, all detached, no host sync.

Means are weighted like the loss (:func:`~logitless.losses.metric_weights`), so the metrics of
micro-batches add up to the step's. Under context parallelism the means are summed and the
extremes maxed over the group, so every rank reports the whole stream's values.
"""

from __future__ import annotations

import torch

from ..contract import collectives

# reported min / max (kept apart: they reduce with MAX over a context group, not SUM)
EXTREMES = ("ratio_min", "ratio_max", "is_weight_min", "is_weight_max")
COUNTS = ("num_tokens", "num_sequences")


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ_t w_t x_t`` over the tokens with ``w_t > 0`` (others may hold anything).  [N] -> []"""
    return (torch.where(w > 0, x, 0.0) * w).sum().detach()


def extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or, negated, min) over valid tokens; -inf when there is none.  [N] -> []"""
    v = x.detach() if largest else -x.detach()
    filled = torch.where(valid, v, float("-inf"))  # [N]
    return torch.cat([filled, filled.new_full((1,), float("-inf"))]).amax()


def finish_metrics(metrics: dict[str, torch.Tensor], group, any_valid: torch.Tensor) -> None:
    """Sum the means and max the extremes over ``group`` (two all-reduces), in place; then
    turn the stored ``max(-x)`` of each ``*_min`` back into a minimum (1.0 without tokens)."""
    means = [k for k in metrics if k not in EXTREMES and k not in COUNTS]
    extremes = [k for k in metrics if k in EXTREMES]
    if group is not None:
        summed = collectives.all_reduce(torch.stack([metrics[k] for k in means]), group, "sum")
        maxed = collectives.all_reduce(torch.stack([metrics[k] for k in extremes]), group, "max")
        metrics.update(zip(means, summed.unbind(), strict=True))
        metrics.update(zip(extremes, maxed.unbind(), strict=True))
    for k in extremes:
        v = metrics[k] if k.endswith("_max") else -metrics[k]
        metrics[k] = torch.where(any_valid, v, torch.ones_like(v))
