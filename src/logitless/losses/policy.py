"""``policy_loss``: one entry point composing ratio, surrogate, corrections, KL, entropy."""

from __future__ import annotations

import torch

from ._segments import Segments, document_segments, gather, segment_sum
from .aggregation import aggregation_weights, metric_weights
from .config import PolicyLossConfig
from .kl import kl_k3, kl_penalty
from .mismatch import sequence_mask, token_band_mask, truncated_is_sequence, truncated_is_token
from .normalizer import LossNormalizer
from .ratio import sequence_log_ratio, token_log_ratio
from .surrogates import (
    MAX_LOG_RATIO,
    Surrogate,
    cispo_surrogate,
    dppo_surrogate,
    gmpo_surrogate,
    ppo_clip_surrogate,
    reinforce_surrogate,
    sapo_surrogate,
)

__all__ = ["policy_loss"]


# ---------------------------------------------------------------------------------------------
# surrogate dispatch: each adapter only picks its options out of the config


def _ppo(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return ppo_clip_surrogate(log_ratio, adv, c.clip_low, c.clip_high, c.dual_clip)


def _cispo(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return cispo_surrogate(log_ratio, lp, adv, c.clip_low, c.clip_high)


def _sapo(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return sapo_surrogate(log_ratio, adv, c.sapo_tau_pos, c.sapo_tau_neg)


def _gmpo(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return gmpo_surrogate(log_ratio, adv, valid, seg, c.clip_low, c.clip_high)


def _reinforce(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return reinforce_surrogate(log_ratio, adv)


def _dppo(c, log_ratio, lp, old, adv, valid, seg) -> Surrogate:
    return dppo_surrogate(log_ratio, lp, old, adv, c.clip_low, c.clip_high, c.dppo_ratio_cap)


_SURROGATES = {
    "ppo_clip": _ppo,
    "cispo": _cispo,
    "sapo": _sapo,
    "gmpo": _gmpo,
    "reinforce": _reinforce,
    "dppo": _dppo,
}


# ---------------------------------------------------------------------------------------------
# input checks and flattening


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(s) for s in t.shape)}]"


def _check_float(name: str, t: object, shape: torch.Size) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (logprobs'), got {_shape(t)}")
    return t


def _segments(logprobs: torch.Tensor, document_ids: torch.Tensor | None) -> Segments:
    """Document of each flattened token: the row of ``[B, T]``, or ``document_ids``."""
    return document_segments(logprobs, document_ids, "logprobs")


def _token_advantages(advantages: object, logprobs: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Per-token ``[N]`` advantages from per-token or per-sequence input."""
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {advantages!r}")
    if advantages.shape == logprobs.shape:
        return advantages.reshape(-1)
    if advantages.dim() == 1 and advantages.shape[0] >= seg.size:
        # one value per sequence: [B] for [B, T] input, [num_documents] for packed input
        if logprobs.dim() == 2 and advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages must have shape {list(logprobs.shape)} (per token) or "
                f"[{logprobs.shape[0]}] (per sequence), got {_shape(advantages)}"
            )
        slot = seg.ids.clamp(min=0)  # [N]; padding reads document 0 and is masked later
        return advantages[slot] if advantages.numel() else advantages.new_zeros(slot.shape)
    raise ValueError(
        f"advantages must have logprobs' shape {list(logprobs.shape)} (per token) or "
        f"[num_sequences] with num_sequences >= {seg.size} (per sequence), "
        f"got {_shape(advantages)}"
    )


def _norm_length(config: PolicyLossConfig, logprobs: torch.Tensor) -> float | None:
    if config.aggregation != "seq_mean_token_sum_norm":
        return None
    if config.norm_length is not None:
        return float(config.norm_length)
    if logprobs.dim() == 2:
        return float(logprobs.shape[1])
    raise ValueError(
        "norm_length must be set in PolicyLossConfig for aggregation='seq_mean_token_sum_norm' "
        "with a packed [N] input (there is no row length to default to)"
    )


# ---------------------------------------------------------------------------------------------
# metrics helpers (all detached, no host syncs)


def _wmean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.where(w > 0, x, 0.0) * w).sum().detach()


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, fn, empty: float) -> torch.Tensor:
    sentinel = float("inf") if fn is torch.amin else float("-inf")
    filled = torch.where(valid, x.detach(), sentinel)  # [N]
    v = fn(torch.cat([filled, filled.new_full((1,), sentinel)]))
    return torch.where(valid.any(), v, torch.full_like(v, empty))


# ---------------------------------------------------------------------------------------------


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    document_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL policy-gradient loss from per-token log-probs; returns ``(loss, metrics)``.

    Per valid token (``mask`` true and not padding)::

        L_t = w_t^mis · surrogate_t + kl_coef · KL_t(π_θ ‖ π_ref) − entropy_coef · H_t
        loss = Σ_t a_t · L_t                 (a_t: the aggregation weights)

    The ratio is per token or per document (GSPO) as ``config.ratio_level`` says; per-document
    statistics are segment sums over ``document_ids`` (``-1`` = padding, never a document).
    With ``normalizer`` (see :func:`loss_normalizer`) the aggregation uses the step's global
    counts, so the micro-batch losses *sum* to the loss of the whole step.

    Args:
        logprobs: ``[N]`` or ``[B, T]`` log π_θ of the sampled tokens, differentiable.
        old_logprobs: same shape, log π_old (behaviour policy at rollout time); no gradient.
        advantages: same shape (per token), or ``[num_sequences]`` (per sequence: ``[B]`` for
            ``[B, T]`` input, one per document id for packed input).
        mask: bool, same shape; tokens that count.
        config: a :class:`PolicyLossConfig`.
        document_ids: ``[N]`` / ``[B, T]`` int64 in ``[0, num_docs)``, ``-1`` for padding.
            Required for ``[N]`` input; default for ``[B, T]``: each row is one sequence.
        ref_logprobs: log π_ref, required when ``config.kl_coef > 0``.
        rollout_logprobs: log π_rollout from the inference engine; required by the mismatch
            corrections, and enables the mismatch metrics when given.
        entropy: per-token entropy, required when ``config.entropy_coef != 0``.
        normalizer: global counts for the step; default: this call's own counts.

    Returns:
        ``loss``: 0-dim fp32 (or the inputs' float dtype) tensor. ``metrics``: dict of detached
        0-dim tensors. Means (``pg_loss``, ``clip_frac_*``, ``ratio_mean``, ``approx_kl``,
        ``kl_ref``, ``entropy``, ``mismatch_kl``, ``is_weight_mean``, ``is_masked_frac``) are
        weighted like the loss and add up over micro-batches; ``ratio_min/max`` and
        ``is_weight_min/max`` are local extremes; ``num_tokens`` / ``num_sequences`` are local
        counts.

    >>> cfg = PolicyLossConfig()
    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, m = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), config=cfg)
    >>> loss
    tensor(-1., grad_fn=<SumBackward0>)
    """  # noqa: E501
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if not isinstance(logprobs, torch.Tensor) or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating-point tensor, got {logprobs!r}")
    if logprobs.dim() not in (1, 2):
        raise ValueError(f"logprobs must have shape [N] or [B, T], got {_shape(logprobs)}")
    shape = logprobs.shape
    _check_float("old_logprobs", old_logprobs, shape)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != shape:
        got = _shape(mask) + f" {mask.dtype}" if isinstance(mask, torch.Tensor) else repr(mask)
        raise ValueError(f"mask must be a bool tensor of shape {list(shape)}, got {got}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when config.kl_coef > 0")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy is required when config.entropy_coef != 0")
    if config.uses_rollout and rollout_logprobs is None:
        raise ValueError(
            "rollout_logprobs is required when a mismatch correction is on "
            "(mismatch_is / mismatch_token_mask / mismatch_seq_mask)"
        )
    for name, t in (
        ("ref_logprobs", ref_logprobs),
        ("rollout_logprobs", rollout_logprobs),
        ("entropy", entropy),
    ):
        if t is not None:
            _check_float(name, t, shape)
    seg = _segments(logprobs, document_ids)
    adv = _token_advantages(advantages, logprobs, seg).detach()  # [N]
    norm_length = _norm_length(config, logprobs)

    # Sanitize: invalid tokens may hold -inf/NaN log-probs; they must not reach exp() or the
    # backward pass (0 · NaN = NaN), so they are replaced by 0 before any arithmetic.
    valid = mask.reshape(-1) & (seg.ids >= 0)  # [N] bool
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 in -> fp32 math

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, t.reshape(-1).to(dtype), 0.0)

    lp, old, adv = clean(logprobs), clean(old_logprobs).detach(), clean(adv)  # [N] each
    validf = valid.to(dtype)  # [N]

    # counts: per document (local; documents are never split) and global denominators
    n_doc = segment_sum(validf, seg)  # [D]
    tokens_in_doc = gather(n_doc, seg)  # [N]
    local_tokens = validf.sum()
    local_seqs = (n_doc > 0).sum().to(dtype)
    if normalizer is None:
        num_tokens, num_seqs = local_tokens, local_seqs
    else:
        num_tokens = torch.as_tensor(normalizer.num_tokens, dtype=dtype, device=lp.device)
        num_seqs = torch.as_tensor(normalizer.num_sequences, dtype=dtype, device=lp.device)
    weights = aggregation_weights(
        config.aggregation, validf, tokens_in_doc, num_tokens, num_seqs, norm_length
    )  # [N]
    mweights = metric_weights(config.aggregation, validf, tokens_in_doc, num_tokens, num_seqs)

    # ratio and surrogate
    token_lr = token_log_ratio(lp, old)  # [N]
    if config.ratio_level == "sequence":
        log_ratio = sequence_log_ratio(lp, old, valid, seg)  # [N], GSPO token form
    else:
        log_ratio = token_lr
    sur = _SURROGATES[config.surrogate](config, log_ratio, lp, old, adv, valid, seg)
    per_token = sur.loss  # [N]

    metrics: dict[str, torch.Tensor] = {}

    # band masks on the current ratio π_θ/π_old (prime-rl): masked tokens keep their place in
    # the denominators, like the mismatch masks below
    if config.ratio_token_mask is not None or config.ratio_seq_mask is not None:
        keep_ratio = torch.ones_like(lp)  # [N]
        if config.ratio_token_mask is not None:
            keep_ratio = keep_ratio * token_band_mask(token_lr, *config.ratio_token_mask)
        if config.ratio_seq_mask is not None:
            lo, hi = config.ratio_seq_mask_range
            keep_ratio = keep_ratio * sequence_mask(
                token_lr, valid, seg, config.ratio_seq_mask, lo, hi
            )
        per_token = per_token * keep_ratio
        metrics["ratio_masked_frac"] = _wmean(1.0 - keep_ratio, mweights)

    # train/inference mismatch correction
    if rollout_logprobs is not None:
        log_rho = old - clean(rollout_logprobs).detach()  # [N], log π_old/π_rollout
        # mismatch_kl: KL(π_rollout ‖ π_old) from rollout samples, k3 with ρ = π_old/π_rollout
        is_weight = torch.ones_like(lp)  # [N]
        if config.mismatch_is == "token":
            is_weight = truncated_is_token(log_rho, config.mismatch_is_cap)
        elif config.mismatch_is == "sequence":
            is_weight = truncated_is_sequence(log_rho, valid, seg, config.mismatch_is_cap)
        keep = torch.ones_like(lp)  # [N]
        if config.mismatch_token_mask is not None:
            keep = keep * token_band_mask(log_rho, *config.mismatch_token_mask)
        if config.mismatch_seq_mask is not None:
            lo, hi = config.mismatch_seq_mask_range
            keep = keep * sequence_mask(log_rho, valid, seg, config.mismatch_seq_mask, lo, hi)
        per_token = per_token * (is_weight * keep)
        metrics["mismatch_kl"] = _wmean(torch.expm1(log_rho) - log_rho, mweights)
        metrics["is_weight_mean"] = _wmean(is_weight, mweights)
        metrics["is_weight_min"] = _masked_extreme(is_weight, valid, torch.amin, 1.0)
        metrics["is_weight_max"] = _masked_extreme(is_weight, valid, torch.amax, 1.0)
        metrics["is_masked_frac"] = _wmean(1.0 - keep, mweights)

    pg_part = per_token
    total = per_token
    if ref_logprobs is not None:
        kl = kl_penalty(
            lp,
            clean(ref_logprobs),
            config.kl_estimator,
            config.kl_log_ratio_clamp,
            config.kl_value_clamp,
        )  # [N]
        metrics["kl_ref"] = _wmean(kl, mweights)
        if config.kl_coef > 0:
            total = total + config.kl_coef * kl
    if entropy is not None:
        ent = clean(entropy)  # [N]
        metrics["entropy"] = _wmean(ent, mweights)
        if config.entropy_coef != 0:
            total = total - config.entropy_coef * ent

    loss = (torch.where(valid, total, 0.0) * weights).sum()

    ratio = log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [N]
    metrics["loss"] = loss.detach()
    metrics["pg_loss"] = (torch.where(valid, pg_part, 0.0) * weights).sum().detach()
    metrics["clip_frac_low"] = _wmean(sur.clipped_low.to(dtype), mweights)
    metrics["clip_frac_high"] = _wmean(sur.clipped_high.to(dtype), mweights)
    if sur.clipped_dual is not None:
        metrics["clip_frac_dual"] = _wmean(sur.clipped_dual.to(dtype), mweights)
    metrics["ratio_mean"] = _wmean(ratio, mweights)
    metrics["ratio_min"] = _masked_extreme(ratio, valid, torch.amin, 1.0)
    metrics["ratio_max"] = _masked_extreme(ratio, valid, torch.amax, 1.0)
    # KL(π_old ‖ π_θ) from samples of π_old, k3 with r = π_θ/π_old (Schulman 2020)
    metrics["approx_kl"] = _wmean(kl_k3(old, lp.detach(), MAX_LOG_RATIO), mweights)
    metrics["num_tokens"] = local_tokens.detach()
    metrics["num_sequences"] = local_seqs.detach()
    return loss, metrics
