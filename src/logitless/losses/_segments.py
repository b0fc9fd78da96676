"""Per-document reductions over a flat token stream (private).

A stream of ``N`` tokens is described by ``ids``: ``[N]`` int64, the document of each token in
``[0, size)``, ``-1`` for padding. ``size`` is the length of per-document buffers. Padding is
routed to one spare slot past the end and dropped, so it never forms a document.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segments(NamedTuple):
    ids: torch.Tensor  # [N] int64, -1 = padding
    size: int  # length of per-document buffers (>= number of documents)


def segment_sum(values: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``out[d] = Σ_{i: ids[i] = d} values[i]``; differentiable in ``values``.  [N] -> [size]"""
    slot = torch.where(seg.ids >= 0, seg.ids, seg.size)  # [N], padding -> spare slot
    out = values.new_zeros(seg.size + 1).index_add(0, slot, values)  # [size + 1]
    return out[: seg.size]


def gather(per_doc: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Broadcast a per-document value to its tokens; padding gets 0.  [size] -> [N]"""
    padded = torch.cat([per_doc, per_doc.new_zeros(1)])  # [size + 1]
    slot = torch.where(seg.ids >= 0, seg.ids, seg.size)  # [N]
    return padded[slot]


def segment_mean(values: torch.Tensor, valid: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Mean of ``values`` over the valid tokens of each document (0 for an empty one).  [size]"""
    total = segment_sum(torch.where(valid, values, 0.0), seg)  # [size]
    count = segment_sum(valid.to(values.dtype), seg)  # [size]
    return total / count.clamp(min=1.0)
