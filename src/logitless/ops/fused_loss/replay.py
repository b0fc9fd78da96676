"""The fused policy loss with sampling replay: the loss over each row's kept set.

:func:`logitless.fused_policy_loss` hands its replay calls (``sampling_mask=`` / ``top_k=`` /
``top_p=`` / ``min_p=``) to :func:`replay_policy_loss`. The head part of a replay call is
cheap to keep between passes (a kept row's statistics need its kept entries only), so the
schedule is: the replay forward (log-probs and entropy of every row over its kept set), the
loss gradient of every row at once, then the replay backward (sparse over the kept ids; the
untruncated rows, if any, run their backend's recompute backward). The loss, its metrics and
the gradients are those of ``policy_loss(linear_logprobs(..., <replay>))``.

Metrics added to the loss's: ``replay_kept_size`` (mean ``|K|`` over the call's tokens, the
label counted), ``replay_label_added`` (how many labels were outside their kept set and were
added) and, with ``with_kept_mass=True``, ``replay_log_kept_mass`` (mean log of the kept mass
under the full softmax: how biased unreplayed log-probs would be). Under context parallelism
they cover the group.
"""

from __future__ import annotations

import dataclasses

import torch

from ...backends.base import RowBatch
from ...contract import collectives
from ...contract.head import HeadCall
from ..replay.op import ReplayPlan, replay_backward, replay_forward, restrict
from ..rows import Rows, kernel_options
from .row_loss import RowLoss


def replay_metrics(plan: ReplayPlan, context_group: object | None = None) -> dict:
    """Detached 0-dim metrics of a replay call's kept sets (see the module doc); summed over
    ``context_group`` first when given (a collective call)."""
    valid = torch.ones_like(plan.logp)
    mass = plan.log_kept_mass
    sums = torch.stack(
        [
            plan.kept_size.double().sum(),
            plan.label_added.double().sum(),
            valid.double().sum(),
            plan.logp.new_zeros((), dtype=torch.float64) if mass is None else mass.double().sum(),
        ]
    )
    if context_group is not None:
        sums = collectives.all_reduce(sums, context_group, "sum")
    size, added, count, mass_sum = sums.float().unbind()
    denom = count.clamp(min=1.0)
    out = {"replay_kept_size": size / denom, "replay_label_added": added}
    if mass is not None:
        out["replay_log_kept_mass"] = mass_sum / denom
    return out


def replay_policy_loss(
    call: HeadCall,
    rows: Rows,
    batch: RowBatch,
    loss: RowLoss,
    needs: tuple[bool, bool, bool] | None,
    context_group: object | None,
) -> tuple[torch.Tensor, dict, tuple | None]:
    """``(loss, metrics, (dh, dW, db) or None)`` of a fused loss with replay.

    ``batch``: the call's valid rows, detached (their gradients reach autograd through the
    fused loss's stored gradients); ``needs`` None: no gradient wanted (only the loss and
    metrics are computed).
    """
    # The gradients wait for the loss's upstream scale (see KernelOptions.grad_dtype).
    opts = dataclasses.replace(kernel_options(call, rows.labels.numel()), held_grads=True)
    spec = restrict(call.replay, rows)
    plan = replay_forward(batch, rows.labels, opts, spec, keep_tile=needs is not None)
    logp, ent = plan.logp, plan.ent
    extra = replay_metrics(plan, context_group)
    if needs is None:
        value, metrics = loss.evaluate(logp, ent, reduce_metrics=True)
        return value, metrics | extra, None
    stats = loss.stats(logp) if context_group is not None else None
    g, e = loss.grads(logp, ent, stats)
    grads = replay_backward(plan, batch, g, e, opts, needs)
    with torch.no_grad():
        value, metrics = loss.evaluate(logp, ent, stats, reduce_metrics=True)
    return value, metrics | extra, grads
