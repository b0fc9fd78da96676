"""The loss contract, checked once: :func:`check_policy_loss`.

Every public entry point that evaluates a policy loss (:func:`~logitless.policy_loss`,
:func:`~logitless.losses.document_stats`, :func:`~logitless.fused_policy_loss`, the HF and
module forms) calls it once, before any work, and passes the :class:`LossCall` it returns to the
computation. Nothing here computes a loss: the checks are shape, dtype, value and
agreement checks, and under context parallelism one collective.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..contract import collectives
from ..contract.checks import check_flag, check_full_precision, fmt_shape
from ..contract.collectives import check_then_agree
from ._segments import (
    Segments,
    assert_segments,
    check_document_ids,
    id_counters,
    segments_from_counters,
)
from .call import DocumentStats, LossCall
from .config import PolicyLossConfig
from .normalizer import LossNormalizer

__all__ = ["check_config", "check_policy_loss"]


def check_config(config: object) -> PolicyLossConfig:
    """``config`` if it is a :class:`PolicyLossConfig`, else ``ValueError``."""
    if config is None:
        raise ValueError(
            "config= is required: pass config=logitless.PolicyLossConfig() for the defaults "
            "(PPO clip with ε = 0.2, token-mean aggregation, no KL, no entropy bonus), or set "
            "its fields (docs/losses.md lists the presets of GRPO, DAPO, GSPO, CISPO, ...)"
        )
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    return config


def _check_float(name: str, t: object, shape: torch.Size) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (logprobs'), got {fmt_shape(t)}")
    return t


def _check_advantages(advantages: object, logprobs: torch.Tensor, has_ids: bool) -> int | None:
    """Per-token (None) or per-sequence (their number) advantages; the count is checked later.

    One rule for every entry point: per-sequence advantages are one per *document*. Without
    ``document_ids`` the documents of a ``[B, T]`` input are its rows (``[B]``); with them,
    there is one advantage per document id (``[D]``, D = 1 + the largest id), whatever the
    input's shape.
    """
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {advantages!r}")
    if advantages.shape == logprobs.shape:
        return None
    if advantages.dim() == 1:
        if logprobs.dim() == 2 and not has_ids and advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages must have shape {list(logprobs.shape)} (per token) or "
                f"[{logprobs.shape[0]}] (one per row: without document_ids each row is one "
                f"sequence), got {fmt_shape(advantages)}"
            )
        return advantages.shape[0]
    what = "[num_documents] (one per document id)" if has_ids else "[B] (one per row)"
    raise ValueError(
        f"advantages must have logprobs' shape {list(logprobs.shape)} (per token) or "
        f"{what} (per sequence), got {fmt_shape(advantages)}"
    )


def _check_advantage_count(
    advantages: torch.Tensor, own: int | None, smallest: int | None, size: int, grouped: bool
) -> None:
    """Per-sequence advantages: exactly one per document (of the whole group). More would be
    silently ignored (the usual "forgot to slice the micro-batch" mistake), fewer unusable."""
    if own is None and smallest is None:
        return
    where = " over the context group" if grouped else ""
    if own is not None and own != size:
        raise ValueError(
            f"advantages: {own} per-sequence values for {size} documents (1 + the largest "
            f"document id{where}); pass exactly one per document (more usually means the "
            f"micro-batch's advantages were not sliced), or logprobs' shape (per token)"
        )
    if smallest is not None and smallest != size:
        raise ValueError(
            f"advantages: another rank of the context group passed {smallest} per-sequence "
            f"advantages for the {size} documents of the group (1 + the largest document "
            "id); every rank must pass the advantages of every document"
        )


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


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossConfig))


def stats_key(config: PolicyLossConfig, logprobs: object, ids: object, rollout: object) -> int:
    """Fingerprint of what document statistics depend on: config and input layout. The
    config enters as its field values: under ``torch.compile`` the fingerprint is a constant
    function's result, and torch 2.11's Dynamo cannot hand it a frozen dataclass."""
    dims = rows = None
    if isinstance(logprobs, torch.Tensor):
        dims = logprobs.dim()
        rows = logprobs.shape[0] if dims == 2 and ids is None else None  # rows are documents
    values = tuple(getattr(config, name) for name in _CONFIG_FIELDS)
    return collectives.signature(values, dims, rows, rollout is None)


class LossArgs(NamedTuple):
    """The tensors and objects of one :func:`~logitless.policy_loss` call, as its caller got
    them (unchecked): what :func:`check_policy_loss` checks. ``logprobs`` only lends its shape,
    dtype and device (the fused loss passes a placeholder)."""

    logprobs: object
    old_logprobs: object
    advantages: object
    mask: object
    config: object = None
    document_ids: object = None
    ref_logprobs: object = None
    rollout_logprobs: object = None
    entropy: object = None
    normalizer: object = None
    document_stats: object = None
    divergence: object = None


class _Local(NamedTuple):
    """What the local checks found: the segments, the per-sequence advantage count (None:
    per token), Dr.GRPO's length and the call's fingerprint."""

    seg: Segments
    adv_len: int | None
    norm_length: float | None
    key: int


def _check_tensors(a: LossArgs, grouped: bool, for_stats: bool) -> torch.Size:
    """Types, shapes, dtypes and what the config requires; returns the log-probs' shape."""
    config = check_config(a.config)
    lp = a.logprobs
    if not isinstance(lp, torch.Tensor) or not lp.is_floating_point():
        raise ValueError(f"logprobs must be a floating-point tensor, got {lp!r}")
    if lp.dim() not in (1, 2):
        raise ValueError(f"logprobs must have shape [N] or [B, T], got {fmt_shape(lp)}")
    shape = lp.shape
    _check_float("old_logprobs", a.old_logprobs, shape)
    check_full_precision(
        old_logprobs=a.old_logprobs,
        advantages=a.advantages,
        ref_logprobs=a.ref_logprobs,
        rollout_logprobs=a.rollout_logprobs,
    )
    m = a.mask
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.shape != shape:
        got = fmt_shape(m) + f" {m.dtype}" if isinstance(m, torch.Tensor) else repr(m)
        raise ValueError(f"mask must be a bool tensor of shape {list(shape)}, got {got}")
    if grouped and config.kl_importance_weight and config.ratio_level != "token":
        raise ValueError(
            f"kl_importance_weight=True with ratio_level={config.ratio_level!r} is not "
            "supported with a "
            "context_group: the gradient of a document's ratio couples the KL of tokens on "
            "other ranks"
        )
    if not for_stats and config.kl_coef > 0 and a.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when config.kl_coef > 0")
    if not for_stats and config.entropy_coef != 0 and a.entropy is None:
        raise ValueError("entropy is required when config.entropy_coef != 0")
    if not for_stats and config.distill_coef != 0 and a.divergence is None:
        raise ValueError(
            "divergence is required when config.distill_coef != 0 (fused_policy_loss computes "
            "it from teacher=)"
        )
    if config.uses_rollout and a.rollout_logprobs is None:
        raise ValueError(
            "rollout_logprobs is required when a mismatch correction is on "
            "(mismatch_is / mismatch_token_mask / mismatch_seq_mask)"
        )
    optional = {"ref_logprobs": a.ref_logprobs, "rollout_logprobs": a.rollout_logprobs}
    optional["entropy"] = a.entropy
    optional["divergence"] = a.divergence
    for name, t in optional.items():
        if t is not None:
            _check_float(name, t, shape)
    _check_devices(lp, old_logprobs=a.old_logprobs, advantages=a.advantages, mask=m, **optional)
    if a.document_ids is None and lp.dim() != 2:
        raise ValueError(
            f"document_ids is required for a packed [N] stream; logprobs has shape "
            f"{list(shape)} and document_ids is None"
        )
    _check_normalizer(a.normalizer)
    return shape


def _check_normalizer(normalizer: object) -> None:
    if normalizer is None:
        return
    if not isinstance(normalizer, LossNormalizer):
        raise ValueError(
            f"normalizer must be a LossNormalizer or None, got {type(normalizer).__name__}"
        )
    check_full_precision(
        **{
            "normalizer.num_tokens": normalizer.num_tokens,
            "normalizer.num_sequences": normalizer.num_sequences,
        }
    )


def _local_checks(a: LossArgs, group: object | None, for_stats: bool, capturable: bool) -> _Local:
    """Every check that needs no collective; ``ValueError`` on bad input (the value checks:
    device-side assertions when ``capturable``)."""
    grouped = group is not None
    _check_tensors(a, grouped, for_stats)
    adv_len = _check_advantages(a.advantages, a.logprobs, a.document_ids is not None)
    key = stats_key(a.config, a.logprobs, a.document_ids, a.rollout_logprobs)
    if a.document_stats is not None:
        _check_stats_key(a.document_stats, key)
    if capturable:
        seg = _assert_values(a, adv_len, _id_bound(a, adv_len, group))
    else:
        seg = _read_values(a, adv_len)
        if a.document_stats is not None:
            _check_stats_size(a.document_stats, seg)
    return _Local(seg, adv_len, _norm_length(a.config, a.logprobs, grouped), key)


# Log-probs that are all >= 0 with some above this are probabilities passed by mistake (a real
# batch has negative log-probs; engines' rounding noise stays within it).
_LOGPROB_TOLERANCE = 1e-3


def _check_devices(logprobs: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != logprobs.device:
            raise ValueError(
                f"{name} must be on logprobs' device {logprobs.device}, got {t.device}"
            )


def _logprob_counters(t: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """[NaN or +inf at a valid token, every valid value >= 0 with some above the tolerance]:
    two device-side counters of a log-prob tensor."""
    flat = t.reshape(-1)
    lowest = torch.where(valid, flat, float("inf")).amin() if flat.numel() else flat.sum()
    highest = torch.where(valid, flat, float("-inf")).amax() if flat.numel() else flat.sum()
    return [
        (valid & (flat.isnan() | (flat == float("inf")))).sum(),
        ((lowest >= 0) & (highest > _LOGPROB_TOLERANCE)).sum(),
    ]


def _advantage_counter(a: LossArgs, adv_len, valid, ids) -> torch.Tensor:
    """Non-finite advantages that reach the loss: at valid tokens (per token), or of the
    documents with a valid token (per sequence: a NaN reward of a sample the trainer masked
    out entirely is not an error)."""
    adv = a.advantages
    if adv_len is None:
        return (valid & ~adv.reshape(-1).isfinite()).sum()
    used = torch.zeros(adv_len + 1, dtype=torch.bool, device=adv.device)
    slot = torch.where(valid & (ids < adv_len), ids, adv_len)  # others: a spare slot
    used.scatter_(0, slot, True)
    return (used[:-1] & ~adv.isfinite()).sum()


def _normalizer_counters(normalizer, valid, ids) -> list[torch.Tensor]:
    """[this call's valid tokens, its documents with one, the normalizer's two counts]."""
    key = torch.where(valid, ids, -1)
    ordered = torch.sort(key, stable=True).values
    first = (ordered >= 0) & torch.cat(
        [ordered.new_ones(1, dtype=torch.bool), ordered[1:] != ordered[:-1]]
    )
    counts = (normalizer.num_tokens, normalizer.num_sequences)
    norm = [torch.as_tensor(c, dtype=torch.float64, device=ids.device) for c in counts]
    return [valid.sum(), first.sum(), *norm]


def _read_values(a: LossArgs, adv_len: int | None) -> Segments:
    """Every check on values, read on the host in one transfer (one sync); returns the
    segments.

    What is an error and what is the caller's data, for the tokens that count (mask true, not
    padding): a NaN or ``+inf`` in ``old_logprobs``, ``ref_logprobs`` or ``rollout_logprobs``
    is an error, and so is a tensor whose values are all ``>= 0`` with some above
    ``_LOGPROB_TOLERANCE`` (probabilities passed for log-probabilities); ``-inf`` is data (a
    token that policy gave probability 0), which the loss's ratio clamps keep finite, and so is
    a stray positive value (noise). A non-finite advantage that reaches the loss is an error.
    Normalizer counts must be finite, >= 0 and at least this call's own valid tokens and
    sequences (a smaller count would scale the loss up).
    """
    lp = a.logprobs
    rows = lp.shape[0] if lp.dim() == 2 else None
    if a.document_ids is None:
        ids = torch.arange(rows, device=lp.device).repeat_interleave(lp.shape[1])
        counters: list[torch.Tensor] = []
    else:
        ids = check_document_ids(lp, a.document_ids, "logprobs")
        counters = id_counters(ids)
    valid = a.mask.reshape(-1) & (ids >= 0)  # [N]
    named = {"old_logprobs": a.old_logprobs, "ref_logprobs": a.ref_logprobs}
    named["rollout_logprobs"] = a.rollout_logprobs
    named = {k: t for k, t in named.items() if t is not None}
    for t in named.values():
        counters += _logprob_counters(t, valid)
    counters.append(_advantage_counter(a, adv_len, valid, ids))
    if a.normalizer is not None:
        counters += _normalizer_counters(a.normalizer, valid, ids)
    values = torch.stack([c.double() for c in counters]).tolist()  # the one host sync
    seg = Segments(ids, rows)
    if a.document_ids is not None:
        seg = segments_from_counters(ids, values[:3], "logprobs")
        values = values[3:]
    for name in named:  # two counters each
        _raise_on_logprobs(name, *values[:2])
        values = values[2:]
    if values[0]:
        raise ValueError(
            f"advantages must be finite; {int(values[0])} value(s) used by this call are NaN "
            "or infinite (e.g. a group-normalized advantage of a group with a NaN reward)"
        )
    if a.normalizer is not None:
        _raise_on_normalizer(*values[1:])
    return seg


def _id_bound(a: LossArgs, adv_len: int | None, group: object | None) -> int:
    """The capturable mode's length of per-document buffers, from shapes only: the size of
    the given document statistics, else the number of per-sequence advantages, else the
    tokens of the whole stream (this shard's times the context group's size: the ranks'
    shards have one shape, as :func:`~logitless.parallel.context_parallel_split` makes
    them)."""
    if a.document_stats is not None:
        return a.document_stats.size
    if adv_len is not None:
        return adv_len
    ranks = 1 if group is None else torch.distributed.get_world_size(group)
    return a.logprobs.numel() * ranks


def _assert_values(a: LossArgs, adv_len: int | None, bound: int) -> Segments:
    """The capturable mode's :func:`_read_values`: the same checks as device-side assertions
    (a ``RuntimeError`` on CPU, a device-side assert on CUDA), with the messages' constant
    part; document ids are asserted below ``bound`` (:func:`_id_bound`), the length of the
    per-document buffers, instead of sizing them from the largest id."""
    lp = a.logprobs
    if a.document_ids is None:
        rows = lp.shape[0]
        seg = Segments(torch.arange(rows, device=lp.device).repeat_interleave(lp.shape[1]), rows)
    else:
        ids = check_document_ids(lp, a.document_ids, "logprobs")
        seg = assert_segments(ids, bound, "logprobs")
    valid = a.mask.reshape(-1) & (seg.ids >= 0)  # [N]
    named = {"old_logprobs": a.old_logprobs, "ref_logprobs": a.ref_logprobs}
    named["rollout_logprobs"] = a.rollout_logprobs
    for name, t in named.items():
        if t is not None:
            n_bad, probs = _logprob_counters(t, valid)
            torch._assert_async(n_bad == 0, _NOT_LOGPROBS.format(name=name))
            torch._assert_async(probs == 0, _LOOK_LIKE_PROBS.format(name=name))
    n_adv = _advantage_counter(a, adv_len, valid, seg.ids)
    torch._assert_async(n_adv == 0, _ADVANTAGES_NOT_FINITE)
    if a.normalizer is not None:
        tokens, seqs, n_tokens, n_seqs = _normalizer_counters(a.normalizer, valid, seg.ids)
        pairs = (("num_tokens", tokens, n_tokens), ("num_sequences", seqs, n_seqs))
        for what, mine, given in pairs:
            torch._assert_async(given.isfinite() & (given >= 0), _NORMALIZER_FINITE.format(what))
            torch._assert_async(given + 0.5 >= mine, _NORMALIZER_SMALL.format(what))
    return seg


_NOT_LOGPROBS = (
    "{name} must be log-probabilities: NaN or +inf at a token that counts (-inf, a "
    "probability of 0, is accepted)"
)
_LOOK_LIKE_PROBS = (
    "{name} look like probabilities, not log-probabilities: every value at the tokens that "
    f"count is >= 0 and some exceed {_LOGPROB_TOLERANCE}. Pass their log"
)
_ADVANTAGES_NOT_FINITE = (
    "advantages must be finite; a value used by this call is NaN or infinite (e.g. a "
    "group-normalized advantage of a group with a NaN reward)"
)
_NORMALIZER_FINITE = "normalizer.{} must be finite and >= 0"
_NORMALIZER_SMALL = (
    "normalizer.{} is smaller than this call's own count: the normalizer must count the whole "
    "step (every micro-batch and rank), else the loss is scaled up"
)


def _raise_on_logprobs(name: str, n_bad: float, looks_like_probs: float) -> None:
    if n_bad:
        raise ValueError(
            f"{name} must be log-probabilities: NaN or +inf at {int(n_bad)} token(s) that "
            "count (-inf, a probability of 0, is accepted)"
        )
    if looks_like_probs:
        raise ValueError(
            f"{name} look like probabilities, not log-probabilities: every value at the "
            f"tokens that count is >= 0 and some exceed {_LOGPROB_TOLERANCE}. Pass their log"
        )


def _raise_on_normalizer(tokens: float, seqs: float, n_tokens: float, n_seqs: float) -> None:
    for what, mine, given in (("num_tokens", tokens, n_tokens), ("num_sequences", seqs, n_seqs)):
        if not (given >= 0 and given < float("inf")):
            raise ValueError(f"normalizer.{what} must be finite and >= 0, got {given}")
        if given + 0.5 < mine:
            raise ValueError(
                f"normalizer.{what} = {given:g} is smaller than this call's own {mine:g}: "
                "the normalizer must count the whole step (every micro-batch and rank), "
                "else the loss is scaled up"
            )


def _check_stats_key(stats: object, key: int) -> None:
    if not isinstance(stats, DocumentStats):
        raise ValueError(f"document_stats must be a DocumentStats, got {type(stats).__name__}")
    if stats.key != key:
        raise ValueError(
            "document_stats were computed for another config or input layout (a different "
            "PolicyLossConfig, [N] vs [B, T] input, or rollout_logprobs given or not); compute "
            "them with document_stats(...) for this call's config and inputs"
        )


def _check_stats_size(stats: DocumentStats, seg: Segments) -> None:
    if seg.size > stats.size:
        raise ValueError(
            f"document_stats cover {stats.size} documents but document_ids go up to "
            f"{seg.size - 1}; compute them on the same stream"
        )


def _agree(group, error, local: _Local | None, a: LossArgs, for_stats: bool, what: str):
    """The context group's agreement: one ``all_reduce`` MAX of [failure, document count,
    call fingerprint twice, advantage count]. Returns (the group's document count, the
    smallest per-sequence advantage count or None)."""
    key = 0 if local is None else local.key
    sig = collectives.signature(
        key,
        a.ref_logprobs is None,
        a.entropy is None,
        a.divergence is None,
        a.normalizer is None,
        a.document_stats is None,
        for_stats,
    )
    unbounded = collectives.UNBOUNDED
    adv_len = None if local is None else local.adv_len
    size, hi, lo, neg_adv = collectives.agree(
        group,
        error,
        what,
        [
            0 if local is None else local.seg.size,
            sig,
            -sig,
            -(unbounded if adv_len is None else adv_len),
        ],
        "context_group",
    )
    if hi != -lo:
        raise ValueError(
            f"{what}: the ranks of the context group made different calls (config, [N] vs "
            "[B, T] input or row count, or which of ref_logprobs / rollout_logprobs / "
            "entropy / divergence / normalizer / document_stats are given); every rank must "
            "make the same call on its own shard of the stream"
        )
    return size, None if -neg_adv == unbounded else -neg_adv


def check_policy_loss(
    a: LossArgs,
    *,
    context_group: object | None = None,
    for_stats: bool = False,
    what: str = "policy_loss",
    capturable: bool = False,
) -> LossCall:
    """Check a :func:`~logitless.policy_loss` call (its arguments in ``a``, the rest here) and
    return its layout.

    Raises ``ValueError`` naming the argument on any bad input, before any work.
    ``for_stats``: the checks of :func:`document_stats` (``ref_logprobs`` / ``entropy`` not
    required); ``what``: the function named in a message about the ranks' agreement.

    With ``context_group`` this is a collective call: one ``all_reduce`` MAX of 5 int64
    (failure flag, document count, call fingerprint twice, advantage count), so a bad input on
    one rank raises on every rank, and the ranks are checked to make the same call.

    ``capturable``: no host read and no collective (CUDA graphs, ``fullgraph`` compiles): the
    value checks are device-side assertions and the ranks' agreement is not checked
    (docs/capturable.md).
    """
    group = collectives.check_group(context_group, "context_group")
    check_flag("capturable", capturable)
    if group is None or capturable:
        local = _local_checks(a, group, for_stats, capturable)
        size, smallest = local.seg.size, local.adv_len
    else:
        local, (size, smallest) = check_then_agree(
            lambda: _local_checks(a, group, for_stats, False),
            lambda loc, err: _agree(group, err, loc, a, for_stats, what),
        )
    if a.document_stats is not None:
        size = a.document_stats.size
    _check_advantage_count(a.advantages, local.adv_len, smallest, size, group is not None)
    seg, adv_len, norm_length, key = local
    return LossCall(
        config=a.config,
        old_logprobs=a.old_logprobs,
        advantages=a.advantages,
        mask=a.mask,
        ref_logprobs=a.ref_logprobs,
        rollout_logprobs=a.rollout_logprobs,
        normalizer=a.normalizer,
        seg=Segments(seg.ids, size),
        adv_len=adv_len,
        norm_length=norm_length,
        key=key,
        group=group,
        divergence=a.divergence,
    )
