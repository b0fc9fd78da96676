"""Row selection: the valid rows of a head call, gathered once before any kernel runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..parallel.vocab import VocabParallel

if TYPE_CHECKING:
    from .._validate import HeadArgs


class Rows(NamedTuple):
    """The valid rows of a head call (label != ignore_index), ready for the kernels.

    hidden: [M, H] (a differentiable gather of the caller's rows); labels: [M] int64;
    temperature: [M] fp32 or None (scalar temperature); index: [M] row ids into the flattened
    batch, or None when every row is valid; num_tokens / batch_shape: the caller's layout.
    """

    hidden: torch.Tensor
    labels: torch.Tensor
    temperature: torch.Tensor | None
    index: torch.Tensor | None
    num_tokens: int
    batch_shape: torch.Size

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the caller's ``labels.shape`` -> its [M] valid rows."""
        flat = values.reshape(-1)
        return flat if self.index is None else flat.index_select(0, self.index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[M] per-row values (any dtype) -> the caller's ``labels.shape``, zero at ignored rows."""
        if self.index is not None:
            values = values.new_zeros(self.num_tokens).index_copy(0, self.index, values)
        return values.reshape(self.batch_shape)


def select_rows(args: HeadArgs, ignore_index: int) -> Rows:
    """Drop ignored rows before any FLOP; no copy when every row is valid.

    The number of valid rows was read on the host by the checks (``args.num_valid``), so the
    index is built without another host synchronization.
    """
    n = args.labels.numel()
    hidden, labels = args.hidden, args.labels
    temp = args.temperature if isinstance(args.temperature, torch.Tensor) else None
    idx = None
    if args.num_valid < n:
        valid = labels != ignore_index
        # Positions of the valid rows in order, without nonzero()'s host sync: each valid row
        # writes its own index to its rank among the valid rows; ignored rows go to a spare slot.
        slot = torch.where(valid, valid.cumsum(0) - 1, args.num_valid)
        arange = torch.arange(n, device=labels.device)
        idx = arange.new_empty(args.num_valid + 1).scatter_(0, slot, arange)[: args.num_valid]
        hidden = hidden.index_select(0, idx)
        labels = labels.index_select(0, idx)
        temp = None if temp is None else temp.index_select(0, idx)
    return Rows(hidden, labels, temp, idx, n, args.batch_shape)


def kernel_labels(rows: Rows, vocab_parallel: VocabParallel | None) -> torch.Tensor:
    """[M] labels as the kernels index the local weight: shard-local under vocab parallelism
    (out of ``[0, V_local)`` for labels another rank owns; the kernels mask those)."""
    if vocab_parallel is None or vocab_parallel.vocab_start == 0:
        return rows.labels
    return rows.labels - vocab_parallel.vocab_start
