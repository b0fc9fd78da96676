"""Small public result types."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogProbs(NamedTuple):
    """Result of :func:`logitless.linear_logprobs`.

    logprobs: ``[...]`` fp32 log-probability of each label; 0.0 where the label is ignored.
    entropy: ``[...]`` fp32 entropy of each row's distribution (0.0 where ignored), or ``None``
    when ``with_entropy=False``.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
