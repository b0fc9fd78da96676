"""Naive full-logits implementations: the oracle for tests and the baseline for benchmarks.

These materialize the whole ``[..., V]`` logits tensor exactly as a hand-written training step
would (built from each op's naive piece: :mod:`logitless.ops.logprobs.naive`,
:mod:`logitless.ops.replay.naive`). Each takes its op's arguments, less the options that say
how and where the op runs (``vocab_parallel``, ``backend``, ``capturable``, ``row_capacity``,
``batch_invariant``, ``weight_grad_into``): its signature is derived from the op's
(:func:`~logitless.contract.options.arguments_like`), so an option is declared once.
``chunk_size`` is accepted and ignored. The input checks are the op's, so a test or a
benchmark can swap one for the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract.divergence import DivergenceOptions, check_divergence_call
from .contract.head import check_head_call
from .contract.options import HeadOptions, SamplerOptions, arguments_like
from .ops.divergence.naive import naive_divergence
from .ops.divergence.op import linear_divergence as ops_divergence
from .ops.logprobs.naive import full_logits, naive_logprobs
from .ops.logprobs.op import linear_logprobs as ops_logprobs
from .ops.replay.naive import kept_set, masked_logprobs
from .ops.rollout.naive import naive_mismatch
from .types import Divergence, LogProbs, RolloutLogProbs

__all__ = ["kept_set", "linear_divergence", "linear_logprobs"]

# the op's options the full-logits path has no use for: how and where the op runs
_OP_ONLY = (
    "vocab_parallel", "backend", "capturable", "row_capacity", "batch_invariant",
    "weight_grad_into",
)  # fmt: skip
_OP_ONLY_DIVERGENCE = ("vocab_parallel", "backend", "batch_invariant")


@arguments_like(ops_logprobs, without=_OP_ONLY)
def linear_logprobs(given: Mapping[str, Any]) -> LogProbs:
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

    With ``rollout_topk`` the result's ``mismatch`` is computed from the same full
    (log-)softmax: gathered at the engine's ids, the mass outside them a log-sum-exp of the
    other columns, the top tokens where a logit equals the row's maximum.
    """
    options = HeadOptions.pick(given).replace(backend="torch")
    head = (given["hidden"], given["weight"], given["labels"], given["bias"])
    call = check_head_call(*head, options, SamplerOptions.pick(given))
    logits = full_logits(call)  # [N, V]
    out = masked_logprobs(call, logits) if call.replay is not None else naive_logprobs(call, logits)
    if call.rollout is None:
        return out
    mismatch = naive_mismatch(call, logits)
    if call.replay is not None:
        return out._replace(mismatch=mismatch)
    return RolloutLogProbs(out.logprobs, out.entropy, mismatch)


@arguments_like(ops_divergence, without=_OP_ONLY_DIVERGENCE)
def linear_divergence(given: Mapping[str, Any]) -> Divergence:
    """:func:`logitless.linear_divergence` from both heads' full ``[..., V]`` logits.

    Computes, in plain PyTorch (TRL's ``generalized_jsd_loss`` per token)::

        lp_s = log_softmax(transform(F.linear(hidden, weight, bias).float()) / T)
        lp_t = log_softmax(transform_t(F.linear(teacher_hidden, teacher_weight, ...)) / T)
        beta 0: Σ p_t (lp_t - lp_s)    beta 1: Σ p_s (lp_s - lp_t)
        else:   β·KL(p_t‖m) + (1-β)·KL(p_s‖m),   m = (1-β)·p_s + β·p_t

    With ``teacher_topk`` the same divergence over the teacher's ids plus the tail bucket. Same
    checks as the op; ``chunk_size`` is accepted and ignored.
    """
    teacher = (given["teacher_hidden"], given["teacher_weight"], given["teacher_bias"])
    options = HeadOptions.pick(given).replace(backend="torch")
    div = DivergenceOptions.pick(given)
    student = (given["hidden"], given["weight"], given["labels"], given["bias"])
    call = check_divergence_call(*student, teacher, given["teacher_topk"], options, div)
    return naive_divergence(call)
