"""The torch backend: the tiled LM-head log-prob / entropy kernel and its recompute backward.

Work is split into tiles of ``[row_chunk, vocab_block]`` logits. The forward pass keeps, per
row, a running max ``m``, ``s = Σ exp(z - m)`` and ``q = Σ exp(z - m)·(z - m)`` across vocab
blocks (online log-sum-exp), so that

    lse = m + log s            H = log s - q / s

and saves only ``[M]``-sized statistics (lse, entropy). Backward recomputes each tile and turns
it into the logit gradient in place:

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y)          (then / T, then · softcap')

where the label term is a scatter-add of ``[rows]`` values into the tile (no one-hot). Tiles are
sized to stay cache-resident on CPU, so the elementwise passes cost a fraction of the matmuls.

This is the CPU path and the fallback on any device. Everything here works on *valid* rows
only: :func:`logitless.kernels.rows.select_rows` drops ignored rows before calling in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.vocab import VocabParallel
from .options import HeadOptions, finish_stats


def _project(
    out: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    temp: torch.Tensor | None,
    opts: HeadOptions,
) -> torch.Tensor:
    """Write the transformed logits ``z = softcap(h·wᵀ + b) / T`` of one tile into fp32 ``out``.

    h: [R, H], w: [Vb, H] in the head dtype; out: [R, Vb] fp32; temp: [R] or None.
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
    if opts.softcap is not None:
        out.div_(opts.softcap).tanh_().mul_(opts.softcap)
    if temp is not None:
        out.div_(temp[:, None])
    elif opts.temperature != 1.0:
        out.div_(opts.temperature)
    return out


def _label_slot(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each row's label inside vocab block [start, start+width), and whether it is there.

    Rows whose label lies outside the block point at a clamped column and get ``inside=False``,
    so callers gather/scatter without a host sync and mask the value instead.
    """
    local = labels - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1)[:, None], inside


def _weight_block(
    weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [v0, v1) of the head in the projection dtype; cast per block so a bf16 model with an
    fp32 head never holds a full fp32 copy of the weight."""
    w = weight[v0:v1].to(dtype)
    return w, None if bias is None else bias[v0:v1].to(dtype)


def _tile_buffer(rows: int, opts: HeadOptions, vocab: int, device: torch.device) -> torch.Tensor:
    size = rows * min(opts.schedule.vocab_block, vocab)
    return torch.empty(size, device=device, dtype=opts.compute_dtype)


class _OnlineStats:
    """Running log-sum-exp / entropy statistics of a block of rows across vocab blocks.

    Keeps, per row, the running max ``m``, ``s = Σ exp(z - m)`` and ``q = Σ exp(z - m)·(z - m)``
    so that ``lse = m + log s`` and ``H = log s - q / s``; also gathers the label logit.
    """

    def __init__(self, labels: torch.Tensor, with_entropy: bool) -> None:
        self.labels = labels
        self.with_entropy = with_entropy
        self.m = self.s = self.q = self.zy = None

    def update(self, z: torch.Tensor, v0: int, destructive: bool) -> None:
        """Fold in tile ``z`` [R, Vb] (columns v0...). ``destructive`` lets it overwrite z."""
        slot, inside = _label_slot(self.labels, v0, z.shape[1])
        z_lab = z.gather(1, slot).squeeze(1)
        self.zy = torch.where(inside, z_lab, z_lab.new_zeros(()) if self.zy is None else self.zy)
        m_blk = z.amax(dim=1)
        m_new = m_blk if self.m is None else torch.maximum(self.m, m_blk)
        d = z.sub_(m_new[:, None]) if destructive else z - m_new[:, None]  # z - m_new <= 0
        if self.with_entropy:
            e = d.exp()
            s_blk = e.sum(dim=1)
            q_blk = torch.bmm(e[:, None, :], d[:, :, None]).view(-1)  # Σ e·(z - m)
        else:
            s_blk = d.exp_().sum(dim=1)
            q_blk = None
        if self.m is None:
            self.s, self.q = s_blk, q_blk
        else:
            shift = self.m - m_new  # <= 0
            alpha = shift.exp()
            if self.with_entropy:
                self.q = alpha * (self.q + shift * self.s) + q_blk
            self.s = alpha * self.s + s_blk
        self.m = m_new

    def finish(
        self, vp: VocabParallel | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logp [R], lse [R], entropy [R] or None; over the whole vocabulary when ``vp`` is
        given (the shards' statistics are combined across its group: a collective call)."""
        return finish_stats(self.m, self.s, self.q, self.zy, vp)


def forward_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    opts: HeadOptions,
    keep_tile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of each row's label, its log-sum-exp and (optionally) entropy.

    hidden: [M, H]; weight: [V, H]; labels: [M] int64 in [0, V); temp: [M] fp32 or None.
    Returns logp [M], lse [M], entropy [M] or None (all fp32), and, when ``keep_tile`` is set
    and the work is one single tile, that tile's transformed logits [M, V] fp32 (else None).
    """
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
    buf = _tile_buffer(min(rows_per, num_rows), opts, vocab, dev) if num_rows else None
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        t_rows = None if temp is None else temp[r0:r1]
        stats = _OnlineStats(labels[r0:r1], opts.with_entropy)
        for v0, v1 in opts.schedule.vocab_blocks(vocab):
            z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
            w, b = _weight_block(weight, bias, v0, v1, hd)
            _project(z, h_all[r0:r1], w, b, t_rows, opts)
            if keep:
                kept = z.clone()
            stats.update(z, v0, destructive=True)
        logp[r0:r1], lse[r0:r1], ent_c = stats.finish(opts.vocab_parallel)
        if ent is not None:
            ent[r0:r1] = ent_c
    return logp, lse, ent, kept


class _RowGrad:
    """Upstream-gradient terms of a block of rows, with the 1/T of the temperature folded in.

    g: [R] d/d logp; e: [R] d/d entropy (None if unused); ent: [R] entropy; temp: [R] or None.
    """

    def __init__(self, g, e, ent, temp, opts: HeadOptions, num_rows: int, device) -> None:
        if temp is not None:
            self.inv_t = 1.0 / temp
        else:
            cd = opts.compute_dtype
            t = 1.0 / (opts.temperature or 1.0)
            self.inv_t = torch.full((num_rows,), t, device=device, dtype=cd)
        if g is None:
            g = torch.zeros_like(self.inv_t)
        self.g_t = (g * self.inv_t)[:, None]  # g / T
        self.e_t = self.coef = None
        if e is not None:
            self.e_t = (e * self.inv_t)[:, None]  # e / T
            self.coef = self.g_t + self.e_t * ent[:, None]  # (g + e·H) / T


def _tile_to_dz(
    z: torch.Tensor,
    lse: torch.Tensor,
    rg: _RowGrad,
    labels: torch.Tensor,
    v0: int,
    opts: HeadOptions,
) -> torch.Tensor:
    """Turn transformed logits ``z`` [R, Vb] into d loss / d raw logits, in place.

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y), then / T and · softcap'(raw).
    """
    cap_grad = None
    if opts.softcap is not None:
        # d softcap(x)/dx = 1 - tanh² = 1 - (z·T / c)²
        scale = (1.0 / opts.softcap) / rg.inv_t
        cap_grad = torch.mul(z, scale[:, None]).square_().neg_().add_(1.0)
    z.sub_(lse[:, None])  # log p
    if rg.e_t is not None:
        p = z.exp()
        # -p·(g + e·(log p + H)) / T  =  p · (log p · (-e/T) - (g + e·H)/T): two passes
        torch.addcmul(rg.coef.neg(), z, rg.e_t.neg(), out=z).mul_(p)
    else:
        z.exp_().mul_(rg.g_t.neg())  # -p·g / T
    _add_label_term(z, rg, labels, v0)
    if cap_grad is not None:
        z.mul_(cap_grad)
    return z


def _add_label_term(dz: torch.Tensor, rg: _RowGrad, labels: torch.Tensor, v0: int) -> None:
    """dz[i, y_i] += g_i / T_i for the rows whose label lies in this tile (no one-hot)."""
    slot, inside = _label_slot(labels, v0, dz.shape[1])
    dz.scatter_add_(1, slot, torch.where(inside, rg.g_t.squeeze(1), 0.0)[:, None])


def _exp_tile_to_dz(
    e: torch.Tensor, to_p: torch.Tensor, rg: _RowGrad, labels: torch.Tensor, v0: int
) -> torch.Tensor:
    """The no-entropy, no-softcap shortcut: ``e`` [R, Vb] holds ``exp(z - m)`` and
    ``to_p = exp(m - lse)`` [R], so ``dz = -(g/T)·p + (g/T)·onehot`` is one multiply."""
    e.mul_((to_p[:, None] * rg.g_t).neg_())
    _add_label_term(e, rg, labels, v0)
    return e


class _GradAccumulator:
    """Accumulates dh [M, H], dW [V, H] and db [V] tile by tile; returns them in input dtypes.

    The weight gradient accumulates in fp32 when the parameter is lower precision and more than
    one row chunk contributes; otherwise directly in the parameter's dtype.
    """

    def __init__(self, hidden, weight, bias, needs, opts: HeadOptions) -> None:
        num_rows, dim = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.hd = opts.head_dtype
        need_h, need_w, need_b = needs
        multi_chunk = num_rows > opts.schedule.rows
        cd = opts.compute_dtype
        w_dtype = weight.dtype if weight.dtype == cd or not multi_chunk else cd
        self.dh = torch.zeros(num_rows, dim, device=dev, dtype=cd) if need_h else None
        self.dw = torch.zeros(vocab, dim, device=dev, dtype=w_dtype) if need_w else None
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
            if self.hd == dz.dtype:
                self.dh[r0:r1].addmm_(dz_h, w)
            else:
                self.dh[r0:r1] += dz_h @ w
        if self.dw is not None:
            gw = self.dw[v0:v1]
            if gw.dtype == dz_h.dtype:
                gw.addmm_(dz_h.t(), h)
            else:
                gw += dz_h.t() @ h

    def result(self, vp: VocabParallel | None = None):
        """(dh, dW, db) in hidden's, weight's and bias's dtypes (None where not needed).

        With ``vp``, dh (this shard's ``dz·W_r``) is first summed over its group if it asks.
        """
        if vp is not None:
            vp.reduce_hidden(self.dh)
        return (
            None if self.dh is None else self.dh.to(self.hidden.dtype),
            None if self.dw is None else self.dw.to(self.weight.dtype),
            None if self.db is None else self.db.to(self.bias.dtype),
        )


def backward_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    opts: HeadOptions,
    needs: tuple[bool, bool, bool],
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients for hidden [M, H], weight [V, H] and bias [V], in those tensors' dtypes.

    grad_logp / grad_ent: [M] upstream gradients (None when that output is unused).
    needs: which of (hidden, weight, bias) want a gradient. ``kept``: the single tile's
    transformed logits saved by the forward pass; it is consumed (overwritten) here.
    """
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    acc = _GradAccumulator(hidden, weight, bias, needs, opts)
    if num_rows == 0:
        return acc.result()
    h_all = hidden.to(hd)
    use_ent = opts.with_entropy and grad_ent is not None
    rows_per = opts.schedule.rows
    buf = None if kept is not None else _tile_buffer(min(rows_per, num_rows), opts, vocab, dev)
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        h = h_all[r0:r1]
        t_rows = None if temp is None else temp[r0:r1]
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
            w, b = _weight_block(weight, bias, v0, v1, hd)
            if kept is not None:
                z = kept
            else:
                z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
                _project(z, h, w, b, t_rows, opts)
            acc.add(_tile_to_dz(z, lse[r0:r1], rg, labels[r0:r1], v0, opts), h, w, r0, v0)
    return acc.result(opts.vocab_parallel)


GradFn = Callable[
    [int, int, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor | None, torch.Tensor | None]",
]


def fused_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    opts: HeadOptions,
    grad_fn: GradFn,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """Log-probs, entropy and parameter gradients in one pass: three matmuls, no recompute.

    For each row chunk the transformed logits of all V columns stay in one ``[rows, V]`` fp32
    buffer (stored block by block). Once the chunk's statistics are known,
    ``grad_fn(r0, r1, logp[r0:r1], entropy[r0:r1])`` returns the upstream gradients
    ``(d loss/d logp, d loss/d entropy)`` of those rows (each [rows] or None), and the chunk is
    turned into dz in place and multiplied out while it is still in memory. ``grad_fn`` must
    only depend on its own rows' values: that is what makes the loss token-local.

    Returns logp [M], entropy [M] or None, and (dh, dW, db) as ``backward_rows`` does.
    """
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    acc = _GradAccumulator(hidden, weight, bias, needs, opts)
    cd = opts.compute_dtype
    logp = torch.empty(num_rows, device=dev, dtype=cd)
    ent = torch.empty(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    if num_rows == 0:
        return logp, ent, acc.result()
    h_all = hidden.to(hd)
    rows_per = opts.schedule.rows
    chunk_buf = torch.empty(min(rows_per, num_rows) * vocab, device=dev, dtype=cd)
    # Without entropy or softcap, the gradient needs p only, not z: store exp(z - m) in pass A.
    keep_exp = not opts.with_entropy and opts.softcap is None
    for r0, r1 in opts.schedule.row_chunks(num_rows):
        rows = r1 - r0
        h, y = h_all[r0:r1], labels[r0:r1]
        t_rows = None if temp is None else temp[r0:r1]

        def tile(v0: int, v1: int, rows: int = rows) -> torch.Tensor:
            return chunk_buf[v0 * rows : v1 * rows].view(rows, v1 - v0)

        stats = _OnlineStats(y, opts.with_entropy)
        shifts = []  # per block: the running max its tile was exponentiated against
        for v0, v1 in opts.schedule.vocab_blocks(vocab):
            w, b = _weight_block(weight, bias, v0, v1, hd)
            z = _project(tile(v0, v1), h, w, b, t_rows, opts)
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
        rg = _RowGrad(g_c, e_c, ent_c, t_rows, opts, rows, dev)
        for j, (v0, v1) in enumerate(opts.schedule.vocab_blocks(vocab)):
            w, _ = _weight_block(weight, None, v0, v1, hd)
            if keep_exp:
                dz = _exp_tile_to_dz(tile(v0, v1), (shifts[j] - lse_c).exp(), rg, y, v0)
            else:
                dz = _tile_to_dz(tile(v0, v1), lse_c, rg, y, v0, opts)
            acc.add(dz, h, w, r0, v0)
    return logp, ent, acc.result(opts.vocab_parallel)
