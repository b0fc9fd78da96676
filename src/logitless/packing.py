"""Packed sequences: cu_seqlens, position_ids, per-token document ids, next-token labels.

A packed batch is one token stream holding several documents. Three descriptions of it are
accepted, and every function here reads a ``[B, T]`` batch as the row-major flattening of its
``B * T`` tokens:

``cu_seqlens``
    ``[D + 1]`` int32/int64 cumulative document lengths: ``cu_seqlens[0] == 0``,
    non-decreasing (a zero-length document is allowed), ``cu_seqlens[-1] <= N``. Document
    ``d`` is tokens ``cu_seqlens[d]:cu_seqlens[d + 1]``; the ``N - cu_seqlens[-1]`` tokens
    after the last document are **padding**. Padding can only sit at the end of the stream.

``position_ids``
    ``[N]`` or ``[B, T]`` integers. A token with position ``0`` starts a document; a token
    with position ``p > 0`` continues the document of the token just before it in the same
    row, which must have position ``p - 1``. A token with a **negative** position (``-1`` by
    convention) is **padding**, anywhere in a row. So every row starts with ``0`` or padding,
    and documents never span rows. From an HF ``attention_mask`` (left or right padding)::

        position_ids = torch.where(attention_mask.bool(), attention_mask.cumsum(-1) - 1, -1)

``document_ids``
    ``[N]`` or ``[B, T]`` int64: ``0 .. num_documents - 1`` for real tokens, ``-1`` for
    **padding**. Each document's tokens are contiguous. This is the form that the losses
    consume for sequence-level statistics (:func:`segment_sum`). Padding never gets an index
    of its own, so a per-document buffer of ``num_documents`` entries is always large enough.

For context parallelism the stream is split along the token dimension over the ranks of a
group (:func:`logitless.parallel.context_parallel_split`). Build labels and document ids on the
whole stream first: a document that the split cuts keeps one id on every rank, and no rank needs
its neighbour's logits.

Every check on values needs one host sync and runs before any work; bad input raises a
``ValueError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import torch

from .contract.checks import check_int as _check_int
from .contract.checks import check_same_device as _check_same_device
from .contract.checks import check_tensor as _check_tensor
from .contract.checks import fmt_shape as _shape
from .contract.options import IGNORE_INDEX

__all__ = [
    "cu_seqlens_to_document_ids",
    "cu_seqlens_to_position_ids",
    "document_ids_to_cu_seqlens",
    "next_token_labels",
    "position_ids_to_cu_seqlens",
    "position_ids_to_document_ids",
    "segment_sum",
]

_SIGNED_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_CU_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# checks


def _check_tokens(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """A ``[N]`` or ``[B, T]`` integer tensor."""
    t = _check_tensor(name, t)
    if t.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape [N] or [B, T], got shape {_shape(t)}")
    if t.dtype not in dtypes:
        raise ValueError(
            f"{name} must have an integer dtype in {[str(d) for d in dtypes]}, got {t.dtype}"
        )
    return t


def _check_cu_seqlens(cu_seqlens: object, total: int | None) -> tuple[torch.Tensor, int]:
    """Validate ``cu_seqlens`` against a stream of ``total`` tokens (``None``: its own end).

    Returns ``cu_seqlens`` as int64 and the stream length.
    """
    cu = _check_tensor("cu_seqlens", cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [num_documents + 1] starting with 0, got shape "
            f"{_shape(cu)}"
        )
    if cu.dtype not in _CU_DTYPES:
        raise ValueError(f"cu_seqlens must have dtype torch.int32 or torch.int64, got {cu.dtype}")
    cu = cu.long()
    # One host sync for every value check (and the stream end).
    first, last, n_decreasing = torch.stack([cu[0], cu[-1], (cu[1:] < cu[:-1]).sum()]).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens must start with 0, got cu_seqlens[0] = {first}")
    if n_decreasing:
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got {n_decreasing} decreasing step(s): "
            f"{cu.tolist() if cu.numel() <= 16 else _shape(cu)}"
        )
    if total is None:
        total = last
    elif last > total:
        raise ValueError(
            f"cu_seqlens[-1] must be <= the number of tokens {total}, got cu_seqlens[-1] = {last}"
        )
    return cu, total


_POSITION_RULE = (
    "position_ids must restart at 0 for each document and count up by 1 (negative = "
    "padding), so each row starts with 0 or a negative id and a position p > 0 follows p - 1"
)


def _check_position_values(pos: torch.Tensor, capturable: bool = False) -> None:
    """Every row starts with 0 or padding; a position p > 0 follows p - 1 in the same row.
    ``capturable``: a device-side assertion instead of a host read."""
    rows = pos.reshape(-1, pos.shape[-1]) if pos.numel() else pos.reshape(0, 1)
    bad = torch.zeros_like(rows, dtype=torch.bool)
    bad[:, 0] = rows[:, 0] > 0
    bad[:, 1:] = (rows[:, 1:] > 0) & (rows[:, 1:] != rows[:, :-1] + 1)
    if capturable:
        torch._assert_async(~bad.any(), _POSITION_RULE)
        return
    n_bad = int(bad.sum())
    if n_bad:
        flat = int(bad.reshape(-1).nonzero()[0])
        where = tuple(torch.unravel_index(torch.tensor(flat), pos.shape))
        where_s = ", ".join(str(int(i)) for i in where)
        raise ValueError(
            f"{_POSITION_RULE}; {n_bad} token(s) do not, first at index ({where_s}) with "
            f"position {int(pos.reshape(-1)[flat])}"
        )


def _check_document_id_values(ids: torch.Tensor, *, padding_only_at_end: bool) -> int:
    """Ids >= -1, each document contiguous; returns 1 + the largest id (0 if none).

    With ``padding_only_at_end``, also: ids non-decreasing over real tokens and no padding
    before the last real token (what cu_seqlens can express).
    """
    flat = ids.reshape(-1).long()
    if flat.numel() == 0:
        return 0
    real = flat >= 0
    new_run = torch.ones_like(real)
    new_run[1:] = flat[1:] != flat[:-1]
    run_ids = flat[real & new_run]  # [runs] the document of each contiguous run, in order
    idx = torch.arange(flat.numel(), device=flat.device)
    last_real = torch.where(real, idx, -1).max()
    checks = [
        (flat < -1).sum(),  # ids below -1
        flat.max().clamp(min=-1) + 1,  # num_documents found
        # a document that starts more than one run is split by another document or padding
        run_ids.numel() - torch.unique(run_ids).numel(),
        (run_ids[1:] < run_ids[:-1]).sum(),  # decreasing document order
        (~real & (idx < last_real)).sum(),  # padding before the last real token
    ]
    n_below, num_documents, n_split, n_decreasing, n_pad_before = torch.stack(
        [torch.as_tensor(c, device=flat.device).long() for c in checks]
    ).tolist()
    if n_below:
        raise ValueError(
            f"document_ids must be >= 0 for real tokens and -1 for padding, got {n_below} "
            f"id(s) < -1, e.g. {int(flat[flat < -1][0])}"
        )
    if n_split:
        raise ValueError(
            "document_ids must keep each document's tokens contiguous, got "
            f"{n_split} extra run(s) of a document split by another document or padding"
        )
    if padding_only_at_end and n_decreasing:
        raise ValueError(
            "document_ids must be non-decreasing over real tokens to convert to cu_seqlens, "
            f"got {n_decreasing} decrease(s) in document order"
        )
    if padding_only_at_end and n_pad_before:
        raise ValueError(
            "cu_seqlens can only express padding at the end of the stream, got "
            f"{n_pad_before} padding token(s) before the last real token; use document ids "
            "instead"
        )
    return num_documents


# --------------------------------------------------------------------------------------------
# converters


def cu_seqlens_to_document_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Per-token document index of a packed stream described by ``cu_seqlens``.

    Args:
        cu_seqlens: ``[D + 1]`` int32/int64, starts at 0, non-decreasing.
        total: stream length ``N >= cu_seqlens[-1]``; default ``cu_seqlens[-1]`` (no padding).

    Returns:
        ``[N]`` int64 on ``cu_seqlens``' device: ``d`` for tokens of document ``d``, ``-1`` for
        the ``N - cu_seqlens[-1]`` padding tokens at the end.

    >>> cu_seqlens_to_document_ids(torch.tensor([0, 3, 5]), total=7)
    tensor([ 0,  0,  0,  1,  1, -1, -1])
    """
    if total is not None:
        _check_int("total", total)
    cu, total = _check_cu_seqlens(cu_seqlens, total)
    return _document_ids_from_cu(cu, total)


def _document_ids_from_cu(cu: torch.Tensor, total: int) -> torch.Tensor:
    idx = torch.arange(total, device=cu.device)
    # number of documents that end at or before token i = the index of i's document
    ids = torch.searchsorted(cu[1:], idx, right=True)  # [N]
    return torch.where(idx < cu[-1], ids, -1)


def cu_seqlens_to_position_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Position of each token within its document, from ``cu_seqlens``.

    Args:
        cu_seqlens: ``[D + 1]`` int32/int64, starts at 0, non-decreasing.
        total: stream length ``N >= cu_seqlens[-1]``; default ``cu_seqlens[-1]``.

    Returns:
        ``[N]`` int64: ``0, 1, ...`` restarting at every document, ``-1`` for tail padding.
        (Zero-length documents leave no trace: position ids cannot express them.)

    >>> cu_seqlens_to_position_ids(torch.tensor([0, 3, 5]), total=6)
    tensor([ 0,  1,  2,  0,  1, -1])
    """
    if total is not None:
        _check_int("total", total)
    cu, total = _check_cu_seqlens(cu_seqlens, total)
    ids = _document_ids_from_cu(cu, total)
    idx = torch.arange(total, device=cu.device)
    return torch.where(ids >= 0, idx - cu[ids.clamp(min=0)], -1)


def position_ids_to_document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index from ``position_ids`` that restart at 0 (negative = padding).

    Args:
        position_ids: ``[N]`` or ``[B, T]`` integers; see the module docstring for the rule.

    Returns:
        int64 of the same shape: documents numbered ``0, 1, ...`` in row-major order across
        the whole batch, ``-1`` for padding.

    >>> position_ids_to_document_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 1, -1, -1, -1]]))
    tensor([[ 0,  0,  0,  1,  1],
            [ 2,  2, -1, -1, -1]])
    """
    return position_documents(position_ids)


def position_documents(position_ids: torch.Tensor, capturable: bool = False) -> torch.Tensor:
    """:func:`position_ids_to_document_ids`; ``capturable``: its value check is a device-side
    assertion (no host read)."""
    pos = _check_tokens("position_ids", position_ids, _SIGNED_INT_DTYPES)
    _check_position_values(pos, capturable)
    return _document_ids_from_positions(pos)


def _document_ids_from_positions(pos: torch.Tensor) -> torch.Tensor:
    starts = (pos == 0).reshape(-1).long()
    ids = (starts.cumsum(0) - 1).reshape(pos.shape)
    return torch.where(pos >= 0, ids, -1)


def document_ids_to_cu_seqlens(
    document_ids: torch.Tensor,
    num_documents: int | None = None,
    *,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """``cu_seqlens`` of a stream given by per-token document ids (``[B, T]`` is flattened).

    Args:
        document_ids: ``[N]`` or ``[B, T]`` signed integers: non-decreasing over real tokens,
            each document contiguous, ``-1`` padding only after the last real token. An id
            with no tokens is a zero-length document.
        num_documents: ``D``; default ``1 + max id`` (trailing empty documents need it).
        dtype: ``torch.int32`` (what flash-attention's varlen kernels take) or ``torch.int64``.

    Returns:
        ``[D + 1]`` of ``dtype``, on ``document_ids``' device.

    >>> document_ids_to_cu_seqlens(torch.tensor([0, 0, 0, 1, 1, -1]))
    tensor([0, 3, 5], dtype=torch.int32)
    """
    ids = _check_tokens("document_ids", document_ids, _SIGNED_INT_DTYPES)
    if num_documents is not None:
        _check_int("num_documents", num_documents)
    if dtype not in _CU_DTYPES:
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype!r}")
    found = _check_document_id_values(ids, padding_only_at_end=True)
    if num_documents is None:
        num_documents = found
    elif found > num_documents:
        raise ValueError(
            f"num_documents must exceed every document id, got num_documents={num_documents} "
            f"and a largest id of {found - 1}"
        )
    return _cu_from_document_ids(ids.reshape(-1).long(), num_documents).to(dtype)


def _cu_from_document_ids(ids: torch.Tensor, num_documents: int) -> torch.Tensor:
    lengths = torch.bincount(ids[ids >= 0], minlength=num_documents)  # [D]
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def position_ids_to_cu_seqlens(
    position_ids: torch.Tensor, *, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """``cu_seqlens`` of the (row-major flattened) stream that ``position_ids`` describe.

    Args:
        position_ids: ``[N]`` or ``[B, T]`` integers restarting at 0; padding (negative ids)
            only after the last document of the flattened stream, since cu_seqlens can express
            nothing else. Use :func:`position_ids_to_document_ids` for padded rows.
        dtype: ``torch.int32`` (default) or ``torch.int64``.

    Returns:
        ``[D + 1]`` of ``dtype``.

    >>> position_ids_to_cu_seqlens(torch.tensor([0, 1, 2, 0, 1, 0, -1]))
    tensor([0, 3, 5, 6], dtype=torch.int32)
    """
    pos = _check_tokens("position_ids", position_ids, _SIGNED_INT_DTYPES)
    if dtype not in _CU_DTYPES:
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype!r}")
    _check_position_values(pos)
    ids = _document_ids_from_positions(pos).reshape(-1)
    try:
        num_documents = _check_document_id_values(ids, padding_only_at_end=True)
    except ValueError as e:
        raise ValueError(f"position_ids: {e}") from None
    return _cu_from_document_ids(ids, num_documents).to(dtype)


# --------------------------------------------------------------------------------------------
# labels and segment sums


def next_token_labels(
    input_ids: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Next-token labels that never cross a document boundary.

    The label of a token is the following token of the same document. The last token of
    each document and every padding token get ``ignore_index``. Describe the packing with at
    most one of ``cu_seqlens``, ``position_ids`` or ``document_ids`` (module docstring):

    - none: each row of ``input_ids`` is one document, no padding (``[N]``: one document);
    - ``cu_seqlens``: documents of the row-major flattened stream; tokens after
      ``cu_seqlens[-1]`` are padding (a document may continue into the next row);
    - ``position_ids`` (same shape as ``input_ids``): documents restart at 0, negative ids
      are padding, anywhere;
    - ``document_ids`` (same shape): ``-1`` is padding, anywhere.

    Build labels on the whole stream, before chunking or sharding it. Equivalent to::

        labels = torch.full_like(input_ids, ignore_index)
        for start, end in documents:                       # token ranges, flattened
            labels.view(-1)[start:end - 1] = input_ids.view(-1)[start + 1:end]

    Args:
        input_ids: ``[N]`` or ``[B, T]`` integer token ids.

    Returns:
        int64 labels with ``input_ids``' shape and device.

    >>> next_token_labels(torch.tensor([5, 6, 7, 8, 9, 0]), cu_seqlens=torch.tensor([0, 3, 5]))
    tensor([   6,    7, -100,    9, -100, -100])
    >>> next_token_labels(torch.tensor([[5, 6, 7], [8, 9, 0]]),
    ...                   position_ids=torch.tensor([[0, 1, 0], [0, 1, -1]]))
    tensor([[   6, -100, -100],
            [   9, -100, -100]])
    """
    ids_in = _check_next_token_args(input_ids, cu_seqlens, position_ids, document_ids, ignore_index)
    flat_in = ids_in.reshape(-1)
    n = flat_in.numel()
    if cu_seqlens is not None:
        cu, _ = _check_cu_seqlens(cu_seqlens, n)
        doc = _document_ids_from_cu(cu, n)
    elif position_ids is not None:
        _check_position_values(position_ids)
        doc = _document_ids_from_positions(position_ids).reshape(-1)
    elif document_ids is not None:
        _check_document_id_values(document_ids, padding_only_at_end=False)
        doc = document_ids.reshape(-1).long()
    else:
        rows = ids_in.shape[0] if ids_in.dim() == 2 else 1
        doc = torch.arange(rows, device=ids_in.device).repeat_interleave(
            ids_in.shape[-1] if ids_in.dim() == 2 else n
        )

    return labels_within_documents(ids_in, doc, ignore_index)


def _check_next_token_args(input_ids, cu_seqlens, position_ids, document_ids, ignore_index):
    """:func:`next_token_labels`'s argument checks; returns the checked ``input_ids``."""
    ids_in = _check_tokens("input_ids", input_ids, _SIGNED_INT_DTYPES + (torch.uint8,))
    given = [
        name
        for name, v in (
            ("cu_seqlens", cu_seqlens),
            ("position_ids", position_ids),
            ("document_ids", document_ids),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"give at most one of cu_seqlens, position_ids, document_ids; got {', '.join(given)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    for name, t in (("position_ids", position_ids), ("document_ids", document_ids)):
        if t is not None:
            _check_tokens(name, t, _SIGNED_INT_DTYPES)
            if t.shape != ids_in.shape:
                raise ValueError(
                    f"{name} must have input_ids' shape {_shape(ids_in)}, got {_shape(t)}"
                )
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens)
    _check_same_device(
        input_ids=ids_in,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        document_ids=document_ids,
    )
    return ids_in


def labels_within_documents(
    input_ids: torch.Tensor, doc: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Next-token labels of checked ``input_ids`` whose flattened tokens belong to documents
    ``doc`` (``[N]``, -1 = padding): the following token where it is in the same document,
    else ``ignore_index``. No check, no host read."""
    n = doc.numel()
    flat_in = input_ids.reshape(-1)
    labels = torch.full((n,), ignore_index, dtype=torch.long, device=input_ids.device)
    if n > 1:
        # token i keeps token i+1 as its label only when both are in the same real document
        same = (doc[:-1] >= 0) & (doc[:-1] == doc[1:])  # [N - 1]
        labels[:-1] = torch.where(same, flat_in[1:].long(), ignore_index)
    return labels.reshape(input_ids.shape)


def segment_sum(
    values: torch.Tensor, document_ids: torch.Tensor, num_documents: int
) -> torch.Tensor:
    """Sum ``values`` over the tokens of each document; padding (``-1``) is left out.

    Plain PyTorch equivalent::

        out = values.new_zeros(num_documents, *extra)
        for d in range(num_documents):
            out[d] = values[document_ids == d].sum(0)

    Differentiable with respect to ``values``. On CUDA it accumulates with atomics, so the
    order of additions (and the last bits of a float sum) may vary between runs.

    Args:
        values: ``[*S, *extra]`` where ``S`` is ``document_ids``' shape.
        document_ids: ``[*S]`` signed integers in ``[-1, num_documents)``.
        num_documents: ``D >= 0``; documents with no tokens sum to 0.

    Returns:
        ``[D, *extra]`` in ``values``' dtype.

    >>> segment_sum(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 1, -1]), 2)
    tensor([3., 3.])
    """
    values = _check_tensor("values", values)
    ids = _check_tensor("document_ids", document_ids)
    if ids.dtype not in _SIGNED_INT_DTYPES:
        raise ValueError(f"document_ids must be a signed integer tensor (int64), got {ids.dtype}")
    if values.shape[: ids.dim()] != ids.shape:
        raise ValueError(
            f"values must have shape [{', '.join(map(str, ids.shape))}, ...] (document_ids' "
            f"shape first), got {_shape(values)}"
        )
    _check_int("num_documents", num_documents)
    _check_same_device(values=values, document_ids=ids)
    flat = ids.reshape(-1).long()
    if flat.numel():
        lo, hi = torch.stack([flat.min(), flat.max()]).tolist()
        if lo < -1 or hi >= num_documents:
            raise ValueError(
                f"document_ids must be in [-1, {num_documents}) (num_documents={num_documents}), "
                f"got ids from {lo} to {hi}"
            )
    extra = values.shape[ids.dim() :]
    return segment_sum_unchecked(values.reshape(flat.numel(), *extra), flat, num_documents)


def segment_sum_unchecked(
    values: torch.Tensor, document_ids: torch.Tensor, num_documents: int
) -> torch.Tensor:
    """:func:`segment_sum` of ``values`` ``[N, *extra]`` over int64 ``document_ids`` ``[N]``
    already known to lie in ``[-1, num_documents)``: no checks, no host sync (hot paths)."""
    # padding goes to one spare slot at the end, dropped afterwards
    slot = torch.where(document_ids >= 0, document_ids, num_documents)
    # scatter_add, not index_add: inductor's C++ code generation crashes on an index_add whose
    # index it computes itself (ids made in the graph, e.g. one per row of [B, T]) in
    # torch 2.13; scatter_add lowers another way (docs/capturable.md, "Under torch.compile").
    slot = slot.reshape(-1, *([1] * (values.dim() - 1))).expand_as(values)
    out = values.new_zeros(num_documents + 1, *values.shape[1:]).scatter_add(0, slot, values)
    return out[:num_documents]
