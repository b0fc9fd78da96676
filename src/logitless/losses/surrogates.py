"""Policy-gradient surrogates: per-token losses (to be minimized) from per-token tensors.

Every function takes ``[N]`` tensors and returns a :class:`Surrogate`: the per-token loss and
the boolean masks of tokens where a clip (or trust-region mask) is active, for metrics. None
of them masks or aggregates; :func:`logitless.losses.policy_loss` does that.

Notation: ``log_ratio = log π_θ − log π_old`` (differentiable through ``log π_θ``),
``r = exp(log_ratio)``, ``A`` the advantage (no gradient), ``sg`` stop-gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._segments import gather, of_ids, segment_mean

__all__ = [
    "SURROGATES",
    "Surrogate",
    "cispo_surrogate",
    "dppo_surrogate",
    "gmpo_surrogate",
    "ppo_clip_surrogate",
    "reinforce_surrogate",
    "sapo_surrogate",
]

# exp() of a log-ratio beyond this is clamped (the anchors clamp at ±20 too).
MAX_LOG_RATIO = 20.0


class Surrogate(NamedTuple):
    loss: torch.Tensor  # [N] per-token loss
    clipped_low: torch.Tensor  # [N] bool: lower clip / mask active
    clipped_high: torch.Tensor  # [N] bool: upper clip / mask active
    clipped_dual: torch.Tensor | None = None  # [N] bool: PPO dual clip active


def _unclipped(loss: torch.Tensor) -> Surrogate:
    """A surrogate that clips no token."""
    no_clip = torch.zeros_like(loss, dtype=torch.bool)
    return Surrogate(loss, no_clip, no_clip)


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [N]


def ppo_clip_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO clipped surrogate with asymmetric range and optional dual clip.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347),
    eq. (7) (``L^CLIP``); asymmetric ``[1 − ε_low, 1 + ε_high]`` from DAPO (Yu et al. 2025,
    arXiv:2503.14476, Sec. 3.1 "Clip-Higher"); dual clip from Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep Reinforcement Learning" (arXiv:1912.09729, dual-clip PPO)::

        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))
        L = min(L, −A·c)   where A < 0           (dual clip, c > 1)

    With ``log_ratio`` in GSPO token form (:func:`logitless.losses.sequence_log_ratio`) this is
    GSPO-token.
    """
    ratio = _ratio(log_ratio)  # [N]
    unclipped = -advantages * ratio  # [N]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N]
    loss = torch.maximum(unclipped, clipped)  # [N]
    clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high)  # [N]
    clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low)  # [N]
    clipped_dual = None
    if dual_clip is not None:
        bound = -advantages * dual_clip  # [N]
        clipped_dual = (advantages < 0) & (loss > bound)  # [N]
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return Surrogate(loss, clipped_low, clipped_high, clipped_dual)


def cispo_surrogate(
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> Surrogate:
    """CISPO: clipped, stop-gradient IS weight times the REINFORCE term.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585), Sec. 3.1, the CISPO objective::

        L = −sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ

    Every token keeps a gradient; the clip only bounds its weight.
    """
    ratio = _ratio(log_ratio)  # [N]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [N]
    loss = -weight * advantages * logprobs  # [N]
    return Surrogate(loss, ratio < 1.0 - clip_low, ratio > 1.0 + clip_high)


def sapo_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> Surrogate:
    """SAPO: a smooth sigmoid gate in place of the hard clip.

    "Soft Adaptive Policy Optimization" (Qwen team 2025, arXiv:2511.20347), the soft gate
    ``f(r) = (4/τ)·σ(τ(r − 1))`` with separate temperatures for positive/negative tokens::

        τ = τ_pos if A > 0 else τ_neg
        L = −A · (4 / τ) · σ(τ · (r − 1))

    Its gradient is ``−A · 4σ(1 − σ) · r ∇log π``: equal to the plain one at ``r = 1``,
    decaying smoothly as ``r`` leaves 1.
    """
    ratio = _ratio(log_ratio)  # [N]
    tau = torch.where(advantages > 0, tau_pos, torch.full_like(ratio, tau_neg))  # [N]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [N]
    return _unclipped(-advantages * gate)


def gmpo_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    document_ids: torch.Tensor,
    num_documents: int,
    clip_low: float,
    clip_high: float,
) -> Surrogate:
    """GMPO: geometric mean of the token ratios, each clipped in log space.

    All tensors ``[N]``; ``document_ids`` int64 in ``[-1, num_documents)`` (``-1``: padding).

    Zhao et al. 2025, "Geometric-Mean Policy Optimization" (GMPO objective: the geometric
    mean of token-level clipped ratios, clip range in log space)::

        ĉ_t = sgn(A) · min(sgn(A) · log r_t, sgn(A) · clip(log r_t, −ε_low, ε_high))
        R   = exp(mean_{t in doc} ĉ_t)                 (per document, valid tokens only)
        L_t = −A_t · sg(R) · exp(ĉ_t − sg(ĉ_t))        (value R; gradient R ∇ĉ_t)

    Aggregated with ``seq_mean_token_mean`` this is exactly ``mean_docs(−A · R)``, the GMPO
    objective; the token form lets every aggregation mode and micro-batch split apply.
    """
    seg = of_ids(document_ids, num_documents)
    c = gmpo_clipped_log_ratio(log_ratio, advantages, clip_low, clip_high)  # [N]
    mean_c = gather(segment_mean(c.detach(), valid, seg), seg)  # [N]
    return gmpo_from_mean(c, mean_c, log_ratio, advantages, clip_low, clip_high)


def gmpo_clipped_log_ratio(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """GMPO's per-token ``ĉ_t`` (sign-aware clip of the log-ratio in log space).  [N] -> [N]"""
    sign = torch.sign(advantages)  # [N]
    bounded = log_ratio.clamp(-clip_low, clip_high)  # [N]
    c = sign * torch.minimum(sign * log_ratio, sign * bounded)  # [N]
    return c.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def gmpo_from_mean(
    c: torch.Tensor,
    mean_c: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> Surrogate:
    """GMPO from ``ĉ_t`` and each token's document mean of ``ĉ`` (a constant).  [N] -> [N]

    ``policy_loss`` computes the document means once (summed over a context-parallel group when
    there is one); :func:`gmpo_surrogate` is the single-process composition.
    """
    ratio = torch.exp(mean_c.detach() + c - c.detach())  # [N], value R of the document
    clipped_high = (advantages > 0) & (log_ratio > clip_high)
    clipped_low = (advantages < 0) & (log_ratio < -clip_low)
    return Surrogate(-advantages * ratio, clipped_low, clipped_high)


def reinforce_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor) -> Surrogate:
    """REINFORCE with an importance ratio and no clip.

    Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning" (the REINFORCE estimator), with a per-token importance ratio::

        L = −A · r          (gradient −A · r ∇log π; on-policy r = 1 gives −A ∇log π)
    """
    ratio = _ratio(log_ratio)  # [N]
    return _unclipped(-advantages * ratio)


def dppo_surrogate(
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    delta_low: float,
    delta_high: float,
    ratio_cap: float,
) -> Surrogate:
    """DPPO-Binary-TV: a binary trust-region mask on the probability difference.

    "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv:2602.04879),
    DPPO-Binary-TV. With ``p = π_θ(y_t)``, ``p_old = π_old(y_t)``::

        M = [p − p_old <= δ_high]  if A > 0  else  [p − p_old >= −δ_low]
        L = −A · sg(min(r, cap)) · log π_θ · sg(M)

    Tokens only leave the update when moving them further would widen the divergence in the
    direction the advantage pushes.
    """
    ratio = _ratio(log_ratio)  # [N]
    diff = (logprobs.exp() - old_logprobs.exp()).detach()  # [N]
    over_high = (advantages > 0) & (diff > delta_high)  # [N]
    over_low = (advantages <= 0) & (diff < -delta_low)  # [N]
    keep = (~(over_high | over_low)).to(logprobs.dtype)  # [N]
    weight = ratio.clamp(max=ratio_cap).detach()  # [N]
    loss = -advantages * weight * logprobs * keep  # [N]
    return Surrogate(loss, over_low & (advantages < 0), over_high)


# ---------------------------------------------------------------------------------------------
# The registry: each surrogate's adapter from a PolicyLossConfig, and what it needs of whole
# documents. ``PolicyLossConfig`` takes its list of names from here.


@dataclass(frozen=True)
class SurrogateSpec:
    """How :func:`~logitless.losses.policy_loss` runs one surrogate.

    run: ``(config, log_ratio, logprobs, old_logprobs, advantages, gmpo_mean) -> Surrogate``,
        all ``[N]`` (``gmpo_mean``: each token's document mean of GMPO's clipped log-ratio, or
        None): picks the surrogate's options out of the config.
    token_only: builds its own per-token ratio, so ``ratio_level="sequence"`` is undefined.
    document_mean: needs the document mean of its clipped log-ratio, a statistic of ``π_θ``
        over whole documents (its gradient is not token-local).
    """

    run: Callable[..., Surrogate]
    token_only: bool = False
    document_mean: bool = False


def _ppo(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    return ppo_clip_surrogate(log_ratio, adv, c.clip_low, c.clip_high, c.dual_clip)


def _cispo(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    return cispo_surrogate(log_ratio, lp, adv, c.clip_low, c.clip_high)


def _sapo(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    return sapo_surrogate(log_ratio, adv, c.sapo_tau_pos, c.sapo_tau_neg)


def _gmpo(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    clipped = gmpo_clipped_log_ratio(log_ratio, adv, c.clip_low, c.clip_high)
    return gmpo_from_mean(clipped, gmpo_mean, log_ratio, adv, c.clip_low, c.clip_high)


def _reinforce(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    return reinforce_surrogate(log_ratio, adv)


def _dppo(c, log_ratio, lp, old, adv, gmpo_mean) -> Surrogate:
    return dppo_surrogate(log_ratio, lp, old, adv, c.clip_low, c.clip_high, c.dppo_ratio_cap)


# GMPO takes a geometric mean of *clipped* token ratios itself; DPPO's trust region is a
# per-token probability difference: neither has a sequence-level ratio.
SURROGATES: dict[str, SurrogateSpec] = {
    "ppo_clip": SurrogateSpec(_ppo),
    "cispo": SurrogateSpec(_cispo),
    "sapo": SurrogateSpec(_sapo),
    "gmpo": SurrogateSpec(_gmpo, token_only=True, document_mean=True),
    "reinforce": SurrogateSpec(_reinforce),
    "dppo": SurrogateSpec(_dppo, token_only=True),
}
