"""The torch backend: the tiled LM-head log-prob / entropy kernel and its recompute backward.

Work is split into tiles of ``[row_chunk, vocab_block]`` logits. The forward pass keeps, per
row, a running max ``m``, ``s = Σ exp(z - m)`` and ``q = Σ exp(z - m)·(z - m)`` across vocab
blocks (online log-sum-exp), so that

    lse = m + log s            H = log s - q / s

and saves only ``[M]``-sized statistics (lse, entropy). Backward recomputes each tile and turns
it into the logit gradient in place:

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y)          (then · dz/dx of the transform)

where the label term is a scatter-add of ``[rows]`` values into the tile (no one-hot), and the
transform's derivative (:class:`logitless.transform.LogitTransform`) is a per-row factor folded
into the upstream gradients times the softcap's slope. Tiles are sized to stay cache-resident
on CPU, so the elementwise passes cost a fraction of the matmuls.

This is the CPU path and the fallback on any device. Everything here works on *valid* rows
only: the op drops ignored rows before calling in.
"""

from __future__ import annotations

import torch

from ..contract.vocab import VocabParallel
from .base import (
    GradFn,
    HeadGrads,
    KernelOptions,
    Needs,
    ProbeStats,
    RowBatch,
    RowStats,
    Upstream,
    add_product,
    extend_rows,
    finish_probed,
    finish_stats,
    padded_backward,
)


def project(
    out: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    temp: torch.Tensor | None,
    opts: KernelOptions,
) -> torch.Tensor:
    """Write the transformed logits ``z = transform(h·wᵀ + b)`` of one tile into ``out``.

    h: [R, H], w: [Vb, H] in the head dtype; out: [R, Vb] in the compute dtype; temp: [R, 1] or
    None (the transform's scalar).
    """
    if h.dtype == out.dtype:
        if b is None:
            torch.mm(h, w.t(), out=out)
        else:
            torch.addmm(b, h, w.t(), out=out)
    else:
        # The projection runs (and rounds) in the head dtype, as F.linear would; softmax is fp32.
        logits = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
        out.copy_(logits)
    return opts.transform.apply_(out, temp)


def label_slot(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each row's label inside vocab block [start, start+width), and whether it is there.

    Rows whose label lies outside the block point at a clamped column and get ``inside=False``,
    so callers gather/scatter without a host sync and mask the value instead.
    """
    local = labels - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1)[:, None], inside


def weight_block(
    weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [v0, v1) of the head in the projection dtype; cast per block so a bf16 model with an
    fp32 head never holds a full fp32 copy of the weight."""
    w = weight[v0:v1].to(dtype)
    return w, None if bias is None else bias[v0:v1].to(dtype)


def _tile_buffer(rows: int, opts: KernelOptions, vocab: int, device: torch.device) -> torch.Tensor:
    size = rows * min(opts.schedule.vocab_block, vocab)
    return torch.empty(size, device=device, dtype=opts.compute_dtype)


class OnlineStats:
    """Running log-sum-exp / entropy statistics of a block of rows across vocab blocks.

    Keeps, per row, the running max ``m``, ``s = Σ exp(z - m)`` and ``q = Σ exp(z - m)·(z - m)``
    so that ``lse = m + log s`` and ``H = log s - q / s``; also gathers the label logit. With
    ``probe`` (``[R, K]`` local ids, -1 unused), also the logits at those ids and ``s_out``,
    ``Σ exp(z - m)`` over the other columns (their own sum: no cancellation), each an extra
    read of a tile the statistics already made (which they leave the same bits).
    """

    def __init__(
        self, labels: torch.Tensor, with_entropy: bool, probe: torch.Tensor | None = None
    ) -> None:
        self.labels = labels
        self.with_entropy = with_entropy
        self.m = self.s = self.q = self.zy = None
        self.probe = probe
        self.z_probe = self.s_out = None

    def update(self, z: torch.Tensor, v0: int, destructive: bool) -> None:
        """Fold in tile ``z`` [R, Vb] (columns v0...). ``destructive`` lets it overwrite z."""
        slot, inside = label_slot(self.labels, v0, z.shape[1])
        z_lab = z.gather(1, slot).squeeze(1)
        self.zy = torch.where(inside, z_lab, z_lab.new_zeros(()) if self.zy is None else self.zy)
        if self.probe is not None:
            col, at = _probe_slots(self.probe, v0, z.shape[1])
            before = z.new_zeros(()) if self.z_probe is None else self.z_probe
            self.z_probe = torch.where(at, z.gather(1, col), before)
        m_blk = z.amax(dim=1)
        m_new = m_blk if self.m is None else torch.maximum(self.m, m_blk)
        d = z.sub_(m_new[:, None]) if destructive else z - m_new[:, None]  # z - m_new <= 0
        if self.with_entropy:
            e = d.exp()
            s_blk = e.sum(dim=1)
            # Σ e·(z - m) by torch's cascade sum of the products (d is a scratch tile here):
            # as the divergence op sums it, so the two ops' entropies agree bit for bit
            q_blk = d.mul_(e).sum(dim=1)
        else:
            e = d.exp_()
            s_blk = e.sum(dim=1)
            q_blk = None
        # e (a scratch tile now) -> the sum over the columns that are not probed ids
        out_blk = None if self.probe is None else _outside_sum(e, self.probe, v0)
        if self.m is None:
            self.s, self.q, self.s_out = s_blk, q_blk, out_blk
        else:
            shift = self.m - m_new  # <= 0
            alpha = shift.exp()
            if self.with_entropy:
                self.q = alpha * (self.q + shift * self.s) + q_blk
            self.s = alpha * self.s + s_blk
            if out_blk is not None:
                self.s_out = alpha * self.s_out + out_blk
        self.m = m_new

    def finish(
        self, vp: VocabParallel | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logp [R], lse [R], entropy [R] or None; over the whole vocabulary when ``vp`` is
        given (the shards' statistics are combined across its group: a collective call)."""
        return finish_stats(self.m, self.s, self.q, self.zy, vp)

    def finish_probed(self, vp: VocabParallel | None = None):
        """:meth:`finish` and the :class:`~.base.ProbeStats` of the probed ids."""
        return finish_probed(self.m, self.s, self.q, self.zy, self.s_out, self.z_probe, vp)


def _probe_slots(ids: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of ids ``[R, K]`` inside vocab block ``[v0, v0 + width)`` (clamped) and whether
    each is there (-1, an unused slot, never is)."""
    local = ids - v0
    at = (ids >= 0) & (local >= 0) & (local < width)
    return local.clamp(0, width - 1), at


def _outside_sum(e: torch.Tensor, ids: torch.Tensor, v0: int) -> torch.Tensor:
    """``[R]`` Σ of tile ``e`` ``[R, Vb]`` over its columns that are not ids; sets the ids'
    columns of ``e`` to 0 (``e`` is scratch by now), exactly: each is added its own negative
    (an unused slot, clamped onto some column, adds 0)."""
    col, at = _probe_slots(ids, v0, e.shape[1])
    e.scatter_add_(1, col, torch.where(at, -e.gather(1, col), 0.0))
    return e.sum(dim=1)


def _temp_col(temp: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    """Rows ``[r0, r1)`` of per-row temperatures as a ``[R, 1]`` column (None: scalar)."""
    return None if temp is None else temp[r0:r1, None]


def forward_rows(
    rows: RowBatch,
    opts: KernelOptions,
    keep_tile: bool = False,
    probe: torch.Tensor | None = None,
) -> RowStats:
    """Log-prob of each row's label, its log-sum-exp and (optionally) entropy.

    rows: M valid rows (labels in ``[0, V)``, or shard-local). Returns :class:`RowStats` in the
    compute dtype, with ``kept``: the single tile's transformed logits ``[M, V]`` when
    ``keep_tile`` is set and the work is one tile (else None; under a padded schedule, the
    padded rows' tile, which :func:`backward_rows` pads the same way); ``probe``: ``[M, K]``
    shard-local ids to report (:class:`~.base.ProbeStats`), or None.
    """
    num_rows = rows.hidden.shape[0]
    pad = opts.schedule.padding(num_rows)
    if pad == 0:
        return _forward_rows(rows, opts, keep_tile, probe)
    return _forward_rows(rows.padded(pad), opts, keep_tile, extend_rows(probe, pad)).cut(num_rows)


def _forward_rows(
    rows: RowBatch, opts: KernelOptions, keep_tile: bool, probe: torch.Tensor | None
) -> RowStats:
    hidden, weight, bias, labels, temp = rows
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    h_all = hidden.to(hd)
    cd = opts.compute_dtype
    logp = torch.empty(num_rows, device=dev, dtype=cd)
    lse = torch.empty(num_rows, device=dev, dtype=cd)
    ent = torch.empty(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    rows_per = opts.schedule.rows
    keep = keep_tile and opts.schedule.num_tiles(num_rows, vocab) == 1
    kept = None
    found = None if probe is None else _ProbeOut(num_rows, probe.shape[1], dev, cd)
    buf = _tile_buffer(min(rows_per, num_rows), opts, vocab, dev) if num_rows else None
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        t_rows = _temp_col(temp, r0, r1)
        stats = OnlineStats(
            labels[r0:r1], opts.with_entropy, None if probe is None else probe[r0:r1]
        )
        for v0, v1 in opts.schedule.vocab_blocks(vocab):
            z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
            w, b = weight_block(weight, bias, v0, v1, hd)
            project(z, h_all[r0:r1], w, b, t_rows, opts)
            if keep:
                kept = z.clone()
            stats.update(z, v0, destructive=True)
        if found is None:
            logp[r0:r1], lse[r0:r1], ent_c = stats.finish(opts.vocab_parallel)
        else:
            logp[r0:r1], lse[r0:r1], ent_c, chunk = stats.finish_probed(opts.vocab_parallel)
            found.put(r0, chunk)
        if ent is not None:
            ent[r0:r1] = ent_c
    return RowStats(logp, lse, ent, kept, None if found is None else found.stats())


class _ProbeOut:
    """The :class:`~.base.ProbeStats` of M rows, written row chunk by row chunk."""

    def __init__(self, num_rows: int, k: int, device: torch.device, dtype: torch.dtype) -> None:
        self.z = torch.zeros(num_rows, k, device=device, dtype=dtype)
        self.rows = [torch.zeros(num_rows, device=device, dtype=dtype) for _ in range(3)]

    def put(self, r0: int, chunk: ProbeStats) -> None:
        r1 = r0 + chunk.max.shape[0]
        self.z[r0:r1] = chunk.z
        for buf, part in zip(self.rows, chunk[1:], strict=True):
            buf[r0:r1] = part

    def stats(self) -> ProbeStats:
        return ProbeStats(self.z, *self.rows)


class _RowGrad:
    """Upstream-gradient terms of a block of rows, with the transform's per-row factor
    (``s / T``) folded in.

    g: [R] d/d logp (None: 0); e: [R] d/d entropy (None if unused); ent: [R] entropy; temp:
    [R, 1] or None.
    """

    def __init__(self, g, e, ent, temp, opts: KernelOptions, num_rows: int, device) -> None:
        factor = opts.transform.row_factor(None if temp is None else temp[:, 0])
        if not isinstance(factor, torch.Tensor):
            factor = torch.full((num_rows,), factor, device=device, dtype=opts.compute_dtype)
        self.temp = temp
        if g is None:
            g = torch.zeros_like(factor)
        self.g_t = (g * factor)[:, None]  # g · s / T
        self.e_t = self.coef = None
        if e is not None:
            self.e_t = (e * factor)[:, None]  # e · s / T
            self.coef = self.g_t + self.e_t * ent[:, None]  # (g + e·H) · s / T


def _tile_to_dz(
    z: torch.Tensor,
    lse: torch.Tensor,
    rg: _RowGrad,
    labels: torch.Tensor,
    v0: int,
    opts: KernelOptions,
) -> torch.Tensor:
    """Turn transformed logits ``z`` [R, Vb] into d loss / d raw logits, in place.

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y), then · s / T and · softcap'(raw).
    """
    slope = opts.transform.softcap_slope(z, rg.temp)
    z.sub_(lse[:, None])  # log p
    if rg.e_t is not None:
        p = z.exp()
        # -p·(g + e·(log p + H)) / T  =  p · (log p · (-e/T) - (g + e·H)/T): two passes
        torch.addcmul(rg.coef.neg(), z, rg.e_t.neg(), out=z).mul_(p)
    else:
        z.exp_().mul_(rg.g_t.neg())  # -p·g / T
    _add_label_term(z, rg, labels, v0)
    if slope is not None:
        z.mul_(slope)
    return z


def _add_label_term(dz: torch.Tensor, rg: _RowGrad, labels: torch.Tensor, v0: int) -> None:
    """dz[i, y_i] += g_i / T_i for the rows whose label lies in this tile (no one-hot)."""
    slot, inside = label_slot(labels, v0, dz.shape[1])
    dz.scatter_add_(1, slot, torch.where(inside, rg.g_t.squeeze(1), 0.0)[:, None])


def _exp_tile_to_dz(
    e: torch.Tensor, to_p: torch.Tensor, rg: _RowGrad, labels: torch.Tensor, v0: int
) -> torch.Tensor:
    """The no-entropy, no-softcap shortcut: ``e`` [R, Vb] holds ``exp(z - m)`` and
    ``to_p = exp(m - lse)`` [R], so ``dz = -(g/T)·p + (g/T)·onehot`` is one multiply."""
    e.mul_((to_p[:, None] * rg.g_t).neg_())
    _add_label_term(e, rg, labels, v0)
    return e


class GradAccumulator:
    """Accumulates dh [M, H], dW [V, H] and db [V] tile by tile; returns them in the dtypes of
    :meth:`KernelOptions.grad_dtype` (the inputs' dtypes, unless held for a later scale).

    Every product is accumulated in fp32 (:func:`add_product`): dh sums one product per vocab
    block, and dW one per row chunk. The weight gradient accumulates in the returned dtype only
    when each of its entries is written once (one row chunk) from a product that comes out in
    that dtype or in fp32; otherwise in fp32. With ``opts.weight_grad_into`` it accumulates
    straight into that buffer (compute dtype, added to what it holds) and :meth:`result`
    returns None for it.
    """

    def __init__(self, hidden, weight, bias, needs, opts: KernelOptions) -> None:
        num_rows, dim = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        self.hidden, self.weight, self.bias, self.opts = hidden, weight, bias, opts
        self.hd = opts.head_dtype
        need_h, need_w, need_b = needs
        cd = opts.compute_dtype
        w_dtype = opts.grad_dtype(weight.dtype)
        once = num_rows <= opts.schedule.rows and self.hd in (w_dtype, cd)
        self.dh = torch.zeros(num_rows, dim, device=dev, dtype=cd) if need_h else None
        self.into = opts.weight_grad_buffer if need_w else None
        self.dw = None
        if self.into is not None:
            self.dw = self.into
        elif need_w:
            self.dw = torch.zeros(vocab, dim, device=dev, dtype=w_dtype if once else cd)
        self.db = None
        if need_b and bias is not None:
            self.db = torch.zeros(vocab, device=dev, dtype=cd)

    def add(self, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor, r0: int, v0: int) -> None:
        """Add tile dz [R, Vb] (fp32) of rows r0... and vocab v0...; h, w in the head dtype."""
        r1, v1 = r0 + dz.shape[0], v0 + dz.shape[1]
        if self.db is not None:
            self.db[v0:v1] += dz.sum(dim=0)
        dz_h = dz if self.hd == dz.dtype else dz.to(self.hd)
        if self.dh is not None:
            add_product(self.dh[r0:r1], dz_h, w)
        if self.dw is not None:
            gw = self.dw[v0:v1]
            if gw.dtype == dz_h.dtype:  # fp32 throughout, or a 16-bit dW written once
                gw.addmm_(dz_h.t(), h)
            elif gw.dtype == self.opts.compute_dtype:  # 16-bit products summed in fp32
                add_product(gw, dz_h.t(), h)
            else:  # a 16-bit dW written once from an fp32 product: rounded once
                gw += dz_h.t() @ h

    def result(self, vp: VocabParallel | None = None):
        """(dh, dW, db) in :meth:`KernelOptions.grad_dtype` of hidden's, weight's and bias's
        dtypes (None where not needed).

        With ``vp``, dh (this shard's ``dz·W_r``) is first summed over its group if it asks.
        """
        if vp is not None:
            vp.reduce_hidden(self.dh)
        dtype = self.opts.grad_dtype
        dw = (
            None
            if self.dw is None or self.into is not None
            else self.dw.to(dtype(self.weight.dtype))
        )
        return (
            None if self.dh is None else self.dh.to(dtype(self.hidden.dtype)),
            dw,
            None if self.db is None else self.db.to(dtype(self.bias.dtype)),
        )


def backward_rows(
    rows: RowBatch, stats: RowStats, up: Upstream, opts: KernelOptions, needs: Needs
) -> HeadGrads:
    """Gradients for hidden [M, H], weight [V, H] and bias [V], in those tensors' dtypes.

    stats: the forward's (lse, entropy, and its single tile if kept: consumed, overwritten
    here); up: the [M] upstream gradients (None where that output is unused).
    """
    num_rows = rows.hidden.shape[0]
    pad = opts.schedule.padding(num_rows)
    return padded_backward(_backward_rows, rows, stats, up, opts, needs, pad)


def _backward_rows(
    rows: RowBatch, stats: RowStats, up: Upstream, opts: KernelOptions, needs: Needs
) -> HeadGrads:
    grad_logp, grad_ent = up
    hidden, weight, bias, labels, temp = rows
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    acc = GradAccumulator(hidden, weight, bias, needs, opts)
    if num_rows == 0:
        return acc.result()
    h_all = hidden.to(hd)
    use_ent = opts.with_entropy and grad_ent is not None
    ent, kept = stats.entropy, stats.kept
    buf = (
        None
        if kept is not None
        else _tile_buffer(min(opts.schedule.rows, num_rows), opts, vocab, dev)
    )
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        h = h_all[r0:r1]
        t_rows = _temp_col(temp, r0, r1)
        rg = _RowGrad(
            None if grad_logp is None else grad_logp[r0:r1],
            grad_ent[r0:r1] if use_ent else None,
            ent[r0:r1] if use_ent else None,
            t_rows,
            opts,
            r1 - r0,
            dev,
        )
        for v0, v1 in opts.schedule.vocab_blocks(vocab):
            w, b = weight_block(weight, bias, v0, v1, hd)
            if kept is not None:
                z = kept
            else:
                z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
                project(z, h, w, b, t_rows, opts)
            acc.add(_tile_to_dz(z, stats.lse[r0:r1], rg, labels[r0:r1], v0, opts), h, w, r0, v0)
    return acc.result(opts.vocab_parallel)


def fused_rows(
    rows: RowBatch, opts: KernelOptions, grad_fn: GradFn, needs: Needs
) -> tuple[torch.Tensor, torch.Tensor | None, HeadGrads]:
    """Log-probs, entropy and parameter gradients in one pass: three matmuls, no recompute.

    For each row chunk the transformed logits of all V columns stay in one ``[rows, V]``
    buffer (stored block by block). Once the chunk's statistics are known,
    ``grad_fn(r0, r1, logp[r0:r1], entropy[r0:r1])`` returns the upstream gradients
    ``(d loss/d logp, d loss/d entropy)`` of those rows (each [rows] or None), and the chunk is
    turned into dz in place and multiplied out while it is still in memory. ``grad_fn`` must
    only depend on its own rows' values: that is what makes the loss token-local.

    Returns logp [M], entropy [M] or None, and (dh, dW, db) as ``backward_rows`` does.
    Under a padded schedule the filler rows get a zero gradient and ``grad_fn`` never sees them.
    """
    num_rows = rows.hidden.shape[0]
    pad = opts.schedule.padding(num_rows)
    if pad == 0:
        return _fused_rows(rows, opts, grad_fn, needs)

    def real_grad_fn(r0: int, r1: int, logp: torch.Tensor, ent: torch.Tensor | None):
        stop = min(r1, num_rows)
        cut = None if ent is None else ent[: stop - r0]
        g, e = grad_fn(r0, stop, logp[: stop - r0], cut)
        return extend_rows(g, r1 - stop, 0.0), extend_rows(e, r1 - stop, 0.0)

    logp, ent, (dh, dw, db) = _fused_rows(rows.padded(pad), opts, real_grad_fn, needs)
    ent = None if ent is None else ent[:num_rows]
    return logp[:num_rows], ent, ((None if dh is None else dh[:num_rows]), dw, db)


def _fused_rows(
    rows: RowBatch, opts: KernelOptions, grad_fn: GradFn, needs: Needs
) -> tuple[torch.Tensor, torch.Tensor | None, HeadGrads]:
    hidden, weight, bias, labels, temp = rows
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    acc = GradAccumulator(hidden, weight, bias, needs, opts)
    cd = opts.compute_dtype
    logp = torch.empty(num_rows, device=dev, dtype=cd)
    ent = torch.empty(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    if num_rows == 0:
        return logp, ent, acc.result()
    h_all = hidden.to(hd)
    chunk_buf = torch.empty(min(opts.schedule.rows, num_rows) * vocab, device=dev, dtype=cd)
    # Without entropy or softcap, the gradient needs p only, not z: store exp(z - m) in pass A.
    keep_exp = not opts.with_entropy and opts.transform.softcap is None
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        n = r1 - r0
        h, y = h_all[r0:r1], labels[r0:r1]
        t_rows = _temp_col(temp, r0, r1)

        def tile(v0: int, v1: int, n: int = n) -> torch.Tensor:
            return chunk_buf[v0 * n : v1 * n].view(n, v1 - v0)

        stats = OnlineStats(y, opts.with_entropy)
        shifts = []  # per block: the running max its tile was exponentiated against
        for v0, v1 in opts.schedule.vocab_blocks(vocab):
            w, b = weight_block(weight, bias, v0, v1, hd)
            z = project(tile(v0, v1), h, w, b, t_rows, opts)
            # keep_exp: the tile is left as exp(z - m), all pass B needs (see _exp_tile_to_dz)
            stats.update(z, v0, destructive=keep_exp)
            shifts.append(stats.m)
        logp_c, lse_c, ent_c = stats.finish(opts.vocab_parallel)
        logp[r0:r1] = logp_c
        if ent is not None:
            ent[r0:r1] = ent_c
        g_c, e_c = grad_fn(r0, r1, logp_c, ent_c)
        if e_c is not None and ent_c is None:
            raise ValueError("grad_fn returned an entropy gradient but with_entropy is False")
        rg = _RowGrad(g_c, e_c, ent_c, t_rows, opts, n, dev)
        for j, (v0, v1) in enumerate(opts.schedule.vocab_blocks(vocab)):
            w, _ = weight_block(weight, None, v0, v1, hd)
            if keep_exp:
                dz = _exp_tile_to_dz(tile(v0, v1), (shifts[j] - lse_c).exp(), rg, y, v0)
            else:
                dz = _tile_to_dz(tile(v0, v1), lse_c, rg, y, v0, opts)
            acc.add(dz, h, w, r0, v0)
    return logp, ent, acc.result(opts.vocab_parallel)
