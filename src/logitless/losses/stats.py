"""Per-document statistics of a policy-loss call: :class:`DocumentStats`, computed once.

Sequence-level parts of a loss (GSPO's ratio, GMPO's mean, sequence masks and sequence
importance weights, per-sequence aggregation) need sums over each document's tokens. They are
segment sums over document ids, summed over the context-parallel group when the stream is
sharded, and every one of them is a stop-gradient constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import collectives
from ._segments import sum_per_document
from .checks import LossCall, check_policy_loss, clean
from .config import PolicyLossConfig
from .surrogates import gmpo_clipped_log_ratio

__all__ = ["DocumentStats", "document_stats"]


@dataclass(frozen=True)
class DocumentStats:
    """Per-document sums of one call's token stream, over its context-parallel group.

    Everything ``policy_loss`` needs to know about whole documents, as ``[size]`` tensors in
    the loss's compute dtype. Every entry is a stop-gradient statistic. Made by
    :func:`document_stats`; pass it to ``policy_loss(..., document_stats=...)`` to evaluate the
    loss on the same stream again (e.g. chunk by chunk) without communicating.

    size: ``D``, the length of per-document buffers: 1 + the largest document id of the group.
    tokens: valid tokens (mask true, not padding) of each document.
    log_ratio: ``Σ_t (log π_θ − log π_old)`` over each document's valid tokens (GSPO ratio,
        ``ratio_seq_mask``), or None when the config needs none.
    clipped_log_ratio: ``Σ_t ĉ_t`` (GMPO), or None.
    log_rho: ``Σ_t log π_old/π_rollout`` (sequence truncated IS, ``mismatch_seq_mask``), or None.
    key: fingerprint of the config and input layout it was computed for (checked on use).
    """

    size: int
    tokens: torch.Tensor
    log_ratio: torch.Tensor | None
    clipped_log_ratio: torch.Tensor | None
    log_rho: torch.Tensor | None
    key: int


def compute_document_stats(
    call: LossCall,
    config: PolicyLossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
) -> DocumentStats:
    """The statistics of a checked call (one all-reduce SUM over ``call.group`` if any)."""
    seg = call.seg
    valid, dtype = call.valid_and_dtype(logprobs, mask)
    lp = clean(logprobs, valid, dtype).detach()  # [N]
    old = clean(old_logprobs, valid, dtype).detach()  # [N]
    token_lr = lp - old  # [N]
    columns = {"tokens": valid.to(dtype)}  # each [N]
    if config.sums_log_ratio:
        columns["log_ratio"] = token_lr
    if config.sums_clipped_log_ratio:
        adv = clean(call.token_advantages(advantages).detach(), valid, dtype)
        c = gmpo_clipped_log_ratio(token_lr, adv, config.clip_low, config.clip_high)
        columns["clipped_log_ratio"] = torch.where(valid, c, 0.0)
    if config.sums_log_rho(rollout_logprobs is not None):
        columns["log_rho"] = old - clean(rollout_logprobs, valid, dtype).detach()
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
    data.

    Returns:
        A :class:`DocumentStats`.
    """
    call = check_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        config=config,
        document_ids=document_ids,
        rollout_logprobs=rollout_logprobs,
        context_group=context_group,
        for_stats=True,
        what="document_stats",
    )
    return compute_document_stats(
        call, config, logprobs, old_logprobs, advantages, mask, rollout_logprobs
    )
