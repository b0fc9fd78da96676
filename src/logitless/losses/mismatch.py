"""Train/inference mismatch corrections against the rollout engine's log-probs.

The rollout engine (vLLM, SGLang) samples from ``π_rollout``, which differs numerically from
the trainer's ``π_old`` for the same weights. With ``log ρ_t = log π_old(y_t) − log π_rollout(y_t)``
(no gradient) each function returns an ``[N]`` detached factor that multiplies the policy term.
Corrections compose: truncated IS weights times keep-masks. References: Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated IS, token
and sequence); Ling team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking
Model" (IcePop: masked IS outside a token band); Liu et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch" (sequence-level masked IS,
geometric mean).
"""

from __future__ import annotations

import math

import torch

from ._segments import Segments, gather, segment_sum

__all__ = [
    "sequence_mask",
    "token_band_mask",
    "truncated_is_sequence",
    "truncated_is_token",
]


def truncated_is_token(
    log_rho: torch.Tensor, cap: float, floor: float | None = None
) -> torch.Tensor:
    """Token-level truncated IS weight ``min(ρ_t, cap)`` (TIS), ``max(·, floor)`` with a floor.
    [N] -> [N]"""
    return _truncate(log_rho.detach(), cap, floor).exp()


def _truncate(log_w: torch.Tensor, cap: float, floor: float | None) -> torch.Tensor:
    """``log_w`` clamped to ``[log floor, log cap]`` (no lower bound without a floor)."""
    return log_w.clamp(min=None if floor is None else math.log(floor), max=math.log(cap))


def truncated_is_sequence(
    log_rho: torch.Tensor, valid: torch.Tensor, segments: Segments, cap: float
) -> torch.Tensor:
    """Sequence-level truncated IS ``min(Π_{t in doc} ρ_t, cap)``, carried by every token.  [N]"""
    total = segment_sum(torch.where(valid, log_rho.detach(), 0.0), segments)  # [D]
    return gather(truncated_is_from_total(total, cap), segments)  # [N]


def truncated_is_from_total(
    total: torch.Tensor, cap: float, floor: float | None = None
) -> torch.Tensor:
    """``min(exp(total_d), cap)`` (and ``max(·, floor)``) per document from
    ``total_d = Σ_t log ρ_t``.  [D] -> [D]"""
    return _truncate(total.detach(), cap, floor).exp()


def token_band_mask(log_rho: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Masked IS / IcePop: 1 where ``low <= ρ_t <= high``, else 0.  [N] -> [N] float"""
    rho = log_rho.detach().exp()
    return ((rho >= low) & (rho <= high)).to(log_rho.dtype)


def sequence_mask(
    log_rho: torch.Tensor,
    valid: torch.Tensor,
    segments: Segments,
    mode: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """1 for every token of a document whose ratio statistic is inside ``[low, high]``.  [N]

    ``mode="geometric"``: ``exp(mean_t log ρ_t)``; ``mode="product"``: ``Π_t ρ_t``. Compared in
    log space, so a long sequence's product never overflows.
    """
    if mode not in ("geometric", "product"):
        raise ValueError(f"mode must be 'geometric' or 'product', got {mode!r}")
    lr = log_rho.detach()
    total = segment_sum(torch.where(valid, lr, 0.0), segments)  # [D]
    count = segment_sum(valid.to(lr.dtype), segments)  # [D]
    return gather(sequence_keep(total, count, mode, low, high), segments)  # [N]


def sequence_keep(
    total: torch.Tensor, count: torch.Tensor, mode: str, low: float, high: float
) -> torch.Tensor:
    """Per-document keep mask of :func:`sequence_mask` from its sums.  [D], [D] -> [D] float

    ``total_d = Σ_t log ρ_t`` and ``count_d`` (valid tokens) over the document's valid tokens.
    """
    stat = total / count.clamp(min=1.0) if mode == "geometric" else total  # [D]
    lo = math.log(low) if low > 0 else -math.inf
    keep = (stat >= lo) & (stat <= math.log(high))  # [D]
    return keep.to(total.dtype)
