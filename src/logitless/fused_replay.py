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

import torch

from ._validate_replay import ReplayArgs
from .kernels import Rows
from .kernels.options import HeadOptions
from .kernels.replay import ReplayPlan, replay_backward, replay_forward, restrict
from .parallel import collectives


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
    rows: Rows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels_k: torch.Tensor,
    opts: HeadOptions,
    replay: ReplayArgs,
    *,
    with_kept_mass: bool,
    needs: tuple[bool, bool, bool] | None,
    loss_fn,
    context_group: object | None,
) -> tuple[torch.Tensor, dict, tuple | None]:
    """``(loss, metrics, (dh, dW, db) or None)`` of a fused policy loss with replay.

    ``needs`` None: no gradient wanted (only the loss and metrics are computed). ``loss_fn``:
    the fused loss's policy loss of the call as a function of the ``[M]`` row values
    (``evaluate``, ``stats``, ``grads``; see ``fused_loss._RowLoss``).
    """
    spec = restrict(replay, rows)
    hidden = rows.hidden.detach()
    w = weight.detach()
    b = None if bias is None else bias.detach()
    plan = replay_forward(
        hidden,
        w,
        b,
        rows.labels,
        labels_k,
        rows.temperature,
        opts,
        spec,
        with_kept_mass=with_kept_mass,
        keep_tile=needs is not None,
    )
    logp, ent = plan.logp, plan.ent
    extra = replay_metrics(plan, context_group)
    if needs is None:
        loss, metrics = loss_fn.evaluate(logp, ent, reduce_metrics=True)
        return loss, metrics | extra, None
    stats = loss_fn.stats(logp) if context_group is not None else None
    g, e = loss_fn.grads(logp, ent, stats)
    grads = replay_backward(plan, hidden, w, b, labels_k, rows.temperature, g, e, opts, needs)
    with torch.no_grad():
        loss, metrics = loss_fn.evaluate(logp, ent, stats, reduce_metrics=True)
    return loss, metrics | extra, grads
