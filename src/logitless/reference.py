"""Naive full-logits implementations: the oracle for tests and the baseline for benchmarks.

These materialize the whole ``[..., V]`` logits tensor exactly as a hand-written training step
would. :func:`linear_logprobs` takes the arguments of :func:`logitless.linear_logprobs` but
``vocab_parallel`` and ``backend``, and runs the same input checks, so a test or a benchmark
can swap one for the other on one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validate import check_chunk_size, check_flag, check_head_args
from .types import LogProbs


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
) -> LogProbs:
    """Per-token log-probs (and entropy) of ``labels`` from full logits.

    Computes, in plain PyTorch::

        logits = F.linear(hidden, weight, bias).float()        # [..., V]
        logits = softcap * tanh(logits / softcap)              # if softcap
        logits = logits / temperature                          # scalar or [...] per token
        logp   = log_softmax(logits).gather(labels)            # [...]
        H      = -(softmax(logits) * log_softmax(logits)).sum(-1)

    with 0.0 (and a zero gradient) at rows whose label is ``ignore_index``. ``chunk_size`` is
    accepted for signature parity and ignored.
    """
    check_chunk_size(chunk_size)
    check_flag("with_entropy", with_entropy)
    args = check_head_args(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        head_dtype=head_dtype,
    )
    dt = args.head_dtype
    b = None if bias is None else bias.to(dt)
    logits = F.linear(args.hidden.to(dt), weight.to(dt), b).float()  # [N, V]
    if args.softcap is not None:
        logits = args.softcap * torch.tanh(logits / args.softcap)
    if isinstance(args.temperature, torch.Tensor):
        logits = logits / args.temperature[:, None]
    else:
        logits = logits / args.temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
    valid = args.labels != ignore_index
    safe_labels = torch.where(valid, args.labels, 0)
    zero = logp_all.new_zeros(())
    logp = torch.where(valid, logp_all.gather(1, safe_labels[:, None]).squeeze(1), zero)
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy = torch.where(valid, ent, zero).reshape(args.batch_shape)
    return LogProbs(logp.reshape(args.batch_shape), entropy)
