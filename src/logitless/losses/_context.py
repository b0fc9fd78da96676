"""Collectives of the loss layer over a context-parallel (or data-parallel) group (private).

Every helper here is a collective call: all ranks of the group must call it, in the same
order, with tensors of the same size, whatever their local data. Local validation errors do
not skip a collective: the failing rank still takes part with a ``failed`` flag and then raises
its error, and the other ranks raise too (instead of hanging in the next collective).
"""

from __future__ import annotations

import zlib

import torch

# Stand-in for "no constraint" in a MAX-reduced value (per-token advantages have no length).
UNBOUNDED = 2**62


def check_group(group: object, name: str = "context_group"):
    """``group`` as a ``ProcessGroup``, or ``None``; raised before any collective."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{name} needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group), but torch.distributed is not initialized"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{name} must be a torch.distributed.ProcessGroup (e.g. from dist.new_group, or "
            f"dist.group.WORLD), got {type(group).__name__}"
        )
    return group


def signature(*parts: object) -> int:
    """A process-independent 31-bit fingerprint of ``parts`` (``hash`` is salted per process)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def exchange(
    group, device: torch.device, failed: bool, values: list[int]
) -> tuple[bool, list[int]]:
    """One all-reduce MAX of ``[failed, *values]`` (int64): (any rank failed, the maxima).

    Pass ``-x`` to get the minimum of ``x``.
    """
    import torch.distributed as dist

    local = torch.tensor([int(failed), *values], dtype=torch.int64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    any_failed, *maxima = local.tolist()
    return bool(any_failed), maxima


def other_rank_failed(what: str, group_name: str = "context") -> ValueError:
    return ValueError(
        f"{what}: another rank of the {group_name} group rejected its inputs (see its "
        "ValueError); this rank's inputs passed the checks"
    )


def agree(
    group,
    device: torch.device,
    error: Exception | None,
    what: str,
    values: list[int],
) -> list[int]:
    """:func:`exchange`, then raise ``error`` on the rank that had it and a ``ValueError`` on
    every other rank when any rank had one; returns the maxima of ``values``."""
    any_failed, maxima = exchange(group, device, error is not None, values)
    if error is not None:
        raise error
    if any_failed:
        raise other_rank_failed(what)
    return maxima


def all_reduce(tensor: torch.Tensor, group, op: str) -> torch.Tensor:
    """A new tensor: ``tensor`` summed (``op="sum"``) or maxed (``"max"``) over the group.

    Reduced in float64 (exact for counts, and the ranks' partial sums lose nothing), returned in
    ``tensor``'s dtype. Detached: the loss layer only reduces stop-gradient statistics.
    """
    import torch.distributed as dist

    out = tensor.detach().to(torch.float64, copy=True)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(out, op=reduce_op, group=group)
    return out.to(tensor.dtype)
