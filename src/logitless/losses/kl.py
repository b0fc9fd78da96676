"""Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ.

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html):
with ``x = log π_ref(y) − log π_θ(y)``::

    k1 = −x                 unbiased, high variance, can be negative
    k2 = x² / 2             biased, low variance; its gradient is the true KL gradient
    k3 = exp(x) − 1 − x     unbiased, low variance, always >= 0
    k3+                     k3 value with k2 gradient (straight-through)
"""

from __future__ import annotations

import torch

from .surrogates import MAX_LOG_RATIO as _MAX_LOG_RATIO  # the surrogates' clamp of exp()


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log π_θ − log π_ref (Schulman 2020, estimator k1).  [N]"""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π_θ − log π_ref)² (Schulman 2020, estimator k2).  [N]"""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """k3 = exp(x) − 1 − x, x = log π_ref − log π_θ (Schulman 2020, estimator k3).  [N]

    ``log_ratio_clamp`` bounds ``x`` before ``exp`` and ``value_clamp`` bounds the result, as
    GRPO implementations do (verl's ``low_var_kl`` clamps at 20 and 10).
    """
    x = ref_logprobs - logprobs  # [N]
    if log_ratio_clamp is not None:
        x = x.clamp(-log_ratio_clamp, log_ratio_clamp)
    k3 = torch.expm1(x) - x  # [N]
    if value_clamp is not None:
        k3 = k3.clamp(-value_clamp, value_clamp)
    return k3


def kl_k3_k2_grad(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """k3 value, k2 gradient: ``k2 − sg(k2) + sg(k3)`` (straight-through, "k3+").  [N]"""
    k2 = kl_k2(logprobs, ref_logprobs)
    k3 = kl_k3(logprobs, ref_logprobs, log_ratio_clamp, value_clamp)
    return k2 - k2.detach() + k3.detach()


def _k1(lp, ref, log_ratio_clamp, value_clamp):
    return kl_k1(lp, ref)


def _k2(lp, ref, log_ratio_clamp, value_clamp):
    return kl_k2(lp, ref)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": kl_k3, "k3+": kl_k3_k2_grad}


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) with the named estimator; ``ref_logprobs`` gets no gradient."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs.detach(), log_ratio_clamp, value_clamp)


def importance_weighted_kl(kl: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """``r · KL_t`` with ``r = exp(log_ratio)``, differentiable in both.  [N], [N] -> [N]

    The tokens were sampled from π_old, so ``E_old[r · k3] = E_θ[k3] = KL(π_θ ‖ π_ref)``: with
    the ratio's gradient kept, the term's gradient is the unbiased reverse-KL gradient
    (DeepSeek-AI 2025, "DeepSeek-V3.2", Sec. 3.1, unbiased KL estimate). ``log_ratio`` is the
    token's ``log π_θ − log π_old`` or its sequence's mean (GSPO), clamped to ±20 before exp.
    """
    return kl * log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
