"""Where a slime micro-batch's response tokens sit on this rank, and its loss inputs laid out
like them.

Part of :mod:`logitless.integrations.slime`. slime's ``get_batch``
(``slime/backends/megatron_utils/data.py``) packs a micro-batch's samples into one THD stream
``[1, S]``; sample ``s`` has ``total_lengths[s]`` tokens, the last ``response_lengths[s]`` of
them its response, and the logits at position ``q`` of a sample score its token ``q + 1``, so
response token ``j`` is scored at position ``P_s − 1 + j`` (``P_s`` the prompt's length).
Under context parallelism each rank holds:

- by default (zigzag), each sample padded to ``2·cp·c`` tokens (``c = ceil(T_s / 2cp)``) and
  cut into ``2·cp`` chunks of ``c``, this rank holding chunks ``r`` and ``2·cp − 1 − r``
  (``slice_with_cp``);
- with ``--allgather-cp``, a contiguous ``1/cp`` of the whole concatenated stream.

In both modes slime hands the loss its per-token inputs (advantages, old / reference /
rollout log-probs) per sample in the zigzag order of ``get_logits_and_tokens_offset_with_cp``
(its ``cp_utils.py``), and the loss masks whole. :func:`responses` reads the layout from the
lengths slime holds as Python ints (one host read: the check of ``rollout_mask_sums``);
:meth:`Responses.per_token` lays an input out like the hidden states' rows (with
``--allgather-cp`` through one all-reduce over the context-parallel group, no gradient: the
inputs are constants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...contract.options import IGNORE_INDEX

__all__ = ["Responses", "responses"]


@dataclass(frozen=True)
class Responses:
    """A micro-batch's response tokens on this rank.

    labels: ``[1, S]`` the token each local position scores where it is a response token with
    ``loss_mask != 0``, else ``IGNORE_INDEX``. document_ids: ``[1, S]`` the sample of each
    response position (masked ones too), -1 elsewhere. rows: ``[S]`` each local position's index
    into the micro-batch's responses laid end to end (``Σ response_lengths``), -1 where it is
    none. entries: that index for each value of slime's per-sample local inputs, in their
    order. counts: how many values each sample's local input holds. allgather: the inputs do
    not cover this rank's rows (``--allgather-cp``): :meth:`per_token` sums them over ``group``.
    """

    labels: torch.Tensor
    document_ids: torch.Tensor
    rows: torch.Tensor
    entries: torch.Tensor
    counts: list[int]
    total: int
    allgather: bool
    group: Any

    def check(self, name: str, values: Sequence[torch.Tensor]) -> None:
        """``values`` (``batch[name]``) hold this rank's response values of every sample."""
        if len(values) != len(self.counts):
            raise ValueError(
                f"batch[{name!r}] must hold one tensor per sample ({len(self.counts)}), got "
                f"{len(values)}"
            )
        for s, (v, n) in enumerate(zip(values, self.counts, strict=True)):
            if not isinstance(v, torch.Tensor) or v.numel() != n:
                got = v.numel() if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"batch[{name!r}][{s}] must hold this rank's {n} response values of sample "
                    f"{s} (slime's context-parallel slice of its response), got {got}"
                )

    def per_token(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """slime's per-sample local input ``values`` (checked: :meth:`check`) as ``[1, S]``
        fp32, laid out like the labels; 0 where a position is not a response token. With
        ``allgather``, a collective over ``group``."""
        device = self.rows.device
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        if self.entries.numel():
            flat[self.entries] = torch.cat([v.reshape(-1) for v in values]).to(device, flat.dtype)
        if self.allgather:
            import torch.distributed as dist

            dist.all_reduce(flat, group=self.group)  # each value lives on one rank
        out = flat[self.rows.clamp(min=0)] if flat.numel() else flat.new_zeros(self.rows.shape)
        return torch.where(self.rows >= 0, out, 0.0)[None]


def responses(
    batch: dict[str, Any], length: int, cp_rank: int, cp_size: int, allgather: bool, group: Any
) -> Responses:
    """The layout of ``batch`` (what slime's ``get_batch`` returned) on this rank of a
    context-parallel group of ``cp_size`` ranks, whose hidden states cover ``length`` positions.
    Raises ``ValueError`` for lengths that do not describe them."""
    totals = [int(t) for t in batch["total_lengths"]]
    lengths = [int(r) for r in batch["response_lengths"]]
    tokens, masks = batch["unconcat_tokens"], batch["loss_masks"]
    _check_samples(totals, lengths, tokens, masks, batch.get("rollout_mask_sums"))
    rows, entries, counts = _positions(totals, lengths, length, cp_rank, cp_size, allgather)
    device = tokens[0].device if tokens else torch.device("cpu")
    rows, entries = rows.to(device), entries.to(device)
    starts = [t - r for t, r in zip(totals, lengths, strict=True)]
    targets = [t.reshape(-1)[p:] for t, p in zip(tokens, starts, strict=True)]
    flat_targets = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long)
    flat_mask = torch.cat([m.reshape(-1) != 0 for m in masks]) if masks else flat_targets.bool()
    sample = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)
    ).to(device)
    at = rows.clamp(min=0)
    response = rows >= 0
    if flat_targets.numel():
        scored = response & flat_mask.to(device)[at]
        labels = torch.where(scored, flat_targets.to(device)[at], IGNORE_INDEX)
        doc = torch.where(response, sample[at], -1)
    else:
        labels = torch.full_like(rows, IGNORE_INDEX)
        doc = torch.full_like(rows, -1)
    total = sum(lengths)
    return Responses(labels[None], doc[None], rows, entries, counts, total, allgather, group)


def _check_samples(totals, lengths, tokens, masks, mask_sums) -> None:
    n = len(totals)
    if not (len(lengths) == len(tokens) == len(masks) == n):
        raise ValueError(
            "batch['total_lengths'], ['response_lengths'], ['unconcat_tokens'] and "
            f"['loss_masks'] must describe the same samples, got {n}, {len(lengths)}, "
            f"{len(tokens)} and {len(masks)}"
        )
    for s in range(n):
        if not 0 < lengths[s] < totals[s] or tokens[s].numel() != totals[s]:
            raise ValueError(
                f"sample {s}: expected 0 < response_length < total_length == "
                f"len(unconcat_tokens) (a prompt of at least one token), got response_length="
                f"{lengths[s]}, total_length={totals[s]}, {tokens[s].numel()} tokens"
            )
        if masks[s].numel() != lengths[s]:
            raise ValueError(
                f"batch['loss_masks'][{s}] must have response_length={lengths[s]} values, got "
                f"{masks[s].numel()}"
            )
    if mask_sums is not None and n:
        own = torch.stack([m.reshape(-1).sum() for m in masks]).to(torch.float64)
        given = torch.as_tensor(mask_sums).reshape(-1).to(own.device, torch.float64)
        if given.numel() != n or not bool((given == own).all()):
            raise ValueError(
                "batch['rollout_mask_sums'] must equal each sample's loss-mask total: a rollout "
                "that emits several samples (slime's per-rollout denominator) is not supported "
                f"by logitless's per-sample mean yet, got {given.tolist()} for mask totals "
                f"{own.tolist()}"
            )


def _positions(totals, lengths, length, cp_rank, cp_size, allgather):
    """``rows [length]`` (each local position's flat response index, -1 where none),
    ``entries`` (the flat index of each value of slime's local inputs) and each sample's
    count of them."""
    contiguous = allgather and cp_size > 1
    rows = torch.full((length,), -1, dtype=torch.long)
    entries, counts = [], []
    base = start = flat = 0  # local base row (cp=1, zigzag), global stream start, flat index
    for total, response in zip(totals, lengths, strict=True):
        q = torch.arange(total - response - 1, total - 1)  # the response's logit positions
        j = flat + torch.arange(response)
        if cp_size == 1:
            local, keep, mine, base = base + q, q >= 0, j, base + total
        else:
            c = -(-total // (2 * cp_size))
            first, second = cp_rank, 2 * cp_size - 1 - cp_rank
            chunk = q // c
            mine = torch.cat([j[chunk == first], j[chunk == second]])  # slime's zigzag order
            if contiguous:
                local = start + q - cp_rank * length
                keep = (local >= 0) & (local < length)
            else:
                local = torch.where(chunk == first, base + q - first * c, base + c + q - second * c)
                keep = (chunk == first) | (chunk == second)
                base += 2 * c
        start, flat = start + total, flat + response
        held = start if contiguous else base
        if held > (length * cp_size if contiguous else length):
            raise ValueError(
                f"total_lengths describe at least {held} positions "
                f"{'in all' if contiguous else 'on this'} of the {cp_size} context-parallel "
                f"ranks, but the hidden states hold {length} per rank"
            )
        rows[local[keep]] = j[keep]
        entries.append(mine)
        counts.append(mine.numel())
    return rows, torch.cat(entries) if entries else torch.zeros(0, dtype=torch.long), counts
