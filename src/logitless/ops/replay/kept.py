"""Kept-set kernels: log-probs, entropy and gradients over a few vocabulary ids per row.

A truncating sampler keeps a set ``K_i`` of token ids for row ``i``. Given the kept entries as
a flat list (``E`` entries: row, global id, and whether it is the row's label), this module
computes, with torch ops only (any device, any dtype):

    z_e = softcap(h_row · W_id + b_id) / T_row                 (gather-dot, fp32 accumulate)
    lse_i = logsumexp_{e ∈ K_i} z_e       H_i = -Σ p_e log p_e,  p_e = exp(z_e - lse_i)
    logp_i = z_{y_i} - lse_i

and, in backward, with upstream ``g_i`` (log-prob) and ``e_i`` (entropy),

    dz_e = g_i·(1[e is the label] - p_e) - e_i·p_e·(z_e - lse_i + H_i)    (then / T, · softcap')
    dh_i += dz_e · W_id        dW_id += dz_e · h_i        db_id += dz_e

Only the kept weight rows are read (``index_select``) and only they get a gradient
(``index_add_``): the cost is ``O(E·H)``, not ``O(rows·V·H)``. Work is cut into chunks of
entries so the gathered ``[chunk, H]`` rows stay within a small fp32 budget; nothing of size
``[rows, V]`` is ever allocated.

Under vocabulary parallelism each rank passes the entries whose ids lie in its shard (local
ids); the per-row statistics are combined over the group exactly as the full-vocabulary
kernels combine theirs (:func:`logitless.backends.base.finish_stats`), and the hidden gradient
is summed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...backends.base import KernelOptions, finish_stats
from ...transform import compute_dtype

# Elements of one gathered [chunk, H] fp32 block (2 MiB): the weight rows, then the hidden rows.
# Small on purpose: the gathers are memory-bound either way, and what the step allocates
# beside the dense weight gradient is its peak memory.
_GATHER_ELEMS = 1 << 19
# Stand-in for the running max of a row without entries on this rank (vocab parallelism): far
# below any logit, finite so that the combine's rescaling stays 0 instead of 0·inf = NaN.
_NO_ENTRY = -1e30


class Entries(NamedTuple):
    """Kept entries of a set of rows, flat.

    rows: [E] int64 row of each entry (into the caller's rows); ids: [E] int64 vocabulary ids
    (global, or shard-local when handed to the gradient kernel); z: [E] fp32 transformed
    logits; is_label: [E] bool, True at the entry that is its row's label (one per row).
    """

    rows: torch.Tensor
    ids: torch.Tensor
    z: torch.Tensor
    is_label: torch.Tensor

    def select(self, keep: torch.Tensor) -> Entries:
        """The entries where ``keep`` [E] is True."""
        return Entries(self.rows[keep], self.ids[keep], self.z[keep], self.is_label[keep])

    def compact(self) -> Entries:
        """The same entries with int32 rows and ids (half the memory of the index lists that
        live from forward to backward); the index ops take either."""
        small = (
            max(self.rows.numel(), 1) < 2**31 and self.ids.numel() and int(self.ids.max()) < 2**31
        )
        if not small:
            return self
        return self._replace(rows=self.rows.int(), ids=self.ids.int())


def _chunks(num: int, dim: int) -> list[tuple[int, int]]:
    step = max(1, _GATHER_ELEMS // max(1, dim))
    return [(s, min(s + step, num)) for s in range(0, num, step)]


def _rows_in(t: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``idx`` of ``t`` rounded to ``dtype`` (the projection dtype), in its compute dtype
    (fp32; float64 for a float64 head)."""
    return t.index_select(0, idx).to(dtype).to(compute_dtype(dtype))


def _entry_temperature(temp: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """[E] temperature of each entry's row, or None for a scalar temperature."""
    return None if temp is None else temp.index_select(0, rows)


def entry_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    ids: torch.Tensor,
    temp: torch.Tensor | None,
    opts: KernelOptions,
) -> torch.Tensor:
    """``z_e = transform(h_{rows_e} · W_{ids_e} + b_{ids_e})`` for E entries, [E] in the
    compute dtype.

    hidden: [M, H]; weight: [V, H] (``ids`` index its rows); temp: [M] or None. The inputs are
    rounded to ``opts.head_dtype`` and multiplied exactly in the compute dtype (products of
    16-bit numbers are exact in fp32), accumulating there.
    """
    num = ids.numel()
    hd = opts.head_dtype
    z = torch.empty(num, device=hidden.device, dtype=opts.compute_dtype)
    for s, e in _chunks(num, hidden.shape[1]):
        w = _rows_in(weight, ids[s:e], hd)
        w.mul_(_rows_in(hidden, rows[s:e], hd))
        z[s:e] = w.sum(1)
    if bias is not None:
        z += bias.index_select(0, ids).to(hd).to(z.dtype)
    return opts.transform.apply_(z, _entry_temperature(temp, rows))


def kept_stats(
    entries: Entries, num_rows: int, opts: KernelOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp [R], lse [R] and entropy [R] (or None) of R rows over their kept entries.

    Every row must have at least one entry (its label) in the group: under
    ``opts.vocab_parallel`` each rank passes its shard's entries and the statistics are
    combined (a collective call).
    """
    vp = opts.vocab_parallel
    dev = entries.z.device
    z, rows = entries.z, entries.rows
    m = torch.full((num_rows,), float("-inf"), device=dev, dtype=z.dtype)
    m.scatter_reduce_(0, rows.long(), z, "amax", include_self=True)
    if vp is not None:
        m = torch.where(torch.isfinite(m), m, _NO_ENTRY)
    d = z - m.index_select(0, rows)  # <= 0
    ex = d.exp()
    s = z.new_zeros(num_rows).index_add_(0, rows, ex)
    q = z.new_zeros(num_rows).index_add_(0, rows, ex * d) if opts.with_entropy else None
    zy = z.new_zeros(num_rows)
    zy.index_add_(0, rows[entries.is_label], z[entries.is_label])
    return finish_stats(m, s, q, zy, vp)


class KeptGrads:
    """Accumulates the kept entries' gradients into dh [M, H] fp32, dW and db.

    The weight gradient accumulates in its dtype (``w_dtype``, the parameter's unless the
    gradients are held, see ``KernelOptions.grad_dtype``) when that is fp32 (in place, into
    a dense ``[V, H]`` buffer that may already hold other rows' gradient) and, for 16-bit
    parameters, in an fp32 buffer over the touched rows only, added once at the end.
    """

    def __init__(
        self, hidden, weight, bias, needs, cd: torch.dtype, w_dtype=None, dw=None, db=None
    ) -> None:
        need_h, need_w, need_b = needs
        dev = hidden.device
        self.weight, self.bias, self.cd = weight, bias, cd
        self.w_dtype = weight.dtype if w_dtype is None else w_dtype  # dW's dtype
        self.dh = torch.zeros(hidden.shape, device=dev, dtype=cd) if need_h else None
        self.need_w = need_w
        self.need_b = need_b and bias is not None
        self.dw, self.db = dw, db

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.weight.shape, device=self.weight.device, dtype=self.w_dtype)

    def add(self, hidden, weight, entries: Entries, grad_of, hd: torch.dtype) -> None:
        """Add the gradients of ``entries`` (local ids), chunk by chunk: ``grad_of(chunk)``
        gives d loss / d raw logit [e] of a chunk of entries, so no [E]-sized temporary lives
        beside the weight gradient."""
        rows, ids = entries.rows, entries.ids
        num, dim = ids.numel(), hidden.shape[1]
        dev = hidden.device
        fp32 = self.w_dtype == self.cd  # accumulate in place
        target = slot = uniq = None
        if self.need_w:
            if fp32:
                if self.dw is None:
                    self.dw = self._zeros()
                target, slot = self.dw, ids
            else:
                uniq, slot = torch.unique(ids.long(), return_inverse=True)
                target = torch.zeros(uniq.numel(), dim, device=dev, dtype=self.cd)
        db = torch.zeros(self.bias.shape, device=dev, dtype=self.cd) if self.need_b else None
        for s, e in _chunks(num, dim):
            dz = grad_of(Entries(rows[s:e], ids[s:e], entries.z[s:e], entries.is_label[s:e]))
            if self.dh is not None:
                w = _rows_in(weight, ids[s:e], hd).mul_(dz[:, None])
                self.dh.index_add_(0, rows[s:e], w)
                del w
            if target is not None:
                target.index_add_(0, slot[s:e], _rows_in(hidden, rows[s:e], hd).mul_(dz[:, None]))
            if db is not None:
                db.index_add_(0, ids[s:e], dz)
        if target is not None and not fp32:
            if self.dw is None:
                self.dw = self._zeros()
            self.dw[uniq] = (self.dw[uniq].to(self.cd) + target).to(self.dw.dtype)
        if db is not None:
            self.db = db.to(self.bias.dtype) if self.db is None else (self.db.to(self.cd) + db)


def entry_grads(
    entries: Entries,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    temp: torch.Tensor | None,
    opts: KernelOptions,
) -> torch.Tensor:
    """d loss / d raw logit of each entry (of a chunk of them), [E] (see the module
    docstring).

    lse, ent, grad_logp, grad_ent: per row [R]; temp: [R] or None.
    """
    rows, z = entries.rows, entries.z
    logp_e = z - lse.index_select(0, rows)  # log p_e
    p = logp_e.exp()
    if grad_logp is not None:
        g = grad_logp.index_select(0, rows)
        dz = torch.where(entries.is_label, g, 0.0) - g * p
    else:
        dz = torch.zeros_like(z)
    if grad_ent is not None and ent is not None:
        e = grad_ent.index_select(0, rows)
        dz -= e * p * (logp_e + ent.index_select(0, rows))
    temp_e = _entry_temperature(temp, rows)
    dz = dz * opts.transform.row_factor(temp_e)
    slope = opts.transform.softcap_slope(z, temp_e)
    return dz if slope is None else dz.mul_(slope)
