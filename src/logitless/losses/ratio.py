"""Importance log-ratios at token and sequence (GSPO) level."""

from __future__ import annotations

import torch

from ..contract import collectives
from ._segments import Segments, gather, of_ids, segment_mean, sum_per_document

__all__ = ["sequence_log_ratio", "sequence_mean_log_ratio", "token_log_ratio"]


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``log π_θ(y_t) − log π_old(y_t)`` per token; gradient through ``logprobs`` only.  [N]"""
    return logprobs - old_logprobs.detach()


def sequence_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    valid: torch.Tensor,
    document_ids: torch.Tensor,
    num_documents: int,
) -> torch.Tensor:
    """GSPO sequence ratio in token form, one value per token.

    All tensors ``[N]``; ``document_ids`` int64 in ``[-1, num_documents)`` (``-1``: padding).

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071): the sequence
    importance ratio ``s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|)`` and its token form
    (GSPO-token) ``s_{i,t} = sg(s_i) · π_θ(y_{i,t}) / sg(π_θ(y_{i,t}))``. In log space::

        log s_{i,t} = sg(mean_{t' in i} (log π_θ − log π_old)) + log π_θ(y_t) − sg(log π_θ(y_t))

    The mean runs over the valid tokens of each document (segment sums over document ids, so
    packed streams work and padding is never a document). Every token carries the value of its
    sequence ratio; its gradient is ``s_i ∇log π_θ(y_t)``.
    """
    seg = of_ids(document_ids, num_documents)
    token = token_log_ratio(logprobs, old_logprobs)  # [N]
    seq_mean = gather(segment_mean(token.detach(), valid, seg), seg)  # [N]
    return sequence_log_ratio_from_mean(logprobs, seq_mean)


def sequence_log_ratio_from_mean(logprobs: torch.Tensor, seq_mean: torch.Tensor) -> torch.Tensor:
    """GSPO token form from each token's document mean log-ratio (a constant).  [N] -> [N]

    ``policy_loss`` computes the document means once (summed over a context-parallel group when
    there is one) and calls this; :func:`sequence_log_ratio` is the single-process composition.
    """
    return seq_mean.detach() + logprobs - logprobs.detach()  # [N]


def sequence_mean_log_ratio(
    token_log_ratio: torch.Tensor,
    valid: torch.Tensor,
    segments: Segments,
    doc_total: torch.Tensor,
    doc_tokens: torch.Tensor,
    group: object | None = None,
) -> torch.Tensor:
    """Each token's document mean ``mean_{t in d} log r_t``, with the mean's own gradient.  [N]

    Unlike the GSPO token form (each token's gradient through its own log-prob only), every
    valid token of the document gets ``1 / n_d`` of the gradient: this is
    ``log s_d`` as a function of all the document's log-probs. The value is
    ``doc_total / doc_tokens`` (``[D]`` constants, e.g. summed over a context-parallel group);
    the gradient flows through this call's tokens of ``token_log_ratio``. ``group``: the
    context-parallel group the documents are split over: the gradient of each document's mean
    is summed over it in backward (one all-reduce of ``[D]``, on every rank), so a token gets
    the whole document's share, wherever the document's other tokens are; without it, only
    this call's tokens' share.
    """
    local = sum_per_document(torch.where(valid, token_log_ratio, 0.0), segments)  # [D]
    mean = (doc_total.detach() + local - local.detach()) / doc_tokens.clamp(min=1.0)  # [D]
    if group is not None and mean.requires_grad:
        # every rank's share of the loss reaches each document's mean through every rank's
        # tokens: the gradient of the mean is their sum
        mean.register_hook(lambda grad: collectives.all_reduce(grad, group, "sum"))
    return gather(mean, segments)  # [N]
