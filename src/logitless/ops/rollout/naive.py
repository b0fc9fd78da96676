"""The rollout-mismatch diagnostics written the naive way, on full ``[N, V]`` logits: the
oracle's piece."""

from __future__ import annotations

import math

import torch

from ...contract.head import HeadCall
from ...types import RolloutMismatch
from ..replay.naive import kept_set
from .mismatch import TrainerSide, partition


def naive_mismatch(call: HeadCall, logits: torch.Tensor) -> RolloutMismatch:
    """The diagnostics of the call's rows from their full transformed ``logits`` [N, V]: the
    trainer's log-softmax (masked to the kept sets under sampling replay), gathered at the
    engine's ids, its mass outside them as a log-sum-exp of the other columns, its top tokens
    where a logit equals the row's maximum; zero at ignored rows."""
    valid = call.labels != call.ignore_index
    z = logits.detach()
    if call.replay is not None:
        keep, _ = kept_set(z, torch.where(valid, call.labels, 0), call.replay)
        z = z.masked_fill(~keep, -math.inf)
    lp = torch.log_softmax(z, dim=-1)
    rollout = call.rollout
    used = rollout.used
    ids = torch.where(used, rollout.ids, 0)
    # an unused slot points at column 0 with "no": added, so it never unmarks an id there
    member = torch.zeros_like(lp).scatter_add_(1, ids, used.to(lp.dtype)) > 0
    tail = torch.where(member, -math.inf, lp).logsumexp(1)
    top = used & (z.gather(1, ids) == z.amax(1, keepdim=True))
    found = partition(TrainerSide(lp.gather(1, ids), tail, top), rollout)
    shape = call.batch_shape

    def place(values: torch.Tensor) -> torch.Tensor:
        mask = valid.reshape(-1, *([1] * (values.dim() - 1)))
        return torch.where(mask, values, values.new_zeros(())).reshape(*shape, *values.shape[1:])

    return RolloutMismatch(*(place(v) for v in found))
