"""The fused loss's view of a loss: a function of the valid rows' log-probs (the typed
interface where the head and the losses meet).

The fused op needs three things of a loss, evaluated at the ``[M]`` log-probs (and entropy)
of the call's valid rows: its value and metrics, its per-document statistics (to hold them
fixed while chunks are evaluated), and its gradient with respect to each row's log-prob and
entropy. :class:`RowLoss` is that interface; :class:`PolicyRowLoss` implements it for
:func:`logitless.policy_loss` (the next op, a divergence to a teacher, brings its own).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ...backends.base import GradFn
from ...losses.call import DocumentStats, LossCall
from ...losses.policy import compute_policy_loss
from ...losses.stats import compute_document_stats
from ..rows import Rows


class RowLoss(Protocol):
    """A loss of the valid rows' log-probs ``[M]`` (and entropy ``[M]``)."""

    def evaluate(
        self,
        logp: torch.Tensor,
        ent: torch.Tensor | None,
        stats: DocumentStats | None = None,
        reduce_metrics: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)``; collectives only with ``reduce_metrics`` (and no ``stats``)."""
        ...

    def stats(self, logp: torch.Tensor) -> DocumentStats:
        """The per-document statistics at these log-probs (summed over a context group)."""
        ...

    def grads(
        self, logp: torch.Tensor, ent: torch.Tensor | None, stats: DocumentStats | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d loss / d logp [M] and d loss / d entropy [M] (None without entropy)."""
        ...


class PolicyRowLoss:
    """:func:`logitless.policy_loss` of a checked call as a :class:`RowLoss`."""

    def __init__(self, call: LossCall, rows: Rows) -> None:
        self.call, self.rows = call, rows

    def evaluate(self, logp, ent, stats=None, reduce_metrics=False):
        entropy = None if ent is None else self.rows.scatter(ent)
        return compute_policy_loss(
            self.call, self.rows.scatter(logp), entropy, stats, reduce_metrics
        )

    def stats(self, logp: torch.Tensor) -> DocumentStats:
        with torch.no_grad():
            return compute_document_stats(self.call, self.rows.scatter(logp))

    def grads(self, logp, ent, stats=None):
        with torch.enable_grad():
            lp = logp.detach().requires_grad_()
            en = None if ent is None else ent.detach().requires_grad_()
            loss, _ = self.evaluate(lp, en, stats)
            inputs = [lp] if en is None else [lp, en]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        g = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        e = None
        if en is not None:
            e = grads[1] if grads[1] is not None else torch.zeros_like(en)
        return g, e

    def divergence_grad(self, logp, ent, stats=None) -> torch.Tensor | None:
        """d loss / d divergence ``[N]`` (the distillation term's weights × its coefficient:
        they do not depend on the log-probs), or None without a divergence."""
        if self.call.divergence is None or self.call.config.distill_coef == 0:
            return None
        with torch.enable_grad():
            d = self.call.divergence.detach().requires_grad_()
            call = dataclasses.replace(self.call, divergence=d)
            entropy = None if ent is None else self.rows.scatter(ent)
            loss, _ = compute_policy_loss(call, self.rows.scatter(logp), entropy, stats)
            (g,) = torch.autograd.grad(loss, d, allow_unused=True)
        return torch.zeros_like(d) if g is None else g


def chunk_grad_fn(
    loss: RowLoss,
    placeholder: torch.Tensor,
    placeholder_ent: torch.Tensor | None,
    stats: DocumentStats | None,
) -> GradFn:
    """``grad_fn(r0, r1, logp_c, ent_c)`` of a token-local loss: the gradient of rows
    ``[r0, r1)`` with every other row held at the placeholder (exact: a token-local loss's
    gradient at a row depends on that row alone)."""

    def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
        full_lp = torch.cat([placeholder[:r0], logp_c, placeholder[r1:]])
        full_ent = None
        if ent_c is not None:
            full_ent = torch.cat([placeholder_ent[:r0], ent_c, placeholder_ent[r1:]])
        g, e = loss.grads(full_lp, full_ent, stats)
        return g[r0:r1], None if e is None else e[r0:r1]

    return grad_fn


def all_rows_grad_fn(loss: RowLoss, logp, ent, stats: DocumentStats | None) -> GradFn:
    """``grad_fn`` of any loss, from one evaluation at every row's exact log-prob (the
    sequence-level losses: a no-grad pass first gives them)."""
    g_all, e_all = loss.grads(logp, ent, stats)

    def grad_fn(r0: int, r1: int, logp_c: torch.Tensor, ent_c: torch.Tensor | None):
        return g_all[r0:r1], None if e_all is None else e_all[r0:r1]

    return grad_fn
