"""The rollout engine's top-k log-probs of a head call: :class:`RolloutTopK`, checked into
:class:`RolloutRows` by :func:`check_rollout_topk`.

Inference engines return, for every generated position, the log-probs of their ``k`` most
likely tokens (vLLM's ``logprobs=k``, which also adds the sampled token when it is not among
them; SGLang's ``top_logprobs_num``). Given to a head call as ``rollout_topk=``, the call also
reports how the trainer's next-token distribution differs from the engine's at each position
(docs/rollout-mismatch.md). Every check runs before any FLOP and raises ``ValueError`` naming
the argument, what was expected and what was given (a host read per 2048 positions).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .checks import INT_DTYPES, MASS_SLACK, check_full_precision, check_topk_values, fmt_shape
from .replay import check_csr_ids
from .sampling import RolloutTopK

__all__ = ["RolloutRows", "RolloutTopK", "check_rollout_topk"]


class RolloutRows(NamedTuple):
    """A checked :class:`RolloutTopK` over the call's ``N`` label positions (views of the given
    tensors where they can be: ``[N, k]`` outputs of the engine are not copied).

    ids: ``[N, k]`` int64 global ids, ``-1`` in unused slots; logprobs: ``[N, k]`` as given
    (float32 / float64; any value in unused slots; read through :meth:`bucket_logprobs`);
    log_tail: ``[N]`` float64 log of the engine's mass outside the ids,
    ``1 - Σ exp(logprobs)`` (``-inf``: no mass left, or the ids cover the whole vocabulary).
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    log_tail: torch.Tensor

    @property
    def used(self) -> torch.Tensor:
        """``[N, k]`` bool: the slots that hold an id."""
        return self.ids >= 0

    def take(self, idx: torch.Tensor | None) -> RolloutRows:
        """Rows ``idx`` (all when None)."""
        return self if idx is None else RolloutRows(*(t.index_select(0, idx) for t in self))

    def rows(self, r0: int, r1: int) -> RolloutRows:
        """Rows ``[r0, r1)`` (views)."""
        return RolloutRows(*(t[r0:r1] for t in self))

    def bucket_logprobs(self) -> torch.Tensor:
        """``[N, k]`` float64 log-probs, clamped at 0 (rounding), ``-inf`` in unused slots."""
        return torch.where(self.used, self.logprobs.double().clamp(max=0.0), -math.inf)


def _tensors(topk: object, batch_shape: torch.Size, device: torch.device):
    """Types, shapes, dtypes and devices of ``topk`` (no value read)."""
    if not isinstance(topk, RolloutTopK):
        raise ValueError(
            f"rollout_topk must be a logitless.RolloutTopK(token_ids, logprobs, pad_id), got "
            f"{type(topk).__name__}"
        )
    ids, lps, pad = topk
    want = f"[{', '.join(map(str, batch_shape))}, k]"
    if not isinstance(ids, torch.Tensor) or ids.dtype not in INT_DTYPES:
        got = f"dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"rollout_topk.token_ids must be an integer tensor {want}, got {got}")
    if ids.dim() != len(batch_shape) + 1 or ids.shape[:-1] != batch_shape:
        raise ValueError(
            f"rollout_topk.token_ids must have shape [*labels.shape, k] = {want} (one row of "
            f"ids per label position), got {fmt_shape(ids)}"
        )
    if not isinstance(lps, torch.Tensor) or not lps.is_floating_point() or lps.shape != ids.shape:
        got = f"shape {fmt_shape(lps)}" if isinstance(lps, torch.Tensor) else type(lps).__name__
        raise ValueError(
            f"rollout_topk.logprobs must be a floating tensor shaped like token_ids "
            f"{fmt_shape(ids)}, got {got}"
        )
    check_full_precision(**{"rollout_topk.logprobs": lps})
    if lps.requires_grad:
        raise ValueError("rollout_topk.logprobs must not require grad (it is the engine's data)")
    if isinstance(pad, bool) or not isinstance(pad, int):
        raise ValueError(f"rollout_topk.pad_id must be an int, got {pad!r}")
    for name, t in (("token_ids", ids), ("logprobs", lps)):
        if t.device != device:
            raise ValueError(
                f"rollout_topk.{name} must be on labels' device {device}, got {t.device}"
            )
    return ids, lps, pad


# Positions checked at once: bounds the check's [rows, k] temporaries (float64 values, the
# duplicate scan's sorted keys) where a forward-only call's own peak is a few tiles.
_CHECK_ROWS = 2048


def check_rollout_topk(
    topk: object, batch_shape: torch.Size, device: torch.device, vocab_size: int
) -> RolloutRows:
    """The checked rows of ``rollout_topk`` over a call's label positions, or ``ValueError``.

    ``vocab_size``: the global vocabulary. Ids must be distinct within a position and in
    ``[0, vocab_size)`` (or ``pad_id``); log-probs finite or ``-inf``, ``<= 0`` and each
    position's probabilities summing to at most 1 (each beyond ``1e-3`` of rounding). Checked
    2048 positions at a time (one host read per block, two when it has ids); an error is
    reported for the whole call (its positions counted from the first).
    """
    ids, lps, pad = _tensors(topk, batch_shape, device)
    n, k = math.prod(batch_shape), ids.shape[-1]
    ids, given = ids.reshape(n, k).long(), lps.reshape(n, k)
    tail = torch.empty(n, dtype=torch.float64, device=device)
    for r0 in range(0, n, _CHECK_ROWS):
        r1 = min(r0 + _CHECK_ROWS, n)
        try:
            tail[r0:r1] = _checked_tail(ids[r0:r1], given[r0:r1], pad, vocab_size)
        except ValueError:
            _checked_tail(ids, given, pad, vocab_size)  # the message of the whole call
            raise
    if pad != -1:  # else the ids are kept as given: -1 marks the unused slots already
        ids = torch.where(ids != pad, ids, -1)
    return RolloutRows(ids, given, tail)


def _checked_tail(ids: torch.Tensor, given: torch.Tensor, pad: int, vocab_size: int):
    """``[R]`` float64 log of the engine's mass outside the ids of R positions (``ids``,
    ``given`` ``[R, k]``), after their checks (``ValueError``)."""
    n, k = ids.shape
    used = ids != pad
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = used.sum(1).cumsum(0)
    check_csr_ids(ids[used], offsets, vocab_size, "rollout_topk")
    lps = torch.where(used, given.double(), -math.inf)
    bad = used & (torch.isnan(lps) | (lps > MASS_SLACK))
    rule = "log-probabilities (<= 0, or -inf; not NaN)"
    check_topk_values("rollout_topk", lps, bad, lps.exp().sum(1), rule)
    tail = torch.log(-torch.expm1(lps.clamp(max=0.0).logsumexp(1).clamp(max=0.0)))
    return torch.where(used.sum(1) >= vocab_size, -math.inf, tail)
