"""The tiled LM-head log-prob / entropy kernel and its recompute backward.

Work is split into tiles of ``[row_chunk, vocab_block]`` logits. The forward pass keeps, per
row, a running max ``m``, ``s = Σ exp(z - m)`` and ``q = Σ exp(z - m)·(z - m)`` across vocab
blocks (online log-sum-exp), so that

    lse = m + log s            H = log s - q / s

and saves only ``[M]``-sized statistics (lse, entropy). Backward recomputes each tile and turns
it into the logit gradient in place:

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y)          (then / T, then · softcap')

where the label term is a scatter-add of ``[rows]`` values into the tile (no one-hot). Tiles are
sized to stay cache-resident on CPU, so the elementwise passes cost a fraction of the matmuls.

Everything here works on *valid* rows only: ``head.py`` drops ignored rows before calling in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements of one fp32 logits tile. CPU: ~8 MiB, so the elementwise passes run out of L2/L3
# instead of DRAM (measured: 2.3 s vs 3.2 s for a 2048 x 151936 x 512 forward with 134 MB
# tiles). CUDA: larger tiles amortize kernel launches; the tile is still bounded, never [N, V].
_TILE_ELEMS = {"cpu": 1 << 21}
_TILE_ELEMS_DEFAULT = 1 << 26
_MAX_ROWS = {"cpu": 2048}
_MAX_ROWS_DEFAULT = 8192
_MIN_VOCAB_BLOCK = 256


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
        block = min(vocab, max(_MIN_VOCAB_BLOCK, tile // rows))
        return Schedule(rows=rows, vocab_block=max(1, block))

    def num_tiles(self, num_rows: int, vocab: int) -> int:
        return -(-num_rows // self.rows) * -(-vocab // self.vocab_block)


@dataclass(frozen=True)
class HeadOptions:
    """Non-tensor options of one head call (kept out of the autograd signature)."""

    softcap: float | None
    temperature: float | None  # scalar temperature; None when a per-row tensor is passed
    with_entropy: bool
    head_dtype: torch.dtype
    schedule: Schedule


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
    if h.dtype == torch.float32:
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
    return torch.empty(rows * min(opts.schedule.vocab_block, vocab), device=device)


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
    logp = torch.empty(num_rows, device=dev)
    lse = torch.empty(num_rows, device=dev)
    ent = torch.empty(num_rows, device=dev) if opts.with_entropy else None
    rows_per, block = opts.schedule.rows, opts.schedule.vocab_block
    keep = keep_tile and opts.schedule.num_tiles(num_rows, vocab) == 1
    kept = None
    buf = _tile_buffer(min(rows_per, num_rows), opts, vocab, dev) if num_rows else None
    for r0 in range(0, num_rows, rows_per):
        r1 = min(r0 + rows_per, num_rows)
        h = h_all[r0:r1]
        y = labels[r0:r1]
        t_rows = None if temp is None else temp[r0:r1]
        m = s = q = zy = None
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
            w, b = _weight_block(weight, bias, v0, v1, hd)
            _project(z, h, w, b, t_rows, opts)
            if keep:
                kept = z.clone()
            slot, inside = _label_slot(y, v0, v1 - v0)
            z_lab = z.gather(1, slot).squeeze(1)
            zy = torch.where(inside, z_lab, z_lab.new_zeros(()) if zy is None else zy)
            m_blk = z.amax(dim=1)
            m_new = m_blk if m is None else torch.maximum(m, m_blk)
            z.sub_(m_new[:, None])  # z - m_new, <= 0
            if opts.with_entropy:
                e = z.exp()
                s_blk = e.sum(dim=1)
                q_blk = torch.bmm(e[:, None, :], z[:, :, None]).view(-1)  # Σ e·(z - m)
            else:
                s_blk = z.exp_().sum(dim=1)
                q_blk = None
            if m is None:
                s, q = s_blk, q_blk
            else:
                shift = m - m_new  # <= 0
                alpha = shift.exp()
                if opts.with_entropy:
                    q = alpha * (q + shift * s) + q_blk
                s = alpha * s + s_blk
            m = m_new
        log_s = s.log()
        lse[r0:r1] = m + log_s
        logp[r0:r1] = zy - lse[r0:r1]
        if ent is not None:
            ent[r0:r1] = log_s - q / s
    return logp, lse, ent, kept


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
    num_rows, dim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    need_h, need_w, need_b = needs
    h_all = hidden.to(hd)
    rows_per, block = opts.schedule.rows, opts.schedule.vocab_block
    multi_chunk = num_rows > rows_per
    # Accumulate across row chunks in fp32 when the parameter is lower precision.
    acc_w_dtype = weight.dtype if (weight.dtype == torch.float32 or not multi_chunk) else None
    grad_h = torch.zeros(num_rows, dim, device=dev) if need_h else None
    grad_w = None
    if need_w:
        grad_w = torch.zeros(vocab, dim, device=dev, dtype=acc_w_dtype or torch.float32)
    grad_b = torch.zeros(vocab, device=dev) if need_b else None
    if num_rows == 0:
        return _cast_grads(grad_h, grad_w, grad_b, hidden, weight, bias)

    zero = torch.zeros((), device=dev)
    g_all = grad_logp if grad_logp is not None else torch.zeros(num_rows, device=dev)
    use_ent = opts.with_entropy and grad_ent is not None
    buf = None if kept is not None else _tile_buffer(min(rows_per, num_rows), opts, vocab, dev)
    for r0 in range(0, num_rows, rows_per):
        r1 = min(r0 + rows_per, num_rows)
        h = h_all[r0:r1]
        y = labels[r0:r1]
        t_rows = None if temp is None else temp[r0:r1]
        inv_t = (
            (1.0 / t_rows)
            if t_rows is not None
            else torch.full((r1 - r0,), 1.0 / (opts.temperature or 1.0), device=dev)
        )
        lse_c = lse[r0:r1, None]
        g_t = (g_all[r0:r1] * inv_t)[:, None]  # g / T
        if use_ent:
            e_t = (grad_ent[r0:r1] * inv_t)[:, None]  # e / T
            coef = g_t + e_t * ent[r0:r1, None]  # (g + e·H) / T
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            w, b = _weight_block(weight, bias, v0, v1, hd)
            if kept is not None:
                z = kept
            else:
                z = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
                _project(z, h, w, b, t_rows, opts)
            cap_grad = None
            if opts.softcap is not None:
                # d softcap(x)/dx = 1 - tanh² = 1 - (z·T / c)²
                scale = (1.0 / opts.softcap) / inv_t
                cap_grad = torch.mul(z, scale[:, None]).square_().neg_().add_(1.0)
            z.sub_(lse_c)  # log p
            if use_ent:
                p = z.exp()
                z.mul_(e_t).add_(coef).mul_(p).neg_()  # -p·(g + e·(log p + H)) / T
            else:
                z.exp_().mul_(g_t).neg_()  # -p·g / T
            slot, inside = _label_slot(y, v0, v1 - v0)
            z.scatter_add_(1, slot, torch.where(inside, g_t.squeeze(1), zero)[:, None])
            if cap_grad is not None:
                z.mul_(cap_grad)
            dz = z if hd == torch.float32 else z.to(hd)
            if need_b:
                grad_b[v0:v1] += z.sum(dim=0)
            if need_h:
                if hd == torch.float32:
                    grad_h[r0:r1].addmm_(dz, w)
                else:
                    grad_h[r0:r1] += dz @ w
            if need_w:
                gw = grad_w[v0:v1]
                if gw.dtype == dz.dtype:
                    gw.addmm_(dz.t(), h)
                else:
                    gw += dz.t() @ h
    return _cast_grads(grad_h, grad_w, grad_b, hidden, weight, bias)


def _cast_grads(grad_h, grad_w, grad_b, hidden, weight, bias):
    return (
        None if grad_h is None else grad_h.to(hidden.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None or bias is None else grad_b.to(bias.dtype),
    )


class LinearLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper: tensors positionally, every other option in one frozen dataclass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temp, opts: HeadOptions):
        keep = any(ctx.needs_input_grad[:3])
        logp, lse, ent, kept = forward_rows(hidden, weight, bias, labels, temp, opts, keep)
        ctx.opts = opts
        ctx.kept = kept
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, temp, lse, ent)
        if ent is None:
            return logp
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, bias, labels, temp, lse, ent = ctx.saved_tensors
        # The kept tile is overwritten by backward: use it once, recompute on a second call
        # (retain_graph=True).
        kept, ctx.kept = ctx.kept, None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None
        gh, gw, gb = backward_rows(
            hidden,
            weight,
            bias,
            labels,
            temp,
            lse,
            ent,
            grad_logp,
            grad_ent,
            ctx.opts,
            needs,
            kept,
        )
        return gh, gw, gb, None, None, None
