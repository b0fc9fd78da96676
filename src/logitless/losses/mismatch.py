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

from ._segments import gather, of_ids, sum_per_document

__all__ = [
    "SEQUENCE_STATISTICS",
    "sequence_mask",
    "token_band_mask",
    "truncated_is_sequence",
    "truncated_is_token",
]


# The per-document statistic of log ρ compared with a band, by mode: the geometric mean of the
# token ratios (in log space: the mean log ratio) or their product (the sum of log ratios).
SEQUENCE_STATISTICS = {
    "geometric": lambda total, count: total / count.clamp(min=1.0),
    "product": lambda total, count: total,
}


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
    log_rho: torch.Tensor,
    valid: torch.Tensor,
    document_ids: torch.Tensor,
    num_documents: int,
    cap: float,
) -> torch.Tensor:
    """Sequence-level truncated IS ``min(Π_{t in doc} ρ_t, cap)``, carried by every token.  [N]

    ``document_ids``: ``[N]`` int64 in ``[-1, num_documents)`` (``-1``: padding).
    """
    seg = of_ids(document_ids, num_documents)
    total = sum_per_document(torch.where(valid, log_rho.detach(), 0.0), seg)  # [D]
    return gather(truncated_is_from_total(total, cap), seg)  # [N]


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
    document_ids: torch.Tensor,
    num_documents: int,
    mode: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """1 for every token of a document whose ratio statistic is inside ``[low, high]``.  [N]

    ``mode="geometric"``: ``exp(mean_t log ρ_t)``; ``mode="product"``: ``Π_t ρ_t``. Compared in
    log space, so a long sequence's product never overflows.
    """
    if mode not in SEQUENCE_STATISTICS:
        raise ValueError(f"mode must be one of {list(SEQUENCE_STATISTICS)}, got {mode!r}")
    seg = of_ids(document_ids, num_documents)
    lr = log_rho.detach()
    total = sum_per_document(torch.where(valid, lr, 0.0), seg)  # [D]
    count = sum_per_document(valid.to(lr.dtype), seg)  # [D]
    return gather(sequence_keep(total, count, mode, low, high), seg)  # [N]


def sequence_keep(
    total: torch.Tensor, count: torch.Tensor, mode: str, low: float, high: float
) -> torch.Tensor:
    """Per-document keep mask of :func:`sequence_mask` from its sums.  [D], [D] -> [D] float

    ``total_d = Σ_t log ρ_t`` and ``count_d`` (valid tokens) over the document's valid tokens.
    """
    stat = SEQUENCE_STATISTICS[mode](total, count)  # [D]
    lo = math.log(low) if low > 0 else -math.inf
    keep = (stat >= lo) & (stat <= math.log(high))  # [D]
    return keep.to(total.dtype)
