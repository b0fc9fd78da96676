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

import dataclasses
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ...backends import backend_for
from ...backends.base import KernelOptions, RowBatch, RowStats, Upstream
from ...contract.head import HeadCall
from ...contract.replay import ReplayArgs
from ...types import ReplayLogProbs
from ..rollout import mismatch
from ..rows import Rows, kernel_batch, kernel_options
from .kept import Entries, KeptGrads, entry_grads
from .sets import TruncatedRows, mask_rows, replayed_rows, take


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
    return _subset(replay, rows.index)


def _subset(replay: ReplayArgs, idx: torch.Tensor | None) -> ReplayArgs:
    """``replay`` over rows ``idx`` of its positions (all when None)."""
    if idx is None:
        return replay
    if replay.is_mask:
        ids, off, _ = _csr_rows(replay.mask_ids, replay.mask_offsets, idx)
        return dataclasses.replace(replay, mask_ids=ids, mask_offsets=off)
    return dataclasses.replace(
        replay,
        top_k=take(replay.top_k, idx),
        top_p=take(replay.top_p, idx),
        min_p=take(replay.min_p, idx),
    )


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

    trunc / full: indices of the truncated and full rows (None: every row); truncated: their
    kept sets (:class:`~.sets.TruncatedRows`, or None without any); full_stats / full_opts:
    the full rows' statistics (their single tile kept for backward on the torch backend) and
    kernel options (None without any); logp, ent, label_added, kept_size, log_kept_mass: [M].
    """

    trunc: torch.Tensor | None
    full: torch.Tensor | None
    truncated: TruncatedRows | None
    full_stats: RowStats | None
    full_opts: KernelOptions | None
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


def replay_forward(
    batch: RowBatch,
    labels: torch.Tensor,
    opts: KernelOptions,
    spec: ReplayArgs,
    *,
    keep_tile: bool = False,
    probe: torch.Tensor | None = None,
) -> ReplayPlan:
    """Log-probs (and entropy) of M valid rows over their kept sets; a plan for backward.

    batch: the rows as the kernels take them (shard-local labels under vocab parallelism);
    labels: [M] global ids; spec: the replay arguments of these M rows; probe: ``[M, K]``
    shard-local ids the full rows' forward also reports (the rollout-mismatch diagnostics), or
    None.
    """
    num_rows, dev = batch.hidden.shape[0], batch.hidden.device
    trunc, full, n_t = _split(spec.truncated())
    cd = opts.compute_dtype
    logp = torch.zeros(num_rows, device=dev, dtype=cd)
    ent = torch.zeros(num_rows, device=dev, dtype=cd) if opts.with_entropy else None
    added = torch.zeros(num_rows, dtype=torch.bool, device=dev)
    size = torch.full((num_rows,), spec.vocab_size, dtype=torch.int64, device=dev)
    kept_mass = torch.zeros(num_rows, device=dev, dtype=cd) if spec.with_kept_mass else None

    full_stats = full_opts = None
    if n_t < num_rows:
        full_opts = _subset_options(opts, num_rows - n_t, batch)
        full_stats = backend_for(full_opts).forward_rows(
            batch.take(full), full_opts, keep_tile, take(probe, full)
        )
        _put(logp, full, full_stats.logp)
        _put(ent, full, full_stats.entropy)

    truncated = None
    if n_t > 0:
        sub = _subset(spec, trunc)
        rows_t, y_t = batch.take(trunc), take(labels, trunc)
        sub_opts = _subset_options(opts, n_t, batch)
        if sub.is_mask:
            truncated = mask_rows(
                rows_t, y_t, sub_opts, sub.mask_ids, sub.mask_offsets, sub.with_kept_mass
            )
        else:
            truncated = replayed_rows(rows_t, y_t, sub_opts, sub)
        _put(logp, trunc, truncated.logp)
        _put(ent, trunc, truncated.entropy)
        _put(added, trunc, truncated.label_added)
        _put(size, trunc, truncated.kept_size)
        if kept_mass is not None:
            _put(kept_mass, trunc, (truncated.lse - truncated.lse_full).clamp(max=0.0))
    return ReplayPlan(
        trunc, full, truncated, full_stats, full_opts, logp, ent, added, size, kept_mass
    )


def _subset_options(opts: KernelOptions, num_rows: int, batch: RowBatch) -> KernelOptions:
    """``opts`` with the torch schedule of a subset of ``num_rows`` rows (never the fused
    one): under vocab parallelism sized by the largest shard, as every rank must cut alike."""
    vp = opts.vocab_parallel
    vocab = batch.weight.shape[0] if vp is None else vp.max_shard
    schedule = type(opts.schedule).choose(
        num_rows, vocab, batch.hidden.device, opts.chunk_size, invariant=opts.schedule.padded
    )
    return dataclasses.replace(opts, schedule=schedule)


def replay_backward(
    plan: ReplayPlan,
    batch: RowBatch,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    opts: KernelOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients for hidden [M, H], weight and bias (their dtypes) from upstream [M] gradients.

    The full rows run their backend's recompute backward; the truncated rows add their kept
    entries' gradients into the same weight gradient (sparse: only kept ids).
    """
    hidden, weight, bias = batch.hidden, batch.weight, batch.bias
    vp = opts.vocab_parallel
    grad_ent = grad_ent if opts.with_entropy else None
    cd = opts.compute_dtype
    t = plan.truncated
    # Every row truncated: the kept-entry accumulator is the whole hidden gradient.
    only_kept = t is not None and plan.full_stats is None and plan.trunc is None
    dh = None
    if needs[0] and not only_kept:
        dh = torch.zeros(hidden.shape, device=hidden.device, dtype=cd)
    dw = db = None
    if plan.full_stats is not None:
        stats, plan.full_stats = plan.full_stats, None  # its kept tile is consumed
        dh_f, dw, db = backend_for(plan.full_opts).backward_rows(
            batch.take(plan.full),
            stats,
            Upstream(take(grad_logp, plan.full), take(grad_ent, plan.full)),
            plan.full_opts,
            needs,
        )
        plan.full_stats = stats._replace(kept=None)  # a second backward recomputes
        if dh is not None:
            _put(dh, plan.full, dh_f.to(cd))
    if t is not None:
        trunc = plan.trunc
        h_t = take(hidden, trunc)
        g_t, e_t, temp_t = (
            take(grad_logp, trunc),
            take(grad_ent, trunc),
            take(batch.temperature, trunc),
        )

        def grad_of(chunk: Entries) -> torch.Tensor:
            return entry_grads(chunk, t.lse, t.entropy, g_t, e_t, temp_t, opts)

        w_dtype = opts.grad_dtype(weight.dtype)
        acc = KeptGrads(h_t, weight, bias, needs, cd, w_dtype, dw=dw, db=db)
        acc.add(h_t, weight, t.entries, grad_of, opts.head_dtype)
        if acc.dh is not None:
            if vp is not None:
                vp.reduce_hidden(acc.dh)
            if only_kept:
                dh = acc.dh
            else:
                _put(dh, trunc, acc.dh)
        dw, db = acc.dw, acc.db
        if needs[1] and dw is None:
            dw = torch.zeros_like(weight, dtype=w_dtype)
        if needs[2] and bias is not None and db is None:
            db = torch.zeros_like(bias)
    return (
        None if dh is None else dh.to(opts.grad_dtype(hidden.dtype)),
        None if dw is None else dw.to(opts.grad_dtype(weight.dtype)),
        None if db is None else db.to(opts.grad_dtype(bias.dtype)),
    )


class ReplayLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`replay_forward` / :func:`replay_backward`.

    Returns log-probs (and entropy) as differentiable outputs; the plan (with the replay
    diagnostics) goes to ``out`` (a list the caller passes in).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels_k, temp, labels, opts, spec, out, probe):
        keep = any(ctx.needs_input_grad[:3])
        batch = RowBatch(hidden, weight, bias, labels_k, temp)
        plan = replay_forward(batch, labels, opts, spec, keep_tile=keep, probe=probe)
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
        none = (None,) * 5
        if grad_logp is None and grad_ent is None:
            return (None, None, None, None, None) + none
        batch = RowBatch(*ctx.saved_tensors)
        needs = tuple(ctx.needs_input_grad[:3])
        gh, gw, gb = replay_backward(ctx.plan, batch, grad_logp, grad_ent, ctx.opts, needs)
        return (gh, gw, gb, None, None) + none


def replay_logprobs(call: HeadCall, rows: Rows) -> ReplayLogProbs:
    """The head op with sampling replay over the call's valid ``rows`` (see the module doc)."""
    spec = restrict(call.replay, rows)
    batch = kernel_batch(call, rows)
    opts = kernel_options(call, rows.labels.numel())
    rollout = None if call.rollout is None else call.rollout.take(rows.index)
    probe = None if rollout is None else mismatch.probe_ids(rollout, call.vocab_parallel)
    if call.tracked:
        out: list[ReplayPlan] = []
        res = ReplayLogprobsFunction.apply(*batch, rows.labels, opts, spec, out, probe)
        logp, ent = res if opts.with_entropy else (res, None)
        plan = out[0]
    else:
        plan = replay_forward(batch, rows.labels, opts, spec, probe=probe)
        logp, ent = plan.logp, plan.ent
    found = None
    if rollout is not None:
        with torch.no_grad():
            trainer = _trainer_side(plan, rollout, probe, batch.weight.shape[0], opts)
            found = mismatch.scatter(rows, mismatch.partition(trainer, rollout))
    return ReplayLogProbs(
        rows.scatter(logp),
        None if ent is None else rows.scatter(ent),
        label_added=rows.scatter(plan.label_added),
        kept_size=rows.scatter(plan.kept_size),
        log_kept_mass=None if plan.log_kept_mass is None else rows.scatter(plan.log_kept_mass),
        mismatch=found,
    )


def _trainer_side(
    plan: ReplayPlan, rollout, probe: torch.Tensor, vocab: int, opts: KernelOptions
) -> mismatch.TrainerSide:
    """The trainer's distribution at the engine's ids of a replay call's M rows: the full rows'
    from their forward's probe, the truncated rows' from their kept entries (``vocab``: this
    shard's rows)."""
    num, k = probe.shape
    dev, cd = probe.device, opts.compute_dtype
    lp = torch.zeros(num, k, device=dev, dtype=cd)
    tail = torch.zeros(num, device=dev, dtype=cd)
    top = torch.zeros(num, k, device=dev, dtype=torch.bool)
    parts = []
    if plan.full_stats is not None:
        parts.append((plan.full, mismatch.of_probe(plan.full_stats.probe, rollout.take(plan.full))))
    if plan.truncated is not None:
        t = plan.truncated
        side = mismatch.of_entries(
            t.entries, t.lse, take(probe, plan.trunc), vocab, opts.vocab_parallel
        )
        parts.append((plan.trunc, side))
    for idx, side in parts:
        for dst, src in zip((lp, tail, top), side, strict=True):
            _put(dst, idx, src.to(dst.dtype))
    return mismatch.TrainerSide(lp, tail, top)
