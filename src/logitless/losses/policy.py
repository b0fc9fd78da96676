"""``policy_loss``: one entry point composing ratio, surrogate, corrections, KL, entropy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _context
from ._segments import Segments, document_segments, gather, segment_sum
from .aggregation import aggregation_weights, metric_weights
from .config import PolicyLossConfig
from .kl import importance_weighted_kl, kl_k3, kl_penalty
from .mismatch import sequence_keep, token_band_mask, truncated_is_from_total, truncated_is_token
from .normalizer import LossNormalizer
from .ratio import sequence_log_ratio_from_mean, sequence_mean_log_ratio, token_log_ratio
from .surrogates import (
    MAX_LOG_RATIO,
    Surrogate,
    cispo_surrogate,
    dppo_surrogate,
    gmpo_clipped_log_ratio,
    gmpo_from_mean,
    ppo_clip_surrogate,
    reinforce_surrogate,
    sapo_surrogate,
)

__all__ = ["DocumentStats", "document_stats", "policy_loss"]


# ---------------------------------------------------------------------------------------------
# surrogate dispatch: each adapter only picks its options out of the config. ``gmpo_mean`` is
# each token's document mean of GMPO's clipped log-ratio (None for the other surrogates).


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


class _Call(NamedTuple):
    """What the local checks of one call found."""

    seg: Segments  # local document ids; size = 1 + the largest local id
    adv_len: int | None  # number of per-sequence advantages; None: per-token advantages
    norm_length: float | None


def _check_advantages(advantages: object, logprobs: torch.Tensor) -> int | None:
    """Per-token (None) or per-sequence (their number) advantages; the count is checked later."""
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {advantages!r}")
    if advantages.shape == logprobs.shape:
        return None
    if advantages.dim() == 1:
        # one value per sequence: [B] for [B, T] input, [num_documents] for packed input
        if logprobs.dim() == 2 and advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages must have shape {list(logprobs.shape)} (per token) or "
                f"[{logprobs.shape[0]}] (per sequence), got {_shape(advantages)}"
            )
        return advantages.shape[0]
    raise ValueError(
        f"advantages must have logprobs' shape {list(logprobs.shape)} (per token) or "
        f"[num_sequences] (per sequence), got {_shape(advantages)}"
    )


def _check_advantage_count(
    advantages: torch.Tensor, own: int | None, smallest: int | None, size: int, grouped: bool
) -> None:
    """Per-sequence advantages must cover every document id (of the whole group)."""
    if smallest is None or smallest >= size:
        return
    where = " over the context group" if grouped else ""
    if own is not None and own < size:
        raise ValueError(
            f"advantages must have logprobs' shape (per token) or [num_sequences] with "
            f"num_sequences >= {size} (1 + the largest document id{where}) (per sequence), "
            f"got {_shape(advantages)}"
        )
    raise ValueError(
        f"advantages: another rank of the context group passed {smallest} per-sequence "
        f"advantages, fewer than the {size} documents of the group (1 + the largest document "
        "id); every rank must pass the advantages of every document"
    )


def _token_advantages(advantages: torch.Tensor, adv_len: int | None, seg: Segments):
    """Per-token ``[N]`` advantages from per-token or (checked) per-sequence input."""
    if adv_len is None:
        return advantages.reshape(-1)
    slot = seg.ids.clamp(min=0)  # [N]; padding reads document 0 and is masked later
    return advantages[slot] if advantages.numel() else advantages.new_zeros(slot.shape)


def _norm_length(config: PolicyLossConfig, logprobs: torch.Tensor, grouped: bool) -> float | None:
    if "seq_mean_token_sum_norm" not in (config.aggregation, config.entropy_aggregation):
        return None
    if config.norm_length is not None:
        return float(config.norm_length)
    if logprobs.dim() == 2 and not grouped:
        return float(logprobs.shape[1])
    what = (
        "a [B, T] shard under context parallelism (its row length is not the sequence length)"
        if grouped
        else "a packed [N] input (there is no row length to default to)"
    )
    raise ValueError(
        "norm_length must be set in PolicyLossConfig for aggregation='seq_mean_token_sum_norm' "
        f"(or entropy_aggregation) with {what}"
    )


def _check_inputs(
    logprobs: object,
    old_logprobs: object,
    advantages: object,
    mask: object,
    config: object,
    document_ids: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    grouped: bool,
    for_stats: bool = False,
) -> _Call:
    """Every local check of a call (no collective); ``ValueError`` on bad input."""
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
    if grouped and config.kl_importance_weight and config.ratio_level == "sequence":
        raise ValueError(
            "kl_importance_weight=True with ratio_level='sequence' is not supported with a "
            "context_group: the gradient of a document's ratio couples the KL of tokens on "
            "other ranks"
        )
    if not for_stats:
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
    seg = document_segments(logprobs, document_ids, "logprobs")
    adv_len = _check_advantages(advantages, logprobs)
    return _Call(seg, adv_len, _norm_length(config, logprobs, grouped))


# ---------------------------------------------------------------------------------------------
# per-document statistics (summed over the context-parallel group)


@dataclass(frozen=True)
class DocumentStats:
    """Per-document sums of one call's token stream, over its context-parallel group.

    Everything ``policy_loss`` needs to know about whole documents, as ``[size]`` tensors in
    the loss's compute dtype. Every entry is a stop-gradient statistic. Made by
    :func:`document_stats`; pass it to ``policy_loss(..., document_stats=...)`` to evaluate the
    loss on the same stream again (e.g. chunk by chunk) without communicating.

    size: ``D``, the length of per-document buffers: 1 + the largest document id of the group.
    tokens: valid tokens (mask true, not padding) of each document.
    log_ratio: ``Σ_t (log π_θ − log π_old)`` over each document's valid tokens (GSPO ratio,
        ``ratio_seq_mask``), or None when the config needs none.
    clipped_log_ratio: ``Σ_t ĉ_t`` (GMPO), or None.
    log_rho: ``Σ_t log π_old/π_rollout`` (sequence truncated IS, ``mismatch_seq_mask``), or None.
    key: fingerprint of the config and input layout it was computed for (checked on use).
    """

    size: int
    tokens: torch.Tensor
    log_ratio: torch.Tensor | None
    clipped_log_ratio: torch.Tensor | None
    log_rho: torch.Tensor | None
    key: int


def _stats_key(config: PolicyLossConfig, logprobs: object, ids: object, rollout: object) -> int:
    dims = rows = None
    if isinstance(logprobs, torch.Tensor):
        dims = logprobs.dim()
        rows = logprobs.shape[0] if dims == 2 and ids is None else None  # rows are documents
    return _context.signature(config, dims, rows, rollout is None)


def _needs(config: PolicyLossConfig, rollout_given: bool) -> tuple[bool, bool, bool]:
    """Which per-document sums ``config`` needs: (log_ratio, clipped_log_ratio, log_rho)."""
    return (
        config.ratio_level == "sequence" or config.ratio_seq_mask is not None,
        config.surrogate == "gmpo",
        rollout_given
        and (config.mismatch_is == "sequence" or config.mismatch_seq_mask is not None),
    )


def _compute_stats(config, lp, old, adv, valid, rollout, seg, group, key) -> DocumentStats:
    """Segment sums of this rank's tokens, summed over ``group`` (one all-reduce) if given."""
    need_lr, need_gmpo, need_rho = _needs(config, rollout is not None)
    token_lr = (lp - old).detach()  # [N]
    columns = {"tokens": valid.to(lp.dtype)}  # each [N]
    if need_lr:
        columns["log_ratio"] = torch.where(valid, token_lr, 0.0)
    if need_gmpo:
        c = gmpo_clipped_log_ratio(token_lr, adv, config.clip_low, config.clip_high)
        columns["clipped_log_ratio"] = torch.where(valid, c, 0.0)
    if need_rho:
        columns["log_rho"] = torch.where(valid, old - rollout.detach(), 0.0)
    sums = {k: segment_sum(v, seg) for k, v in columns.items()}  # each [size]
    if group is not None:
        flat = _context.all_reduce(torch.cat(list(sums.values())), group, "sum")
        sums = dict(zip(sums, flat.split(seg.size), strict=True))
    return DocumentStats(
        seg.size,
        sums["tokens"],
        sums.get("log_ratio"),
        sums.get("clipped_log_ratio"),
        sums.get("log_rho"),
        key,
    )


def _check_stats(stats: object, key: int, seg: Segments) -> None:
    if not isinstance(stats, DocumentStats):
        raise ValueError(f"document_stats must be a DocumentStats, got {type(stats).__name__}")
    if stats.key != key:
        raise ValueError(
            "document_stats were computed for another config or input layout (a different "
            "PolicyLossConfig, [N] vs [B, T] input, or rollout_logprobs given or not); compute "
            "them with document_stats(...) for this call's config and inputs"
        )
    if seg.size > stats.size:
        raise ValueError(
            f"document_stats cover {stats.size} documents but document_ids go up to "
            f"{seg.size - 1}; compute them on the same stream"
        )


def _agree(group, logprobs, error, what, call, sig) -> tuple[int, int | None]:
    """Collective 1: (largest size, smallest per-sequence advantage count) over the group."""
    device = logprobs.device if isinstance(logprobs, torch.Tensor) else torch.device("cpu")
    size = call.seg.size if call is not None else 0
    adv_len = call.adv_len if call is not None and call.adv_len is not None else None
    size, hi, lo, neg_adv = _context.agree(
        group,
        device,
        error,
        what,
        [size, sig, -sig, -(_context.UNBOUNDED if adv_len is None else adv_len)],
    )
    if hi != -lo:
        raise ValueError(
            f"{what}: the ranks of the context group made different calls (config, [N] vs [B, T] "
            "input or row count, or which of ref_logprobs / rollout_logprobs / entropy / "
            "normalizer / document_stats are given); every rank must make the same call on "
            "its own shard of the stream"
        )
    return size, None if -neg_adv == _context.UNBOUNDED else -neg_adv


def document_stats(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    document_ids: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    context_group: object | None = None,
) -> DocumentStats:
    """The per-document statistics of a :func:`policy_loss` call, computed once.

    Same arguments as :func:`policy_loss` (``ref_logprobs``, ``entropy`` and ``normalizer`` do
    not enter them). Pass the result as ``policy_loss(..., document_stats=stats)`` to evaluate
    the loss on the same stream several times (e.g. once per chunk of rows, with the other rows
    held fixed) without recomputing the document sums, and under context parallelism without
    any collective. Only ``log π_θ`` enters the stats (GSPO ratio, GMPO, ``ratio_seq_mask``),
    as a constant: the gradient of a later ``policy_loss`` is exact for the values passed here.

    With ``context_group`` this is a collective call over the group: two ``all_reduce`` calls
    (MAX of 5 int64, then SUM of ``k · D`` float64, ``k`` = 1 to 4 sums), whatever the rank's
    data.

    Returns:
        A :class:`DocumentStats`.
    """
    group = _context.check_group(context_group)
    error, call = None, None
    try:
        call = _check_inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            config,
            document_ids,
            None,
            rollout_logprobs,
            None,
            grouped=group is not None,
            for_stats=True,
        )
    except ValueError as e:
        if group is None:
            raise
        error = e
    key = _stats_key(config, logprobs, document_ids, rollout_logprobs)
    if group is None:
        size, smallest = call.seg.size, call.adv_len
    else:
        size, smallest = _agree(group, logprobs, error, "document_stats", call, key)
    _check_advantage_count(advantages, call.adv_len, smallest, size, group is not None)
    seg = Segments(call.seg.ids, size)
    valid, dtype = _valid_and_dtype(logprobs, mask, seg)
    lp, old = _clean(logprobs, valid, dtype), _clean(old_logprobs, valid, dtype)
    adv = _clean(_token_advantages(advantages, call.adv_len, seg).detach(), valid, dtype)
    rollout = None if rollout_logprobs is None else _clean(rollout_logprobs, valid, dtype)
    return _compute_stats(config, lp.detach(), old.detach(), adv, valid, rollout, seg, group, key)


def _valid_and_dtype(logprobs: torch.Tensor, mask: torch.Tensor, seg: Segments):
    valid = mask.reshape(-1) & (seg.ids >= 0)  # [N] bool
    return valid, torch.promote_types(logprobs.dtype, torch.float32)  # bf16 in -> fp32 math


def _clean(t: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Invalid tokens may hold -inf/NaN log-probs; they must not reach exp() or the backward
    pass (0 · NaN = NaN), so they are replaced by 0 before any arithmetic."""
    return torch.where(valid, t.reshape(-1).to(dtype), 0.0)


# ---------------------------------------------------------------------------------------------
# metrics helpers (all detached, no host syncs)

# reported min / max (kept apart: they reduce with MAX over a context group, not SUM)
_EXTREMES = {"ratio_min", "ratio_max", "is_weight_min", "is_weight_max"}
_COUNTS = {"num_tokens", "num_sequences"}


def _wmean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.where(w > 0, x, 0.0) * w).sum().detach()


def _extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or, negated, min) over valid tokens; -inf when there is none.  [N] -> []"""
    v = x.detach() if largest else -x.detach()
    filled = torch.where(valid, v, float("-inf"))  # [N]
    return torch.cat([filled, filled.new_full((1,), float("-inf"))]).amax()


# ---------------------------------------------------------------------------------------------


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
    config: PolicyLossConfig,
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
    stream (:func:`logitless.packing.context_parallel_split`) with *global* document ids (or
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
    group = _context.check_group(context_group)
    grouped = group is not None
    error, call = None, None
    key = 0
    try:
        call = _check_inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            config,
            document_ids,
            ref_logprobs,
            rollout_logprobs,
            entropy,
            grouped=grouped,
        )
        key = _stats_key(config, logprobs, document_ids, rollout_logprobs)
        if document_stats is not None:
            _check_stats(document_stats, key, call.seg)
        if normalizer is not None and not isinstance(normalizer, LossNormalizer):
            raise ValueError(
                f"normalizer must be a LossNormalizer or None, got {type(normalizer).__name__}"
            )
    except ValueError as e:
        if not grouped:
            raise
        error = e
    if grouped:
        sig = _context.signature(
            key,
            ref_logprobs is None,
            entropy is None,
            normalizer is None,
            document_stats is None,
        )
        size, smallest = _agree(group, logprobs, error, "policy_loss", call, sig)  # collective 1
    else:
        size, smallest = call.seg.size, call.adv_len
    if document_stats is not None:
        size = document_stats.size
    _check_advantage_count(advantages, call.adv_len, smallest, size, grouped)
    seg = Segments(call.seg.ids, size)
    valid, dtype = _valid_and_dtype(logprobs, mask, seg)
    adv = _token_advantages(advantages, call.adv_len, seg).detach()  # [N]
    lp = _clean(logprobs, valid, dtype)  # [N]
    old = _clean(old_logprobs, valid, dtype).detach()  # [N]
    adv = _clean(adv, valid, dtype)  # [N]
    validf = valid.to(dtype)  # [N]
    rollout = None if rollout_logprobs is None else _clean(rollout_logprobs, valid, dtype)

    # per-document statistics (collective 2 under context parallelism) and counts
    if document_stats is None:
        stats = _compute_stats(config, lp, old, adv, valid, rollout, seg, group, key)
    else:
        stats = document_stats

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
    sur = _SURROGATES[config.surrogate](config, log_ratio, lp, old, adv, gmpo_mean)
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
        metrics["ratio_masked_frac"] = _wmean(1.0 - keep_ratio, mweights)

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
        metrics["mismatch_kl"] = _wmean(torch.expm1(log_rho) - log_rho, mweights)
        metrics["is_weight_mean"] = _wmean(is_weight, mweights)
        metrics["is_weight_min"] = _extreme(is_weight, valid, largest=False)
        metrics["is_weight_max"] = _extreme(is_weight, valid, largest=True)
        metrics["is_masked_frac"] = _wmean(1.0 - keep, mweights)

    pg_part = per_token
    total = per_token
    if ref_logprobs is not None:
        kl = kl_penalty(
            lp,
            _clean(ref_logprobs, valid, dtype),
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
        metrics["kl_ref"] = _wmean(kl, mweights)
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
        ent = _clean(entropy, valid, dtype)  # [N]
        metrics["entropy"] = _wmean(ent, ent_mweights)
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
    metrics["clip_frac_low"] = _wmean(sur.clipped_low.to(dtype), mweights)
    metrics["clip_frac_high"] = _wmean(sur.clipped_high.to(dtype), mweights)
    if sur.clipped_dual is not None:
        metrics["clip_frac_dual"] = _wmean(sur.clipped_dual.to(dtype), mweights)
    metrics["ratio_mean"] = _wmean(ratio, mweights)
    metrics["ratio_min"] = _extreme(ratio, valid, largest=False)
    metrics["ratio_max"] = _extreme(ratio, valid, largest=True)
    # KL(π_old ‖ π_θ) from samples of π_old, k3 with r = π_θ/π_old (Schulman 2020)
    metrics["approx_kl"] = _wmean(kl_k3(old, lp.detach(), MAX_LOG_RATIO), mweights)
    metrics["num_tokens"] = call_tokens.detach()
    metrics["num_sequences"] = call_seqs.detach()
    _finish_metrics(metrics, group, any_valid=call_tokens > 0 if grouped else valid.any())

    if normalizer is not None and normalizer.loss_scale != 1.0:
        loss = loss * normalizer.loss_scale
    return loss, metrics


def _finish_metrics(metrics: dict[str, torch.Tensor], group, any_valid: torch.Tensor) -> None:
    """Sum the means and max the extremes over ``group`` (collectives 3 and 4), in place."""
    means = [k for k in metrics if k not in _EXTREMES and k not in _COUNTS]
    extremes = [k for k in metrics if k in _EXTREMES]
    if group is not None:
        summed = _context.all_reduce(torch.stack([metrics[k] for k in means]), group, "sum")
        maxed = _context.all_reduce(torch.stack([metrics[k] for k in extremes]), group, "max")
        metrics.update(zip(means, summed.unbind(), strict=True))
        metrics.update(zip(extremes, maxed.unbind(), strict=True))
    for k in extremes:  # stored as max(x) or max(-x) = -min(x); 1.0 when there is no token
        v = metrics[k] if k.endswith("_max") else -metrics[k]
        metrics[k] = torch.where(any_valid, v, torch.ones_like(v))
