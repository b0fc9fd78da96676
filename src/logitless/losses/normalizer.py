"""Global denominators for one optimizer step split into micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..contract import collectives
from ..contract.checks import check_flag, finite_number
from ._segments import (
    Segments,
    assert_segments,
    check_document_ids,
    document_segments,
    sum_per_document,
)

__all__ = ["LossNormalizer", "loss_normalizer"]


@dataclass(frozen=True)
class LossNormalizer:
    """Counts for a whole optimizer step, shared by all its micro-batches.

    num_tokens: valid tokens (mask true, not padding) in the step, over every micro-batch and
        every data- and context-parallel rank.
    num_sequences: documents with at least one valid token in the step (a document split
        across context-parallel ranks counts once).
    loss_scale: :func:`policy_loss` multiplies the loss it returns by this (metrics stay
        unscaled). Default 1.

    Pass the same normalizer to every micro-batch's :func:`policy_loss`; the micro-batch losses
    then *sum* to the whole-step loss (and so do their gradients), over micro-batches and over
    ranks: each rank's loss is its share of the step's loss.

    **DDP / FSDP.** Their gradient reduction *averages* over the ranks it spans (DDP: its
    process group, by default the world; FSDP: the sharding (and replication) group, which
    includes the context-parallel ranks when they are folded into the FSDP mesh). Averaging
    the shares divides the step's gradient by that number of ranks ``R``. Undo it with
    ``loss_scale=R``: ``loss_normalizer(..., loss_scale=dist.get_world_size(ddp_group))``. The
    gradients after DDP's reduction are then exactly the whole-step gradient of one process.
    Alternatively keep ``loss_scale=1`` and make the reduction a sum (FSDP2:
    ``model.set_gradient_divide_factor(1.0)``). With a reduction that sums (or with no
    gradient reduction at all, e.g. context parallelism alone with your own all-reduce of
    gradients summing), ``loss_scale`` stays 1.
    """

    num_tokens: torch.Tensor | float
    num_sequences: torch.Tensor | float
    loss_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences"):
            v = getattr(self, name)
            if isinstance(v, torch.Tensor):
                if v.numel() != 1 or v.dtype == torch.bool:
                    raise ValueError(f"{name} must be a scalar tensor or number, got {v!r}")
            elif not finite_number(v) or v < 0:
                raise ValueError(
                    f"{name} must be a finite number >= 0 or a scalar tensor, got {v!r}"
                )
        _check_loss_scale(self.loss_scale)


def _check_loss_scale(v: object) -> None:
    if not finite_number(v) or v <= 0:
        raise ValueError(
            f"loss_scale must be a finite number > 0 (the number of ranks DDP/FSDP average "
            f"gradients over, or 1), got {v!r}"
        )


def _segments(mask: torch.Tensor, ids: torch.Tensor | None, ranks: int | None) -> Segments:
    """A micro-batch's segments; ``ranks`` (the context group's size, 1 without one) in the
    capturable mode: ids asserted on the device below the stream's token count (this shard's
    times ``ranks``), which sizes the per-document buffers."""
    if ranks is None or ids is None:
        return document_segments(mask, ids, "mask")
    flat = check_document_ids(mask, ids, "mask")
    return assert_segments(flat, flat.numel() * ranks, "mask")


def _local_counts(
    masks: Sequence[torch.Tensor],
    document_ids: Sequence[torch.Tensor | None] | None,
    ranks: int | None = None,
) -> list[tuple[torch.Tensor, Segments]]:
    """Validated ``(valid [N_k] bool, segments)`` per micro-batch (local document ids);
    ``ranks``: see :func:`_segments`."""
    if not isinstance(masks, Sequence) or len(masks) == 0:
        raise ValueError(f"masks must hold at least one micro-batch mask, got {masks!r}")
    if document_ids is None:
        document_ids = [None] * len(masks)
    if len(document_ids) != len(masks):
        raise ValueError(
            f"document_ids must have one entry per mask ({len(masks)}), got {len(document_ids)}"
        )
    out = []
    for k, (mask, ids) in enumerate(zip(masks, document_ids, strict=True)):
        if not isinstance(mask, torch.Tensor) or mask.dim() not in (1, 2):
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"masks[{k}] must be a [N] or [B, T] tensor, got {got}")
        if mask.dtype != torch.bool:
            raise ValueError(
                f"masks[{k}] must be a bool tensor (as policy_loss's mask), got {mask.dtype}"
            )
        seg = _segments(mask, ids, ranks)
        out.append((mask.reshape(-1).bool() & (seg.ids >= 0), seg))
    return out


def loss_normalizer(
    masks: Sequence[torch.Tensor],
    document_ids: Sequence[torch.Tensor | None] | None = None,
    *,
    process_group: object | None = None,
    context_group: object | None = None,
    loss_scale: float = 1.0,
    capturable: bool = False,
) -> LossNormalizer:
    """Count valid tokens and sequences over all micro-batches of a step (and all ranks).

    Args:
        masks: one bool mask per micro-batch, ``[N_k]`` or ``[B_k, T_k]``.
        document_ids: one ``[N_k]`` / ``[B_k, T_k]`` int64 tensor per micro-batch (``-1`` for
            padding), or ``None`` (each row of a ``[B, T]`` mask is one sequence). Ids are per
            micro-batch; a document must not span micro-batches.
        process_group: the data-parallel group (ranks holding *different* documents): the
            counts are summed over it with one ``all_reduce``. Leave the context-parallel
            peers out of it.
        context_group: the context-parallel group (ranks holding shards of the *same*
            micro-batches, with global document ids): per-document token counts of each
            micro-batch are summed over it before documents are counted, so a document split
            across ranks counts once, and a rank may hold no token of a document. Every rank of
            the group must pass the same number of micro-batches.
        loss_scale: stored in the normalizer; set it to the number of ranks DDP/FSDP average
            gradients over (see :class:`LossNormalizer`).
        capturable: no host read (CUDA graphs, ``torch.compile(fullgraph=True)``): document
            ids are checked by device-side assertions and must lie below the stream's token
            count (this shard's times the context group's size), the collectives are plain
            sums (one ``all_reduce`` SUM of ``Σ_k size_k + 1`` float64 on the context group,
            one of 2 on the data-parallel group) and the ranks' agreement is not checked: every
            rank of a context group must pass micro-batches of the same shapes. Bad input that
            shapes reveal still raises ``ValueError``, on its rank only.

    Returns:
        A :class:`LossNormalizer` of 0-dim float64 tensors on the masks' device, the same on
        every rank of both groups.

    Collectives (none without groups), in this order: with ``context_group``, ``all_reduce``
    MAX of 4 int64 (failure flag, micro-batch count, document count) and ``all_reduce`` SUM of
    ``K · D + 1`` float64 on it; with ``process_group``, ``all_reduce`` SUM of 3 float64 on it.
    Bad input on one rank raises ``ValueError`` on every rank of the groups it reached.

    >>> m = [torch.tensor([[True, True], [True, False]]), torch.tensor([[False, False]])]
    >>> n = loss_normalizer(m)
    >>> (int(n.num_tokens), int(n.num_sequences))
    (3, 2)
    """
    cp = collectives.check_group(context_group, "context_group")
    dp = collectives.check_group(process_group, "process_group")
    if check_flag("capturable", capturable):
        _check_loss_scale(loss_scale)
        ranks = 1 if cp is None else torch.distributed.get_world_size(cp)
        counts = _counts(_local_counts(masks, document_ids, ranks), cp, dp)
        return LossNormalizer(counts[0], counts[1], loss_scale=loss_scale)
    error, local = None, None
    try:
        _check_loss_scale(loss_scale)
        local = _local_counts(masks, document_ids)
    except ValueError as e:
        if cp is None and dp is None:
            raise
        error = e
    device = local[0][0].device if local else torch.device("cpu")
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # [tokens, sequences]
    if cp is not None:
        counts, error = _context_counts(cp, local, error, counts)
    elif error is None:
        counts = _counts(local)
    if dp is not None:
        counts = collectives.sum_or_raise(dp, counts, error, "loss_normalizer", "process_group")
    if error is not None:
        raise error
    return LossNormalizer(num_tokens=counts[0], num_sequences=counts[1], loss_scale=loss_scale)


def _context_counts(cp, local, error: ValueError | None, counts: torch.Tensor):
    """:func:`loss_normalizer`'s counts over the context group ``cp``: ``(counts, error)``,
    ``counts`` left as given where any rank failed (every rank then knows it)."""
    # A failure anywhere in the context group is known to all its ranks after this
    # exchange; they skip the next collective together and still join the data-parallel
    # one below, so no rank of either group is left waiting.
    k = len(local) if local else 0
    size = max((seg.size for _, seg in local), default=0) if local else 0
    any_failed, (k_hi, k_lo, size) = collectives.exchange(cp, error is not None, [k, -k, size])
    if any_failed and error is None:
        error = collectives.other_rank_failed("loss_normalizer", "context_group")
    elif error is None and k_hi != -k_lo:
        error = ValueError(
            "loss_normalizer: every rank of the context group must pass the same number of "
            f"micro-batches (shards of the same ones), got from {-k_lo} to {k_hi} (this "
            f"rank: {k})"
        )
    if not any_failed and k_hi == -k_lo:
        # every micro-batch's per-document buffer sized by the group's largest id
        counts = _counts([(v, Segments(seg.ids, size)) for v, seg in local], cp)
    return counts, error


def _counts(local: list[tuple[torch.Tensor, Segments]], cp=None, dp=None) -> torch.Tensor:
    """``[tokens, sequences]`` float64 of checked micro-batches, with no host read: the
    per-document token counts of every micro-batch (summed over ``cp`` in one buffer, each
    micro-batch's sized by its segments), then the two counts (summed over ``dp``). The
    capturable mode's path, and the default mode's without groups."""
    per_doc = [sum_per_document(v.double(), seg) for v, seg in local]  # each [size_k]
    tokens = torch.stack([v.sum(dtype=torch.float64) for v, _ in local]).sum().reshape(1)
    flat = torch.cat([*per_doc, tokens])
    if cp is not None:
        flat = collectives.all_reduce(flat, cp, "sum")
    counts = torch.stack([flat[-1], (flat[:-1] > 0).sum(dtype=torch.float64)])
    if dp is not None:
        counts = collectives.all_reduce(counts, dp, "sum")
    return counts
