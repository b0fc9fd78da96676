"""The one "fail together" protocol for every collective call of logitless.

A collective call must be made by every rank of its group, in the same order, with tensors of
the same size, whatever the rank's local data. So local validation never skips a collective:
a rank whose inputs failed its checks still takes part, with a ``failed`` flag, and raises its
own ``ValueError`` afterwards; every other rank learns from the same collective that some rank
failed and raises a ``ValueError`` saying so, instead of hanging in the next collective.

Used by the vocab-parallel head (:mod:`.vocab`), the context-parallel losses, the step
normalizer and the step accumulator. :func:`check_then_agree` is the rule every checked
collective call follows: its local check runs, then the agreement, whatever the check found.
Besides its fingerprint (:mod:`.fingerprint`), this module imports only torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .fingerprint import fingerprint

T = TypeVar("T")
R = TypeVar("R")

# Stand-in for "no constraint" in a MAX-reduced value (e.g. per-token advantages have no count).
UNBOUNDED = 2**62


def check_group(group: object, name: str):
    """``group`` as a ``ProcessGroup``, or ``None``; a ``ValueError`` before any collective."""
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


def comm_device(group) -> torch.device:
    """Device for small control tensors of ``group``: the current CUDA device for NCCL groups,
    the CPU otherwise."""
    if _backend_name(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_and_size(group) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size.

    A ``torch.distributed.ProcessGroup`` (None: the default group) is asked through
    torch.distributed. A standalone backend object built directly over a store without
    ``init_process_group`` (Fast-LLM builds its groups so: ``ProcessGroupGloo(store, rank,
    size)``, a ``torch.distributed.Backend``) is unknown to ``torch.distributed.get_rank``
    and is asked itself; the collectives take either kind.
    """
    import torch.distributed as dist

    if _standalone(group):
        return group.rank(), group.size()
    return dist.get_rank(group), dist.get_world_size(group)


def _standalone(group) -> bool:
    """A group object that is not a ``torch.distributed.ProcessGroup`` (see rank_and_size)."""
    import torch.distributed as dist

    return group is not None and not isinstance(group, dist.ProcessGroup)


def _backend_name(group) -> str:
    import torch.distributed as dist

    return group.name() if _standalone(group) else dist.get_backend(group)


def signature(*parts: object) -> int:
    """A process-independent 31-bit fingerprint of ``parts`` (``hash`` is salted per process).

    ``parts`` are Python values (configs, shapes, flags), so under ``torch.compile`` the
    fingerprint is a constant of the traced code, computed once while tracing. The function
    marked constant for the compiler lives in a module imported only while compiling:
    marking it here would import ``torch._dynamo`` (1.5 s) with ``import logitless``."""
    if torch.compiler.is_compiling():
        from logitless.contract._traced import constant_fingerprint

        return constant_fingerprint(*parts)
    return fingerprint(parts)


def other_rank_failed(what: str, group_name: str) -> ValueError:
    """The error of a rank whose own inputs passed while another rank's did not.

    ``group_name`` names the argument that holds the group (``"context_group"``, ...).
    """
    return ValueError(
        f"{what}: another rank of {group_name} rejected its inputs (see its ValueError); this "
        "rank's inputs passed the checks"
    )


def exchange(group, failed: bool, values: list[int]) -> tuple[bool, list[int]]:
    """One all-reduce MAX of ``[failed, *values]`` (int64): (any rank failed, the maxima).

    Pass ``-x`` to get the minimum of ``x``. Raises nothing: for callers that must join
    another collective before raising (see :func:`agree` for the usual case).
    """
    import torch.distributed as dist

    local = torch.tensor([int(failed), *values], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    any_failed, *maxima = local.tolist()
    return bool(any_failed), maxima


def agree(
    group, error: Exception | None, what: str, values: list[int], group_name: str
) -> list[int]:
    """:func:`exchange`, then raise ``error`` on the rank that had it and a ``ValueError`` on
    every other rank when any rank had one; returns the maxima of ``values``."""
    any_failed, maxima = exchange(group, error is not None, values)
    if error is not None:
        raise error
    if any_failed:
        raise other_rank_failed(what, group_name)
    return maxima


def sum_or_raise(
    group, values: torch.Tensor, error: Exception | None, what: str, group_name: str
) -> torch.Tensor:
    """``values`` (1-D float64) summed over ``group`` in one all-reduce that also carries the
    failure flag; raises like :func:`agree`. Returns a new tensor on ``values``' device."""
    import torch.distributed as dist

    flagged = torch.cat([values.double(), values.new_tensor([float(error is not None)]).double()])
    flagged = flagged.to(comm_device(group))
    dist.all_reduce(flagged, op=dist.ReduceOp.SUM, group=group)
    if error is not None:
        raise error
    if flagged[-1] > 0:
        raise other_rank_failed(what, group_name)
    return flagged[:-1].to(values.device)


def all_reduce(tensor: torch.Tensor, group, op: str) -> torch.Tensor:
    """A new tensor: ``tensor`` summed (``op="sum"``) or maxed (``"max"``) over the group.

    Reduced in float64 (exact for counts, and the ranks' partial sums lose nothing), returned in
    ``tensor``'s dtype. Detached: only stop-gradient statistics are reduced this way.
    """
    import torch.distributed as dist

    out = tensor.detach().to(torch.float64, copy=True)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(out, op=reduce_op, group=group)
    return out.to(tensor.dtype)


def check_then_agree(
    check: Callable[[], T], agree: Callable[[T | None, ValueError | None], R]
) -> tuple[T, R]:
    """``(check(), agree(result, None))``; when ``check`` raises ``ValueError``, ``agree`` is
    called with ``(None, error)`` all the same (and must raise)."""
    result, error = None, None
    try:
        result = check()
    except ValueError as e:
        error = e
    agreed = agree(result, error)
    if error is not None:  # agree should have raised it; never return a failed check
        raise error
    return result, agreed
