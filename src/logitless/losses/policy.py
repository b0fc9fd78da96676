"""``policy_loss``: one entry point, and the short driver that composes a loss from its parts.

The contract is checked once (:func:`~logitless.losses.checks.check_policy_loss`); the
per-document statistics come from :mod:`.stats`; the surrogate is one of
:data:`~logitless.losses.surrogates.SURROGATES`; the other parts (ratio masks, mismatch
correction, KL, entropy) are the registered :data:`~logitless.losses.terms.TERMS`.
"""

from __future__ import annotations

import torch

from .call import DocumentStats, LossCall
from .checks import LossArgs, check_policy_loss
from .config import PolicyLossConfig
from .kl import kl_k3
from .metrics import extreme, finish_metrics, weighted_mean
from .normalizer import LossNormalizer
from .ratio import sequence_log_ratio_from_mean, sequence_mean_log_ratio, token_log_ratio
from .stats import compute_document_stats
from .surrogates import MAX_LOG_RATIO, SURROGATES, Surrogate
from .terms import TERMS
from .tokens import LossTokens

__all__ = ["policy_loss"]


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
    capturable: bool = False,
    divergence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL policy-gradient loss from per-token log-probs; returns ``(loss, metrics)``.

    Per valid token (``mask`` true and not padding)::

        L_t = w_t^mis · surrogate_t + kl_coef · KL_t(π_θ ‖ π_ref) − entropy_coef · H_t
              + distill_coef · D_t
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
        divergence: per-token divergence ``D_t`` from a teacher's next-token distribution
            (e.g. :func:`logitless.linear_divergence`), differentiable; required when
            ``config.distill_coef != 0``.
        normalizer: global counts for the step; default: this call's own counts (over the
            context group, if any). Its ``loss_scale`` multiplies the returned loss.
        context_group: the context-parallel ``ProcessGroup`` (see above), or None.
        document_stats: per-document statistics from :func:`document_stats` for this same
            stream and config: used instead of computing (and communicating) them.
        capturable: no host read and shapes that depend on the input shapes only (CUDA
            graphs, ``torch.compile(fullgraph=True)``): the value checks become device-side
            assertions, per-document buffers are sized from the shapes (one per per-sequence
            advantage, else one per token of the stream), and under context parallelism the
            ranks' agreement is not checked (docs/capturable.md).

    Returns:
        ``loss``: 0-dim fp32 (or the inputs' float dtype) tensor, times
        ``normalizer.loss_scale``. ``metrics``: dict of detached 0-dim tensors, unscaled. Means
        (``loss``, ``pg_loss``, ``clip_frac_*``, ``ratio_mean``, ``log_ratio_mean`` (the
        log-ratio the surrogate used: per token, or GSPO's document mean), ``approx_kl``,
        ``kl_ref``, ``entropy``, ``distill_divergence``, ``mismatch_kl``, ``is_weight_mean``,
        ``is_masked_frac``, ``ratio_masked_frac``, ``opsm_masked_frac``) are weighted like the
        loss and add up over micro-batches;
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
    args = LossArgs(
        logprobs, old_logprobs, advantages, mask, config, document_ids, ref_logprobs,
        rollout_logprobs, entropy, normalizer, document_stats, divergence,
    )  # fmt: skip
    call = check_policy_loss(args, context_group=context_group, capturable=capturable)
    return compute_policy_loss(call, logprobs, entropy, document_stats)


def _surrogate(t: LossTokens) -> tuple[Surrogate, torch.Tensor]:
    """The config's surrogate at these tokens, and the log-ratio it used (per token, or in
    GSPO's token form with each document's mean)."""
    c = t.config
    token_lr = token_log_ratio(t.lp, t.old)  # [N]
    if c.ratio_level == "sequence":
        log_ratio = sequence_log_ratio_from_mean(t.lp, t.doc_mean(t.stats.log_ratio))  # GSPO
    elif c.ratio_level == "sequence_mean":  # GSPO, differentiated through the mean
        doc_total = t.per_doc(t.stats.log_ratio)
        log_ratio = sequence_mean_log_ratio(
            token_lr, t.valid, t.call.seg, doc_total, t.n_doc, t.call.group
        )
    else:
        log_ratio = token_lr
    gmpo_mean = t.doc_mean(t.stats.clipped_log_ratio) if c.sums_clipped_log_ratio else None
    return SURROGATES[c.surrogate].run(c, log_ratio, t.lp, t.old, t.adv, gmpo_mean), log_ratio


def _surrogate_metrics(t: LossTokens, sur: Surrogate, log_ratio: torch.Tensor) -> dict:
    """Clip fractions, the ratio's mean and extremes, and the approximate KL to π_old."""
    dtype, mw = t.dtype, t.mweights
    ratio = log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # [N]
    out = {
        "clip_frac_low": weighted_mean(sur.clipped_low.to(dtype), mw),
        "clip_frac_high": weighted_mean(sur.clipped_high.to(dtype), mw),
    }
    if sur.clipped_dual is not None:
        out["clip_frac_dual"] = weighted_mean(sur.clipped_dual.to(dtype), mw)
    out["ratio_mean"] = weighted_mean(ratio, mw)
    out["log_ratio_mean"] = weighted_mean(log_ratio.detach(), mw)
    out["ratio_min"] = extreme(ratio, t.valid, largest=False)
    out["ratio_max"] = extreme(ratio, t.valid, largest=True)
    # KL(π_old ‖ π_θ) from samples of π_old, k3 with r = π_θ/π_old (Schulman 2020)
    out["approx_kl"] = weighted_mean(kl_k3(t.old, t.lp.detach(), MAX_LOG_RATIO), mw)
    return out


def compute_policy_loss(
    call: LossCall,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None = None,
    document_stats: DocumentStats | None = None,
    reduce_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` of a call already checked by ``check_policy_loss`` (no checks
    here), at ``logprobs`` (and ``entropy``). ``reduce_metrics=False`` skips the metrics'
    collectives under context parallelism (for repeated evaluations whose metrics are
    discarded).

    The surrogate gives the policy term; each registered term multiplies it (masks, IS
    weights) or adds a part of its own (KL, entropy); ``loss = Σ_t w_t · L_t``.
    """
    stats = document_stats
    if stats is None:
        stats = compute_document_stats(call, logprobs)
    t = LossTokens.of(call, logprobs, entropy, stats)
    sur, log_ratio = _surrogate(t)
    policy = sur.loss  # [N]
    metrics: dict[str, torch.Tensor] = {}
    total_parts, own_weights = [], []
    for term in TERMS.values():
        part = term(t)
        if part is None:
            continue
        metrics.update(part.metrics)
        if part.factor is not None:
            policy = policy * part.factor
        if part.addend is not None:
            (total_parts if part.weights is None else own_weights).append(part)
    total = policy
    for part in total_parts:
        total = total + part.addend
    loss = (torch.where(t.valid, total, 0.0) * t.weights).sum()
    for part in own_weights:
        loss = loss + (torch.where(t.valid, part.addend, 0.0) * part.weights).sum()

    metrics["loss"] = loss.detach()
    metrics["pg_loss"] = (torch.where(t.valid, policy, 0.0) * t.weights).sum().detach()
    metrics.update(_surrogate_metrics(t, sur, log_ratio))
    call_tokens = t.n_doc.sum()
    metrics["num_tokens"] = call_tokens.detach()
    metrics["num_sequences"] = (t.n_doc > 0).sum().to(t.dtype).detach()
    group = call.group if reduce_metrics else None
    any_valid = call_tokens > 0 if call.group is not None else t.valid.any()
    finish_metrics(metrics, group, any_valid=any_valid)
    if call.normalizer is not None and call.normalizer.loss_scale != 1.0:
        loss = loss * call.normalizer.loss_scale
    return loss, metrics
