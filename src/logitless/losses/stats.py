"""Per-document statistics of a policy-loss call: :class:`DocumentStats`, computed once.

Sequence-level parts of a loss (GSPO's ratio, GMPO's mean, sequence masks and sequence
importance weights, per-sequence aggregation) need sums over each document's tokens. They are
segment sums over document ids, summed over the context-parallel group when the stream is
sharded, and every one of them is a stop-gradient constant.
"""

from __future__ import annotations

import torch

from ..contract import collectives
from ._segments import sum_per_document
from .call import DocumentStats, LossCall
from .checks import LossArgs, check_policy_loss
from .config import PolicyLossConfig
from .surrogates import gmpo_clipped_log_ratio
from .tokens import clean

__all__ = ["DocumentStats", "document_stats"]


def compute_document_stats(call: LossCall, logprobs: torch.Tensor) -> DocumentStats:
    """The statistics of a checked call at ``logprobs`` (one all-reduce SUM over ``call.group``
    if any)."""
    config, seg = call.config, call.seg
    valid, dtype = call.valid_and_dtype(logprobs)
    lp = clean(logprobs, valid, dtype).detach()  # [N]
    old = clean(call.old_logprobs, valid, dtype).detach()  # [N]
    token_lr = lp - old  # [N]
    columns = {"tokens": valid.to(dtype)}  # each [N]
    if config.sums_log_ratio:
        columns["log_ratio"] = token_lr
    if config.sums_clipped_log_ratio:
        adv = clean(call.token_advantages().detach(), valid, dtype)
        c = gmpo_clipped_log_ratio(token_lr, adv, config.clip_low, config.clip_high)
        columns["clipped_log_ratio"] = torch.where(valid, c, 0.0)
    if config.sums_log_rho(call.rollout_logprobs is not None):
        columns["log_rho"] = old - clean(call.rollout_logprobs, valid, dtype).detach()
    sums = {k: sum_per_document(v, seg) for k, v in columns.items()}  # each [size]
    if call.group is not None:
        flat = collectives.all_reduce(torch.cat(list(sums.values())), call.group, "sum")
        sums = dict(zip(sums, flat.split(seg.size), strict=True))
    return DocumentStats(
        seg.size,
        sums["tokens"],
        sums.get("log_ratio"),
        sums.get("clipped_log_ratio"),
        sums.get("log_rho"),
        call.key,
    )


def document_stats(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    document_ids: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    context_group: object | None = None,
    capturable: bool = False,
) -> DocumentStats:
    """The per-document statistics of a :func:`policy_loss` call, computed once.

    Same arguments as :func:`policy_loss` (``ref_logprobs``, ``entropy`` and ``normalizer`` do
    not enter them). Pass the result as ``policy_loss(..., document_stats=stats)`` to evaluate
    the loss on the same stream several times (e.g. once per chunk of rows, with the other rows
    held fixed) without recomputing the document sums, and under context parallelism without
    any collective. Only ``log π_θ`` enters the stats (GSPO ratio, GMPO, ``ratio_seq_mask``),
    as a constant: the gradient of a later ``policy_loss`` is exact for the values passed here.

    With ``context_group`` this is a collective call over the group: two ``all_reduce`` calls
    (MAX of 5 int64, then SUM of ``k · D`` float64, ``k`` = 1 to 4 sums), whatever the rank's
    data (the first is skipped with ``capturable``, as in :func:`policy_loss`).

    Returns:
        A :class:`DocumentStats`.
    """
    args = LossArgs(
        logprobs, old_logprobs, advantages, mask, config, document_ids,
        rollout_logprobs=rollout_logprobs,
    )  # fmt: skip
    call = check_policy_loss(
        args, context_group=context_group, for_stats=True, what="document_stats",
        capturable=capturable,
    )  # fmt: skip
    return compute_document_stats(call, logprobs)
