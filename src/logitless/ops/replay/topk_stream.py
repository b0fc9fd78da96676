"""Streaming top-k over vocabulary tiles, and the sampler's kept set replayed from it.

The sampler this replays (vLLM's ``apply_top_k_top_p_pytorch``,
``vllm/v1/sample/ops/topk_topp_sampler.py``, after temperature and its min-p logits processor)
keeps, for logits ``z`` of one row:

- min-p: ``p_j >= min_p · max p``, i.e. ``z_j >= max z + log(min_p)``;
- top-k: ``z_j >=`` the k-th largest value (every token tied with it is kept);
- top-p over the distribution renormalized on what is left: a token is kept while the mass
  of the tokens before it, in decreasing order, is below ``p`` (so at least one is kept).

Each step keeps a superlevel set ``{z_j >= t}``, so the kept set of a row is ``{z_j >= t_i}``
for one threshold ``t_i``. It is found without ``[rows, V]`` logits: one pass over the
vocabulary tiles keeps, per row, the ``C`` largest logits seen so far (each tile's candidates
merged with the running ones by ``torch.topk``), the number of tokens tied with the ``C``-th
value that did not fit, and the online max / ``Σ exp`` of the whole row (for min-p and for a
top-p without top-k). From the sorted candidates the thresholds follow directly. A row whose
kept set is not decided by its candidates (a top-p / min-p set larger than ``C``, or ties at
the boundary beyond the candidates) is streamed again with a larger ``C``, up to ``V``.

Where this differs from vLLM: ties at the top-p boundary are all kept (vLLM's sort order
decides among them), the top-p cumulative sums are taken in float64 in decreasing order
(vLLM: fp32, increasing order), and vLLM's Triton top-k kernel may trim a tie group at the
k-th value to exactly k tokens. These only move tokens whose logits tie or whose cumulative
mass equals ``p`` to rounding; a label that falls out that way is added back and counted.

Under vocabulary parallelism every rank streams its shard; the candidates are merged with one
all-gather of ``[rows, C]`` values and ids (and the online statistics with the usual combine),
so every rank ends with the same candidates and the same kept sets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ...backends.base import KernelOptions, RowBatch, Schedule
from ...backends.torch_tiles import OnlineStats, label_slot, project, weight_block
from ...contract.replay import ReplayArgs
from ...contract.vocab import VocabParallel

# Candidate values + ids of one row chunk: at most this many [rows, C] entries at once (per
# rank of a vocab-parallel group: the merge gathers every rank's).
_CANDIDATE_ELEMS = 1 << 20
# Work tensors of one candidate merge ([rows, C + new] values and ids): at most this many.
_MERGE_ELEMS = 1 << 18
# Candidate count for rows truncated by top-p / min-p only, before any widening.
DEFAULT_CANDIDATES = 1024
_WIDEN = 4  # a row whose kept set does not fit is streamed again with this many times C


class Candidates(NamedTuple):
    """The C largest logits of R rows, and the online statistics of the whole row.

    vals: [R, C] fp32 sorted in decreasing order (-inf padding when a row has fewer tokens);
    ids: [R, C] int32 global ids (-1 padding); extra: [R] int64 tokens equal to
    ``vals[:, -1]`` that are not among the candidates; lse: [R] log-sum-exp of the whole row;
    zy: [R] the label logit.
    """

    vals: torch.Tensor
    ids: torch.Tensor
    extra: torch.Tensor
    lse: torch.Tensor
    zy: torch.Tensor


def _count_eq(vals: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return (vals == theta[:, None]).sum(1)


def _merge(cand_v, cand_i, extra, new_v, new_i, new_eq, cap: int):
    """Merge new candidates into the running C largest (sorted, decreasing).

    ``new_eq(theta)`` counts the new tokens, kept here or not, equal to ``theta`` [R]. The
    running ``extra`` (tokens tied with the C-th value left out) stays exact: after the merge,
    ``extra' = [θ' == θ]·extra + #{old candidates and new tokens == θ'} - #{kept == θ'}``.
    """
    theta = cand_v[:, -1]
    vals, pos = torch.cat([cand_v, new_v], 1).topk(cap, dim=1)
    ids = torch.cat([cand_i, new_i], 1).gather(1, pos)
    theta2 = vals[:, -1]
    seen_eq = _count_eq(cand_v, theta2) + new_eq(theta2)
    extra = torch.where(theta2 == theta, extra, 0) + seen_eq - _count_eq(vals, theta2)
    extra = torch.where(torch.isfinite(theta2), extra, 0)  # -inf: padding, not tokens
    return vals, ids, extra


class _RunningTopK:
    """The C largest logits seen so far of R rows, and the count of ties left out.

    ``sparse`` (CPU): once a row holds C candidates, only tile logits at or above its C-th
    value can still enter; after the first tiles they are few, and they are picked with
    ``nonzero`` (a host read, free on CPU) into a per-row buffer of width ``C / 2``, merged
    into the candidates only when the buffer is full. Until the next merge the filter uses a
    stale (lower) C-th value, so it picks a superset of what matters; nothing is lost.
    Otherwise (accelerators: no host sync; or a tile where many logits pass the filter) the
    tile's own top ``min(C, Vb)`` are merged at once. Merges run on blocks of rows, so their
    ``[rows, C + new]`` work tensors stay within ``_MERGE_ELEMS`` elements.
    """

    def __init__(self, vals: torch.Tensor, ids: torch.Tensor, extra: torch.Tensor, sparse: bool):
        """``vals`` [R, C] fp32, ``ids`` [R, C] int32, ``extra`` [R] int64: storage the
        running candidates are kept in (filled here)."""
        rows, cap = vals.shape
        device = vals.device
        self.cap, self.sparse = cap, sparse
        self.vals, self.ids, self.extra = vals.fill_(float("-inf")), ids.fill_(-1), extra.zero_()
        self.width = max(64, cap // 2)
        self.buf_v = torch.full((rows, self.width), float("-inf"), device=device, dtype=vals.dtype)
        self.buf_i = torch.full((rows, self.width), -1, dtype=torch.int32, device=device)
        self.fill = torch.zeros(rows, dtype=torch.int64, device=device)
        self.full = False  # every row holds C finite candidates

    def _merge(self, new_v, new_i, new_eq) -> None:
        """Merge ``new_v`` / ``new_i`` [R, n] (``new_eq(theta, r0, r1)``: the new tokens of
        rows r0:r1 equal to ``theta``) into the candidates, block of rows by block."""
        rows = self.vals.shape[0]
        step = max(1, _MERGE_ELEMS // (self.cap + new_v.shape[1]))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            vals, ids, extra = _merge(
                self.vals[r0:r1],
                self.ids[r0:r1],
                self.extra[r0:r1],
                new_v[r0:r1],
                new_i[r0:r1],
                lambda t, r0=r0, r1=r1: new_eq(t, r0, r1),
                self.cap,
            )
            self.vals[r0:r1], self.ids[r0:r1], self.extra[r0:r1] = vals, ids, extra

    def flush(self) -> None:
        """Merge the buffered logits into the candidates."""
        if not self.sparse or not bool((self.fill > 0).any()):
            return
        buf_v = self.buf_v
        self._merge(buf_v, self.buf_i, lambda t, r0, r1: _count_eq(buf_v[r0:r1], t))
        self.buf_v.fill_(float("-inf"))
        self.buf_i.fill_(-1)
        self.fill.zero_()

    def _fold_dense(self, z: torch.Tensor, v0: int) -> None:
        """Merge the tile's own top ``min(C, Vb)`` (block of rows by block)."""
        rows, width = z.shape
        k = min(self.cap, width)
        step = max(1, _MERGE_ELEMS // max(width, self.cap + k))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            zb = z[r0:r1]
            new_v, pos = zb.topk(k, dim=1)
            vals, ids, extra = _merge(
                self.vals[r0:r1],
                self.ids[r0:r1],
                self.extra[r0:r1],
                new_v,
                (pos + v0).int(),
                lambda t, zb=zb: _count_eq(zb, t),
                self.cap,
            )
            self.vals[r0:r1], self.ids[r0:r1], self.extra[r0:r1] = vals, ids, extra
        self.full = self.sparse and bool(torch.isfinite(self.vals[:, -1]).all())

    def fold(self, z: torch.Tensor, v0: int) -> None:
        """Fold tile ``z`` [R, Vb] (global vocabulary columns v0...)."""
        rows, width = z.shape
        if not self.sparse or not self.full:
            self._fold_dense(z, v0)
            return
        above = z >= self.vals[:, -1:]
        num = int(above.count_nonzero())
        if num == 0:
            return
        if num * 8 > rows * width:  # a heavy tile: the dense merge costs less
            self._fold_dense(z, v0)
            return
        r, c = above.nonzero(as_tuple=True)
        counts = torch.bincount(r, minlength=rows)
        if int(counts.max()) > self.width:  # more than a buffer's worth in one row
            self._fold_dense(z, v0)
            return
        if int((self.fill + counts).max()) > self.width:
            self.flush()
        start = counts.cumsum(0) - counts
        slot = torch.arange(r.numel(), device=z.device) - start[r] + self.fill[r]
        self.buf_v[r, slot], self.buf_i[r, slot] = z[r, c], (c + v0).int()
        self.fill += counts


def _host_filter(device: torch.device) -> bool:
    """Whether the candidate filter may read a count per tile on the host (free on CPU; on an
    accelerator it would be a synchronization per tile, so every tile is merged instead)."""
    return device.type == "cpu"


def _gather_ranks(vp: VocabParallel, t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(vp.world_size)]
    dist.all_gather(out, t.contiguous(), group=vp.group)
    return out


def _merge_ranks(vp: VocabParallel, vals, ids, extra, cap: int):
    """Merge every rank's candidates (one all-gather of [R, C] values, ids, extra): the
    global C largest, identical on every rank."""
    all_v = _gather_ranks(vp, vals)
    all_i = _gather_ranks(vp, ids)
    all_x = _gather_ranks(vp, extra)
    cat_v = torch.cat(all_v, 1)
    merged, pos = cat_v.topk(cap, dim=1)
    merged_i = torch.cat(all_i, 1).gather(1, pos)
    theta = merged[:, -1]
    left_out = sum(torch.where(v[:, -1] == theta, x, 0) for v, x in zip(all_v, all_x, strict=True))
    extra = left_out + _count_eq(cat_v, theta) - _count_eq(merged, theta)
    extra = torch.where(torch.isfinite(theta), extra, 0)
    return merged, merged_i, extra


def stream_candidates(
    batch: RowBatch, opts: KernelOptions, cap: int, with_mass: bool = True
) -> Candidates:
    """One pass over the vocabulary: the ``cap`` largest logits of each row (see the module).

    batch: R rows (weight: this rank's shard under ``opts.vocab_parallel``; labels
    shard-local); ``cap`` <= the global vocabulary size. ``with_mass``: also the whole row's
    log-sum-exp (online max and ``Σ exp``; otherwise ``lse`` is NaN). Rows are processed in
    chunks whose ``[rows, cap]`` candidates stay within a fixed budget; in the batch-invariant
    mode, the log-prob op's fixed row blocks (the last one padded), so a row's candidates and
    mass do not depend on the other rows.
    """
    if opts.schedule.padded:
        num_rows = batch.hidden.shape[0]
        pad = opts.schedule.padding(num_rows)
        cand = _stream(batch.padded(pad), opts, cap, with_mass, opts.schedule)
        return Candidates(*(x[:num_rows] for x in cand))
    return _stream(batch, opts, cap, with_mass, None)


def _stream(
    batch: RowBatch, opts: KernelOptions, cap: int, with_mass: bool, fixed: Schedule | None
) -> Candidates:
    """:func:`stream_candidates` under the schedule ``fixed`` (None: chosen here)."""
    hidden, weight, bias, labels, temp = batch
    vp = opts.vocab_parallel
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    offset = 0 if vp is None else vp.vocab_start
    sched_vocab = vocab if vp is None else vp.max_shard
    world = 1 if vp is None else vp.world_size
    rows_per = max(1, min(opts.schedule.rows, _CANDIDATE_ELEMS // (cap * world), num_rows))
    sched = fixed or Schedule.choose(num_rows, sched_vocab, dev, rows_per)
    sparse = _host_filter(dev)
    h_all = hidden.to(opts.head_dtype)
    cd = opts.compute_dtype
    out_v = torch.empty(num_rows, cap, device=dev, dtype=cd)
    out_i = torch.empty(num_rows, cap, dtype=torch.int32, device=dev)
    out_x = torch.empty(num_rows, dtype=torch.int64, device=dev)
    lse = torch.empty(num_rows, device=dev, dtype=cd)
    zy = torch.empty(num_rows, device=dev, dtype=cd)
    tile = min(sched.rows, max(num_rows, 1)) * min(sched.vocab_block, vocab)
    buf = torch.empty(tile, device=dev, dtype=cd)
    for r0, r1 in sched.row_chunks(num_rows):
        n = r1 - r0
        t_rows = None if temp is None else temp[r0:r1, None]
        top = _RunningTopK(out_v[r0:r1], out_i[r0:r1], out_x[r0:r1], sparse)
        stats = OnlineStats(labels[r0:r1], with_entropy=False)
        zy_c = torch.zeros(n, device=dev, dtype=cd)
        for v0, v1 in sched.vocab_blocks(vocab):
            z = buf[: n * (v1 - v0)].view(n, v1 - v0)
            w, b = weight_block(weight, bias, v0, v1, opts.head_dtype)
            project(z, h_all[r0:r1], w, b, t_rows, opts)
            top.fold(z, v0 + offset)
            if with_mass:
                stats.update(z, v0, destructive=True)
            else:
                slot, inside = label_slot(labels[r0:r1], v0, v1 - v0)
                zy_c = torch.where(inside, z.gather(1, slot)[:, 0], zy_c)
        top.flush()
        if vp is not None:
            merged = _merge_ranks(vp, top.vals, top.ids, top.extra, cap)
            out_v[r0:r1], out_i[r0:r1], out_x[r0:r1] = merged
        if with_mass:
            m, s, zy_c = stats.m, stats.s, stats.zy
            if vp is not None:  # the whole row's statistics, and the label logit from its shard
                m, s, _, zy_c = vp.combine(m, s, None, zy_c)
            lse[r0:r1] = m + s.log()
        else:
            lse[r0:r1] = float("nan")
            if vp is not None:  # the label logit from the shard that holds it
                dist.all_reduce(zy_c, op=dist.ReduceOp.SUM, group=vp.group)
        zy[r0:r1] = zy_c
    return Candidates(out_v, out_i, out_x, lse, zy)


class KeptSets(NamedTuple):
    """Result of :func:`kept_from_candidates` for R rows.

    covered: [R] bool, the row's kept set was decided by its candidates (otherwise stream it
    again with more); threshold: [R] the kept set is ``{z >= threshold}``; count: [R] int64
    candidates kept (``vals >= threshold``, a prefix of the sorted candidates); need: [R] int64
    a candidate count that would decide an uncovered row (a lower bound).
    """

    covered: torch.Tensor
    threshold: torch.Tensor
    count: torch.Tensor
    need: torch.Tensor


def kept_from_candidates(cand: Candidates, spec: ReplayArgs) -> KeptSets:
    """The sampler's kept set of each row from its sorted candidates (see the module doc).

    spec: the sampler's parameters of these R rows (:meth:`ReplayArgs.take`): ``top_k`` [R]
    int64 (>= ``vocab_size``: none), ``top_p`` [R] float64 in (0, 1], ``min_p`` [R] float64
    in [0, 1), or None each. Rows without top-k need their top-p / min-p set within the
    candidates; ``KeptSets.covered`` says which rows were decided.
    """
    top_k, top_p, min_p, vocab_size = spec.top_k, spec.top_p, spec.min_p, spec.vocab_size
    vals, extra = cand.vals, cand.extra
    rows, cap = vals.shape
    dev = vals.device
    complete = cap >= vocab_size  # every token of the row is a candidate
    neg_inf = torch.full((rows,), float("-inf"), device=dev)
    theta = vals[:, -1]
    top = vals[:, 0]  # the row's max logit
    col = torch.arange(cap, device=dev)
    t0 = neg_inf
    if top_k is not None:
        binding = top_k < vocab_size
        kth = vals.gather(1, (top_k.clamp(1, cap) - 1)[:, None])[:, 0]
        t0 = torch.where(binding, kth, neg_inf)
    if min_p is not None:
        t_min = top + torch.log(min_p.clamp(min=1e-300)).to(top.dtype)
        t0 = torch.maximum(t0, torch.where(min_p > 0, t_min, neg_inf))

    def fits(t: torch.Tensor) -> torch.Tensor:
        """{z >= t} lies within the candidates."""
        if complete:
            return torch.ones(rows, dtype=torch.bool, device=dev)
        return (t > theta) | ((t == theta) & (extra == 0))

    k0_fits = fits(t0)
    threshold, decided = t0, k0_fits | (t0 == theta)  # decided: the threshold is known
    if top_p is not None:
        n0 = (vals >= t0[:, None]).sum(1)
        in_k0 = col[None, :] < n0[:, None]
        mass = torch.where(in_k0, (vals.double() - top.double()[:, None]).exp(), 0.0)
        incl = mass.cumsum(1)
        excl = incl - mass
        # S0, the mass of the set top-p renormalizes over (relative to exp(max)): from the
        # candidates when it lies within them, the whole row's when only top-p truncates.
        whole = (cand.lse.double() - top.double()).exp()
        s0 = torch.where(k0_fits, incl[:, -1], whole)
        known = k0_fits | (t0 == float("-inf"))
        bound = top_p * s0
        keep_p = (excl < bound[:, None]) & in_k0
        j_star = (keep_p.sum(1) - 1).clamp(min=0)
        t_p = vals.gather(1, j_star[:, None])[:, 0]
        found = known & (k0_fits | (incl[:, -1] >= bound))
        truncating = top_p < 1
        threshold = torch.where(truncating, torch.maximum(t0, t_p), t0)
        decided = torch.where(truncating, found, decided)
    # Covered: every token >= the threshold is a candidate. A decided row that is not covered
    # left out only ties at its threshold (their ids are unknown): `extra` more candidates
    # take them all in. Otherwise widen.
    covered = decided & fits(threshold)
    count = (vals >= threshold[:, None]).sum(1)
    need = torch.where(decided, cap + extra, cap * _WIDEN)
    need = torch.where(covered, cap, need)
    return KeptSets(covered, threshold, count, need.clamp(max=vocab_size))
