"""The types of a checked policy-loss call: :class:`LossCall` and :class:`DocumentStats`.

``check_policy_loss`` (:mod:`.checks`) builds a :class:`LossCall` once per call; the document
statistics (:mod:`.stats`), the loss terms (:mod:`.terms`) and the driver (:mod:`.policy`)
take it whole, so the config and the loss inputs travel inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._segments import Segments
from .config import PolicyLossConfig
from .normalizer import LossNormalizer


@dataclass(frozen=True)
class LossCall:
    """One policy-loss call, checked: its inputs and their layout.

    config; old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, normalizer: as
    given to :func:`~logitless.policy_loss` (the log-probs of the policy itself are not part of
    the call: the fused loss evaluates it at many).
    seg: document of each flattened token (``[N]`` int64, -1 = padding) and the length of
        per-document buffers (over the context group: 1 + its largest id).
    adv_len: number of per-sequence advantages, or None for per-token advantages.
    norm_length: Dr.GRPO's ``L`` for ``seq_mean_token_sum_norm``, else None.
    key: fingerprint of the config and input layout (what document statistics must match).
    group: the context-parallel group, or None.
    divergence: the per-token divergence to a teacher (differentiable), or None.
    """

    config: PolicyLossConfig
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    normalizer: LossNormalizer | None
    seg: Segments
    adv_len: int | None
    norm_length: float | None
    key: int
    group: object | None
    divergence: torch.Tensor | None = None

    def valid_and_dtype(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """``[N]`` bool of the tokens that count, and the compute dtype (bf16 in -> fp32)."""
        valid = self.mask.reshape(-1) & (self.seg.ids >= 0)
        return valid, torch.promote_types(logprobs.dtype, torch.float32)

    def token_advantages(self) -> torch.Tensor:
        """Per-token ``[N]`` advantages from per-token or per-sequence input."""
        advantages = self.advantages
        if self.adv_len is None:
            return advantages.reshape(-1)
        slot = self.seg.ids.clamp(min=0)  # [N]; padding reads document 0 and is masked later
        return advantages[slot] if advantages.numel() else advantages.new_zeros(slot.shape)


@dataclass(frozen=True)
class DocumentStats:
    """Per-document sums of one call's token stream, over its context-parallel group.

    Everything ``policy_loss`` needs to know about whole documents, as ``[size]`` tensors in
    the loss's compute dtype. Every entry is a stop-gradient statistic. Made by
    :func:`~logitless.losses.document_stats`; pass it to ``policy_loss(...,
    document_stats=...)`` to evaluate the loss on the same stream again (e.g. chunk by chunk)
    without communicating.

    size: ``D``, the length of per-document buffers: 1 + the largest document id of the group.
    tokens: valid tokens (mask true, not padding) of each document.
    log_ratio: ``Σ_t (log π_θ − log π_old)`` over each document's valid tokens (GSPO ratio,
        ``ratio_seq_mask``), or None when the config needs none.
    clipped_log_ratio: ``Σ_t ĉ_t`` (GMPO), or None.
    log_rho: ``Σ_t log π_old/π_rollout`` (sequence truncated IS, ``mismatch_seq_mask``), or None.
    key: fingerprint of the config and input layout it was computed for (checked on use).
    """

    size: int
    tokens: torch.Tensor
    log_ratio: torch.Tensor | None
    clipped_log_ratio: torch.Tensor | None
    log_rho: torch.Tensor | None
    key: int
