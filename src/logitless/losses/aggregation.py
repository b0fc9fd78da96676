"""Aggregation of per-token losses into a scalar, as per-token weights.

Every mode is ``loss = Σ_t w_t · L_t`` over valid tokens, with a weight that depends only on
the token's document and on *global* counts (``num_tokens`` ``T``, ``num_sequences`` ``S``:
valid tokens and documents with at least one valid token in the whole optimizer step), plus the
token count ``n_d`` of the token's own document. Because the weights are global, the loss is a
plain sum over micro-batches: computing it per micro-batch and adding gives the whole-batch
value and gradients, as long as no document is split across micro-batches.

=========================  ==========================  ====================================
mode                       w_t                         loss
=========================  ==========================  ====================================
token_mean                 1 / T                       Σ_t L_t / T         (DAPO, TRL "dapo")
seq_mean_token_mean        1 / (n_d · S)               mean_d mean_t L_t   (GRPO paper)
seq_mean_token_sum         1 / S                       mean_d Σ_t L_t
seq_mean_token_sum_norm    1 / (S · L)                 Σ_t L_t / (S · L)   (Dr.GRPO, eq. 3)
token_sum                  1                           Σ_t L_t
=========================  ==========================  ====================================

Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
(arXiv:2503.20783), which replaces the per-sequence ``1/|o_i|`` with a constant.
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "aggregation_weights", "metric_weights"]


def _token_mean(valid, n_doc, num_tokens, num_sequences, norm_length):
    return valid / num_tokens.clamp(min=1)


def _token_sum(valid, n_doc, num_tokens, num_sequences, norm_length):
    return valid


def _seq_mean_token_mean(valid, n_doc, num_tokens, num_sequences, norm_length):
    return valid / (n_doc.clamp(min=1) * num_sequences.clamp(min=1))


def _seq_mean_token_sum(valid, n_doc, num_tokens, num_sequences, norm_length):
    return valid / num_sequences.clamp(min=1)


def _seq_mean_token_sum_norm(valid, n_doc, num_tokens, num_sequences, norm_length):
    return valid / (num_sequences.clamp(min=1) * norm_length)


AGGREGATIONS = {
    "token_mean": _token_mean,
    "token_sum": _token_sum,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregation_weights(
    mode: str,
    valid: torch.Tensor,
    tokens_in_doc: torch.Tensor,
    num_tokens: torch.Tensor,
    num_sequences: torch.Tensor,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Per-token weights ``w_t`` of ``mode`` (0 on invalid tokens).

    Args:
        mode: an aggregation name (see the module table).
        valid: ``[N]`` float, 1 for tokens that count, 0 otherwise.
        tokens_in_doc: ``[N]`` float, ``n_d``: valid tokens of the token's document.
        num_tokens, num_sequences: 0-dim float tensors, the step's global counts.
        norm_length: Dr.GRPO's ``L`` (needed for ``seq_mean_token_sum_norm`` only).

    Returns:
        ``[N]`` weights; ``Σ_t w_t L_t`` is the aggregated loss.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {mode!r}")
    if mode == "seq_mean_token_sum_norm" and norm_length is None:
        raise ValueError("norm_length is required for aggregation='seq_mean_token_sum_norm'")
    return AGGREGATIONS[mode](valid, tokens_in_doc, num_tokens, num_sequences, norm_length)


def metric_weights(
    mode: str,
    valid: torch.Tensor,
    tokens_in_doc: torch.Tensor,
    num_tokens: torch.Tensor,
    num_sequences: torch.Tensor,
) -> torch.Tensor:
    """Weights that turn a per-token statistic into a mean, normalized like the loss.

    ``seq_mean_token_mean`` averages per sequence then over sequences; every other mode
    averages over tokens. Either way the weights sum to 1 over the step, so per-micro-batch
    metrics add up to the whole-step metric.
    """
    if mode == "seq_mean_token_mean":
        return _seq_mean_token_mean(valid, tokens_in_doc, num_tokens, num_sequences, None)
    return _token_mean(valid, tokens_in_doc, num_tokens, num_sequences, None)
