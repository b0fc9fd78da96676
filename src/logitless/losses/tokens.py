"""The token view of a checked loss call: its inputs as ``[N]`` tensors, cleaned, with the
counts and weights every loss term shares (:class:`LossTokens`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._segments import gather
from .aggregation import aggregation_weights, metric_weights
from .call import DocumentStats, LossCall


def clean(t: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` flattened to ``[N]`` in ``dtype``, 0 at tokens that do not count.

    Invalid tokens may hold -inf/NaN log-probs; they must not reach exp() or the backward pass
    (0 · NaN = NaN), so they are replaced by 0 before any arithmetic.
    """
    return torch.where(valid, t.reshape(-1).to(dtype), 0.0)


@dataclass(frozen=True)
class LossTokens:
    """One loss call at given log-probs, as the terms read it (every tensor ``[N]`` unless
    said otherwise; 0 at tokens that do not count).

    call: the checked call (its config and inputs). lp: log π_θ (differentiable); old: log
    π_old; adv: per-token advantages; entropy: H (differentiable) or None; valid / validf: the
    tokens that count; dtype: the compute dtype. stats: the per-document sums; n_doc ``[D]``
    and tokens_in_doc: valid tokens per document; num_tokens / num_seqs: the counts the
    aggregation divides by (0-dim: the normalizer's, or the call's own); weights: the loss's
    aggregation weights; mweights: the metrics' weights.
    """

    call: LossCall
    lp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    entropy: torch.Tensor | None
    valid: torch.Tensor
    validf: torch.Tensor
    dtype: torch.dtype
    stats: DocumentStats
    n_doc: torch.Tensor
    tokens_in_doc: torch.Tensor
    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    weights: torch.Tensor
    mweights: torch.Tensor

    @staticmethod
    def of(
        call: LossCall,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        stats: DocumentStats,
    ) -> LossTokens:
        valid, dtype = call.valid_and_dtype(logprobs)
        validf = valid.to(dtype)
        n_doc = stats.tokens.to(dtype)  # [D]; stats may come from a call in another dtype
        tokens_in_doc = gather(n_doc, call.seg)  # [N]
        norm = call.normalizer
        if norm is None:
            num_tokens, num_seqs = n_doc.sum(), (n_doc > 0).sum().to(dtype)
        else:
            num_tokens = torch.as_tensor(norm.num_tokens, dtype=dtype, device=valid.device)
            num_seqs = torch.as_tensor(norm.num_sequences, dtype=dtype, device=valid.device)
        agg = call.config.aggregation
        counts = (validf, tokens_in_doc, num_tokens, num_seqs)
        return LossTokens(
            call=call,
            lp=clean(logprobs, valid, dtype),
            old=clean(call.old_logprobs, valid, dtype).detach(),
            adv=clean(call.token_advantages().detach(), valid, dtype),
            entropy=None if entropy is None else clean(entropy, valid, dtype),
            valid=valid,
            validf=validf,
            dtype=dtype,
            stats=stats,
            n_doc=n_doc,
            tokens_in_doc=tokens_in_doc,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            weights=aggregation_weights(agg, *counts, call.norm_length),
            mweights=metric_weights(agg, *counts),
        )

    @property
    def config(self):
        return self.call.config

    def per_doc(self, total: torch.Tensor | None) -> torch.Tensor:
        """A ``[D]`` document statistic in the compute dtype."""
        return total.to(self.dtype)

    def doc_mean(self, total: torch.Tensor) -> torch.Tensor:
        """Each token's document mean of a ``[D]`` per-document sum: ``[N]``."""
        return gather(self.per_doc(total) / self.n_doc.clamp(min=1.0), self.call.seg)

    def input(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Another per-token input of the call, cleaned like the others (None stays None)."""
        return None if t is None else clean(t, self.valid, self.dtype)
