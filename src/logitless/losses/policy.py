"""``policy_loss``: one entry point composing ratio, surrogate, corrections, KL, entropy.

The contract is checked once (:func:`~logitless.losses.checks.check_policy_loss`); the
per-document statistics come from :mod:`.stats`, the metrics helpers from :mod:`.metrics`.
"""

from __future__ import annotations

import torch

from ._segments import gather
from .aggregation import aggregation_weights, metric_weights
from .checks import LossCall, check_policy_loss, clean
from .config import PolicyLossConfig
from .kl import importance_weighted_kl, kl_k3, kl_penalty
from .metrics import extreme, finish_metrics, weighted_mean
from .mismatch import sequence_keep, token_band_mask, truncated_is_from_total, truncated_is_token
from .normalizer import LossNormalizer
from .ratio import sequence_log_ratio_from_mean, sequence_mean_log_ratio, token_log_ratio
from .stats import DocumentStats, compute_document_stats
from .surrogates import MAX_LOG_RATIO, SURROGATES

__all__ = ["policy_loss"]


def _keep_mask(like, token_log, token_band, doc_log, seq_mode, seq_range, n_doc, seg):
    """``[N]`` 0/1 weights: a token is kept when ``token_log`` ``[N]`` lies in ``token_band``
    (if set) and its document's ``doc_log()`` ``[D]`` passes ``seq_mode`` within ``seq_range``
    (if set; ``doc_log`` is only called then)."""
    keep = torch.ones_like(like)
    if token_band is not None:
        keep = keep * token_band_mask(token_log, *token_band)
    if seq_mode is not None:
        lo, hi = seq_range
        keep = keep * gather(sequence_keep(doc_log(), n_doc, seq_mode, lo, hi), seg)
    return keep


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    document_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    context_group: object | None = None,
    document_stats: DocumentStats | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL policy-gradient loss from per-token log-probs; returns ``(loss, metrics)``.

    Per valid token (``mask`` true and not padding)::

        L_t = w_t^mis · surrogate_t + kl_coef · KL_t(π_θ ‖ π_ref) − entropy_coef · H_t
        loss = Σ_t a_t · L_t                 (a_t: the aggregation weights)

    The ratio is per token or per document (GSPO) as ``config.ratio_level`` says; per-document
    statistics are segment sums over ``document_ids`` (``-1`` = padding, never a document).
    With ``normalizer`` (see :func:`loss_normalizer`) the aggregation uses the step's global
    counts, so the micro-batch losses *sum* to the loss of the whole step.

    **Context parallelism.** With ``context_group``, each rank passes its shard of one packed
    stream (:func:`logitless.parallel.context_parallel_split`) with *global* document ids (or
    a ``[B, T]`` shard split along ``T``, every rank holding all ``B`` rows) and the same
    per-sequence advantages. Every per-document statistic (token counts, GSPO/GMPO ratios,
    sequence masks, sequence IS weights) is summed over the group, and the call's token and
    sequence counts too, so each rank's ``loss`` is its *share*: the shares sum to the loss of
    the whole stream in one process, and each rank's ``backward()`` gives its tokens exactly
    the single-process gradient. Every per-document statistic is a stop-gradient constant, so
    backward needs no communication. This is a **collective call**: every rank of the group
    must make it, with the same config and optional arguments, whatever its data (no tokens,
    everything masked). It issues, in this order, on the group: ``all_reduce`` MAX of 5 int64
    (agreement: failure flag, document count, call fingerprint, advantage count), ``all_reduce``
    SUM of the ``k · D`` per-document float64 sums (skipped when ``document_stats`` is given),
    ``all_reduce`` SUM of the float64 mean metrics, ``all_reduce`` MAX of the float64 extreme
    metrics. Bad input on one rank raises ``ValueError`` on every rank instead of hanging.

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
        normalizer: global counts for the step; default: this call's own counts (over the
            context group, if any). Its ``loss_scale`` multiplies the returned loss.
        context_group: the context-parallel ``ProcessGroup`` (see above), or None.
        document_stats: per-document statistics from :func:`document_stats` for this same
            stream and config: used instead of computing (and communicating) them.

    Returns:
        ``loss``: 0-dim fp32 (or the inputs' float dtype) tensor, times
        ``normalizer.loss_scale``. ``metrics``: dict of detached 0-dim tensors, unscaled. Means
        (``loss``, ``pg_loss``, ``clip_frac_*``, ``ratio_mean``, ``approx_kl``, ``kl_ref``,
        ``entropy``, ``mismatch_kl``, ``is_weight_mean``, ``is_masked_frac``,
        ``ratio_masked_frac``) are weighted like the loss and add up over micro-batches;
        ``ratio_min/max`` and ``is_weight_min/max`` are extremes; ``num_tokens`` /
        ``num_sequences`` count the call's valid tokens and documents. With
        ``context_group`` every metric covers the whole group's stream (the same value on every
        rank, equal to the single-process metric; a document split across ranks counts once).
        With ``document_stats`` and no ``context_group``: means and extremes cover this rank's
        tokens only (means are its share of the group's), counts cover the group.

    >>> cfg = PolicyLossConfig()
    >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, m = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), config=cfg)
    >>> loss
    tensor(-1., grad_fn=<SumBackward0>)
    """  # noqa: E501
    call = check_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        config=config,
        document_ids=document_ids,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        entropy=entropy,
        normalizer=normalizer,
        context_group=context_group,
        document_stats=document_stats,
    )
    return compute_policy_loss(
        call,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        config=config,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        entropy=entropy,
        normalizer=normalizer,
        document_stats=document_stats,
    )


def compute_policy_loss(
    call: LossCall,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    document_stats: DocumentStats | None = None,
    reduce_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` of a call already checked by ``check_policy_loss`` (no checks
    here). ``reduce_metrics=False`` skips the metrics' collectives under context parallelism
    (for repeated evaluations whose metrics are discarded)."""
    seg = call.seg
    group = call.group if reduce_metrics else None
    grouped = call.group is not None
    valid, dtype = call.valid_and_dtype(logprobs, mask)
    lp = clean(logprobs, valid, dtype)  # [N]
    old = clean(old_logprobs, valid, dtype).detach()  # [N]
    adv = clean(call.token_advantages(advantages).detach(), valid, dtype)  # [N]
    validf = valid.to(dtype)  # [N]
    rollout = None if rollout_logprobs is None else clean(rollout_logprobs, valid, dtype)

    # per-document statistics (one all-reduce under context parallelism) and counts
    stats = document_stats
    if stats is None:
        stats = compute_document_stats(
            call, config, logprobs, old_logprobs, advantages, mask, rollout_logprobs
        )

    def per_doc(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)  # stats may come from a call in another dtype

    n_doc = per_doc(stats.tokens)  # [D]
    tokens_in_doc = gather(n_doc, seg)  # [N]
    call_tokens = n_doc.sum()
    call_seqs = (n_doc > 0).sum().to(dtype)
    if normalizer is None:
        num_tokens, num_seqs = call_tokens, call_seqs
    else:
        num_tokens = torch.as_tensor(normalizer.num_tokens, dtype=dtype, device=lp.device)
        num_seqs = torch.as_tensor(normalizer.num_sequences, dtype=dtype, device=lp.device)
    weights = aggregation_weights(
        config.aggregation, validf, tokens_in_doc, num_tokens, num_seqs, call.norm_length
    )  # [N]
    mweights = metric_weights(config.aggregation, validf, tokens_in_doc, num_tokens, num_seqs)

    def doc_mean(total: torch.Tensor) -> torch.Tensor:
        return gather(per_doc(total) / n_doc.clamp(min=1.0), seg)  # [N]

    # ratio and surrogate
    token_lr = token_log_ratio(lp, old)  # [N]
    if config.ratio_level == "sequence":
        log_ratio = sequence_log_ratio_from_mean(lp, doc_mean(stats.log_ratio))  # GSPO token form
    else:
        log_ratio = token_lr
    gmpo_mean = doc_mean(stats.clipped_log_ratio) if config.surrogate == "gmpo" else None
    sur = SURROGATES[config.surrogate].run(config, log_ratio, lp, old, adv, gmpo_mean)
    per_token = sur.loss  # [N]

    metrics: dict[str, torch.Tensor] = {}

    # band masks on the current ratio π_θ/π_old (prime-rl): masked tokens keep their place in
    # the denominators, like the mismatch masks below
    if config.ratio_token_mask is not None or config.ratio_seq_mask is not None:
        keep_ratio = _keep_mask(
            lp,
            token_lr,
            config.ratio_token_mask,
            lambda: per_doc(stats.log_ratio),
            config.ratio_seq_mask,
            config.ratio_seq_mask_range,
            n_doc,
            seg,
        )  # [N]
        per_token = per_token * keep_ratio
        metrics["ratio_masked_frac"] = weighted_mean(1.0 - keep_ratio, mweights)

    # train/inference mismatch correction
    if rollout is not None:
        log_rho = old - rollout.detach()  # [N], log π_old/π_rollout
        # mismatch_kl: KL(π_rollout ‖ π_old) from rollout samples, k3 with ρ = π_old/π_rollout
        is_weight = torch.ones_like(lp)  # [N]
        if config.mismatch_is == "token":
            is_weight = truncated_is_token(
                log_rho, config.mismatch_is_cap, config.mismatch_is_floor
            )
        elif config.mismatch_is == "sequence":
            total_rho = per_doc(stats.log_rho)  # [D]
            weight = truncated_is_from_total(
                total_rho, config.mismatch_is_cap, config.mismatch_is_floor
            )  # [D]
            is_weight = gather(weight, seg)
        keep = _keep_mask(
            lp,
            log_rho,
            config.mismatch_token_mask,
            lambda: per_doc(stats.log_rho),
            config.mismatch_seq_mask,
            config.mismatch_seq_mask_range,
            n_doc,
            seg,
        )  # [N]
        per_token = per_token * (is_weight * keep)
        # clamped like approx_kl: a rollout log-prob of -inf (probability 0) keeps it finite
        lr = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        metrics["mismatch_kl"] = weighted_mean(torch.expm1(lr) - lr, mweights)
        metrics["is_weight_mean"] = weighted_mean(is_weight, mweights)
        metrics["is_weight_min"] = extreme(is_weight, valid, largest=False)
        metrics["is_weight_max"] = extreme(is_weight, valid, largest=True)
        metrics["is_masked_frac"] = weighted_mean(1.0 - keep, mweights)

    pg_part = per_token
    total = per_token
    if ref_logprobs is not None:
        kl = kl_penalty(
            lp,
            clean(ref_logprobs, valid, dtype),
            config.kl_estimator,
            config.kl_log_ratio_clamp,
            config.kl_value_clamp,
        )  # [N]
        if config.kl_importance_weight:
            if config.ratio_level == "sequence":  # s_d, differentiable in all its tokens
                kl_log_ratio = sequence_mean_log_ratio(
                    token_lr, valid, seg, per_doc(stats.log_ratio), n_doc
                )
            else:
                kl_log_ratio = token_lr
            kl = importance_weighted_kl(kl, kl_log_ratio)
        metrics["kl_ref"] = weighted_mean(kl, mweights)
        if config.kl_coef > 0:
            total = total + config.kl_coef * kl
    # the entropy term is aggregated like the loss unless entropy_aggregation says otherwise
    ent_weights, ent_mweights = weights, mweights
    if config.entropy_aggregation is not None:
        counts = (validf, tokens_in_doc, num_tokens, num_seqs)
        ent_weights = aggregation_weights(config.entropy_aggregation, *counts, call.norm_length)
        ent_mweights = metric_weights(config.entropy_aggregation, *counts)
    ent_part = None
    if entropy is not None:
        ent = clean(entropy, valid, dtype)  # [N]
        metrics["entropy"] = weighted_mean(ent, ent_mweights)
        if config.entropy_coef != 0 and config.entropy_aggregation is None:
            total = total - config.entropy_coef * ent
        elif config.entropy_coef != 0:
            ent_part = -config.entropy_coef * ent

    loss = (torch.where(valid, total, 0.0) * weights).sum()
    if ent_part is not None:
        loss = loss + (torch.where(valid, ent_part, 0.0) * ent_weights).sum()

    ratio = log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [N]
    metrics["loss"] = loss.detach()
    metrics["pg_loss"] = (torch.where(valid, pg_part, 0.0) * weights).sum().detach()
    metrics["clip_frac_low"] = weighted_mean(sur.clipped_low.to(dtype), mweights)
    metrics["clip_frac_high"] = weighted_mean(sur.clipped_high.to(dtype), mweights)
    if sur.clipped_dual is not None:
        metrics["clip_frac_dual"] = weighted_mean(sur.clipped_dual.to(dtype), mweights)
    metrics["ratio_mean"] = weighted_mean(ratio, mweights)
    metrics["ratio_min"] = extreme(ratio, valid, largest=False)
    metrics["ratio_max"] = extreme(ratio, valid, largest=True)
    # KL(π_old ‖ π_θ) from samples of π_old, k3 with r = π_θ/π_old (Schulman 2020)
    metrics["approx_kl"] = weighted_mean(kl_k3(old, lp.detach(), MAX_LOG_RATIO), mweights)
    metrics["num_tokens"] = call_tokens.detach()
    metrics["num_sequences"] = call_seqs.detach()
    finish_metrics(metrics, group, any_valid=call_tokens > 0 if grouped else valid.any())

    if normalizer is not None and normalizer.loss_scale != 1.0:
        loss = loss * normalizer.loss_scale
    return loss, metrics
