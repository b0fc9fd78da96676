"""The sparse teacher's part of the divergence's torch tiles (:mod:`.torch_divergence`): K
top-k ids per row plus one tail bucket.

Two distributions over a row's K+1 buckets (its ids ``K`` and the tail): the teacher's ``r``
(its log-probs ``lp_t`` at the ids, the tail mass ``τ_t = 1 - Σ_K p_t``) and the student's
``q`` (``lp_s`` at the ids, its tail ``τ_s = Σ_{j∉K} p_s,j``). The divergence is TRL's
generalized JSD over the buckets (0·log 0 = 0)::

    beta 0:   D = KL(r‖q) = Σ_K p_t·(lp_t - lp_s) + τ_t·(log τ_t - log τ_s)
    beta 1:   D = KL(q‖r) = Σ_K p_s·(lp_s - lp_t) + τ_s·(log τ_s - log τ_t)
    else:     D = β·KL(r‖M) + (1-β)·KL(q‖M),   M = (1-β)·q + β·r

The student's gradient flows through its K entries and its tail (``dq_b/dz_j = p_s,j·([j in
b] - q_b)``)::

    beta 0:   dD/dz_s,j = p_s,j - p_t,j              for j in K
                        = p_s,j·(1 - τ_t / τ_s)      for j outside K
    beta > 0: dD/dz_s,j = p_s,j·(u_b(j) - Σ_b q_b·u_b),  u_b = log q_b - log r_b      (beta 1)
                                                      u_b = (1-β)·(log q_b - log M_b)  (JSD)

(``b(j)``: the bucket of column ``j``; ``Σ_b q_b·u_b`` is KL(q‖r), resp. (1-β)·KL(q‖M): the
forms of the dense reverse KL and JSD with the buckets for the vocabulary.) At the ids and
outside them the factor is written per entry, never as a difference of the two (which cancels
when they are far apart). The student's tail is summed over the columns outside ``K`` (the
kept columns zeroed in the tile of ``exp``), never as ``1 - Σ_K p_s``, which cancels when
``K`` holds almost all the mass.
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


def _buckets(lp_s: torch.Tensor, log_tail_s: torch.Tensor, teacher):
    """``[R, K+1]`` bucket log-probs of the student and the teacher (``-inf``: an unused slot
    or an empty tail)."""
    lq = torch.cat([lp_s.masked_fill(~teacher.used, -math.inf), log_tail_s[:, None]], 1)
    lr = torch.cat([teacher.logprobs.masked_fill(~teacher.used, -math.inf),
                    teacher.log_tail[:, None]], 1)  # fmt: skip
    return lq, lr


def _kl(lp_a: torch.Tensor, lp_b: torch.Tensor) -> torch.Tensor:
    """``[R]`` KL(a‖b) of bucket log-probs ``[R, B]``, 0·log 0 = 0."""
    return torch.where(lp_a > -math.inf, lp_a.exp() * (lp_a - lp_b), 0.0).sum(1)


def log_mixture(lq: torch.Tensor, lr: torch.Tensor, beta: float) -> torch.Tensor:
    """``log((1-β)·q + β·r)`` of log-probs (any shape, broadcast)."""
    return torch.logaddexp(lq + math.log1p(-beta), lr + math.log(beta))


def divergence(lp_s: torch.Tensor, log_tail_s: torch.Tensor, teacher, beta: float):
    """``([R], [R] or None)``: the divergence over the ids plus the tail bucket, and what its
    gradient needs beyond it (KL(q‖r) at beta 1, KL(q‖M) for the JSD, None at beta 0).

    lp_s: ``[R, K]`` student log-probs at the ids; log_tail_s: ``[R]`` log of its tail;
    teacher: the rows' :class:`TopKRows`.
    """
    lq, lr = _buckets(lp_s, log_tail_s, teacher)
    if beta == 0.0:
        return _kl(lr, lq), None
    if beta == 1.0:
        d = _kl(lq, lr)
        return d, d
    log_m = log_mixture(lq, lr, beta)
    kl_q = _kl(lq, log_m)
    return beta * _kl(lr, log_m) + (1.0 - beta) * kl_q, kl_q


def tail_factor(log_tail_t, log_tail_s, aux, beta: float) -> torch.Tensor:
    """``[R]`` the gradient's factor ``u`` on the student's tail columns, less ``Σ_b q_b·u_b``
    (beta > 0; 0 where the student has no tail: no column carries it)."""
    if beta == 1.0:
        u = (log_tail_s - log_tail_t) - aux
    else:
        u = (1.0 - beta) * ((log_tail_s - log_mixture(log_tail_s, log_tail_t, beta)) - aux)
    return torch.where(log_tail_s > -math.inf, u, 0.0)


def tail_ratio(log_tail_t: torch.Tensor, log_tail_s: torch.Tensor) -> torch.Tensor:
    """``[R]`` ``τ_t / τ_s`` (0 where the teacher has no tail)."""
    return torch.where(log_tail_t > -math.inf, (log_tail_t - log_tail_s).exp(), 0.0)


def kept_factor(
    out: torch.Tensor, scratch: torch.Tensor, ids: torch.Tensor, v0: int, d, ratio
) -> torch.Tensor:
    """Beta 0: ``out`` ``[R, Vb]`` <- ``u·d``, where the divergence's gradient is ``p_s ⊙ u·d``
    minus ``d·p_t`` at the ids: ``u = 1`` at the ids, ``1 - τ_t/τ_s`` elsewhere. Written per
    entry, not as ``(1 - r) + r`` at the ids, which cancels when the ratio ``r`` is large.
    ``scratch``: a free tile (overwritten with the ids' membership); d: ``[R, 1]``; ratio:
    ``[R]``."""
    col, inside = slots(ids, v0, out.shape[1])
    member = scratch.zero_().scatter_add_(1, col, inside.to(scratch.dtype))  # 1 at the ids
    return torch.where(member > 0, d, (1.0 - ratio)[:, None] * d, out=out)


def bucket_factor(out, scratch, lp_s, teacher, v0: int, d, aux, u_tail, beta: float):
    """Beta > 0: ``out`` ``[R, Vb]`` <- ``d·(u_b(j) - Σ_b q_b·u_b)`` (the divergence's gradient
    is ``p_s ⊙`` this): each id's own value at its column, ``u_tail`` (:func:`tail_factor`)
    elsewhere; each entry written once (an id's column gets its value plus exact zeros).

    lp_s: the tile's student log-probs; scratch: a free tile; d, aux: ``[R, 1]``, ``[R]``;
    u_tail: ``[R]``."""
    col, inside = slots(teacher.ids, v0, out.shape[1])
    lp_k = lp_s.gather(1, col)  # [R, K]
    if beta == 1.0:
        u_k = (lp_k - teacher.logprobs) - aux[:, None]
    else:
        log_m = log_mixture(lp_k, teacher.logprobs, beta)
        u_k = (1.0 - beta) * ((lp_k - log_m) - aux[:, None])
    out.zero_().scatter_add_(1, col, torch.where(inside, u_k * d, 0.0))
    member = scratch.zero_().scatter_add_(1, col, inside.to(scratch.dtype))  # 1 at the ids
    return out.addcmul_(member.neg_().add_(1.0), u_tail[:, None] * d)


def add_teacher_term(dz: torch.Tensor, teacher, d: torch.Tensor, v0: int) -> None:
    """``dz[i, k] -= d_i·p_t,k`` for the ids inside this tile (in place); d: ``[R, 1]``, the
    divergence's upstream gradient with the transform's row factor."""
    col, inside = slots(teacher.ids, v0, dz.shape[1])
    p_t = torch.where(teacher.used, teacher.logprobs.exp(), 0.0)
    dz.scatter_add_(1, col, torch.where(inside, -p_t * d, 0.0))
