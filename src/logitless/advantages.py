"""Advantage estimators from one scalar reward per sequence (outcome rewards).

Every estimator takes ``rewards`` ``[S]`` and returns ``[S]`` advantages, one per sequence,
ready for :func:`logitless.losses.policy_loss` (which broadcasts them to the tokens). Groups
(the responses sampled for one prompt) are given either as ``group_size`` (the rewards of a
group are contiguous, ``S`` a multiple of it) or as ``group_ids`` ``[S]`` int64 in
``[0, S)``. Group statistics are segment sums (``index_add``), no Python loop over groups.
Nothing here needs a gradient; the outputs are detached.
"""

from __future__ import annotations

import torch

__all__ = [
    "dr_grpo_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
]


def _group_ids(
    rewards: object, group_size: int | None, group_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``(rewards [S] float, group ids [S] int64)``."""
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [S], got {list(rewards.shape)}")
    s = rewards.shape[0]
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size and group_ids")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if s % group_size:
            raise ValueError(f"rewards length {s} must be a multiple of group_size={group_size}")
        ids = torch.arange(s, device=rewards.device) // group_size
    else:
        if (
            not isinstance(group_ids, torch.Tensor)
            or group_ids.is_floating_point()
            or group_ids.dtype == torch.bool
        ):
            raise ValueError(f"group_ids must be an int64 tensor, got {group_ids!r}")
        if group_ids.shape != rewards.shape:
            raise ValueError(
                f"group_ids must have rewards' shape [{s}], got {list(group_ids.shape)}"
            )
        if group_ids.device != rewards.device:
            raise ValueError(f"group_ids must be on rewards' device {rewards.device}")
        ids = group_ids.long()
    if s:
        # one host sync: id range and non-finite rewards (a NaN reward would silently turn its
        # whole group's advantages into NaN)
        lo, hi, n_bad = torch.stack([ids.min(), ids.max(), (~rewards.isfinite()).sum()]).tolist()
        if lo < 0 or hi >= s:
            raise ValueError(f"group_ids must be in [0, {s}), got ids from {lo} to {hi}")
        if n_bad:
            raise ValueError(f"rewards must be finite, got {n_bad} NaN or infinite reward(s)")
    return rewards.detach(), ids


def _group_sum(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group sums broadcast back to the members.  [S] -> [S]"""
    sums = values.new_zeros(values.shape[0]).index_add(0, ids, values)  # [S] (ids < S)
    return sums[ids]


def _group_stats(rewards: torch.Tensor, ids: torch.Tensor):
    """Per-member group size, mean and unbiased std (0 for a group of one).  [S] each"""
    n = _group_sum(torch.ones_like(rewards), ids)  # [S]
    mean = _group_sum(rewards, ids) / n  # [S]
    sq = _group_sum((rewards - mean).square(), ids)  # [S]
    std = (sq / (n - 1).clamp(min=1)).sqrt()  # [S]
    return n, mean, std


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: ``A_i = (r_i − mean_g r) / (std_g r + eps)``.

    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1.2 (outcome supervision).
    ``std`` is the unbiased group standard deviation (as ``torch.std``); ``scale_by_std=False``
    gives Dr.GRPO's ``A_i = r_i − mean_g r``.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2, eps=0.0)
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    r, ids = _group_ids(rewards, group_size, group_ids)
    _, mean, std = _group_stats(r, ids)
    centered = r - mean  # [S]
    if not scale_by_std:
        return centered
    # a group with equal rewards has centered == 0 exactly: keep it 0 even when eps == 0
    return torch.where(centered == 0, 0.0, centered / (std + eps))


def dr_grpo_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dr.GRPO: ``A_i = r_i − mean_g r`` (no std scaling).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783), Sec. 3.2: dividing by the group std biases towards too-easy/too-hard
    questions, so it is dropped.
    """
    return grpo_advantages(rewards, group_size=group_size, group_ids=group_ids, scale_by_std=False)


def rloo_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """RLOO: ``A_i = r_i − mean_{j ≠ i} r_j`` (leave-one-out baseline).

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
    2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs" (arXiv:2402.14740), eq. (8). A group of one has no baseline; its
    advantage is 0.
    """
    r, ids = _group_ids(rewards, group_size, group_ids)
    n = _group_sum(torch.ones_like(r), ids)  # [S]
    total = _group_sum(r, ids)  # [S]
    baseline = (total - r) / (n - 1).clamp(min=1)  # [S]
    return torch.where(n > 1, r - baseline, 0.0)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++: batch-normalized advantages, ``A = (x − mean_batch x) / (std_batch x + eps)``.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (arXiv:2501.03262): normalization over the whole global batch instead of per
    group. With groups given (``group_size`` or ``group_ids``), ``x = r − mean_g r`` first
    ("REINFORCE++-baseline"); otherwise ``x = r``. ``std`` is unbiased.
    """
    if group_size is None and group_ids is None:
        if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
            raise ValueError(f"rewards must be a floating-point tensor, got {rewards!r}")
        if rewards.dim() != 1:
            raise ValueError(f"rewards must have shape [S], got {list(rewards.shape)}")
        x = rewards.detach()
    else:
        x = dr_grpo_advantages(rewards, group_size=group_size, group_ids=group_ids)
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)
