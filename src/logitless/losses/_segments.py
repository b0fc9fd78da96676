"""Per-document reductions over a flat token stream (private).

A stream of ``N`` tokens is described by ``ids``: ``[N]`` int64, the document of each token in
``[0, size)``, ``-1`` for padding. ``size`` is the length of per-document buffers. Padding is
routed to one spare slot past the end and dropped, so it never forms a document.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..packing import segment_sum_unchecked


class Segments(NamedTuple):
    ids: torch.Tensor  # [N] int64, -1 = padding
    size: int  # length of per-document buffers (>= number of documents)


def of_ids(document_ids: object, num_documents: object) -> Segments:
    """``Segments`` from public arguments: ``[N]`` int64 ids in ``[-1, num_documents)``."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.is_floating_point():
        raise ValueError(f"document_ids must be an int64 tensor, got {document_ids!r}")
    if isinstance(num_documents, bool) or not isinstance(num_documents, int) or num_documents < 0:
        raise ValueError(f"num_documents must be an int >= 0, got {num_documents!r}")
    return Segments(document_ids.reshape(-1).long(), num_documents)


def sum_per_document(values: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``out[d] = Σ_{i: ids[i] = d} values[i]``; differentiable in ``values``.  [N] -> [size]"""
    return segment_sum_unchecked(values, seg.ids, seg.size)


def gather(per_doc: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Broadcast a per-document value to its tokens; padding gets 0.  [size] -> [N]"""
    padded = torch.cat([per_doc, per_doc.new_zeros(1)])  # [size + 1]
    slot = torch.where(seg.ids >= 0, seg.ids, seg.size)  # [N]
    return padded[slot]


def segment_mean(values: torch.Tensor, valid: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Mean of ``values`` over the valid tokens of each document (0 for an empty one).  [size]"""
    total = sum_per_document(torch.where(valid, values, 0.0), seg)  # [size]
    count = sum_per_document(valid.to(values.dtype), seg)  # [size]
    return total / count.clamp(min=1.0)


def document_segments(like: torch.Tensor, document_ids: torch.Tensor | None, name: str) -> Segments:
    """Document of each flattened token of ``like`` (named ``name`` in errors).

    ``[B, T]`` without ``document_ids``: each row is one document. Otherwise ``document_ids``
    must have ``like``'s shape and integer ids >= -1 (one host sync for the range).
    """
    if document_ids is None:
        if like.dim() != 2:
            raise ValueError(
                f"document_ids is required for a packed [N] stream; {name} has shape "
                f"{list(like.shape)} and document_ids is None"
            )
        b, t = like.shape
        return Segments(torch.arange(b, device=like.device).repeat_interleave(t), b)
    if not isinstance(document_ids, torch.Tensor) or document_ids.is_floating_point():
        raise ValueError(f"document_ids must be an int64 tensor, got {document_ids!r}")
    if document_ids.shape != like.shape:
        raise ValueError(
            f"document_ids must have {name}' shape {list(like.shape)}, "
            f"got {list(document_ids.shape)}"
        )
    ids = document_ids.reshape(-1).long()
    if ids.numel():
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one host sync
        if lo < -1:
            raise ValueError(f"document_ids must be >= -1 (-1 = padding), got min {lo}")
        return Segments(ids, hi + 1 if hi >= 0 else 0)
    return Segments(ids, 0)
