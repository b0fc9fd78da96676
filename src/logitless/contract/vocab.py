"""Vocab-parallel (tensor-parallel) LM head over torch.distributed.

Each rank of a group holds rows ``[vocab_start, vocab_end)`` of the head weight. Labels are
global ids. Per row, every rank computes its shard's running max ``m``, ``s = Σ exp(z - m)``,
``q = Σ exp(z - m)·(z - m)`` and the label logit (0 where the label is not in the shard); the
group combines them with one all-reduce MAX (of ``m``) and one all-reduce SUM (of the rescaled
``s``, ``q`` and the label logit), so every rank ends with the same log-probs and entropy:

    M = max_r m_r        S = Σ_r s_r·e^(m_r - M)        Q = Σ_r e^(m_r - M)·(q_r + (m_r - M)·s_r)
    lse = M + log S      H = log S - Q / S              logp = z_y - lse

Backward needs no communication for the weight shard: each rank forms ``dz`` for its own
columns from the global ``lse`` and ``H``. The hidden gradient ``Σ_r dz_r · W_r`` is summed over
the group (one all-reduce of ``[rows, H]``), unless the caller's framework does that itself.

This module only uses torch.distributed (through :mod:`.collectives`); it imports neither the
head nor the losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import agree, comm_device, rank_and_size

__all__ = ["VocabParallel", "even_vocab_range"]


def even_vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``vocab_size`` rows split ``world_size`` ways.

    Shares differ by at most one row; the first ``vocab_size % world_size`` ranks get the
    larger ones. ``even_vocab_range(10, 1, 3) == (4, 7)``.
    """
    for name, v in (("vocab_size", vocab_size), ("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if vocab_size < world_size:
        raise ValueError(
            f"vocab_size={vocab_size} cannot be split over {world_size} ranks with a non-empty "
            "shard on each"
        )
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class VocabParallel:
    """Which rows of the vocabulary this rank's head weight holds, within a process group.

    Constructing one is a collective call over ``group``: every rank of the group must construct
    it (once, e.g. at model set-up), and the ranks' ranges are exchanged and checked to tile
    ``[0, vocab_size)`` in rank order, without gaps or overlaps.

    Args:
        group: the tensor-parallel process group (None: the default group).
        vocab_start, vocab_end: this rank's rows ``[vocab_start, vocab_end)`` of the global
            ``[vocab_size, H]`` weight; its ``weight`` argument must be ``[vocab_end -
            vocab_start, H]`` and its ``bias`` (if any) the matching slice.
        vocab_size: the global vocabulary size, checked against the ranges; None: taken from
            them.
        reduce_hidden_grad: sum the hidden-state gradient over the group in backward (True).
            Pass False when the caller's framework does that itself, as a column-parallel
            layer's backward would (Megatron's "copy to tensor-parallel region"); each rank then
            gets only its shard's contribution ``dz_r · W_r``.

    Every call of ``linear_logprobs`` / ``fused_policy_loss`` with it is a collective call too:
    all ranks pass the same ``hidden`` rows (the same tokens), the same labels and options.

    Example (2 ranks, vocabulary of 1000 rows)::

        vp = VocabParallel.even(1000, group)          # rank 0: [0, 500), rank 1: [500, 1000)
        out = linear_logprobs(hidden, full_weight[vp.vocab_start:vp.vocab_end], labels,
                              vocab_parallel=vp)        # same log-probs on every rank
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        vocab_end: int,
        *,
        vocab_size: int | None = None,
        reduce_hidden_grad: bool = True,
    ) -> None:
        _need_group(group, "VocabParallel")
        for name, v in (("vocab_start", vocab_start), ("vocab_end", vocab_end)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
        ):
            raise ValueError(f"vocab_size must be None or an int, got {vocab_size!r}")
        if not isinstance(reduce_hidden_grad, bool):
            raise ValueError(f"reduce_hidden_grad must be a bool, got {reduce_hidden_grad!r}")
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        # Exchange every rank's range before judging any, so all ranks raise together
        # instead of one raising and the others hanging in a later collective.
        mine = torch.tensor([vocab_start, vocab_end], dtype=torch.int64, device=comm_device(group))
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=group)
        ranges = tuple((int(t[0]), int(t[1])) for t in gathered)
        _check_tiling(ranges, vocab_size)
        self.ranges: tuple[tuple[int, int], ...] = ranges
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.vocab_size: int = ranges[-1][1]
        self.max_shard: int = max(e - s for s, e in ranges)
        self.reduce_hidden_grad = reduce_hidden_grad

    @classmethod
    def even(
        cls,
        vocab_size: int,
        group: dist.ProcessGroup | None = None,
        *,
        reduce_hidden_grad: bool = True,
    ) -> VocabParallel:
        """The even split of ``vocab_size`` rows over ``group`` (see :func:`even_vocab_range`)."""
        _need_group(group, "VocabParallel.even")
        start, end = even_vocab_range(vocab_size, *rank_and_size(group))
        return cls(group, start, end, vocab_size=vocab_size, reduce_hidden_grad=reduce_hidden_grad)

    @property
    def shard_size(self) -> int:
        return self.vocab_end - self.vocab_start

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[vocab_size, ...]`` tensor (weight or bias); a view."""
        if not isinstance(full, torch.Tensor) or full.dim() < 1 or full.shape[0] != self.vocab_size:
            got = list(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(f"expected a tensor of shape [{self.vocab_size}, ...], got {got}")
        return full[self.vocab_start : self.vocab_end]

    def __repr__(self) -> str:
        return (
            f"VocabParallel(rank={self.rank}/{self.world_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}) of {self.vocab_size}, "
            f"reduce_hidden_grad={self.reduce_hidden_grad})"
        )

    # --- collectives used by the kernels ------------------------------------------------

    def agree(self, labels: torch.Tensor | None, error: Exception | None = None) -> None:
        """Collective check at the start of every call, before any other collective.

        All ranks must pass the same tokens: their row counts and a label checksum are compared
        with one all-reduce of five int64 values (MAX of x and of -x gives max and min at once).
        A rank whose own validation failed (``error``) still takes part, then raises it; the
        other ranks raise too instead of hanging in the next collective.
        """
        n = checksum = 0
        if labels is not None:
            flat = labels.reshape(-1).long()
            n = flat.numel()
            weights = torch.arange(1, n + 1, device=flat.device, dtype=torch.int64)
            checksum = int((flat * weights).sum()) if n else 0
        what = "vocab_parallel"
        values = [n, -n, checksum, -checksum]
        hi_n, lo_n, hi_c, lo_c = agree(self.group, error, what, values, "the vocab_parallel group")
        if hi_n != -lo_n:
            raise ValueError(
                f"vocab_parallel: every rank must pass the same tokens, but the ranks' row counts "
                f"range from {-lo_n} to {hi_n} (this rank: {n}). Give each rank of the "
                "tensor-parallel group the same hidden rows and labels."
            )
        if hi_c != -lo_c:
            raise ValueError(
                "vocab_parallel: every rank must pass the same labels (global token ids), but "
                "they differ between ranks. Build labels before sharding the vocabulary."
            )

    def combine(
        self, m: torch.Tensor, s: torch.Tensor, q: torch.Tensor | None, zy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Merge per-shard online statistics of R rows into the global ones.

        m: [R] shard max; s: [R] Σ exp(z - m); q: [R] Σ exp(z - m)(z - m) or None; zy: [R]
        label logit (0 where the label is in another shard). Returns (M, S, Q, z_y), each [R],
        identical on every rank.
        """
        m_all = m.clone()
        dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=self.group)
        shift = m - m_all  # <= 0
        alpha = shift.exp()
        parts = [alpha * s, zy]
        if q is not None:
            parts.append(alpha * (q + shift * s))
        packed = torch.stack(parts)  # [2 or 3, R]
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        return m_all, packed[0], packed[2] if q is not None else None, packed[1]

    def reduce_hidden(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Sum a partial hidden gradient [M, H] over the group (in place) if asked to."""
        if grad is not None and self.reduce_hidden_grad:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        return grad


def _check_tiling(ranges: tuple[tuple[int, int], ...], vocab_size: int | None) -> None:
    """Ranges in rank order must be non-empty and tile [0, vocab_size) exactly."""
    shown = ", ".join(f"rank {r}: [{s}, {e})" for r, (s, e) in enumerate(ranges))
    hint = "use VocabParallel.even(vocab_size, group) for the even split"
    for r, (s, e) in enumerate(ranges):
        if s >= e:
            raise ValueError(
                f"VocabParallel: rank {r} has an empty range [{s}, {e}) ({shown}); {hint}"
            )
        expected_start = 0 if r == 0 else ranges[r - 1][1]
        if s != expected_start:
            raise ValueError(
                f"VocabParallel: the ranges must tile the vocabulary in rank order, without gaps "
                f"or overlaps; rank {r} starts at {s}, expected {expected_start} ({shown}); {hint}"
            )
    if vocab_size is not None and ranges[-1][1] != vocab_size:
        raise ValueError(
            f"VocabParallel: the ranges cover [0, {ranges[-1][1]}) but vocab_size={vocab_size} "
            f"({shown}; {len(ranges)} ranks in the group); {hint}"
        )


def _need_group(group: dist.ProcessGroup | None, what: str) -> None:
    """A ``ValueError`` unless ``group`` can be used: torch.distributed initialized (the
    default group, None, or one it made), or a standalone backend object (see
    :func:`~logitless.contract.collectives.rank_and_size`)."""
    if dist.is_available() and dist.is_initialized():
        return
    if group is None or isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{what} needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group), or a standalone group object"
        )
