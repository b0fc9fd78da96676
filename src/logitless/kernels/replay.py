"""Sampling replay: log-probs, entropy and gradients over the sampler's kept sets.

For a valid row with kept set ``K`` (the label always counted in it):

    logp = z[y] - logsumexp(z[K])        H = -Σ_{j∈K} p_j log p_j,   p = softmax(z[K])

with gradients through ``z[K]`` only (``K`` is a constant). The rows of a call fall in two
groups, each computed without ``[rows, V]`` logits:

- *truncated* rows, whose kept set is given (a non-empty ``sampling_mask`` row) or replayed
  (``top_k`` / ``top_p`` / ``min_p``, :mod:`.topk_stream`): their kept entries are a flat list
  (:class:`.kept.Entries`) and the statistics and gradients touch only those weight rows
  (:mod:`.kept`). A mask costs ``O(kept·H)``; a replay one streaming pass over the vocabulary
  (a matmul and a running top-k), then ``O(kept·H)``.
- *full* rows (an empty mask row; ``top_k >= V``, ``top_p = 1``, ``min_p = 0``): the ordinary
  full-vocabulary kernels of the call's backend.

The replay itself is torch code on every device: with ``backend="triton"`` the full rows run
the Triton kernels and the truncated rows this module's torch code.

If the label is not in its row's kept set it is added (and reported: ``label_added``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.autograd.function import once_differentiable

from .._validate_replay import ReplayArgs
from ..parallel.vocab import VocabParallel
from ..types import ReplayLogProbs
from .kept import Entries, KeptGrads, entry_grads, entry_logits, kept_stats
from .options import HeadOptions, Schedule
from .rows import Rows
from .topk_stream import DEFAULT_CANDIDATES, kept_from_candidates, stream_candidates


def _csr_rows(ids: torch.Tensor, offsets: torch.Tensor, idx: torch.Tensor):
    """Rows ``idx`` of a CSR (ids, offsets): (ids [E'], offsets [len(idx) + 1], row [E'])."""
    counts = (offsets[1:] - offsets[:-1]).index_select(0, idx)
    new_off = torch.zeros(idx.numel() + 1, dtype=torch.int64, device=ids.device)
    new_off[1:] = counts.cumsum(0)
    row = torch.repeat_interleave(torch.arange(idx.numel(), device=ids.device), counts)
    within = torch.arange(row.numel(), device=ids.device) - new_off[:-1][row]
    src = offsets[:-1].index_select(0, idx)[row] + within
    return ids.index_select(0, src), new_off, row


def restrict(replay: ReplayArgs, rows: Rows) -> ReplayArgs:
    """The replay arguments of the call's valid rows (``rows.index``; None: all rows), as
    :class:`ReplayArgs` over those M rows."""
    idx = rows.index
    if replay.is_mask:
        ids, off = replay.mask_ids, replay.mask_offsets
        if idx is not None:
            ids, off, _ = _csr_rows(ids, off, idx)
        return ReplayArgs(replay.vocab_size, mask_ids=ids, mask_offsets=off)

    return ReplayArgs(
        replay.vocab_size,
        top_k=_take(replay.top_k, idx),
        top_p=_take(replay.top_p, idx),
        min_p=_take(replay.min_p, idx),
    )


def _take(t: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """Rows ``idx`` of ``t`` (every row when ``idx`` is None)."""
    return t if t is None or idx is None else t.index_select(0, idx)


def _put(dst: torch.Tensor | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
    """``dst[idx] = src`` (every row when ``idx`` is None)."""
    if dst is None:
        return
    if idx is None:
        dst.copy_(src)
    else:
        dst[idx] = src


@dataclass
class ReplayPlan:
    """Forward results of a replay call over its M valid rows, and what backward needs.

    trunc / full: indices of the truncated and full rows (None: every row), has_trunc /
    has_full: whether there are any; entries: the
    truncated rows' kept entries (rows index the truncated subset, global ids); trunc_lse /
    trunc_ent / full_lse / full_ent: per-row statistics; full_opts: the full rows' kernel
    options; full_tile: their single tile kept for backward (torch backend), or None.
    """

    trunc: torch.Tensor | None
    full: torch.Tensor | None
    has_trunc: bool
    has_full: bool
    entries: Entries | None
    trunc_lse: torch.Tensor | None
    trunc_ent: torch.Tensor | None
    full_lse: torch.Tensor | None
    full_ent: torch.Tensor | None
    full_opts: HeadOptions | None
    full_tile: torch.Tensor | None
    logp: torch.Tensor
    ent: torch.Tensor | None
    label_added: torch.Tensor
    kept_size: torch.Tensor
    log_kept_mass: torch.Tensor | None


def _split(mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(indices where ``mask`` [M] is True, where it is False, the True count); an index is
    None when it would be every row."""
    num = int(mask.sum())
    idx = torch.arange(mask.numel(), device=mask.device)
    yes = None if num == mask.numel() else idx[mask]
    no = None if num == 0 else idx[~mask]
    return yes, no, num


def _sub_options(opts: HeadOptions, num_rows: int, vocab: int, device) -> HeadOptions:
    """``opts`` with the torch schedule of a (sub)set of rows (never the fused one)."""
    vp = opts.vocab_parallel
    sched_vocab = vocab if vp is None else vp.max_shard
    return replace(opts, schedule=Schedule.choose(num_rows, sched_vocab, device, opts.chunk_size))


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


def _mask_entries(hidden, weight, bias, labels, temp, opts, ids, offsets):
    """Kept entries of the mask rows (all non-empty) with their logits on this rank.

    Returns (this rank's entries with local ids, label_added [R], kept_size [R])."""
    vp = opts.vocab_parallel
    num_rows = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(num_rows, device=ids.device), counts)
    nan = torch.full((ids.numel(),), float("nan"), device=ids.device, dtype=opts.compute_dtype)
    entries = Entries(rows, ids, nan, torch.zeros_like(ids, dtype=torch.bool))
    entries, added = _with_labels(entries, labels, num_rows)
    local = _local(entries, vp)
    z = entry_logits(hidden, weight, bias, local.rows, local.ids, temp, opts)
    return local._replace(z=z), added, counts + added.long()


# Rows of candidates turned into kept entries at once (bounds the selection's work tensors).
_SELECT_ROWS = 256


def _prefix_stats(vals, count, zy, added, with_entropy):
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
    if with_entropy:
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


def _replayed_rows(
    hidden, weight, bias, labels, labels_k, temp, opts, spec: ReplayArgs, mass: bool
):
    """Replay the sampler on R rows: their statistics over the kept sets and this rank's
    kept entries (int32 rows / local ids) for backward.

    Returns (entries, logp, lse, entropy or None, label_added, kept_size, full-row lse or
    None)."""
    num_rows, dev = hidden.shape[0], hidden.device
    vocab = spec.vocab_size
    # Candidates: the largest binding top-k, or a first guess for rows cut by top-p / min-p only
    # (widened for the rows whose kept set turns out larger).
    cap = 1
    unbound = torch.ones(num_rows, dtype=torch.bool, device=dev)
    if spec.top_k is not None:
        unbound = spec.top_k >= vocab
        if not bool(unbound.all()):
            cap = int(spec.top_k[~unbound].max())
    if bool(unbound.any()):
        cap = max(cap, DEFAULT_CANDIDATES)
    cap = min(cap, vocab)
    # The whole row's log-sum-exp: for the kept-mass report, and for a top-p that no top-k
    # bounds (it renormalizes over the whole row); otherwise the pass skips it.
    with_mass = mass or (spec.top_p is not None and bool((unbound & (spec.top_p < 1)).any()))
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
        cand = stream_candidates(
            _take(hidden, pending),
            weight,
            bias,
            _take(labels_k, pending),
            _take(temp, pending),
            opts,
            cap,
            with_mass,
        )
        sets = kept_from_candidates(
            cand,
            _take(spec.top_k, pending),
            _take(spec.top_p, pending),
            _take(spec.min_p, pending),
            vocab,
        )
        rows = torch.arange(num_rows, device=dev) if pending is None else pending
        count = torch.where(sets.covered, sets.count, 0)
        y = _take(labels, pending)
        part, add = _select_entries(cand, count, y, rows, opts.vocab_parallel)
        parts.append(part)
        done = torch.nonzero(sets.covered).squeeze(1)
        lp, ls, en = _prefix_stats(
            cand.vals[done], count[done], cand.zy[done], add[done], opts.with_entropy
        )
        at = rows[done]
        logp[at], lse[at], added[at] = lp, ls, add[done]
        size[at] = count[done] + add[done].long()
        lse_full[at] = cand.lse[done]
        if ent is not None:
            ent[at] = en
        left = ~sets.covered
        if not bool(left.any()):
            break
        cap = min(vocab, int(sets.need[left].max()))
        pending = rows[left]
    entries = (
        parts[0] if len(parts) == 1 else Entries(*(torch.cat(t) for t in zip(*parts, strict=True)))
    )
    return entries, logp, lse, ent, added, size, lse_full if with_mass else None


def replay_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    labels_k: torch.Tensor,
    temp: torch.Tensor | None,
    opts: HeadOptions,
    spec: ReplayArgs,
    *,
    with_kept_mass: bool,
    keep_tile: bool = False,
) -> ReplayPlan:
    """Log-probs (and entropy) of M valid rows over their kept sets; a plan for backward.

    hidden: [M, H]; weight: [V, H] (this rank's shard under ``opts.vocab_parallel``);
    labels: [M] global ids; labels_k: [M] the kernels' (shard-local) labels; temp: [M] or None.
    """
    from . import backend_module

    num_rows, dev = hidden.shape[0], hidden.device
    vocab = weight.shape[0]
    vp = opts.vocab_parallel
    trunc, full, n_t = _split(spec.truncated())
    has_trunc, has_full = n_t > 0, n_t < num_rows
    cd = opts.compute_dtype
    logp = torch.zeros(num_rows, device=dev, dtype=cd)
    ent = torch.zeros(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    added = torch.zeros(num_rows, dtype=torch.bool, device=dev)
    size = torch.full((num_rows,), spec.vocab_size, dtype=torch.int64, device=dev)
    kept_mass = torch.zeros(num_rows, device=dev, dtype=cd) if with_kept_mass else None

    full_lse = full_ent = full_opts = tile = None
    if has_full:
        full_opts = _sub_options(opts, num_rows - n_t, vocab, dev)
        lp, full_lse, full_ent, tile = backend_module(full_opts).forward_rows(
            _take(hidden, full),
            weight,
            bias,
            _take(labels_k, full),
            _take(temp, full),
            full_opts,
            keep_tile,
        )
        _put(logp, full, lp)
        _put(ent, full, full_ent)

    entries = t_lse = t_ent = None
    if has_trunc:
        h_t = _take(hidden, trunc)
        y_t, yk_t, temp_t = _take(labels, trunc), _take(labels_k, trunc), _take(temp, trunc)
        if spec.mask_offsets is not None:
            ids, off = spec.mask_ids, spec.mask_offsets
            if trunc is not None:
                ids, off, _ = _csr_rows(ids, off, trunc)
            entries, add_t, size_t = _mask_entries(h_t, weight, bias, y_t, temp_t, opts, ids, off)
            lp, t_lse, t_ent = kept_stats(entries, n_t, opts.with_entropy, vp)
            entries = entries.compact()
            lse_full = None
            if with_kept_mass:
                sub = replace(_sub_options(opts, n_t, vocab, dev), with_entropy=False)
                with torch.no_grad():
                    _, lse_full, _, _ = backend_module(sub).forward_rows(
                        h_t, weight, bias, yk_t, temp_t, sub
                    )
        else:
            sub = _sub_options(opts, n_t, vocab, dev)
            spec_t = ReplayArgs(
                spec.vocab_size,
                top_k=_take(spec.top_k, trunc),
                top_p=_take(spec.top_p, trunc),
                min_p=_take(spec.min_p, trunc),
            )
            entries, lp, t_lse, t_ent, add_t, size_t, lse_full = _replayed_rows(
                h_t, weight, bias, y_t, yk_t, temp_t, sub, spec_t, with_kept_mass
            )
        _put(logp, trunc, lp)
        _put(ent, trunc, t_ent)
        _put(added, trunc, add_t)
        _put(size, trunc, size_t)
        if kept_mass is not None:
            _put(kept_mass, trunc, (t_lse - lse_full).clamp(max=0.0))
    return ReplayPlan(
        trunc=trunc,
        full=full,
        has_trunc=has_trunc,
        has_full=has_full,
        entries=entries,
        trunc_lse=t_lse,
        trunc_ent=t_ent,
        full_lse=full_lse,
        full_ent=full_ent,
        full_opts=full_opts,
        full_tile=tile,
        logp=logp,
        ent=ent,
        label_added=added,
        kept_size=size,
        log_kept_mass=kept_mass,
    )


def replay_backward(
    plan: ReplayPlan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels_k: torch.Tensor,
    temp: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    opts: HeadOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients for hidden [M, H], weight and bias (their dtypes) from upstream [M] gradients.

    The full rows run their backend's recompute backward; the truncated rows add their kept
    entries' gradients into the same weight gradient (sparse: only kept ids).
    """
    from . import backend_module

    vp = opts.vocab_parallel
    use_ent = opts.with_entropy and grad_ent is not None
    grad_ent = grad_ent if use_ent else None
    # Every row truncated: the kept-entry accumulator is the whole hidden gradient.
    only_kept = plan.has_trunc and not plan.has_full and plan.trunc is None
    cd = opts.compute_dtype
    dh = None
    if needs[0] and not only_kept:
        dh = torch.zeros(hidden.shape, device=hidden.device, dtype=cd)
    dw = db = None
    if plan.has_full:
        tile, plan.full_tile = plan.full_tile, None  # consumed: a second backward recomputes
        dh_f, dw, db = backend_module(plan.full_opts).backward_rows(
            _take(hidden, plan.full),
            weight,
            bias,
            _take(labels_k, plan.full),
            _take(temp, plan.full),
            plan.full_lse,
            plan.full_ent,
            _take(grad_logp, plan.full),
            _take(grad_ent, plan.full),
            plan.full_opts,
            needs,
            tile,
        )
        if dh is not None:
            _put(dh, plan.full, dh_f.to(cd))
    if plan.has_trunc:
        trunc = plan.trunc
        h_t = _take(hidden, trunc)
        g_t, e_t, temp_t = _take(grad_logp, trunc), _take(grad_ent, trunc), _take(temp, trunc)

        def grad_of(chunk: Entries) -> torch.Tensor:
            return entry_grads(chunk, plan.trunc_lse, plan.trunc_ent, g_t, e_t, temp_t, opts)

        acc = KeptGrads(h_t, weight, bias, needs, cd, dw=dw, db=db)
        acc.add(h_t, weight, plan.entries, grad_of, opts.head_dtype)
        if acc.dh is not None:
            if vp is not None:
                vp.reduce_hidden(acc.dh)
            if only_kept:
                dh = acc.dh
            else:
                _put(dh, trunc, acc.dh)
        dw, db = acc.dw, acc.db
        if needs[1] and dw is None:
            dw = torch.zeros_like(weight)
        if needs[2] and bias is not None and db is None:
            db = torch.zeros_like(bias)
    return (
        None if dh is None else dh.to(hidden.dtype),
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )


class ReplayLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`replay_forward` / :func:`replay_backward`.

    Returns log-probs (and entropy) as differentiable outputs; the replay diagnostics go to
    ``out`` (a list the caller passes in) as the forward's plan.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, labels_k, temp, opts, spec, flags, out):
        keep = any(ctx.needs_input_grad[:3])
        plan = replay_forward(
            hidden,
            weight,
            bias,
            labels,
            labels_k,
            temp,
            opts,
            spec,
            with_kept_mass=flags,
            keep_tile=keep,
        )
        out.append(plan)
        ctx.plan, ctx.opts = plan, opts
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels_k, temp)
        if plan.ent is None:
            return plan.logp
        return plan.logp, plan.ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, bias, labels_k, temp = ctx.saved_tensors
        none = (None,) * 7
        if grad_logp is None and grad_ent is None:
            return (None, None, None) + none
        needs = tuple(ctx.needs_input_grad[:3])
        gh, gw, gb = replay_backward(
            ctx.plan, hidden, weight, bias, labels_k, temp, grad_logp, grad_ent, ctx.opts, needs
        )
        return (gh, gw, gb) + none


def replay_logprobs(
    rows: Rows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels_k: torch.Tensor,
    opts: HeadOptions,
    replay: ReplayArgs,
    *,
    with_kept_mass: bool,
    grad: bool,
) -> ReplayLogProbs:
    """The head op with sampling replay over the call's valid ``rows`` (see the module doc)."""
    spec = restrict(replay, rows)
    if grad:
        out: list[ReplayPlan] = []
        res = ReplayLogprobsFunction.apply(
            rows.hidden,
            weight,
            bias,
            rows.labels,
            labels_k,
            rows.temperature,
            opts,
            spec,
            with_kept_mass,
            out,
        )
        logp, ent = res if opts.with_entropy else (res, None)
        plan = out[0]
    else:
        plan = replay_forward(
            rows.hidden,
            weight,
            bias,
            rows.labels,
            labels_k,
            rows.temperature,
            opts,
            spec,
            with_kept_mass=with_kept_mass,
        )
        logp, ent = plan.logp, plan.ent
    return ReplayLogProbs(
        rows.scatter(logp),
        None if ent is None else rows.scatter(ent),
        label_added=rows.scatter(plan.label_added),
        kept_size=rows.scatter(plan.kept_size),
        log_kept_mass=None if plan.log_kept_mass is None else rows.scatter(plan.log_kept_mass),
    )
