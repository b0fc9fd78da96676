"""The sparse teacher's part of the divergence tiles: K top-k ids per row plus one tail bucket.

With the teacher's log-probs ``lp_t`` over a row's ids ``K`` and its tail mass
``τ_t = 1 - Σ_K p_t``, and the student's ``lp_s`` and tail ``τ_s = Σ_{j∉K} p_s,j``::

    D = Σ_K p_t·(lp_t - lp_s) + τ_t·(log τ_t - log τ_s)            (0·log 0 = 0)

    dD/dz_s,j = p_s,j - p_t,j              for j in K
              = p_s,j·(1 - τ_t / τ_s)      for j outside K

(the teacher's tail spread over the student's tail in the student's proportions; the two
cases are written per entry, since ``(1 - r) + r`` at the ids cancels for a large ratio). The
student's tail is summed over the columns outside ``K`` (the kept columns zeroed in the tile
of ``exp``), never as ``1 - Σ_K p_s``, which cancels when ``K`` holds almost all the mass.
"""

from __future__ import annotations

import math

import torch


def slots(ids: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of ids ``[R, K]`` inside vocab block ``[v0, v0 + width)`` (clamped) and whether
    each is there (unused slots hold -1: never inside)."""
    local = ids - v0
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def pick(z: torch.Tensor, ids: torch.Tensor, v0: int, picked: torch.Tensor) -> torch.Tensor:
    """``picked`` ``[R, K]`` with the entries of tile ``z`` ``[R, Vb]`` (columns ``v0...``) at the
    ids inside it."""
    col, inside = slots(ids, v0, z.shape[1])
    return torch.where(inside, z.gather(1, col), picked)


def outside_sum(e: torch.Tensor, ids: torch.Tensor, v0: int) -> torch.Tensor:
    """``[R]`` Σ of tile ``e`` over the columns that are not ids; zeroes those columns of ``e``
    in place (exactly: each is added its own negative)."""
    col, inside = slots(ids, v0, e.shape[1])
    kept = e.gather(1, col)
    e.scatter_add_(1, col, torch.where(inside, -kept, 0.0))
    return e.sum(1)


def divergence(lp_s: torch.Tensor, log_tail_s: torch.Tensor, teacher) -> torch.Tensor:
    """``[R]`` forward KL over the ids plus the tail bucket.

    lp_s: ``[R, K]`` student log-probs at the ids; log_tail_s: ``[R]`` log of its tail;
    teacher: the rows' :class:`TopKRows`.
    """
    p_t = torch.where(teacher.used, teacher.logprobs.exp(), 0.0)
    head = (p_t * (teacher.logprobs - lp_s)).sum(1)
    tail_t = teacher.log_tail.exp()
    has_tail = teacher.log_tail > -math.inf
    return head + torch.where(has_tail, tail_t * (teacher.log_tail - log_tail_s), 0.0)


def tail_ratio(log_tail_t: torch.Tensor, log_tail_s: torch.Tensor) -> torch.Tensor:
    """``[R]`` ``τ_t / τ_s`` (0 where the teacher has no tail)."""
    return torch.where(log_tail_t > -math.inf, (log_tail_t - log_tail_s).exp(), 0.0)


def kept_factor(
    out: torch.Tensor, scratch: torch.Tensor, ids: torch.Tensor, v0: int, d, ratio
) -> torch.Tensor:
    """``out`` ``[R, Vb]`` <- ``u·d``, where the divergence's gradient is ``p_s ⊙ u·d`` minus
    ``d·p_t`` at the ids: ``u = 1`` at the ids, ``1 - τ_t/τ_s`` elsewhere. Written per entry,
    not as ``(1 - r) + r`` at the ids, which cancels when the ratio ``r`` is large.
    ``scratch``: a free tile (overwritten with the ids' membership); d: ``[R, 1]``; ratio:
    ``[R]``."""
    col, inside = slots(ids, v0, out.shape[1])
    member = scratch.zero_().scatter_add_(1, col, inside.to(scratch.dtype))  # 1 at the ids
    return torch.where(member > 0, d, (1.0 - ratio)[:, None] * d, out=out)


def add_teacher_term(dz: torch.Tensor, teacher, d: torch.Tensor, v0: int) -> None:
    """``dz[i, k] -= d_i·p_t,k`` for the ids inside this tile (in place); d: ``[R, 1]``, the
    divergence's upstream gradient with the transform's row factor."""
    col, inside = slots(teacher.ids, v0, dz.shape[1])
    p_t = torch.where(teacher.used, teacher.logprobs.exp(), 0.0)
    dz.scatter_add_(1, col, torch.where(inside, -p_t * d, 0.0))
