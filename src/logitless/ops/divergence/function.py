"""The divergence op's autograd function: the student's tensors positionally, the teacher and
every option in objects (the teacher is frozen: it gets no gradient)."""

from __future__ import annotations

import torch

from ...backends import divergence_backend_for
from ...backends.base import DivOptions, DivRows, DivStats, DivUpstream
from ..rows import refuse_double_backward


class LinearDivergenceFunction(torch.autograd.Function):
    """Forward: both heads' row statistics; backward: the recomputed student tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows: DivRows, opts: DivOptions):
        student = rows.student._replace(hidden=hidden, weight=weight, bias=bias)
        stats = divergence_backend_for(opts).forward_rows(rows._replace(student=student), opts)
        ctx.opts = opts
        ctx.rows = rows._replace(student=student._replace(hidden=None, weight=None, bias=None))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, *stats)
        outputs = (stats.divergence, stats.logp)
        return outputs + ((stats.entropy,) if stats.entropy is not None else ())

    @staticmethod
    def backward(ctx, grad_div, grad_logp, grad_ent=None):
        refuse_double_backward("linear_divergence")
        hidden, weight, bias, *saved = ctx.saved_tensors
        if grad_div is None and grad_logp is None and grad_ent is None:
            return None, None, None, None, None
        stats = DivStats(*saved)
        student = ctx.rows.student._replace(hidden=hidden, weight=weight, bias=bias)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        gh, gw, gb = divergence_backend_for(ctx.opts).backward_rows(
            ctx.rows._replace(student=student),
            stats,
            DivUpstream(grad_div, grad_logp, grad_ent),
            ctx.opts,
            needs,
        )
        return gh, gw, gb, None, None


def run_rows(rows: DivRows, opts: DivOptions) -> DivStats:
    """The rows' statistics: through autograd when the student wants a gradient (only its
    divergence, log-prob and entropy are meaningful then), else the forward alone."""
    s = rows.student
    tracked = (s.hidden, s.weight, s.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked):
        out = LinearDivergenceFunction.apply(s.hidden, s.weight, s.bias, rows, opts)
        ent = out[2] if len(out) == 3 else None
        return DivStats(out[0], out[1], ent, *(None,) * (len(DivStats._fields) - 3))
    return divergence_backend_for(opts).forward_rows(rows, opts)
