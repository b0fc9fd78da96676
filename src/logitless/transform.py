"""The logit transform of a head, written once (in torch; the Triton kernels hold its twin),
with its derivative next to it, and the one compute-dtype rule.

For the raw logits ``x = h·Wᵀ + b`` of a row with temperature ``T``::

    z = softcap(s · x) / T,          softcap(u) = c·tanh(u / c)  (the identity without ``c``)

    dz/dx = (s / T) · softcap'(s·x),  softcap'(u) = 1 - tanh²(u / c) = 1 - (z·T / c)²

``s`` is the logit scale (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), ``c`` the
soft-capping constant (Gemma 2/3), ``T`` the sampling temperature (a scalar, or one per row).
The derivative splits into a per-row factor (:meth:`LogitTransform.row_factor`, ``s / T``) and
an elementwise one (:meth:`LogitTransform.softcap_slope`, from the transformed values
themselves, so backward needs no copy of ``x``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def compute_dtype(head_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a head's softmax statistics, outputs and gradient accumulators: fp32, or
    float64 for a float64 head (so ``gradcheck`` holds at float64 accuracy)."""
    return torch.float64 if head_dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap(scale · x) / temperature`` (see the module).

    scale: the logit scale ``s``, or None (1). softcap: ``c``, or None. temperature: the scalar
    ``T``, or None when the call has one temperature per row (then passed to each method as a
    tensor ``temp`` broadcastable to the logits: ``[R, 1]`` for a tile, ``[E]`` for entries).
    """

    scale: float | None = None
    softcap: float | None = None
    temperature: float | None = 1.0

    def _inv_t(self, temp: torch.Tensor | None) -> torch.Tensor | float:
        if temp is not None:
            return 1.0 / temp
        return 1.0 / (self.temperature or 1.0)

    def apply_(self, x: torch.Tensor, temp: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (raw logits, bias included) -> ``z``, in place; returns ``x``."""
        if self.scale is not None:
            x.mul_(self.scale)
        if self.softcap is not None:
            x.div_(self.softcap).tanh_().mul_(self.softcap)
        if temp is not None:
            x.div_(temp)
        elif self.temperature not in (None, 1.0):
            x.div_(self.temperature)
        return x

    def apply(self, x: torch.Tensor, temp: torch.Tensor | None = None) -> torch.Tensor:
        """``z`` of ``x``, out of place (differentiable: the naive reference's path)."""
        if self.scale is not None:
            x = x * self.scale
        if self.softcap is not None:
            x = self.softcap * torch.tanh(x / self.softcap)
        if temp is not None:
            return x / temp
        return x / self.temperature if self.temperature not in (None, 1.0) else x

    def row_factor(self, temp: torch.Tensor | None = None) -> torch.Tensor | float:
        """The per-row part of ``dz/dx``: ``s / T`` (a tensor like ``temp``, or a float)."""
        inv_t = self._inv_t(temp)
        return inv_t if self.scale is None else inv_t * self.scale

    def softcap_slope(self, z: torch.Tensor, temp: torch.Tensor | None = None):
        """The elementwise part of ``dz/dx``, ``1 - (z·T / c)²``, from the transformed ``z``;
        None without softcap. Out of place (``z`` is usually still needed)."""
        if self.softcap is None:
            return None
        t_over_c = (temp if temp is not None else (self.temperature or 1.0)) / self.softcap
        return torch.mul(z, t_over_c).square_().neg_().add_(1.0)
