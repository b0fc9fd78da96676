"""RL policy losses on per-token tensors: small pure functions and one entry point.

The losses never import the LM head: they take log-probs (and entropy) computed by
:func:`logitless.linear_logprobs` or anything else. Formulas: the README's "Policy losses".

Layout: one small pure function per variant (:mod:`.surrogates`, :mod:`.kl`, :mod:`.mismatch`,
:mod:`.ratio`, :mod:`.aggregation`, each with the registry its config names come from),
:mod:`.config` (the options), :mod:`.checks` (the contract, checked once), :mod:`.stats`
(per-document statistics), :mod:`.metrics`, :mod:`.policy` (the composition) and
:mod:`.normalizer` (step-level counts).
"""

from .aggregation import aggregation_weights, metric_weights
from .checks import check_policy_loss
from .config import PolicyLossConfig
from .distillation import distillation_loss
from .kl import importance_weighted_kl, kl_k1, kl_k2, kl_k3, kl_k3_k2_grad, kl_penalty
from .mismatch import sequence_mask, token_band_mask, truncated_is_sequence, truncated_is_token
from .normalizer import LossNormalizer, loss_normalizer
from .policy import policy_loss
from .ratio import sequence_log_ratio, token_log_ratio
from .rollout_mismatch import MismatchMetrics, rollout_mismatch_metrics
from .stats import DocumentStats, document_stats
from .surrogates import (
    Surrogate,
    cispo_surrogate,
    dppo_surrogate,
    gmpo_surrogate,
    ppo_clip_surrogate,
    reinforce_surrogate,
    sapo_surrogate,
)

__all__ = [
    "DocumentStats",
    "LossNormalizer",
    "MismatchMetrics",
    "PolicyLossConfig",
    "Surrogate",
    "aggregation_weights",
    "check_policy_loss",
    "cispo_surrogate",
    "distillation_loss",
    "document_stats",
    "dppo_surrogate",
    "gmpo_surrogate",
    "importance_weighted_kl",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_k2_grad",
    "kl_penalty",
    "loss_normalizer",
    "metric_weights",
    "policy_loss",
    "ppo_clip_surrogate",
    "reinforce_surrogate",
    "rollout_mismatch_metrics",
    "sapo_surrogate",
    "sequence_log_ratio",
    "sequence_mask",
    "token_band_mask",
    "token_log_ratio",
    "truncated_is_sequence",
    "truncated_is_token",
]
