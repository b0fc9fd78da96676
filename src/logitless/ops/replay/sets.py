"""The kept sets of a call's truncated rows: their entries, with logits, and statistics.

A truncated row keeps a set ``K`` of token ids: given by the engine (a ``sampling_mask`` row,
:func:`mask_rows`) or replayed from the trainer's own logits (``top_k`` / ``top_p`` /
``min_p``, :func:`replayed_rows`: a streaming top-k over the vocabulary, :mod:`.topk_stream`).
Either way the result is :class:`TruncatedRows`: the kept entries of this rank as a flat list
(:class:`.kept.Entries`, the label always among them) and each row's statistics over ``K``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ...backends import backend_for
from ...backends.base import KernelOptions, RowBatch
from ...contract.replay import ReplayArgs
from ...contract.vocab import VocabParallel
from . import topk_stream
from .kept import Entries, entry_logits, kept_stats
from .topk_stream import kept_from_candidates, stream_candidates


class TruncatedRows(NamedTuple):
    """R truncated rows: ``entries`` (this rank's, int32 rows / local ids, for backward);
    ``logp``, ``lse``, ``entropy`` (or None) over the kept sets; ``label_added`` (the label
    was outside its kept set); ``kept_size`` (``|K|`` with the label); ``lse_full``: the whole
    row's log-sum-exp when the kept mass was asked for (else None)."""

    entries: Entries
    logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    label_added: torch.Tensor
    kept_size: torch.Tensor
    lse_full: torch.Tensor | None


def take(t: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """Rows ``idx`` of ``t`` (every row when ``idx`` is None)."""
    return t if t is None or idx is None else t.index_select(0, idx)


def _local(entries: Entries, vp: VocabParallel | None) -> Entries:
    """This rank's entries, with shard-local ids."""
    if vp is None:
        return entries
    mine = (entries.ids >= vp.vocab_start) & (entries.ids < vp.vocab_end)
    e = entries.select(mine)
    return e._replace(ids=e.ids - vp.vocab_start)


def _with_labels(entries: Entries, labels: torch.Tensor, num_rows: int):
    """Mark each row's label entry and append the label where the kept set lacks it (its
    logit left NaN, to be computed with the others). Returns (entries, label_added [R])."""
    is_label = entries.ids == labels.index_select(0, entries.rows)
    has = torch.zeros(num_rows, dtype=torch.int64, device=labels.device)
    has.index_add_(0, entries.rows, is_label.long())
    added = has == 0
    rows_a = torch.nonzero(added).squeeze(1)
    ids_a = labels.index_select(0, rows_a)
    z_a = entries.z.new_full((rows_a.numel(),), float("nan"))
    merged = Entries(
        torch.cat([entries.rows, rows_a]),
        torch.cat([entries.ids, ids_a]),
        torch.cat([entries.z, z_a]),
        torch.cat([is_label, torch.ones_like(rows_a, dtype=torch.bool)]),
    )
    return merged, added


def mask_rows(
    batch: RowBatch,
    labels: torch.Tensor,
    opts: KernelOptions,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    with_kept_mass: bool,
) -> TruncatedRows:
    """The R rows of a mask (every row non-empty): kept entries from the mask's CSR ``ids`` /
    ``offsets`` (global ids), the label added where the mask lacks it; the kept mass costs one
    no-grad pass of the full-vocabulary kernels."""
    vp = opts.vocab_parallel
    num_rows = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(num_rows, device=ids.device), counts)
    nan = torch.full((ids.numel(),), float("nan"), device=ids.device, dtype=opts.compute_dtype)
    entries = Entries(rows, ids, nan, torch.zeros_like(ids, dtype=torch.bool))
    entries, added = _with_labels(entries, labels, num_rows)
    local = _local(entries, vp)
    z = entry_logits(batch.hidden, batch.weight, batch.bias, local.rows, local.ids,
                     batch.temperature, opts)  # fmt: skip
    local = local._replace(z=z)
    logp, lse, ent = kept_stats(local, num_rows, opts)
    lse_full = None
    if with_kept_mass:
        full = dataclasses.replace(opts, with_entropy=False)
        with torch.no_grad():
            lse_full = backend_for(full).forward_rows(batch, full).lse
    return TruncatedRows(local.compact(), logp, lse, ent, added, counts + added.long(), lse_full)


# Rows of candidates turned into kept entries at once (bounds the selection's work tensors).
_SELECT_ROWS = 256


def _prefix_stats(vals, count, zy, added, opts: KernelOptions):
    """logp, lse, entropy [R] over each row's kept prefix ``vals[:, :count]`` (sorted,
    decreasing) plus, where ``added``, the label logit ``zy``."""
    cap = vals.shape[1]
    top = vals[:, 0]
    in_k = torch.arange(cap, device=vals.device)[None, :] < count[:, None]
    d = torch.where(in_k, vals - top[:, None], 0.0)  # <= 0 in the kept prefix
    e = torch.where(in_k, d.exp(), 0.0)
    dy = zy - top
    ey = torch.where(added, dy.exp(), 0.0)
    s = e.sum(1) + ey
    lse = top + s.log()
    ent = None
    if opts.with_entropy:
        q = (e * d).sum(1) + ey * dy
        ent = s.log() - q / s
    return zy - lse, lse, ent


def _select_entries(cand, count, labels, rows, vp) -> tuple[Entries, torch.Tensor]:
    """This rank's kept entries of a pass's covered rows (int32 rows / local ids), and which
    rows lacked their label (it is appended as an entry).

    cand: the pass's candidates of R rows; count: [R] kept prefix (0 for rows not covered);
    labels: [R] global; rows: [R] the call's row index of each. Works on blocks of rows
    written into preallocated arrays, so no [E]-sized temporary is made beside the result."""
    dev = cand.vals.device
    n, cap = cand.vals.shape
    col = torch.arange(cap, device=dev)[None, :]
    lo, hi = (0, None) if vp is None else (vp.vocab_start, vp.vocab_end)

    def block(r0, r1):
        ids = cand.ids[r0:r1]
        keep = col < count[r0:r1, None]
        label = (ids == labels[r0:r1, None]) & keep
        if vp is not None:
            keep = keep & (ids >= lo) & (ids < hi)
        return ids, keep, label

    added = torch.zeros(n, dtype=torch.bool, device=dev)
    blocks = [(r0, min(n, r0 + _SELECT_ROWS)) for r0 in range(0, n, _SELECT_ROWS)]
    num = 0
    for r0, r1 in blocks:
        _, keep, label = block(r0, r1)
        added[r0:r1] = (count[r0:r1] > 0) & ~label.any(1)
        num += int(keep.sum())
    ra = torch.nonzero(added).squeeze(1)  # labels outside their kept set become entries
    ya = labels.index_select(0, ra)
    if vp is not None:  # ... of the rank that holds them
        mine = (ya >= lo) & (ya < hi)
        ra, ya = ra[mine], ya[mine]
    total = num + ra.numel()
    out = Entries(
        torch.empty(total, dtype=torch.int32, device=dev),
        torch.empty(total, dtype=torch.int32, device=dev),
        torch.empty(total, device=dev, dtype=cand.vals.dtype),
        torch.empty(total, dtype=torch.bool, device=dev),
    )
    at = 0
    for r0, r1 in blocks:
        ids, keep, label = block(r0, r1)
        k = int(keep.sum())
        out.rows[at : at + k] = torch.repeat_interleave(rows[r0:r1], keep.sum(1))
        out.ids[at : at + k] = ids[keep] - lo
        out.z[at : at + k] = cand.vals[r0:r1][keep]
        out.is_label[at : at + k] = label[keep]
        at += k
    out.rows[at:] = rows.index_select(0, ra)
    out.ids[at:] = ya - lo
    out.z[at:] = cand.zy.index_select(0, ra)
    out.is_label[at:] = True
    return out, added


def _first_cap(spec: ReplayArgs, num_rows: int, device) -> tuple[int, torch.Tensor]:
    """Candidates of the first pass: the largest binding top-k, or a first guess for rows cut
    by top-p / min-p only (widened for the rows whose kept set turns out larger); and which
    rows no top-k bounds."""
    vocab = spec.vocab_size
    cap = 1
    unbound = torch.ones(num_rows, dtype=torch.bool, device=device)
    if spec.top_k is not None:
        unbound = spec.top_k >= vocab
        if not bool(unbound.all()):
            cap = int(spec.top_k[~unbound].max())
    if bool(unbound.any()):
        cap = max(cap, topk_stream.DEFAULT_CANDIDATES)
    return min(cap, vocab), unbound


def replayed_rows(
    batch: RowBatch, labels: torch.Tensor, opts: KernelOptions, spec: ReplayArgs
) -> TruncatedRows:
    """Replay the sampler on R rows (``labels``: their global ids): their statistics over the
    kept sets and this rank's kept entries (int32 rows / local ids) for backward. A row whose
    kept set is not decided by its candidates is streamed again with more."""
    num_rows, dev = batch.hidden.shape[0], batch.hidden.device
    cap, unbound = _first_cap(spec, num_rows, dev)
    # The whole row's log-sum-exp: for the kept-mass report, and for a top-p that no top-k
    # bounds (it renormalizes over the whole row); otherwise the pass skips it.
    with_mass = spec.with_kept_mass or (
        spec.top_p is not None and bool((unbound & (spec.top_p < 1)).any())
    )
    cd = opts.compute_dtype
    logp = torch.empty(num_rows, device=dev, dtype=cd)
    lse = torch.empty(num_rows, device=dev, dtype=cd)
    ent = torch.empty(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    added = torch.zeros(num_rows, dtype=torch.bool, device=dev)
    size = torch.zeros(num_rows, dtype=torch.int64, device=dev)
    lse_full = torch.empty(num_rows, device=dev, dtype=cd)
    parts: list[Entries] = []
    pending = None  # None: every row
    while True:
        cand = stream_candidates(batch.take(pending), opts, cap, with_mass)
        sets = kept_from_candidates(cand, spec.take(pending))
        rows = torch.arange(num_rows, device=dev) if pending is None else pending
        count = torch.where(sets.covered, sets.count, 0)
        part, add = _select_entries(cand, count, take(labels, pending), rows, opts.vocab_parallel)
        parts.append(part)
        done = torch.nonzero(sets.covered).squeeze(1)
        lp, ls, en = _prefix_stats(cand.vals[done], count[done], cand.zy[done], add[done], opts)
        at = rows[done]
        logp[at], lse[at], added[at] = lp, ls, add[done]
        size[at] = count[done] + add[done].long()
        lse_full[at] = cand.lse[done]
        if ent is not None:
            ent[at] = en
        left = ~sets.covered
        if not bool(left.any()):
            break
        cap = min(spec.vocab_size, int(sets.need[left].max()))
        pending = rows[left]
    entries = (
        parts[0] if len(parts) == 1 else Entries(*(torch.cat(t) for t in zip(*parts, strict=True)))
    )
    return TruncatedRows(
        entries, logp, lse, ent, added, size, lse_full if spec.with_kept_mass else None
    )
