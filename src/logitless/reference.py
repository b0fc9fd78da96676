"""Naive full-logits implementations: the oracle for tests and the baseline for benchmarks.

These materialize the whole ``[..., V]`` logits tensor exactly as a hand-written training step
would (built from each op's naive piece: :mod:`logitless.ops.logprobs.naive`,
:mod:`logitless.ops.replay.naive`). They take the same arguments as
:func:`logitless.linear_logprobs` (``chunk_size`` is accepted and ignored; there is no
``vocab_parallel`` or ``backend``) and the same input checks, so a test or a benchmark can
swap one for the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .contract.divergence import DivergenceOptions, TeacherTopK, check_divergence_call
from .contract.head import check_head_call
from .contract.options import HeadOptions, SamplerOptions, given_arguments
from .ops.divergence.naive import naive_divergence
from .ops.logprobs.naive import full_logits, naive_logprobs
from .ops.replay.naive import kept_set, masked_logprobs
from .sampling import SamplingMask
from .types import Divergence, LogProbs

__all__ = ["kept_set", "linear_divergence", "linear_logprobs"]


@given_arguments
def linear_logprobs(
    given: Mapping[str, Any],
    /,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
) -> LogProbs:
    """Per-token log-probs (and entropy) of ``labels`` from full logits.

    Computes, in plain PyTorch::

        logits = F.linear(hidden, weight, bias).float()        # [..., V]
        logits = logits * logit_scale                          # if logit_scale
        logits = softcap * tanh(logits / softcap)              # if softcap
        logits = logits / temperature                          # scalar or [...] per token
        logp   = log_softmax(logits).gather(labels)            # [...]
        H      = -(softmax(logits) * log_softmax(logits)).sum(-1)

    with 0.0 (and a zero gradient) at rows whose label is ``ignore_index``. ``chunk_size`` is
    accepted for signature parity and ignored. A float64 head stays in float64.

    With sampling replay (``sampling_mask`` / ``top_k`` / ``top_p`` / ``min_p``, as in
    :func:`logitless.linear_logprobs`), the logits outside each row's kept set ``K`` are set to
    ``-inf`` before the log-softmax (a masked log-softmax; :func:`kept_set` builds ``K`` as a
    ``[N, V]`` mask from the full logits), and the result is a ``ReplayLogProbs``.
    """
    options = HeadOptions.pick(given).replace(backend="torch")
    call = check_head_call(hidden, weight, labels, bias, options, SamplerOptions.pick(given))
    logits = full_logits(call)  # [N, V]
    if call.replay is not None:
        return masked_logprobs(call, logits)
    return naive_logprobs(call, logits)


@given_arguments
def linear_divergence(
    given: Mapping[str, Any],
    /,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    *,
    teacher_topk: TeacherTopK | None = None,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_logit_scale: float | None = None,
    teacher_softcap: float | None = None,
    vocab_size: int | None = None,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
) -> Divergence:
    """:func:`logitless.linear_divergence` from both heads' full ``[..., V]`` logits.

    Computes, in plain PyTorch (TRL's ``generalized_jsd_loss`` per token)::

        lp_s = log_softmax(transform(F.linear(hidden, weight, bias).float()) / T)
        lp_t = log_softmax(transform_t(F.linear(teacher_hidden, teacher_weight, ...)) / T)
        beta 0: Σ p_t (lp_t - lp_s)    beta 1: Σ p_s (lp_s - lp_t)
        else:   β·KL(p_t‖m) + (1-β)·KL(p_s‖m),   m = (1-β)·p_s + β·p_t

    With ``teacher_topk`` the same divergence over the teacher's ids plus the tail bucket. Same
    checks as the op; ``chunk_size`` is accepted and ignored.
    """
    teacher = (teacher_hidden, teacher_weight, teacher_bias)
    options = HeadOptions.pick(given).replace(backend="torch")
    div = DivergenceOptions.pick(given)
    call = check_divergence_call(hidden, weight, labels, bias, teacher, teacher_topk, options, div)
    return naive_divergence(call)
