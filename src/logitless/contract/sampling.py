"""What a truncating sampler kept: the kept token ids of each generated position; and what
the engine reported of its distribution there, its top-k log-probs (:class:`RolloutTopK`, the
rollout-mismatch diagnostics, ``docs/rollout-mismatch.md``).

When rollouts are sampled with top-k / top-p, the engine samples from the truncated,
renormalized distribution over a kept set ``K`` of each position, and the log-probs it reports
(vLLM's ``processed_logprobs``) are normalized over ``K``. A trainer that normalizes over the
whole vocabulary computes a different policy: every importance ratio then carries
``log Σ_{j∈K} p_j``, the log of the kept mass. DeepSeek-V3.2 (arXiv 2512.02556, section 3.1,
"Keep Sampling Mask") keeps the sampler's masks and applies them to the trainer's policy, so
both sides share one action space. :class:`SamplingMask` carries such a mask into
:func:`logitless.linear_logprobs`, :func:`logitless.fused_policy_loss`, the module forms and
the HF integration (``sampling_mask=``); see ``docs/sampling-replay.md``.

Two layouts of the same thing:

- CSR (:class:`SamplingMask`): ``token_ids`` ``[nnz]`` and ``offsets`` ``[N + 1]`` over the
  ``N`` label positions in row-major order; position ``i`` kept
  ``token_ids[offsets[i]:offsets[i + 1]]``. This is vLLM's layout.
- padded: ``[..., K]`` ids per position with a pad value (default -1) in the unused slots.

A position with no kept id means "not truncated": the full vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import INT_DTYPES as _INT_DTYPES
from .checks import fmt_shape as _shape

__all__ = ["RolloutTopK", "SamplingMask"]


class SamplingMask(NamedTuple):
    """Kept token ids per label position, in CSR form (vLLM's ``SamplingMask`` layout).

    token_ids: ``[nnz]`` integer global vocabulary ids, the kept ids of position 0, then of
        position 1, ... (any order inside a position, no duplicates).
    offsets: ``[N + 1]`` integer, non-decreasing, ``offsets[0] == 0`` and
        ``offsets[-1] == nnz``; ``N`` is the number of label positions (``labels.numel()``,
        row-major). Position ``i`` kept ``token_ids[offsets[i]:offsets[i + 1]]``; none means
        not truncated (the full vocabulary).

    Positions whose label is ``ignore_index`` may hold anything valid (they are skipped).
    The label of a position is always counted in its kept set; if the mask lacks it, the op
    adds it and reports it (``LogProbs.label_added``).

    Example:
        >>> import torch
        >>> m = SamplingMask.from_padded(torch.tensor([[3, 7, -1], [-1, -1, -1], [5, -1, -1]]))
        >>> m.token_ids.tolist(), m.offsets.tolist()
        ([3, 7, 5], [0, 2, 2, 3])
        >>> m.to_padded().tolist()
        [[3, 7], [-1, -1], [5, -1]]
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_positions(self) -> int:
        """N, the number of label positions the mask describes."""
        return self.offsets.numel() - 1

    def counts(self) -> torch.Tensor:
        """``[N]`` int64 number of kept ids of each position (0: not truncated)."""
        return (self.offsets[1:] - self.offsets[:-1]).long()

    @classmethod
    def from_padded(cls, token_ids: torch.Tensor, pad_value: int = -1) -> SamplingMask:
        """The CSR form of padded ids ``[..., K]``: entries equal to ``pad_value`` are unused.

        The leading dimensions are flattened row-major, so position ``i`` of the result is
        ``token_ids.reshape(-1, K)[i]``. Kept ids keep their order within a position.
        """
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() < 1:
            got = _shape(token_ids) if isinstance(token_ids, torch.Tensor) else type(token_ids)
            raise ValueError(f"token_ids must be an integer tensor of shape [..., K], got {got}")
        if token_ids.dtype not in _INT_DTYPES:
            raise ValueError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
        if isinstance(pad_value, bool) or not isinstance(pad_value, int):
            raise ValueError(f"pad_value must be an int, got {pad_value!r}")
        n = 1
        for d in token_ids.shape[:-1]:
            n *= d
        ids = token_ids.reshape(n, token_ids.shape[-1])
        used = ids != pad_value  # [N, K]
        offsets = torch.zeros(ids.shape[0] + 1, dtype=torch.int64, device=ids.device)
        offsets[1:] = used.sum(1).cumsum(0)
        return cls(ids[used].long(), offsets)

    def to_padded(self, pad_value: int = -1, width: int | None = None) -> torch.Tensor:
        """``[N, K]`` int64 ids with ``pad_value`` in unused slots; ``K = width`` or the largest
        count. Reshape the result to ``[*labels.shape, K]`` for the caller's layout."""
        if isinstance(pad_value, bool) or not isinstance(pad_value, int):
            raise ValueError(f"pad_value must be an int, got {pad_value!r}")
        counts = self.counts()
        most = int(counts.max()) if counts.numel() else 0
        width = most if width is None else width
        if isinstance(width, bool) or not isinstance(width, int) or width < most:
            raise ValueError(f"width must be an int >= the largest count {most}, got {width!r}")
        n = counts.numel()
        out = torch.full((n, width), pad_value, dtype=torch.int64, device=self.token_ids.device)
        if self.token_ids.numel():
            row = torch.repeat_interleave(torch.arange(n, device=counts.device), counts)
            col = torch.arange(row.numel(), device=row.device) - self.offsets[:-1].long()[row]
            out[row, col] = self.token_ids.long()
        return out


class RolloutTopK(NamedTuple):
    """The rollout engine's top-k log-probs at each label position, as the engine returns them.

    token_ids: ``[*labels.shape, k]`` integer global vocabulary ids; ``pad_id`` in the slots a
        position does not use (``k`` may vary per position). The ids of a position are
        distinct, in any order; the sampled token may be one of them.
    logprobs: ``[*labels.shape, k]`` float32 / float64 log-probabilities of those ids under the
        engine's distribution (``<= 0``; ``-inf`` is a probability of 0, as vLLM's processed
        log-probs give the tokens its sampler masked); the values at unused slots are not read.
    pad_id: the id of an unused slot (any other id outside ``[0, V)`` is an error).

    A position whose slots are all unused is not compared (``RolloutMismatch.compared`` is
    False there).

    Example:
        >>> import torch
        >>> topk = RolloutTopK(
        ...     token_ids=torch.tensor([[[5, 9], [2, -1]]]),         # [B=1, T=2, k=2]
        ...     logprobs=torch.tensor([[[-0.1, -2.5], [-0.3, 0.0]]]),
        ... )
        >>> int((topk.token_ids != topk.pad_id).sum())
        3
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    pad_id: int = -1
