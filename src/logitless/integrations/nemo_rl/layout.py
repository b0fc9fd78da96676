"""NeMo RL's token layouts, as its fused forward gets them and as its losses want them back.

Part of :mod:`logitless.integrations.nemo_rl`. NeMo RL's Megatron worker hands ``GPTModel``
its input ids as the labels (``labels=input_ids_cp_sharded``): batch-first ``[B, S]``, or for
a packed batch one THD row ``[1, T/cp]`` whose sequences are each padded to
``cu_seqlens_q_padded`` and split over the context-parallel ranks in Megatron's zigzag order
(2·cp chunks per sequence, rank r holding chunks r and 2·cp−1−r; NeMo RL's
``_pack_sequences_for_megatron`` and ``_get_tokens_on_this_cp_rank``). Its losses and its
log-prob post-processor take next-token log-probs ``[B, S−1]`` in the unpacked layout, the
same on every context-parallel rank (its logits path gathers them over the group with
``AllGatherCPTensor``). This module turns the one into the other:

- :func:`next_token_labels`: the label of each local token is the next token *of its own
  sequence* (the ignore index at a sequence's last token and at padding), built from the
  whole sequence (gathered over the context-parallel group, a few int64 per token), so no
  label crosses a packed boundary and none is missing at a zigzag chunk's edge;
- :func:`unpack`: this rank's ``[1, T/cp]`` log-probs gathered over the group (in backward,
  the gradient summed over the group and this rank's tokens taken, as ``AllGatherCPTensor``
  does) and laid out ``[B, S−1]``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...contract.options import IGNORE_INDEX

__all__ = ["Packing", "gather_context", "next_token_labels", "unpack"]


class Packing:
    """Where each token of a packed (THD) batch lives: its sequences' real and padded
    offsets (``cu_seqlens_q`` / ``cu_seqlens_q_padded`` of ``packed_seq_params``, read once)
    and the context-parallel split."""

    def __init__(self, params: Any, cp_rank: int, cp_size: int, device: torch.device) -> None:
        real = params.cu_seqlens_q
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else real
        self.starts = padded[:-1].tolist()
        self.lengths = (real[1:] - real[:-1]).tolist()
        self.padded = (padded[1:] - padded[:-1]).tolist()
        self.cp_rank, self.cp_size, self.device = cp_rank, cp_size, device
        self.total = int(padded[-1])

    def positions(self, rank: int) -> torch.Tensor:
        """The global packed position of each of ``rank``'s tokens, ``[T/cp]``."""
        chunks = 2 * self.cp_size if self.cp_size > 1 else 1
        out = []
        for start, n_pad in zip(self.starts, self.padded, strict=True):
            c = n_pad // chunks
            pieces = (rank, chunks - 1 - rank) if self.cp_size > 1 else (0,)
            out += [torch.arange(start + k * c, start + (k + 1) * c) for k in pieces]
        return torch.cat(out).to(self.device) if out else torch.zeros(0, dtype=torch.long)

    def order(self) -> torch.Tensor:
        """Every rank's positions, rank after rank: where each gathered token goes."""
        return torch.cat([self.positions(r) for r in range(self.cp_size)])

    def next_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The next-token label of every global position ``[T]`` of the packed ids ``[T]``."""
        labels = torch.full_like(ids, IGNORE_INDEX)
        for start, n in zip(self.starts, self.lengths, strict=True):
            if n > 1:
                labels[start : start + n - 1] = ids[start + 1 : start + n]
        return labels


def gather_context(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` ``[n]`` of every rank of ``group``, rank after rank ``[size * n]``; backward sums
    the gradient over the group and keeps this rank's part (the semantics of NeMo RL's
    ``AllGatherCPTensor``: every rank computes the loss on the gathered tensor)."""
    return _GatherContext.apply(x, group)


class _GatherContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.numel())
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.numel() // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * n : (rank + 1) * n], None


def next_token_labels(
    input_ids: torch.Tensor, packing: Packing | None, cp_group: Any
) -> torch.Tensor:
    """The labels of this rank's tokens, in their layout: ``[B, S]`` (the next input id, the
    ignore index at the last position) or ``[1, T/cp]`` packed (the next token of the same
    sequence; the ignore index at each sequence's last token and at padding)."""
    if packing is None:
        tail = torch.full_like(input_ids[:, :1], IGNORE_INDEX)
        return torch.cat([input_ids[:, 1:], tail], dim=1)
    local = input_ids.reshape(-1)
    if packing.cp_size > 1:
        every = _all_gather(local, cp_group)
        ids = torch.empty_like(every)
        ids[packing.order()] = every
    else:
        ids = local
    labels = packing.next_tokens(ids)
    return labels[packing.positions(packing.cp_rank)][None]


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty(dist.get_world_size(group) * x.numel())
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def unpack(
    logprobs: torch.Tensor, packing: Packing | None, cp_group: Any, width: int | None
) -> torch.Tensor:
    """Next-token log-probs ``[B, width − 1]`` (position t scores token t+1), from this
    rank's ``[B, S]`` (padded) or ``[1, T/cp]`` (packed) log-probs; differentiable.

    ``width``: the unpacked batch's sequence length (NeMo RL's ``data["input_ids"]``); None:
    the padded batch's own, or the longest packed sequence's padded length."""
    if packing is None:
        out = logprobs[:, :-1]
        return out if width is None else out[:, : width - 1]
    flat = logprobs.reshape(-1)
    if packing.cp_size > 1:
        every = gather_context(flat, cp_group)
        flat = every.new_zeros(packing.total).index_put((packing.order(),), every)
    width = max(packing.padded, default=1) if width is None else width
    rows, cols, src = [], [], []
    for i, (start, n) in enumerate(zip(packing.starts, packing.lengths, strict=True)):
        m = max(min(n, width) - 1, 0)  # a packed tail may exceed the unpacked row (NeMo RL)
        rows.append(torch.full((m,), i))
        cols.append(torch.arange(m))
        src.append(torch.arange(start, start + m))
    index = [torch.cat(t).to(flat.device) for t in (rows, cols, src)]
    out = flat.new_zeros(len(packing.starts), width - 1)
    return out.index_put((index[0], index[1]), flat[index[2]])
