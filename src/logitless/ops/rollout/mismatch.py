"""The trainer's next-token distribution against the rollout engine's top-k, per position.

For a valid position the engine reported ``k`` ids ``K`` with log-probs ``lp_r`` (its mass
outside them: ``τ_r = 1 - Σ_K r``); the trainer's distribution ``t`` (the op's: the whole
vocabulary, or the sampler's kept set under sampling replay) gives ``lp_t`` at the ids and
``τ_t``, its mass outside them. On the K+1 buckets {each id, the rest} (0·log 0 = 0)::

    KL(r‖t) = Σ_K r·(lp_r - lp_t) + τ_r·(log τ_r - log τ_t)
    KL(t‖r) = Σ_K t·(lp_t - lp_r) + τ_t·(log τ_t - log τ_r)
    TV      = ½·(Σ_K |r - t| + |τ_r - τ_t|)

(the algebra of the sparse teacher's tail bucket, ``docs/distillation.md``). Merging the
columns outside ``K`` into one bucket is a map of the vocabulary, and an f-divergence (KL, TV)
never grows under a map of its outcomes (the data-processing inequality): each value is a lower
bound of the full-vocabulary one, exact on the partition.

The trainer's side comes from the forward that computes the log-probs, without another pass
over the vocabulary: the backends' probe (:class:`~logitless.backends.base.ProbeStats`: the
logits at the ids as the tiles computed them, and the mass outside the ids summed over its own
columns, so a small ``τ_t`` keeps its relative precision) or, for rows truncated by sampling
replay, their kept entries (:func:`of_entries`). The buckets are formed in float64 from those
compute-dtype values; the outputs are in the compute dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...backends.base import ProbeStats
from ...contract.collectives import all_reduce
from ...contract.head import HeadCall
from ...contract.rollout import RolloutRows
from ...contract.vocab import VocabParallel
from ...types import RolloutLogProbs, RolloutMismatch
from ..logprobs.function import run_rows_probed
from ..replay.kept import Entries
from ..rows import Rows, kernel_batch, kernel_options


class TrainerSide(NamedTuple):
    """The trainer's distribution at R positions' engine ids ``[R, K]``: ``logprobs`` (compute
    dtype; ``-inf``: no mass; any value at unused slots), ``log_tail`` ``[R]`` (log of its mass
    outside the ids) and ``top`` (bool: the id is one of the trainer's most likely tokens)."""

    logprobs: torch.Tensor
    log_tail: torch.Tensor
    top: torch.Tensor


def probe_ids(rollout: RolloutRows, vp: VocabParallel | None) -> torch.Tensor:
    """``[R, K]`` the engine's ids as this rank's kernels index its weight: shard-local, -1 at
    unused slots and at another shard's ids."""
    ids = rollout.ids
    if vp is None:
        return ids
    mine = (ids >= vp.vocab_start) & (ids < vp.vocab_end)
    return torch.where(mine, ids - vp.vocab_start, -1)


def of_probe(stats: ProbeStats, rollout: RolloutRows) -> TrainerSide:
    """The trainer's side from a full-vocabulary forward's probe: ``lp = (z - m) - log Σ`` (the
    label's log-prob expression: the same bits where an id is the label), ``τ_t`` from the
    columns outside the ids, an id on top when its logit equals the row's maximum (the same
    computed values: exact, ties included)."""
    m, log_sum = stats.max[:, None], stats.log_sum[:, None]
    top = rollout.used & (stats.z == m)
    lp = stats.z.sub_(m).sub_(log_sum)  # the probe's logits are not read again
    return TrainerSide(lp, stats.log_out - stats.log_sum, top)


def of_entries(
    entries: Entries,
    lse: torch.Tensor,
    probe: torch.Tensor,
    vocab: int,
    vp: VocabParallel | None,
) -> TrainerSide:
    """The trainer's side over kept sets (sampling replay's truncated rows): R rows' kept
    ``entries`` (this rank's, shard-local ids, logits ``z``), their log-sum-exp over the kept
    set ``lse`` ``[R]`` (the whole group's), the engine's ids ``probe`` ``[R, K]`` (shard-local,
    -1 elsewhere) and ``vocab``, this shard's rows. An id outside its kept set has
    probability 0 (``-inf``); ``τ_t`` sums the kept entries that are not ids; an id is on top
    when its logit equals the kept set's maximum. Under ``vp`` the parts are combined over the
    group (one MAX and one SUM all-reduce)."""
    num, k = probe.shape
    rows, ids, z = entries.rows.long(), entries.ids.long(), entries.z
    top = z.new_full((num,), -math.inf).scatter_reduce_(0, rows, z, "amax", include_self=True)
    keys = torch.where(probe >= 0, torch.arange(num, device=z.device)[:, None] * vocab + probe, -1)
    keys, order = keys.reshape(-1).sort()
    mine = rows * vocab + ids
    pos = torch.searchsorted(keys, mine).clamp(max=max(keys.numel() - 1, 0))
    hit = keys[pos] == mine if keys.numel() else torch.zeros_like(mine, dtype=torch.bool)
    slot = order[pos][hit]
    z_k = z.new_zeros(num * k).index_put_((slot,), z[hit])
    n_k = z.new_zeros(num * k).index_put_((slot,), torch.ones_like(z[hit]))
    out = z.new_zeros(num).index_add_(0, rows[~hit], (z[~hit] - lse[rows[~hit]]).exp())
    if vp is not None:
        top = all_reduce(top, vp.group, "max")
        parts = all_reduce(torch.cat([z_k.view(num, k), n_k.view(num, k), out[:, None]], 1),
                           vp.group, "sum")  # fmt: skip
        z_k, n_k, out = parts[:, :k].reshape(-1), parts[:, k : 2 * k].reshape(-1), parts[:, -1]
    z_k, found = z_k.view(num, k), n_k.view(num, k) > 0
    lp = torch.where(found, z_k - lse[:, None], -math.inf)
    return TrainerSide(lp, out.log(), found & (z_k == top[:, None]))


def _kl(lp_a: torch.Tensor, lp_b: torch.Tensor) -> torch.Tensor:
    """``[R]`` KL(a‖b) of bucket log-probs ``[R, B]``, 0·log 0 = 0 (infinite where b has no
    mass and a has)."""
    return torch.where(lp_a > -math.inf, lp_a.exp() * (lp_a - lp_b), 0.0).sum(1)


# Positions whose buckets are formed at once (bounds the float64 [rows, k + 1] temporaries).
_CHUNK_ROWS = 1024


def partition(trainer: TrainerSide, rollout: RolloutRows) -> RolloutMismatch:
    """The diagnostics of R positions on the K+1 buckets (the module doc), from the trainer's
    side and the engine's; in the trainer's compute dtype, 0 where a position has no id. The
    trainer's log-probs become the result's (0 written at the unused slots, in place)."""
    num, dtype = rollout.ids.shape[0], trainer.logprobs.dtype
    out = torch.zeros(5, num, dtype=dtype, device=rollout.ids.device)
    agree = torch.zeros(num, dtype=torch.bool, device=rollout.ids.device)
    for r0 in range(0, num, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, num)
        part = TrainerSide(*(t[r0:r1] for t in trainer))
        out[:, r0:r1], agree[r0:r1] = _buckets(part, rollout.rows(r0, r1))
    compared = rollout.used.any(1)
    lp = trainer.logprobs.masked_fill_(~(rollout.used & compared[:, None]), 0.0)
    return RolloutMismatch(lp, *out.unbind(0), agree & compared, compared)


def _buckets(trainer: TrainerSide, rollout: RolloutRows) -> tuple[torch.Tensor, torch.Tensor]:
    """``([5, R] KL(r‖t), KL(t‖r), TV, Σ_K t, Σ_K r; [R] top-1 agreement)`` of R positions,
    formed in float64 (0 where a position has no id)."""
    used = rollout.used
    lp_r = rollout.bucket_logprobs()
    lp_t = torch.where(used, trainer.logprobs.double(), -math.inf)
    buckets_t = torch.cat([lp_t, trainer.log_tail.double()[:, None]], 1)
    buckets_r = torch.cat([lp_r, rollout.log_tail[:, None]], 1)
    best = torch.cat([lp_r, lp_r.new_full((lp_r.shape[0], 1), -math.inf)], 1).amax(1)
    agree = (used & (lp_r == best[:, None]) & trainer.top).any(1)
    values = torch.stack(
        [  # a KL is >= 0: rounding of the two sides' masses (each ~1 ulp from 1) is clamped
            _kl(buckets_r, buckets_t).clamp(min=0.0),
            _kl(buckets_t, buckets_r).clamp(min=0.0),
            0.5 * (buckets_r.exp() - buckets_t.exp()).abs().sum(1),
            lp_t.exp().sum(1),
            lp_r.exp().sum(1),
        ]
    )
    return torch.where(used.any(1), values, 0.0), agree


def scatter(rows: Rows, found: RolloutMismatch) -> RolloutMismatch:
    """The diagnostics of the call's valid rows in the caller's layout (``labels.shape``, and
    ``[*labels.shape, k]`` for the log-probs), zero (False) at ignored positions."""

    def place(values: torch.Tensor) -> torch.Tensor:
        if rows.index is not None:
            zeros = values.new_zeros((rows.num_tokens, *values.shape[1:]))
            values = zeros.index_copy(0, rows.index, values)
        return values.reshape(*rows.batch_shape, *values.shape[1:])

    return RolloutMismatch(*(place(v) for v in found))


def rollout_logprobs(call: HeadCall, rows: Rows) -> RolloutLogProbs:
    """The log-prob op with the rollout-mismatch diagnostics (no sampling replay): the call's
    forward, probed at the engine's ids (the log-probs and entropy are the same bits as
    without), then the buckets."""
    rollout = call.rollout.take(rows.index)
    batch = kernel_batch(call, rows)
    opts = kernel_options(call, rows.labels.numel())
    logp, ent, found = run_rows_probed(batch, opts, probe_ids(rollout, call.vocab_parallel))
    with torch.no_grad():
        mismatch = scatter(rows, partition(of_probe(found, rollout), rollout))
    return RolloutLogProbs(rows.scatter(logp), None if ent is None else rows.scatter(ent), mismatch)
