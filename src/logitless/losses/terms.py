"""The terms of a policy loss besides its surrogate, each one small pure function, registered.

A term reads the call's token view (:class:`~.tokens.LossTokens`) and returns a :class:`Term`:
a per-token ``factor`` that multiplies the policy term (masks, importance weights), or a
per-token ``addend`` to the loss (a penalty or a bonus, aggregated with the loss's weights or
its own), and its metrics; None when the config does not use it. :data:`TERMS` lists them in
the order :func:`~logitless.losses.policy.compute_policy_loss` applies them; a new term is one
function and one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._segments import gather
from .aggregation import aggregation_weights, metric_weights
from .kl import importance_weighted_kl, kl_penalty
from .metrics import extreme, weighted_mean
from .mismatch import sequence_keep, token_band_mask, truncated_is_from_total, truncated_is_token
from .ratio import sequence_mean_log_ratio, token_log_ratio
from .surrogates import MAX_LOG_RATIO
from .tokens import LossTokens


class Term(NamedTuple):
    """One term's part of the loss: ``factor`` [N] (multiplies the policy term) or ``addend``
    [N] (added per token; aggregated with ``weights`` [N], or the loss's when None), and its
    detached 0-dim metrics."""

    metrics: dict[str, torch.Tensor]
    factor: torch.Tensor | None = None
    addend: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def _keep_mask(t: LossTokens, token_log, token_band, doc_log, seq_mode, seq_range):
    """``[N]`` 0/1 weights: a token is kept when ``token_log`` ``[N]`` lies in ``token_band``
    (if set) and its document's ``doc_log()`` ``[D]`` passes ``seq_mode`` within ``seq_range``
    (if set; ``doc_log`` is only called then)."""
    keep = torch.ones_like(t.lp)
    if token_band is not None:
        keep = keep * token_band_mask(token_log, *token_band)
    if seq_mode is not None:
        lo, hi = seq_range
        keep = keep * gather(sequence_keep(doc_log(), t.n_doc, seq_mode, lo, hi), t.call.seg)
    return keep


def ratio_masks(t: LossTokens) -> Term | None:
    """Band masks on the current ratio ``π_θ/π_old`` (prime-rl's token and sequence masks):
    masked tokens leave the policy term and keep their place in the denominators."""
    c = t.config
    if c.ratio_token_mask is None and c.ratio_seq_mask is None:
        return None
    keep = _keep_mask(
        t,
        token_log_ratio(t.lp, t.old),
        c.ratio_token_mask,
        lambda: t.per_doc(t.stats.log_ratio),
        c.ratio_seq_mask,
        c.ratio_seq_mask_range,
    )  # [N]
    return Term({"ratio_masked_frac": weighted_mean(1.0 - keep, t.mweights)}, factor=keep)


def off_policy_sequence_mask(t: LossTokens) -> Term | None:
    """Off-policy sequence masking (DeepSeek-AI 2025, "DeepSeek-V3.2", Sec. 3.1, OPSM):
    ``M_t = 0`` where ``A_t < 0`` and the token's document has
    ``mean_{t' in d} (log π_old − log π_θ) > opsm_delta``, else 1 (stop-gradient); masked
    tokens leave the policy term and keep their place in the denominators."""
    delta = t.config.opsm_delta
    if delta is None:
        return None
    drift = -t.doc_mean(t.stats.log_ratio)  # [N], each token's document mean of log old/θ
    masked = ((t.adv < 0) & (drift > delta)).to(t.dtype)  # [N]
    return Term({"opsm_masked_frac": weighted_mean(masked, t.mweights)}, factor=1.0 - masked)


def mismatch_correction(t: LossTokens) -> Term | None:
    """Train/inference mismatch against the rollout engine (``ρ = π_old / π_rollout``):
    truncated importance sampling and masks (see :mod:`.mismatch`)."""
    rollout = t.input(t.call.rollout_logprobs)
    if rollout is None:
        return None
    c = t.config
    log_rho = t.old - rollout.detach()  # [N]
    is_weight = torch.ones_like(t.lp)  # [N]
    if c.mismatch_is == "token":
        is_weight = truncated_is_token(log_rho, c.mismatch_is_cap, c.mismatch_is_floor)
    elif c.mismatch_is == "sequence":
        total = t.per_doc(t.stats.log_rho)  # [D]
        weight = truncated_is_from_total(total, c.mismatch_is_cap, c.mismatch_is_floor)
        is_weight = gather(weight, t.call.seg)
    keep = _keep_mask(
        t,
        log_rho,
        c.mismatch_token_mask,
        lambda: t.per_doc(t.stats.log_rho),
        c.mismatch_seq_mask,
        c.mismatch_seq_mask_range,
    )  # [N]
    # KL(π_rollout ‖ π_old) from rollout samples, k3 with ρ; clamped like approx_kl, so a
    # rollout log-prob of -inf (probability 0) keeps it finite
    lr = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    metrics = {
        "mismatch_kl": weighted_mean(torch.expm1(lr) - lr, t.mweights),
        "is_weight_mean": weighted_mean(is_weight, t.mweights),
        "is_weight_min": extreme(is_weight, t.valid, largest=False),
        "is_weight_max": extreme(is_weight, t.valid, largest=True),
        "is_masked_frac": weighted_mean(1.0 - keep, t.mweights),
    }
    return Term(metrics, factor=is_weight * keep)


def kl_to_reference(t: LossTokens) -> Term | None:
    """``kl_coef · KL(π_θ ‖ π_ref)`` per token (``kl_estimator``), optionally weighted by the
    differentiable importance ratio (``kl_importance_weight``); reported whenever
    ``ref_logprobs`` is given."""
    ref = t.input(t.call.ref_logprobs)
    if ref is None:
        return None
    c = t.config
    kl = kl_penalty(t.lp, ref, c.kl_estimator, c.kl_log_ratio_clamp, c.kl_value_clamp)  # [N]
    if c.kl_importance_weight:
        token_lr = token_log_ratio(t.lp, t.old)
        if c.ratio_level != "token":  # s_d, differentiable in all its tokens
            log_ratio = sequence_mean_log_ratio(
                token_lr, t.valid, t.call.seg, t.per_doc(t.stats.log_ratio), t.n_doc
            )
        else:
            log_ratio = token_lr
        kl = importance_weighted_kl(kl, log_ratio)
    metrics = {"kl_ref": weighted_mean(kl, t.mweights)}
    return Term(metrics, addend=c.kl_coef * kl if c.kl_coef > 0 else None)


def _own_weights(t: LossTokens, aggregation: str | None):
    """A term's ``(weights, metric weights)`` under its own ``aggregation`` (None: the loss's,
    returned as ``(None, t.mweights)``), with the loss's counts."""
    if aggregation is None:
        return None, t.mweights
    counts = (t.validf, t.tokens_in_doc, t.num_tokens, t.num_seqs)
    weights = aggregation_weights(aggregation, *counts, t.call.norm_length)
    return weights, metric_weights(aggregation, *counts)


def entropy_bonus(t: LossTokens) -> Term | None:
    """``- entropy_coef · H`` per token, aggregated like the loss or with
    ``entropy_aggregation``; the entropy is reported whenever it is given."""
    if t.entropy is None:
        return None
    c = t.config
    weights, mweights = _own_weights(t, c.entropy_aggregation)
    metrics = {"entropy": weighted_mean(t.entropy, mweights)}
    addend = -c.entropy_coef * t.entropy if c.entropy_coef != 0 else None
    return Term(metrics, addend=addend, weights=weights)


def distillation(t: LossTokens) -> Term | None:
    """``+ distill_coef · D`` per token (``D``: the divergence from a teacher's distribution,
    differentiable), aggregated like the loss or with ``distill_aggregation``; ``D`` is
    reported as ``distill_divergence`` whenever it is given."""
    divergence = t.input(t.call.divergence)
    if divergence is None:
        return None
    c = t.config
    weights, mweights = _own_weights(t, c.distill_aggregation)
    metrics = {"distill_divergence": weighted_mean(divergence, mweights)}
    addend = c.distill_coef * divergence if c.distill_coef != 0 else None
    return Term(metrics, addend=addend, weights=weights)


#: The terms, in the order they apply (factors multiply the surrogate in this order).
TERMS: dict[str, Callable[[LossTokens], Term | None]] = {
    "ratio_masks": ratio_masks,
    "opsm": off_policy_sequence_mask,
    "mismatch": mismatch_correction,
    "kl": kl_to_reference,
    "entropy": entropy_bonus,
    "distillation": distillation,
}
