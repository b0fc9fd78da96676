"""What every kernel backend implements, and what they share.

A backend computes, for the valid rows it is given (:class:`RowBatch`), the per-row statistics
of ``z = transform(h·Wᵀ + b)`` (running max, ``Σ exp``, ``Σ exp·z``, the label logit ->
log-prob, log-sum-exp, entropy) in forward and the head gradients in backward, without writing
``[rows, V]`` logits to memory on an accelerator. Each op a backend runs has its interface here:
:class:`KernelBackend` (the log-prob op, which replay and the fused loss run on too) and
:class:`DivergenceBackend` (the divergence to a teacher head);
``logitless.contract.backend.BACKENDS`` names each backend's module for each op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ..contract.collectives import all_reduce
from ..contract.divergence import TopKRows
from ..contract.options import WeightGradInto
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

    def padded(self, pad: int) -> RowBatch:
        """The rows followed by ``pad`` copies of the first: the batch-invariant schedule's
        filler (real values, so every statistic of a filler row stays finite; the backends give
        it a zero upstream gradient and drop its results)."""
        if pad == 0:
            return self
        t = self.temperature
        return self._replace(
            hidden=extend_rows(self.hidden, pad),
            labels=extend_rows(self.labels, pad),
            temperature=None if t is None else extend_rows(t, pad),
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


def extend_rows(t: torch.Tensor | None, pad: int, fill: float | None = None):
    """``t`` ``[M, ...]`` followed by ``pad`` rows: copies of its first row, or ``fill``."""
    if t is None or pad == 0:
        return t
    tail = (
        t.new_full((pad, *t.shape[1:]), fill)
        if fill is not None
        else t[:1].expand(pad, *t.shape[1:])
    )
    return torch.cat([t, tail])


# Elements of one fp32 logits tile. CPU: ~8 MiB, so the elementwise passes run out of L2/L3
# instead of DRAM (measured: 2.3 s vs 3.2 s for a 2048 x 151936 x 512 forward with 134 MB
# tiles). CUDA: larger tiles amortize kernel launches; the tile is still bounded, never [N, V].
_TILE_ELEMS = {"cpu": 1 << 21}
_TILE_ELEMS_DEFAULT = 1 << 26
# Rows of a full tile in the default schedule: its width (vocabulary columns) is the tile's
# elements over these, from the device alone (4096 columns on CPU, 16384 elsewhere), so a
# row's online-softmax merge order does not change with the number of rows in the call.
_ROWS_PER_TILE = {"cpu": 512}
_ROWS_PER_TILE_DEFAULT = 4096
_MIN_VOCAB_BLOCK = 256
_BLOCK_ALIGN = 64
# The batch-invariant mode's row block: every tile projects exactly this many rows (the last
# block padded), so the BLAS sees one M whatever the call (it picks its kernel, and its thread
# split, by M). Large enough to keep the projection compute-bound while the weight streams by:
# on CPU the default mode's full row chunk (512), whose tiles are then the default's (128 rows
# measured 1.18x the default mode's time at the bench's default shape, the weight streamed
# four times as often; 512: see docs/benchmarks.md).
_INVARIANT_ROWS = {"cpu": 512}
_INVARIANT_ROWS_DEFAULT = 256
# Elements of the [rows, V] fp32 buffer of the gradient-in-forward (fused) path: 256 MiB on CPU
# (the weight gradient of a 150k x 512 head is another 300 MiB), 1 GiB on accelerators.
_CHUNK_ELEMS = {"cpu": 64 << 20}
_CHUNK_ELEMS_DEFAULT = 1 << 28


def _aligned(cols: int, vocab: int) -> int:
    """``cols`` rounded down to a multiple of 64 (at least 256), at most ``vocab``. A multiple
    of 64 columns keeps every tile row 256-byte aligned: an odd width (e.g. 4755 for 441 rows)
    measured ~10% slower in the projection matmuls on CPU."""
    return max(1, min(vocab, max(_MIN_VOCAB_BLOCK, cols // _BLOCK_ALIGN * _BLOCK_ALIGN)))


@dataclass(frozen=True)
class Schedule:
    """How the ``[M, V]`` logits are cut into tiles of ``[rows, vocab_block]``.

    ``padded``: the batch-invariant schedule: every row chunk is exactly ``rows`` rows (the
    backends append copies of the first row, with a zero upstream gradient, to reach a multiple
    of ``rows``, and drop them from the results), so each tile's shapes are the same whatever
    the call holds.

    This class is the one place the torch tiles' cut is decided (:meth:`choose`); the Triton
    launcher decides its splits and configurations from the same ``padded`` flag
    (``backends/triton_launch.py``).
    """

    rows: int
    vocab_block: int
    padded: bool = False

    @staticmethod
    def choose(
        num_rows: int,
        vocab: int,
        device: torch.device,
        chunk_size: int | None,
        *,
        invariant: bool = False,
        fused: bool = False,
    ) -> Schedule:
        """The schedule of ``num_rows`` rows over ``vocab`` columns. The tile width depends on
        ``vocab`` and the device only (or on the caller's ``chunk_size``, to keep a tile of
        that many rows within the tile budget); ``invariant``: :meth:`invariant`.

        ``fused``: for the gradient-in-forward path, whose row chunk keeps all V logits: the
        same tile width, and no more rows than the plain chunk or the memory budget allows
        (with ``invariant``, the log-prob op's schedule itself: the same forward, bit for
        bit)."""
        if invariant:
            return Schedule.invariant(vocab, device)
        tile = _TILE_ELEMS.get(device.type, _TILE_ELEMS_DEFAULT)
        width = _aligned(tile // _ROWS_PER_TILE.get(device.type, _ROWS_PER_TILE_DEFAULT), vocab)
        if chunk_size is not None:
            return Schedule(
                rows=chunk_size, vocab_block=min(width, _aligned(tile // chunk_size, vocab))
            )
        rows = max(1, min(num_rows, tile // width))
        if fused:
            rows = max(1, min(rows, _CHUNK_ELEMS.get(device.type, _CHUNK_ELEMS_DEFAULT) // vocab))
        return Schedule(rows=rows, vocab_block=width)

    @staticmethod
    def invariant(vocab: int, device: torch.device) -> Schedule:
        """The batch-invariant schedule: fixed row blocks, the tile width from ``vocab`` and
        the device alone (never from the rows or the caller's ``chunk_size``)."""
        rows = _INVARIANT_ROWS.get(device.type, _INVARIANT_ROWS_DEFAULT)
        tile = _TILE_ELEMS.get(device.type, _TILE_ELEMS_DEFAULT)
        return Schedule(rows=rows, vocab_block=_aligned(tile // rows, vocab), padded=True)

    def row_chunks(self, num_rows: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the row chunks."""
        return [(r, min(r + self.rows, num_rows)) for r in range(0, num_rows, self.rows)]

    def vocab_blocks(self, vocab: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the vocab blocks."""
        step = self.vocab_block
        return [(v, min(v + step, vocab)) for v in range(0, vocab, step)]

    def num_tiles(self, num_rows: int, vocab: int) -> int:
        return -(-num_rows // self.rows) * -(-vocab // self.vocab_block)

    def padding(self, num_rows: int) -> int:
        """Rows the backends append to ``num_rows`` (0 unless :attr:`padded`)."""
        return -num_rows % self.rows if self.padded else 0


def check_invariant_blas(device: torch.device, dtype: torch.dtype, dim: int, schedule: Schedule):
    """Refuse the batch-invariant mode where this device's matmul gives a row different bits
    at another place in a block, or beside other rows (some BLAS builds split a block's rows
    unevenly over threads or vectorize the edge rows differently): checked once per device,
    dtype, width, block (and CPU thread count) on a random probe of the schedule's own shapes,
    then remembered."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0  # a BLAS splits by them
    key = (str(device), dtype, dim, schedule.rows, schedule.vocab_block, threads)
    ok = _POSITION_FREE.get(key)
    if ok is None:
        if _is_fake(device):
            return  # no data to check (FakeTensorMode): the first real call checks
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "batch_invariant=True checks the device's matmul once, on the first call: run "
                "one call outside CUDA graph capture first (the usual warm-up)"
            )
        ok = _POSITION_FREE[key] = _rows_position_free(device, dtype, dim, schedule)
    if not ok:
        raise ValueError(
            f"batch_invariant=True is not available on {device} with {dtype} heads of width "
            f"{dim}: this device's matmul gives a row different bits at another place in a "
            f"block of {schedule.rows} rows, so no fixed schedule can make a token's result "
            "independent of the rest of the batch; use batch_invariant=False"
        )


_POSITION_FREE: dict[tuple, bool] = {}


def _is_fake(device: torch.device) -> bool:
    from torch._guards import detect_fake_mode

    return device.type == "meta" or detect_fake_mode() is not None


def _rows_position_free(device, dtype, dim: int, schedule: Schedule) -> bool:
    """Whether ``h·Wᵀ`` (forward) and ``dz·W`` (hidden gradient) give each row the same bits
    when it moves in its block and its neighbours change."""
    rows, width = schedule.rows, schedule.vocab_block
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    h, fresh, w, dz = rand(rows, dim), rand(rows, dim), rand(width, dim), rand(rows, width)
    fresh_dz = rand(rows, width)
    ref_f, ref_b = h @ w.t(), dz @ w
    for shift in {1, rows // 2 + 1, rows - 1} - {0, rows}:
        moved_f = torch.cat([h[shift:], fresh[:shift]]) @ w.t()
        moved_b = torch.cat([dz[shift:], fresh_dz[:shift]]) @ w
        if not (torch.equal(moved_f[: rows - shift], ref_f[shift:])
                and torch.equal(moved_b[: rows - shift], ref_b[shift:])):  # fmt: skip
            return False
    return True


@dataclass(frozen=True)
class KernelOptions:
    """What one kernel launch needs besides its rows (kept out of the autograd signature).

    transform: logit scale, softcap and scalar temperature; schedule: the torch tiles' cut of
    the work; vocab_parallel: this rank's vocabulary shard (the kernels' labels are then
    shard-local); backend: the resolved backend that runs the rows; chunk_size: the caller's
    rows per pass (None: the backend's choice); weight_grad_into: the buffer a backward adds
    the weight gradient into (its compute-dtype ``[V, H]``: the backends return None for dW
    then), or None; held_grads: the gradients wait for an upstream scale that a later backward
    applies (the fused loss), see :meth:`grad_dtype`.
    """

    transform: LogitTransform
    with_entropy: bool
    head_dtype: torch.dtype
    schedule: Schedule
    vocab_parallel: VocabParallel | None = None
    backend: str = "torch"
    chunk_size: int | None = None
    weight_grad_into: WeightGradInto | None = None
    held_grads: bool = False

    @property
    def weight_grad_buffer(self) -> torch.Tensor | None:
        """The tensor dW is added into (None: the backends return dW)."""
        into = self.weight_grad_into
        return None if into is None else into.buffer

    @property
    def compute_dtype(self) -> torch.dtype:
        """Softmax statistics, outputs and gradient accumulators (:func:`compute_dtype`)."""
        return compute_dtype(self.head_dtype)

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype a backend returns a parameter's gradient in: the parameter's, except that
        an fp16 gradient held for a later upstream scale (``held_grads``) stays in the compute
        dtype. Held unscaled in fp16, a gradient that a gradient scaler's 2^16 would keep
        normal falls into fp16's subnormals or to zero; bf16 has fp32's exponent range."""
        if self.held_grads and param_dtype == torch.float16:
            return self.compute_dtype
        return param_dtype


class ProbeStats(NamedTuple):
    """What a forward found at each row's probed ids (``forward_rows(..., probe=ids)``, ids
    ``[M, K]``: the rollout engine's top-k), over the whole vocabulary (every shard), in the
    compute dtype:

    z ``[M, K]``: the transformed logits at the ids, the very values the tiles folded into the
    row's statistics (0 at unused slots); max ``[M]``: the row's maximum logit ``m``; log_sum
    ``[M]``: ``log Σ_j exp(z_j - m)``; log_out ``[M]``: ``log Σ_{j not an id} exp(z_j - m)``,
    summed over those columns themselves (``-inf`` when there is none).

    So ``log p = (z - m) - log_sum`` (the expression of the label's log-prob, bit for bit),
    the row's mass outside the ids is ``exp(log_out - log_sum)`` without cancellation, and an
    id is an argmax exactly when ``z == m``.
    """

    z: torch.Tensor
    max: torch.Tensor
    log_sum: torch.Tensor
    log_out: torch.Tensor

    def padded(self, pad: int) -> ProbeStats:
        """Rows followed by ``pad`` copies of the first."""
        return ProbeStats(*(extend_rows(x, pad) for x in self))

    def cut(self, rows: int) -> ProbeStats:
        """The first ``rows`` rows."""
        return ProbeStats(*(x[:rows] for x in self))


class RowStats(NamedTuple):
    """A forward's per-row results: logp, lse, entropy (or None) ``[M]`` in the compute dtype,
    ``kept``: the torch tiles' single tile of transformed logits, kept for backward when the
    whole call was one tile (else None), and ``probe``: what the forward found at the probed
    ids (:class:`ProbeStats`; None without a probe)."""

    logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    kept: torch.Tensor | None = None
    probe: ProbeStats | None = None

    def cut(self, num_rows: int) -> RowStats:
        """The first ``num_rows`` rows' results (a padded forward's, its filler rows dropped;
        ``kept``, the padded tile, as it is)."""
        ent, probe = self.entropy, self.probe
        return self._replace(
            logp=self.logp[:num_rows],
            lse=self.lse[:num_rows],
            entropy=None if ent is None else ent[:num_rows],
            probe=None if probe is None else probe.cut(num_rows),
        )

    def padded(self, pad: int) -> RowStats:
        """The statistics backward reads (lse, entropy) followed by ``pad`` copies of the
        first row's (see :func:`padded_backward`)."""
        return self._replace(lse=extend_rows(self.lse, pad), entropy=extend_rows(self.entropy, pad))


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


def padded_backward(backward: Callable, rows, stats, up, opts, needs: Needs, pad: int) -> HeadGrads:
    """``backward(rows, stats, up, opts, needs)`` of any backend or op on ``rows`` followed by
    ``pad`` filler rows (the batch-invariant schedule's whole row blocks): the fillers repeat
    the first row's statistics and get a zero upstream gradient, so their logit gradient is
    exactly 0 (they add nothing to dW / db) and their hidden gradient is dropped. ``rows`` and
    ``stats`` have ``padded(pad)``; ``up`` is a tuple of ``[M]`` tensors or None. ``pad`` 0:
    ``backward`` on the rows as they are."""
    if pad == 0:
        return backward(rows, stats, up, opts, needs)
    up = type(up)(*(extend_rows(u, pad, 0.0) for u in up))
    dh, dw, db = backward(rows.padded(pad), stats.padded(pad), up, opts, needs)
    return (None if dh is None else dh[: dh.shape[0] - pad]), dw, db


class KernelBackend(Protocol):
    """The log-prob op's three entry points, which every backend's module for it defines (same
    contract, same tests). ``forward_rows``'s ``probe``: ``[M, K]`` int64 shard-local ids
    whose logits and complement mass the forward also reports (``-1``: an unused slot, or an
    id of another shard), in ``RowStats.probe``; the other statistics are the same bits with
    or without it."""

    def forward_rows(
        self,
        rows: RowBatch,
        opts: KernelOptions,
        keep_tile: bool = False,
        probe: torch.Tensor | None = None,
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

        lse = m + log s        H = log s - q / s        logp = (zy - m) - log s

    (``zy - m`` first: rounding ``m + log s`` before the subtraction would cost the likely
    tokens' log-probs several times their accuracy; the divergence op's log-prob is the same
    expression, so the two agree bit for bit in the batch-invariant mode.)
    """
    if vp is not None:
        m, s, q, zy = vp.combine(m, s, q, zy)
    return _finish(m, s, q, zy)


def _finish(m, s, q, zy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    log_s = s.log()
    lse = m + log_s
    ent = None if q is None else log_s - q / s
    return (zy - m) - log_s, lse, ent


def finish_probed(
    m: torch.Tensor,
    s: torch.Tensor,
    q: torch.Tensor | None,
    zy: torch.Tensor,
    s_out: torch.Tensor,
    z: torch.Tensor,
    vp: VocabParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ProbeStats]:
    """:func:`finish_stats` (the same bits) and the :class:`ProbeStats` of a probed forward.

    s_out ``[R]``: ``Σ exp(z - m)`` over the columns that are not probed ids (on the same
    running max as ``s``); z ``[R, K]``: the logits at the ids this shard holds (0 at the
    others). With ``vp`` they are combined over its group after the statistics (one more SUM
    all-reduce: each id has one owner, so its logit is added to zeros, exactly).
    """
    if vp is not None:
        m_own = m
        m, s, q, zy = vp.combine(m, s, q, zy)
        packed = torch.cat([((m_own - m).exp() * s_out)[:, None], z], 1)
        packed = all_reduce(packed, vp.group, "sum")
        s_out, z = packed[:, 0], packed[:, 1:]
    logp, lse, ent = _finish(m, s, q, zy)
    return logp, lse, ent, ProbeStats(z, m, s.log(), s_out.log())


@functools.cache
def _has_fp32_out_mm(device: torch.device) -> bool:
    """Whether torch.addmm adds a 16-bit product into an fp32 tensor without first rounding it
    to 16 bits (``out_dtype=``: cuBLAS with an fp32 C, recent torch on CUDA). Probed once."""
    if device.type != "cuda":
        return False
    acc = torch.zeros(1, 1, device=device)
    one = torch.ones(1, 1, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with the product accumulated in ``acc``'s dtype (fp32), for ``a`` and
    ``b`` in one (possibly 16-bit) dtype: never a 16-bit product rounded before it is added.

    The one rule for every gradient accumulation of the head (the weight and hidden gradients
    of both backends): a bf16 ``a @ b`` comes out rounded to bf16, so adding it into an fp32
    buffer (Megatron's ``main_grad``, a hidden gradient summed over vocabulary tiles) would
    round every term to bf16 first. On CUDA cuBLAS writes the fp32 sum directly
    (``out_dtype=``); elsewhere the operands are widened (exact: a 16-bit value is an fp32
    value), which costs one fp32 copy of ``a`` and ``b`` (both a tile or a chunk).
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _has_fp32_out_mm(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


# --------------------------------------------------------------------------------------------
# The divergence's rows (its torch tiles, ``torch_divergence.py``, and its Triton kernels,
# ``triton_divergence.py``, both implement :class:`DivergenceBackend` on them)
# --------------------------------------------------------------------------------------------


class DivRows(NamedTuple):
    """The valid rows of a divergence call: the student's :class:`RowBatch` (labels
    shard-local under vocab parallelism), the teacher's (its hidden ``[M, H_t]``, weight,
    bias; None with a sparse teacher) and the sparse teacher's rows (ids shard-local)."""

    student: RowBatch
    teacher: RowBatch | None
    topk: TopKRows | None

    def padded(self, pad: int) -> DivRows:
        """These rows followed by ``pad`` copies of the first (the batch-invariant schedule's
        filler, see :meth:`RowBatch.padded`)."""
        t, topk = self.teacher, self.topk
        return DivRows(
            self.student.padded(pad),
            None if t is None else t.padded(pad),
            None if topk is None else TopKRows(*(extend_rows(x, pad) for x in topk)),
        )


@dataclass(frozen=True)
class DivOptions:
    """The kernels' options: the student's (schedule, transform, entropy, vocab parallel), the
    teacher's transform and head dtype (same schedule), the mode and beta."""

    student: KernelOptions
    teacher: KernelOptions | None
    mode: str
    beta: float


class DivStats(NamedTuple):
    """Forward results per row ``[M]`` (compute dtype): divergence, log-prob, entropy (or
    None); each head's log-sum-exp as its two parts, the max ``m`` and ``log Σ exp(z - m)``
    (``log p = (z - m) - log Σ``: rounding ``m + log Σ`` first would cost the likely tokens'
    log-probs ~6x their accuracy); ``aux``: KL(p_s‖p_t) (reverse), KL(p_s‖m) (JSD), the same
    over the top-k buckets (a sparse teacher, beta > 0), else None; ``tail``: the log of the
    student's mass outside the sparse teacher's ids (None with a dense teacher)."""

    divergence: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor | None
    max: torch.Tensor
    log_sum: torch.Tensor
    teacher_max: torch.Tensor | None
    teacher_log_sum: torch.Tensor | None
    aux: torch.Tensor | None
    tail: torch.Tensor | None

    def padded(self, pad: int) -> DivStats:
        """Every field followed by ``pad`` copies of its first row (see
        :func:`padded_backward`)."""
        return DivStats(*(extend_rows(x, pad) for x in self))


class DivUpstream(NamedTuple):
    """Upstream gradients ``[M]`` of the divergence, the log-prob and the entropy (None: unused)."""

    divergence: torch.Tensor | None
    logp: torch.Tensor | None
    entropy: torch.Tensor | None


class DivergenceBackend(Protocol):
    """The divergence op's two entry points, which every backend's module for it defines (same
    contract, same tests: tests/test_divergence*.py)."""

    def forward_rows(self, rows: DivRows, opts: DivOptions) -> DivStats: ...

    def backward_rows(
        self, rows: DivRows, stats: DivStats, up: DivUpstream, opts: DivOptions, needs: Needs
    ) -> HeadGrads: ...
