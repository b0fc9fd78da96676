"""Sampling replay written the naive way, on full ``[N, V]`` logits: the oracle's piece."""

from __future__ import annotations

import torch

from ...contract.head import HeadCall
from ...contract.replay import ReplayArgs
from ...types import ReplayLogProbs


def kept_set(
    logits: torch.Tensor, labels: torch.Tensor, replay: ReplayArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` bool kept set of each row (label included) and ``[N]`` bool "label added".

    logits: ``[N, V]`` the sampler's logits (after softcap and temperature); labels: ``[N]``
    ids in ``[0, V)``. With a mask: the mask's ids (every id where a row has none). With the
    sampler's parameters, in vLLM's order: min-p (``z >= max z + log min_p``), top-k (``z >=``
    the k-th largest value, ties kept), then top-p over the renormalized rest: a token is kept
    when the mass of the tokens with a strictly larger logit is below ``p`` (float64 sums).
    """
    n, vocab = logits.shape
    dev = logits.device
    z = logits.detach()
    if replay.is_mask:
        counts = replay.mask_offsets[1:] - replay.mask_offsets[:-1]
        keep = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        row = torch.repeat_interleave(torch.arange(n, device=dev), counts)
        keep[row, replay.mask_ids] = True
        keep[counts == 0] = True
    else:
        keep = torch.ones(n, vocab, dtype=torch.bool, device=dev)
        if replay.min_p is not None:
            top = z.amax(-1, keepdim=True)
            cut = top + torch.log(replay.min_p.clamp(min=1e-300)).float()[:, None]
            keep &= (z >= cut) | (replay.min_p[:, None] == 0)
        if replay.top_k is not None:
            k = replay.top_k.clamp(1, vocab)
            kth = z.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
            keep &= (z >= kth) | (replay.top_k[:, None] >= vocab)
        if replay.top_p is not None:
            masked = torch.where(keep, z.double(), float("-inf"))
            probs = masked.softmax(-1)
            sv, order = masked.sort(-1, descending=True)
            sp = probs.gather(1, order)
            excl = sp.cumsum(-1) - sp  # mass before each token, in decreasing order
            # tokens tied in value share the mass strictly before their group
            starts = torch.ones_like(sv, dtype=torch.bool)
            starts[:, 1:] = sv[:, 1:] != sv[:, :-1]
            group = starts.long().cumsum(-1) - 1
            first = torch.full_like(excl, float("inf")).scatter_reduce(
                1, group, excl, "amin", include_self=True
            )
            keep_sorted = first.gather(1, group) < replay.top_p[:, None]
            keep_p = torch.zeros_like(keep).scatter(1, order, keep_sorted)
            keep &= keep_p | (replay.top_p[:, None] >= 1)
    rows = torch.arange(n, device=dev)
    added = ~keep[rows, labels]
    keep[rows, labels] = True
    return keep, added


def masked_logprobs(call: HeadCall, logits: torch.Tensor) -> ReplayLogProbs:
    """The call's log-probs over each row's kept set: a log-softmax of its full ``logits``
    [N, V] masked to :func:`kept_set`."""
    valid = call.labels != call.ignore_index
    labels = torch.where(valid, call.labels, 0)
    out = _masked_logprobs(logits, labels, valid, call)
    fields = (out.logprobs, out.entropy, out.label_added, out.kept_size, out.log_kept_mass)
    shape = call.batch_shape
    return ReplayLogProbs(*(None if t is None else t.reshape(shape) for t in fields))


def _masked_logprobs(logits, labels, valid, call: HeadCall):
    """The replay branch of :func:`linear_logprobs`: a log-softmax over each row's kept set."""
    keep, added = kept_set(logits, labels, call.replay)  # [N, V], [N]
    masked = logits.masked_fill(~keep, float("-inf"))
    logp_all = torch.log_softmax(masked, dim=-1)
    zero = logits.new_zeros(())
    logp = torch.where(valid, logp_all.gather(1, labels[:, None]).squeeze(1), zero)
    entropy = None
    if call.with_entropy:
        # H = lse_K - Σ_K p z: z outside K is replaced by 0 (p = 0 there) so no 0·inf appears
        lse = torch.logsumexp(masked, dim=-1)
        ent = lse - (logp_all.exp() * logits.masked_fill(~keep, 0.0)).sum(-1)
        entropy = torch.where(valid, ent, zero)
    kept_mass = None
    if call.replay.with_kept_mass:
        with torch.no_grad():
            gap = torch.logsumexp(masked, -1) - torch.logsumexp(logits, -1)
            kept_mass = torch.where(valid, gap.clamp(max=0.0), zero)
    size = torch.where(valid, keep.sum(-1), 0)
    return ReplayLogProbs(
        logp,
        entropy,
        label_added=added & valid,
        kept_size=size,
        log_kept_mass=kept_mass,
    )
