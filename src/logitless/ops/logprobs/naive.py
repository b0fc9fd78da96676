"""The log-prob op written the naive way, on full ``[N, V]`` logits: the oracle's piece."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...contract.head import HeadCall
from ...types import LogProbs


def full_logits(call: HeadCall) -> torch.Tensor:
    """``[N, V]`` transformed logits of every row, in the compute dtype (differentiable):
    ``F.linear`` in the head dtype, as a hand-written step does, then the transform."""
    dt = call.head_dtype
    b = None if call.bias is None else call.bias.to(dt)
    logits = F.linear(call.hidden.to(dt), call.weight.to(dt), b).to(call.compute_dtype)
    temp = None if call.temperature is None else call.temperature[:, None]
    return call.transform.apply(logits, temp)


def naive_logprobs(call: HeadCall, logits: torch.Tensor) -> LogProbs:
    """Log-probs (and entropy) of the call's labels from its full ``logits`` [N, V]; 0.0 at
    ignored rows."""
    valid = call.labels != call.ignore_index
    safe_labels = torch.where(valid, call.labels, 0)
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
    zero = logp_all.new_zeros(())
    logp = torch.where(valid, logp_all.gather(1, safe_labels[:, None]).squeeze(1), zero)
    entropy = None
    if call.with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy = torch.where(valid, ent, zero).reshape(call.batch_shape)
    return LogProbs(logp.reshape(call.batch_shape), entropy)
