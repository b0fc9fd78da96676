"""The rollout-mismatch diagnostics reduced per sequence and per batch, ready to log.

:func:`rollout_mismatch_metrics` takes the per-token :class:`~logitless.types.RolloutMismatch`
of a log-prob call given ``rollout_topk=`` (docs/rollout-mismatch.md) and the response mask,
and returns token means over the batch, the worst sequence's mean of each divergence, and the
per-sequence means themselves; documents are the policy losses' (rows of ``[B, T]``, or
``document_ids`` of a packed stream: the same segment sums).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..types import RolloutMismatch
from ._segments import document_segments, segment_mean, sum_per_document

__all__ = ["MismatchMetrics", "rollout_mismatch_metrics"]

# per-token diagnostics averaged over tokens (top1_agree: the fraction that agree)
_MEANS = (
    "kl_rollout_trainer",
    "kl_trainer_rollout",
    "total_variation",
    "topk_mass",
    "rollout_mass",
    "top1_agree",
)
# divergences whose worst sequence is reported too
_WORST = ("kl_rollout_trainer", "kl_trainer_rollout", "total_variation")


class MismatchMetrics(NamedTuple):
    """metrics: name -> 0-dim fp32 tensor, ready to log (``prefix`` + the diagnostic's name:
    its token mean over the batch; ``..._seq_max`` for the divergences: the largest of the
    sequences' means; ``tokens``: how many positions were compared); per_sequence: name ->
    ``[D]`` fp32 means over each sequence's compared tokens (0 for a sequence with none), and
    ``tokens`` ``[D]``."""

    metrics: dict[str, torch.Tensor]
    per_sequence: dict[str, torch.Tensor]


def rollout_mismatch_metrics(
    mismatch: RolloutMismatch,
    mask: torch.Tensor | None = None,
    *,
    document_ids: torch.Tensor | None = None,
    prefix: str = "rollout_mismatch/",
) -> MismatchMetrics:
    """Per-sequence and per-batch means of the rollout-mismatch diagnostics (no gradient).

    Args:
        mismatch: the ``mismatch`` of :func:`logitless.linear_logprobs` (or an integration's
            log-prob function) called with ``rollout_topk=``; its tensors ``[B, T]`` or ``[N]``.
        mask: ``[B, T]`` / ``[N]`` bool, the tokens to count (the response mask); None: all.
            Only positions the call compared (a label and an id) count either way.
        document_ids: ``[N]`` (or ``[B, T]``) int64 document of each token of a packed stream,
            -1 for padding, as :func:`logitless.policy_loss` takes them; None: each row of a
            ``[B, T]`` batch is a sequence.
        prefix: the start of every metric's name.

    A token whose divergence is infinite (the trainer gives no mass where the engine has some:
    an id outside the trainer's kept set under replay, or the engine's ids holding all its
    mass where the trainer has a tail) makes the means infinite: they are reported as they are.

    >>> import torch, logitless
    >>> from logitless import RolloutTopK
    >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(50, 8)
    >>> labels = torch.randint(0, 50, (2, 5))
    >>> top = torch.randn(2, 5, 50).log_softmax(-1).topk(4)
    >>> out = logitless.linear_logprobs(
    ...     hidden, weight, labels, rollout_topk=RolloutTopK(top.indices, top.values))
    >>> found = rollout_mismatch_metrics(out.mismatch)
    >>> sorted(found.metrics)[:3]
    ['rollout_mismatch/kl_rollout_trainer', 'rollout_mismatch/kl_rollout_trainer_seq_max', \
'rollout_mismatch/kl_trainer_rollout']
    >>> found.per_sequence["tokens"]
    tensor([5., 5.])
    """
    if not isinstance(mismatch, RolloutMismatch):
        raise ValueError(
            f"mismatch must be a RolloutMismatch (the .mismatch of a call given rollout_topk=), "
            f"got {type(mismatch).__name__}"
        )
    compared = mismatch.compared
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != compared.shape:
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"mask must have the diagnostics' shape {list(compared.shape)}, got {got}"
            )
        compared = compared & mask.bool()
    seg = document_segments(compared, document_ids, "mismatch")
    valid = compared.reshape(-1)
    tokens = sum_per_document(valid.float(), seg)
    count = valid.sum().float()
    metrics, per_seq = {}, {"tokens": tokens}
    with torch.no_grad():
        for name in _MEANS:
            x = getattr(mismatch, name).reshape(-1).float()
            per_seq[name] = segment_mean(x, valid, seg)
            total = torch.where(valid, x, 0.0).sum()
            metrics[prefix + name] = total / count.clamp(min=1.0)
        for name in _WORST:
            seq = torch.where(tokens > 0, per_seq[name], 0.0)  # each mean >= 0
            metrics[prefix + name + "_seq_max"] = torch.cat([seq, seq.new_zeros(1)]).amax()
    metrics[prefix + "tokens"] = count
    return MismatchMetrics(metrics, per_seq)
