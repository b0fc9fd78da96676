"""A distillation loss alone: a per-token divergence aggregated like the policy losses.

The aggregation, the documents, the step normalizer and the context group are the policy
loss's own (one rule, in :mod:`.checks` / :mod:`.tokens` / :mod:`.terms`): the loss is
:func:`~logitless.policy_loss`'s distillation term with a zero policy term (zero advantages:
every surrogate is ``-A·f(r)``, so its value and gradient vanish), and the metrics are that
term's.
"""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .normalizer import LossNormalizer
from .policy import policy_loss

__all__ = ["distillation_loss"]

_METRICS = ("loss", "distill_divergence", "num_tokens", "num_sequences")


def distillation_loss(
    divergence: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    document_ids: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    context_group: object | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``Σ_t a_t · D_t``: a per-token divergence (:func:`logitless.linear_divergence`)
    aggregated like a policy loss; returns ``(loss, metrics)``.

    Args:
        divergence: ``[N]`` or ``[B, T]`` per-token divergence, differentiable.
        mask: bool, same shape: the tokens that count.
        aggregation: one of the policy losses' aggregations (``"token_mean"``: TRL's
            ``batchmean`` over tokens; ``"seq_mean_token_mean"``, ...; ``norm_length`` for
            ``"seq_mean_token_sum_norm"``).
        document_ids, normalizer, context_group: as in :func:`logitless.policy_loss` (packed
            streams, whole-step denominators, context parallelism).

    Returns:
        ``loss`` (0-dim, times ``normalizer.loss_scale``) and detached metrics ``loss``,
        ``distill_divergence`` (the weighted mean), ``num_tokens``, ``num_sequences``.

    >>> d = torch.tensor([[0.5, 0.1, 0.0]], requires_grad=True)
    >>> m = torch.tensor([[True, True, False]])
    >>> loss, metrics = distillation_loss(d, m)
    >>> round(float(loss), 4), sorted(metrics)
    (0.3, ['distill_divergence', 'loss', 'num_sequences', 'num_tokens'])
    """
    if not isinstance(divergence, torch.Tensor) or not divergence.is_floating_point():
        raise ValueError(f"divergence must be a floating-point tensor, got {divergence!r}")
    config = PolicyLossConfig(
        aggregation=aggregation, norm_length=norm_length, distill_coef=1.0,
        distill_aggregation=None,
    )  # fmt: skip
    zeros = torch.zeros(divergence.shape, device=divergence.device)
    loss, metrics = policy_loss(
        zeros, zeros, zeros, mask, config=config, document_ids=document_ids,
        normalizer=normalizer, context_group=context_group, divergence=divergence,
    )  # fmt: skip
    return loss, {k: v for k, v in metrics.items() if k in _METRICS}
