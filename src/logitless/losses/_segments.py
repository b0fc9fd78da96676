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


def check_document_ids(like: torch.Tensor, document_ids: object, name: str) -> torch.Tensor:
    """``document_ids`` as ``[N]`` int64, after the checks that need no value: a signed integer
    (not bool: a mask passed by mistake) tensor of ``like``'s shape on its device."""
    if (
        not isinstance(document_ids, torch.Tensor)
        or document_ids.is_floating_point()
        or document_ids.dtype == torch.bool
        or document_ids.is_complex()
    ):
        got = document_ids.dtype if isinstance(document_ids, torch.Tensor) else document_ids
        raise ValueError(f"document_ids must be an int64 tensor (-1 = padding), got {got!r}")
    if document_ids.shape != like.shape:
        raise ValueError(
            f"document_ids must have {name}' shape {list(like.shape)}, "
            f"got {list(document_ids.shape)}"
        )
    if document_ids.device != like.device:
        raise ValueError(
            f"document_ids must be on {name}' device {like.device}, got {document_ids.device}"
        )
    return document_ids.reshape(-1).long()


def id_counters(ids: torch.Tensor) -> list[torch.Tensor]:
    """Device-side ``[min id, max id, tokens of a document that follow another document or
    padding]`` of ``[N]`` int64 ids (no host sync; fixed shapes).

    A document is contiguous when, in id order, each of its tokens sits right after the
    previous one: sorting the positions by id (stable) and counting jumps finds the rest.
    """
    if ids.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=ids.device)
        return [zero, zero - 1, zero]
    order = torch.argsort(ids, stable=True)  # positions, grouped by id, in stream order
    sorted_ids = ids[order]
    same_doc = (sorted_ids[1:] == sorted_ids[:-1]) & (sorted_ids[1:] >= 0)
    jumps = same_doc & (order[1:] - order[:-1] != 1)
    return [ids.min(), ids.max(), jumps.sum()]


_MIN_ID = "document_ids must be >= -1 (-1 = padding)"


def _split_message(name: str) -> str:
    return (
        "document_ids must keep each document's tokens contiguous in the (row-major) "
        "flattened stream: a document's tokens come after another document or padding. Ids "
        f"that restart in every row of a [B, T] {name} must be made global (e.g. offset each "
        "row's ids), and a document must not resume later"
    )


def segments_from_counters(ids: torch.Tensor, values: list, name: str) -> Segments:
    """Raise on what :func:`id_counters` found (``values``: their host values)."""
    lo, hi, n_split = (int(v) for v in values)
    if lo < -1:
        raise ValueError(f"{_MIN_ID}, got min {lo}")
    if n_split:
        raise ValueError(f"{_split_message(name)} ({n_split} such token(s))")
    return Segments(ids, hi + 1 if hi >= 0 else 0)


def assert_segments(ids: torch.Tensor, size: int, name: str) -> Segments:
    """The capturable mode's :func:`segments_from_counters`: device-side assertions with the
    same messages, and ``size`` given (a bound known from the shapes) instead of read: every
    id must lie below it."""
    lo, hi, n_split = id_counters(ids)
    torch._assert_async(lo >= -1, _MIN_ID)
    torch._assert_async(n_split == 0, _split_message(name))
    torch._assert_async(
        hi < size,
        f"document_ids must be < {size} in the capturable mode (the number of per-sequence "
        f"advantages, else of tokens: a bound known from the shapes)",
    )
    return Segments(ids, size)


def document_segments(like: torch.Tensor, document_ids: torch.Tensor | None, name: str) -> Segments:
    """Document of each flattened token of ``like`` (named ``name`` in errors).

    ``[B, T]`` without ``document_ids``: each row is one document. Otherwise ``document_ids``
    must have ``like``'s shape, integer ids >= -1, each document contiguous (one host sync).
    """
    if document_ids is None:
        if like.dim() != 2:
            raise ValueError(
                f"document_ids is required for a packed [N] stream; {name} has shape "
                f"{list(like.shape)} and document_ids is None"
            )
        b, t = like.shape
        return Segments(torch.arange(b, device=like.device).repeat_interleave(t), b)
    ids = check_document_ids(like, document_ids, name)
    values = torch.stack(id_counters(ids)).tolist()  # one host sync
    return segments_from_counters(ids, values, name)
