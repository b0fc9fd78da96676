"""The sparse teacher's part of the divergence tiles: K top-k ids per row plus one tail bucket.

With the teacher's log-probs ``lp_t`` over a row's ids ``K`` and its tail mass
``τ_t = 1 - Σ_K p_t``, and the student's ``lp_s`` and tail ``τ_s = Σ_{j∉K} p_s,j``::

    D = Σ_K p_t·(lp_t - lp_s) + τ_t·(log τ_t - log τ_s)            (0·log 0 = 0)

    dD/dz_s,j = p_s,j - p_t,j              for j in K
              = p_s,j·(1 - τ_t / τ_s)      for j outside K

(the teacher's tail spread over the student's tail in the student's proportions). The
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


def divergence(
    picked: torch.Tensor, lse: torch.Tensor, log_tail_s: torch.Tensor, teacher
) -> torch.Tensor:
    """``[R]`` forward KL over the ids plus the tail bucket.

    picked: ``[R, K]`` student logits at the ids; lse: ``[R]`` the student's log-sum-exp;
    log_tail_s: ``[R]`` log of its tail; teacher: the rows' :class:`TopKRows`.
    """
    lp_s = picked - lse[:, None]
    p_t = torch.where(teacher.used, teacher.logprobs.exp(), 0.0)
    head = (p_t * (teacher.logprobs - lp_s)).sum(1)
    tail_t = teacher.log_tail.exp()
    has_tail = teacher.log_tail > -math.inf
    return head + torch.where(has_tail, tail_t * (teacher.log_tail - log_tail_s), 0.0)


def tail_ratio(log_tail_t: torch.Tensor, log_tail_s: torch.Tensor) -> torch.Tensor:
    """``[R]`` ``τ_t / τ_s`` (0 where the teacher has no tail)."""
    return torch.where(log_tail_t > -math.inf, (log_tail_t - log_tail_s).exp(), 0.0)


def add_kept_grad(
    dz: torch.Tensor, p: torch.Tensor, teacher, ratio: torch.Tensor, d: torch.Tensor, v0: int
) -> None:
    """``dz[i, k] += d_i·(p_s,k·r_i - p_t,k)`` for the ids inside this tile (in place).

    p: the tile's student probabilities ``[R, Vb]``; ratio: ``[R]`` ``τ_t / τ_s``; d: ``[R, 1]``
    the divergence's upstream gradient (with the transform's row factor).
    """
    col, inside = slots(teacher.ids, v0, dz.shape[1])
    p_t = torch.where(teacher.used, teacher.logprobs.exp(), 0.0)
    value = (p.gather(1, col) * ratio[:, None] - p_t) * d
    dz.scatter_add_(1, col, torch.where(inside, value, 0.0))
