"""What every kernel backend implements, and what they share.

A backend computes, for the valid rows it is given (:class:`RowBatch`), the per-row statistics
of ``z = transform(h·Wᵀ + b)`` (running max, ``Σ exp``, ``Σ exp·z``, the label logit ->
log-prob, log-sum-exp, entropy) in forward and the head gradients in backward, without writing
``[rows, V]`` logits to memory on an accelerator. :class:`KernelBackend` is that interface;
``logitless.contract.backend.BACKENDS`` lists the implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ..contract.vocab import VocabParallel
from ..transform import LogitTransform, compute_dtype


class RowBatch(NamedTuple):
    """The valid rows a kernel works on.

    hidden ``[M, H]``; weight ``[V, H]`` (a vocabulary shard under vocab parallelism); bias
    ``[V]`` or None; labels ``[M]`` int64 as the kernels index the weight (shard-local under
    vocab parallelism: outside ``[0, V)`` for another rank's labels, which the kernels mask);
    temperature ``[M]`` per-row temperatures, or None (the transform's scalar).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: torch.Tensor | None

    def take(self, idx: torch.Tensor | None) -> RowBatch:
        """Rows ``idx`` (all when None)."""
        if idx is None:
            return self
        t = self.temperature
        return self._replace(
            hidden=self.hidden.index_select(0, idx),
            labels=self.labels.index_select(0, idx),
            temperature=None if t is None else t.index_select(0, idx),
        )

    def detached(self) -> RowBatch:
        """The same rows without autograd history (for kernels whose gradients reach autograd
        some other way)."""
        b = self.bias
        return self._replace(
            hidden=self.hidden.detach(),
            weight=self.weight.detach(),
            bias=None if b is None else b.detach(),
        )


# Elements of one fp32 logits tile. CPU: ~8 MiB, so the elementwise passes run out of L2/L3
# instead of DRAM (measured: 2.3 s vs 3.2 s for a 2048 x 151936 x 512 forward with 134 MB
# tiles). CUDA: larger tiles amortize kernel launches; the tile is still bounded, never [N, V].
_TILE_ELEMS = {"cpu": 1 << 21}
_TILE_ELEMS_DEFAULT = 1 << 26
_MAX_ROWS = {"cpu": 2048}
_MAX_ROWS_DEFAULT = 8192
_MIN_VOCAB_BLOCK = 256
_BLOCK_ALIGN = 64
# Elements of the [rows, V] fp32 buffer of the gradient-in-forward (fused) path: 256 MiB on CPU
# (the weight gradient of a 150k x 512 head is another 300 MiB), 1 GiB on accelerators.
_CHUNK_ELEMS = {"cpu": 64 << 20}
_CHUNK_ELEMS_DEFAULT = 1 << 28


@dataclass(frozen=True)
class Schedule:
    """How the ``[M, V]`` logits are cut into tiles of ``[rows, vocab_block]``."""

    rows: int
    vocab_block: int

    @staticmethod
    def choose(num_rows: int, vocab: int, device: torch.device, chunk_size: int | None) -> Schedule:
        tile = _TILE_ELEMS.get(device.type, _TILE_ELEMS_DEFAULT)
        if chunk_size is None:
            rows = max(1, min(num_rows, _MAX_ROWS.get(device.type, _MAX_ROWS_DEFAULT)))
        else:
            rows = chunk_size
        # A multiple of 64 columns keeps every tile row 256-byte aligned: an odd width (e.g.
        # 4755 for 441 rows) measured ~10% slower in the projection matmuls on CPU.
        block = min(vocab, max(_MIN_VOCAB_BLOCK, tile // rows // _BLOCK_ALIGN * _BLOCK_ALIGN))
        return Schedule(rows=rows, vocab_block=max(1, block))

    @staticmethod
    def choose_fused(
        num_rows: int, vocab: int, device: torch.device, chunk_size: int | None
    ) -> Schedule:
        """Schedule for the gradient-in-forward path, whose row chunk keeps all V logits."""
        if chunk_size is None:
            budget = _CHUNK_ELEMS.get(device.type, _CHUNK_ELEMS_DEFAULT)
            chunk_size = max(1, min(num_rows, budget // vocab))
        return Schedule.choose(num_rows, vocab, device, chunk_size)

    def row_chunks(self, num_rows: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the row chunks."""
        return [(r, min(r + self.rows, num_rows)) for r in range(0, num_rows, self.rows)]

    def vocab_blocks(self, vocab: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the vocab blocks."""
        step = self.vocab_block
        return [(v, min(v + step, vocab)) for v in range(0, vocab, step)]

    def num_tiles(self, num_rows: int, vocab: int) -> int:
        return -(-num_rows // self.rows) * -(-vocab // self.vocab_block)


@dataclass(frozen=True)
class KernelOptions:
    """What one kernel launch needs besides its rows (kept out of the autograd signature).

    transform: logit scale, softcap and scalar temperature; schedule: the torch tiles' cut of
    the work; vocab_parallel: this rank's vocabulary shard (the kernels' labels are then
    shard-local); backend: the resolved backend that runs the rows; chunk_size: the caller's
    rows per pass (None: the backend's choice).
    """

    transform: LogitTransform
    with_entropy: bool
    head_dtype: torch.dtype
    schedule: Schedule
    vocab_parallel: VocabParallel | None = None
    backend: str = "torch"
    chunk_size: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """Softmax statistics, outputs and gradient accumulators (:func:`compute_dtype`)."""
        return compute_dtype(self.head_dtype)


class RowStats(NamedTuple):
    """A forward's per-row results: logp, lse, entropy (or None) ``[M]`` in the compute dtype,
    and ``kept``: the torch tiles' single tile of transformed logits, kept for backward when
    the whole call was one tile (else None)."""

    logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    kept: torch.Tensor | None = None


class Upstream(NamedTuple):
    """The upstream gradients of a backward: d loss / d logp and d loss / d entropy, each
    ``[M]`` or None (that output unused)."""

    logp: torch.Tensor | None
    entropy: torch.Tensor | None


#: ``(r0, r1, logp [r1 - r0], entropy or None) -> (d loss / d logp, d loss / d entropy or
#: None)`` of rows ``[r0, r1)``: the loss's per-row gradient, for the fused rows.
GradFn = Callable[
    [int, int, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor | None]",
]
#: Which of (hidden, weight, bias) want a gradient.
Needs = tuple[bool, bool, bool]
#: (d hidden [M, H], d weight [V, H], d bias [V]), each None when not needed, in their dtypes.
HeadGrads = tuple["torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]


class KernelBackend(Protocol):
    """The three entry points every backend module defines (same contract, same tests)."""

    def forward_rows(
        self, rows: RowBatch, opts: KernelOptions, keep_tile: bool = False
    ) -> RowStats: ...

    def backward_rows(
        self, rows: RowBatch, stats: RowStats, up: Upstream, opts: KernelOptions, needs: Needs
    ) -> HeadGrads: ...

    def fused_rows(
        self, rows: RowBatch, opts: KernelOptions, grad_fn: GradFn, needs: Needs
    ) -> tuple[torch.Tensor, torch.Tensor | None, HeadGrads]: ...


def finish_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    q: torch.Tensor | None,
    zy: torch.Tensor,
    vp: VocabParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp [R], lse [R], entropy [R] or None from online statistics of R rows.

    m: running max; s = Σ exp(z - m); q = Σ exp(z - m)·(z - m) (None without entropy); zy: the
    label logit. With ``vp`` the shards' statistics are first combined over its group (a
    collective call), so the results cover the whole vocabulary:

        lse = m + log s        H = log s - q / s        logp = zy - lse
    """
    if vp is not None:
        m, s, q, zy = vp.combine(m, s, q, zy)
    log_s = s.log()
    lse = m + log_s
    ent = None if q is None else log_s - q / s
    return zy - lse, lse, ent
