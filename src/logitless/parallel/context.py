"""Context parallelism: one packed token stream split along its tokens over a group.

Rank ``r`` of ``W`` gets either the ``r``-th of ``W`` equal chunks (``contiguous``) or, for
causal attention's load balance, chunks ``r`` and ``2W - 1 - r`` of ``2W`` (``zigzag``).
:func:`context_parallel_split` cuts a per-token tensor, :func:`context_parallel_merge` puts the
ranks' pieces back together and :func:`context_parallel_indices` gives a rank's token
positions. The losses take ``context_group=`` to sum their per-document statistics over the
group (see :func:`logitless.policy_loss`).
"""

from __future__ import annotations

import torch

from ..contract.checks import check_int as _check_int
from ..contract.checks import check_tensor as _check_tensor
from ..contract.checks import fmt_shape as _shape

__all__ = [
    "CP_LAYOUTS",
    "context_parallel_indices",
    "context_parallel_merge",
    "context_parallel_split",
]


CP_LAYOUTS = ("contiguous", "zigzag")


def _check_cp_args(rank: object, world_size: object, layout: object) -> tuple[int, int]:
    """Validated ``(rank, number of equal chunks the stream is cut into)``."""
    _check_int("world_size", world_size, minimum=1)
    _check_int("rank", rank)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
    return rank, world_size if layout == "contiguous" else 2 * world_size


def _cp_ranges(length: int, rank: int, world_size: int, layout: str) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of ``rank``'s shard, in its local order."""
    if layout == "contiguous":
        size = length // world_size
        return [(rank * size, (rank + 1) * size)]
    size = length // (2 * world_size)
    last = 2 * world_size - 1 - rank
    return [(rank * size, (rank + 1) * size), (last * size, (last + 1) * size)]


def _not_divisible(length: int, chunks: int, world_size: int, layout: str) -> ValueError:
    return ValueError(
        f"a stream of {length} tokens cannot be split evenly for layout={layout!r} over "
        f"world_size={world_size} (the length must be a multiple of {chunks}); pass pad_value= "
        "to pad its end (-1 for document_ids and position_ids, the ignore_index for labels, "
        "False for masks, 0 for float tensors), or pad the stream yourself"
    )


def context_parallel_indices(
    length: int,
    rank: int,
    world_size: int,
    *,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of the tokens that context-parallel rank ``rank`` holds, in local order.

    ``contiguous``: the stream is cut into ``world_size`` equal chunks and rank ``r`` holds
    chunk ``r``. ``zigzag`` (load-balanced for causal attention): it is cut into
    ``2 · world_size`` equal chunks and rank ``r`` holds chunks ``r`` and
    ``2 · world_size − 1 − r``, in that order.

    Args:
        length: ``N``, the stream length; a multiple of ``world_size`` (contiguous) or of
            ``2 · world_size`` (zigzag).
        rank, world_size: ``0 <= rank < world_size``.
        layout: ``"contiguous"`` or ``"zigzag"``.
        device: of the result.

    Returns:
        ``[N / world_size]`` int64: ``tensor[indices]`` is the rank's shard.

    >>> context_parallel_indices(8, 0, 2, layout="zigzag")
    tensor([0, 1, 6, 7])
    """
    rank, chunks = _check_cp_args(rank, world_size, layout)
    _check_int("length", length)
    if length % chunks:
        raise _not_divisible(length, chunks, world_size, layout)
    return torch.cat(
        [torch.arange(a, b, device=device) for a, b in _cp_ranges(length, rank, world_size, layout)]
    )


def context_parallel_split(
    tensor: torch.Tensor,
    rank: int,
    world_size: int,
    *,
    layout: str = "contiguous",
    dim: int = 0,
    pad_value: bool | int | float | None = None,
) -> torch.Tensor:
    """Context-parallel rank ``rank``'s shard of a packed per-token tensor.

    Splits ``tensor`` along ``dim`` (the token dimension: ``0`` for ``[N]`` / ``[N, H]``, ``1``
    for ``[B, T]`` / ``[B, T, H]``) as :func:`context_parallel_indices` says. Split every
    per-token tensor of a step the same way (hidden states, labels, document ids, masks,
    old/reference/rollout log-probs, per-token advantages) *after* building labels and
    document ids on the whole stream: a document cut by the split keeps its one global id, so
    per-document statistics can be summed over the group (``policy_loss(...,
    context_group=...)``). Per-sequence advantages ``[D]`` are not split: every rank passes
    all of them.

    A length that is not a multiple of ``world_size`` (contiguous) or ``2 · world_size``
    (zigzag) raises ``ValueError``, unless ``pad_value`` is given: the end of the stream is then
    padded with it to the next multiple. Use ``-1`` for document ids and position ids, the
    ``ignore_index`` for labels, ``False`` for masks and ``0`` for float tensors, so padding is
    never trained on and never forms a document.

    Args:
        tensor: any tensor with a token dimension ``dim``.
        rank, world_size: ``0 <= rank < world_size``.
        layout: ``"contiguous"`` or ``"zigzag"``.
        dim: the token dimension.
        pad_value: value of the padding, or ``None`` to require an even split.

    Returns:
        The shard, ``tensor.shape`` with ``N_padded / world_size`` along ``dim``; a view of
        ``tensor`` for an unpadded contiguous split, a copy otherwise. Differentiable.

    >>> x = torch.arange(10)
    >>> context_parallel_split(x, 1, 2, layout="zigzag", pad_value=-1)
    tensor([3, 4, 5, 6, 7, 8])
    >>> context_parallel_merge([context_parallel_split(x, r, 2, layout="zigzag", pad_value=-1)
    ...                         for r in range(2)], layout="zigzag", length=10)
    tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    tensor = _check_tensor("tensor", tensor)
    rank, chunks = _check_cp_args(rank, world_size, layout)
    dim = _check_dim(dim, tensor)
    _check_pad_value(pad_value, tensor)
    length = tensor.shape[dim]
    rest = length % chunks
    if rest:
        if pad_value is None:
            raise _not_divisible(length, chunks, world_size, layout)
        pad_shape = list(tensor.shape)
        pad_shape[dim] = chunks - rest
        tensor = torch.cat([tensor, tensor.new_full(pad_shape, pad_value)], dim)
        length = tensor.shape[dim]
    parts = [tensor.narrow(dim, a, b - a) for a, b in _cp_ranges(length, rank, world_size, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def context_parallel_merge(
    shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    layout: str = "contiguous",
    dim: int = 0,
    length: int | None = None,
) -> torch.Tensor:
    """The inverse of :func:`context_parallel_split`: the whole stream from every rank's shard.

    Args:
        shards: the ``world_size`` shards in rank order (e.g. from ``all_gather``), each of the
            same shape.
        layout, dim: as given to :func:`context_parallel_split`.
        length: the stream's length before padding; ``None`` keeps the padding.

    Returns:
        The stream, ``shards[0].shape`` with ``world_size · shard_length`` (or ``length``) along
        ``dim``. Differentiable.

    >>> context_parallel_merge([torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])],
    ...                        layout="zigzag")
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    if not isinstance(shards, (list, tuple)) or len(shards) == 0:
        raise ValueError(f"shards must be a non-empty list of tensors, got {shards!r}")
    for i, s in enumerate(shards):
        _check_tensor(f"shards[{i}]", s)
    world_size = len(shards)
    _, chunks = _check_cp_args(0, world_size, layout)
    dim = _check_dim(dim, shards[0])
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"shards must all have the same shape, got {sorted(shapes)}")
    local = shards[0].shape[dim]
    if layout == "zigzag" and local % 2:
        raise ValueError(
            f"zigzag shards hold two equal chunks, so their length along dim {dim} must be even, "
            f"got {local}"
        )
    total = local * world_size
    if length is not None:
        _check_int("length", length)
        if length > total:
            raise ValueError(
                f"length must be <= the merged length {total} ({world_size} shards of {local}), "
                f"got {length}"
            )
    if layout == "contiguous":
        ordered = list(shards)
    else:
        half = local // 2
        ordered = [None] * chunks
        for r, s in enumerate(shards):
            ordered[r] = s.narrow(dim, 0, half)
            ordered[chunks - 1 - r] = s.narrow(dim, half, half)
    out = torch.cat(ordered, dim)
    return out if length is None else out.narrow(dim, 0, length)


def _check_pad_value(pad_value: object, tensor: torch.Tensor) -> None:
    """A pad value that the tensor's dtype holds as given (no silent cast: -1 in a bool mask
    would be True, 0.5 in an id tensor 0)."""
    if pad_value is None:
        return
    if tensor.dtype == torch.bool:
        ok = isinstance(pad_value, bool)
    elif tensor.is_floating_point() or tensor.is_complex():
        ok = isinstance(pad_value, (int, float)) and not isinstance(pad_value, bool)
    else:
        ok = isinstance(pad_value, int) and not isinstance(pad_value, bool)
    if not ok:
        raise ValueError(
            f"pad_value must be None or a value of the tensor's dtype {tensor.dtype} (a bool for "
            f"bool tensors, an int for integer tensors, a number for float tensors), got "
            f"{pad_value!r}"
        )


def _check_dim(dim: object, tensor: torch.Tensor) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"dim must be an int in [{-tensor.dim()}, {tensor.dim()}) for a tensor of shape "
            f"{_shape(tensor)}, got {dim!r}"
        )
    return dim % tensor.dim()
