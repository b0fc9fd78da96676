"""The divergence op written the naive way, on both heads' full ``[N, V]`` logits: the
oracle's piece (differentiable through autograd; the teacher's logits carry no gradient)."""

from __future__ import annotations

import math

import torch

from ...contract.divergence import DivergenceCall, TopKRows
from ...types import Divergence
from ..logprobs.naive import full_logits, naive_logprobs


def generalized_jsd(lp_s: torch.Tensor, lp_t: torch.Tensor, beta: float) -> torch.Tensor:
    """``[N]`` TRL's divergence of log-probs ``[N, V]``: KL(t‖s) at beta 0, KL(s‖t) at 1,
    else ``β·KL(p_t‖m) + (1-β)·KL(p_s‖m)`` with ``m = (1-β)·p_s + β·p_t``."""
    if beta == 0.0:
        return (lp_t.exp() * (lp_t - lp_s)).sum(-1)
    if beta == 1.0:
        return (lp_s.exp() * (lp_s - lp_t)).sum(-1)
    log_m = torch.logaddexp(lp_s + math.log1p(-beta), lp_t + math.log(beta))
    kl_t = (lp_t.exp() * (lp_t - log_m)).sum(-1)
    kl_s = (lp_s.exp() * (lp_s - log_m)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def _bucket_kl(lp_a: torch.Tensor, lp_b: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(a‖b) of bucket log-probs ``[N, B]`` with 0·log 0 = 0: an empty bucket
    (``-inf``) adds nothing, and neither its value nor its gradient is a NaN."""
    has = lp_a > -math.inf
    a = torch.where(has, lp_a, 0.0)
    b = torch.where(has, lp_b, 0.0)
    return torch.where(has, a.exp() * (a - b), 0.0).sum(-1)


def topk_divergence(lp_s: torch.Tensor, topk: TopKRows, beta: float) -> torch.Tensor:
    """``[N]`` TRL's divergence over each row's top-k ids plus one tail bucket (the teacher's
    mass outside the ids against the student's); the student's tail is a log-sum-exp over the
    columns outside the ids."""
    col = topk.ids.clamp(min=0)
    kept = torch.zeros_like(lp_s).scatter_add_(1, col, topk.used.to(lp_s.dtype)) > 0
    log_tail_s = lp_s.masked_fill(kept, -math.inf).logsumexp(1)
    lq = torch.cat([lp_s.gather(1, col).masked_fill(~topk.used, -math.inf), log_tail_s[:, None]], 1)
    lr = torch.cat([topk.logprobs.masked_fill(~topk.used, -math.inf), topk.log_tail[:, None]], 1)
    if beta == 0.0:
        return _bucket_kl(lr, lq)
    if beta == 1.0:
        return _bucket_kl(lq, lr)
    # the mixture of two empty buckets is empty: -inf, held away from logaddexp's NaN gradient
    both = (lq > -math.inf) | (lr > -math.inf)
    mixed = torch.logaddexp(
        torch.where(both, lq, 0.0) + math.log1p(-beta), torch.where(both, lr, 0.0) + math.log(beta)
    )
    log_m = torch.where(both, mixed, -math.inf)
    return beta * _bucket_kl(lr, log_m) + (1.0 - beta) * _bucket_kl(lq, log_m)


def naive_divergence(call: DivergenceCall) -> Divergence:
    """The call's divergence (and student log-probs / entropy) from full logits."""
    student = call.student
    z_s = full_logits(student)  # [N, V]
    lp_s = torch.log_softmax(z_s, dim=-1)
    if call.topk is not None:
        div = topk_divergence(lp_s, call.topk, call.beta)
    else:
        with torch.no_grad():
            z_t = full_logits(call.teacher).to(lp_s.dtype)
        div = generalized_jsd(lp_s, torch.log_softmax(z_t, dim=-1), call.beta)
    valid = student.labels != student.ignore_index
    div = torch.where(valid, div, div.new_zeros(())).reshape(student.batch_shape)
    logp, ent = naive_logprobs(student, z_s)
    return Divergence(div, logp if call.with_logprobs else None, ent)
