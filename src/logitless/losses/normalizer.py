"""Global denominators for one optimizer step split into micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._segments import document_segments, segment_sum

__all__ = ["LossNormalizer", "loss_normalizer"]


@dataclass(frozen=True)
class LossNormalizer:
    """Counts for a whole optimizer step, shared by all its micro-batches.

    num_tokens: valid tokens (mask true, not padding) in the step.
    num_sequences: documents with at least one valid token in the step.

    Pass the same normalizer to every micro-batch's :func:`policy_loss`; the micro-batch losses
    then *sum* to the whole-step loss (and so do their gradients). With data parallelism, the
    sum also runs over ranks: if your gradient all-reduce averages (DDP, FSDP), multiply each
    rank's loss by the world size.
    """

    num_tokens: torch.Tensor | float
    num_sequences: torch.Tensor | float

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences"):
            v = getattr(self, name)
            if isinstance(v, torch.Tensor):
                if v.numel() != 1 or v.dtype == torch.bool:
                    raise ValueError(f"{name} must be a scalar tensor or number, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0 or a scalar tensor, got {v!r}")


def loss_normalizer(
    masks: Sequence[torch.Tensor],
    document_ids: Sequence[torch.Tensor | None] | None = None,
    *,
    process_group: object | None = None,
) -> LossNormalizer:
    """Count valid tokens and sequences over all micro-batches of a step (and all ranks).

    Args:
        masks: one bool mask per micro-batch, ``[N_k]`` or ``[B_k, T_k]``.
        document_ids: one ``[N_k]`` / ``[B_k, T_k]`` int64 tensor per micro-batch (``-1`` for
            padding), or ``None`` (each row of a ``[B, T]`` mask is one sequence).
        process_group: when given, the counts are summed over its ranks with one
            ``all_reduce`` (so each rank's micro-batches must hold distinct documents).

    Returns:
        A :class:`LossNormalizer` of 0-dim float64 tensors on the masks' device.

    >>> m = [torch.tensor([[True, True], [True, False]]), torch.tensor([[False, False]])]
    >>> n = loss_normalizer(m)
    >>> (int(n.num_tokens), int(n.num_sequences))
    (3, 2)
    """
    if len(masks) == 0:
        raise ValueError("masks must hold at least one micro-batch mask, got an empty sequence")
    if document_ids is None:
        document_ids = [None] * len(masks)
    if len(document_ids) != len(masks):
        raise ValueError(
            f"document_ids must have one entry per mask ({len(masks)}), got {len(document_ids)}"
        )
    device = masks[0].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # [tokens, sequences]
    for mask, ids in zip(masks, document_ids, strict=True):
        seg = document_segments(mask, ids, "mask")
        valid = mask.reshape(-1).bool() & (seg.ids >= 0)  # [N]
        per_doc = segment_sum(valid.double(), seg)  # [D]
        counts += torch.stack([valid.sum(dtype=torch.float64), (per_doc > 0).sum().double()])
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
    return LossNormalizer(num_tokens=counts[0], num_sequences=counts[1])
