"""The log-prob op's autograd function: tensors positionally, every option in one object."""

from __future__ import annotations

import torch

from ...backends import backend_for
from ...backends.base import KernelOptions, ProbeStats, RowBatch, RowStats, Upstream
from ..rows import refuse_double_backward


class LinearLogprobsFunction(torch.autograd.Function):
    """Forward: a backend's row statistics; backward: its recompute (or the kept tile).

    ``probe``: ``[M, K]`` ids whose :class:`~logitless.backends.base.ProbeStats` the forward
    appends to ``found`` (a list), or None."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temp, opts: KernelOptions, probe, found):
        keep = any(ctx.needs_input_grad[:3])
        rows = RowBatch(hidden, weight, bias, labels, temp)
        stats = backend_for(opts).forward_rows(rows, opts, keep, probe)
        if probe is not None:
            found.append(stats.probe)
        ctx.opts = opts
        ctx.kept = stats.kept
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, temp, stats.lse, stats.entropy)
        if stats.entropy is None:
            return stats.logp
        return stats.logp, stats.entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        refuse_double_backward("linear_logprobs")
        hidden, weight, bias, labels, temp, lse, ent = ctx.saved_tensors
        # The kept tile is overwritten by backward: use it once, recompute on a second call
        # (retain_graph=True).
        kept, ctx.kept = ctx.kept, None
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None, None, None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        gh, gw, gb = backend_for(ctx.opts).backward_rows(
            RowBatch(hidden, weight, bias, labels, temp),
            RowStats(None, lse, ent, kept),
            Upstream(grad_logp, grad_ent),
            ctx.opts,
            needs,
        )
        if needs[1] and ctx.opts.weight_grad_into is not None:
            ctx.opts.weight_grad_into.added()  # dW went into the buffer; autograd gets None
        return gh, gw, gb, None, None, None, None, None


def run_rows(rows: RowBatch, opts: KernelOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp [M], entropy [M] or None)`` of the rows: through autograd when a gradient is
    wanted, else the backend's forward alone (nothing saved)."""
    logp, ent, _ = run_rows_probed(rows, opts, None)
    return logp, ent


def run_rows_probed(
    rows: RowBatch, opts: KernelOptions, probe: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, ProbeStats | None]:
    """:func:`run_rows` that also reports what the forward found at ``probe`` (``[M, K]``
    shard-local ids; None: nothing probed). The probe's results carry no gradient."""
    tracked = (rows.hidden, rows.weight, rows.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked):
        found: list[ProbeStats] = []
        out = LinearLogprobsFunction.apply(*rows, opts, probe, found)
        logp, ent = out if opts.with_entropy else (out, None)
        return logp, ent, found[0] if found else None
    stats = backend_for(opts).forward_rows(rows, opts, False, probe)
    return stats.logp, stats.entropy, stats.probe
