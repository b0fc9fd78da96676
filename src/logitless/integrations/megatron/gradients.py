"""Gradient-accumulation fusion: the head's weight gradient straight into Megatron DDP's
``main_grad``.

Part of :mod:`logitless.integrations.megatron` (which re-exports :func:`main_grad_into`).
Under Megatron's DDP each parameter carries an fp32 ``main_grad`` and, with
``gradient_accumulation_fusion``, a layer adds its weight gradient into it and marks the
parameter ``grad_added_to_main_grad``. The head does the same through the ops'
``weight_grad_into`` (:class:`~logitless.contract.options.WeightGradInto`): no ``[V/tp, H]``
gradient tensor is returned.
"""

from __future__ import annotations

import dataclasses

import torch

from ...contract.options import HeadOptions, WeightGradInto
from ...transform import compute_dtype
from .model import MegatronHead, agree, head_weight

__all__ = ["main_grad_into", "with_grad_into"]


def main_grad_into(
    weight: torch.Tensor, *, shared: bool = False, dtype: torch.dtype = torch.float32
) -> WeightGradInto | None:
    """The weight's Megatron DDP ``main_grad`` as a :class:`WeightGradInto` (None when DDP
    gave it none of ``dtype``).

    Megatron's protocol, as ``ColumnParallelLinear`` follows it under
    ``gradient_accumulation_fusion``: after the gradient is added into ``main_grad``, the
    parameter is marked ``grad_added_to_main_grad`` and carries a placeholder ``.grad``, so
    DDP's backward hook (which asserts a gradient under ``overlap_grad_reduce``) marks it
    ready without adding anything. The placeholder is one zero seen as ``[V/tp, H]``
    (``expand``), set on the parameter after the add: Megatron's own is a full
    ``torch.empty`` of that shape. ``shared``: the weight gets another gradient in the same
    backward (the input embedding it is tied to, a distillation term): then neither the flag
    nor the placeholder is set, and that gradient arrives as ``.grad`` for the hook to add.
    """
    main = getattr(weight, "main_grad", None)
    if not isinstance(main, torch.Tensor) or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if main.dtype != dtype or main.shape != weight.shape or main.device != weight.device:
        return None
    return WeightGradInto(main, None if shared else lambda: _mark_added(weight))


def _mark_added(weight: torch.Tensor) -> None:
    weight.grad_added_to_main_grad = True
    if weight.grad is None:  # a zero, so a hook that adds it anyway (zero_out_wgrad) adds 0
        weight.grad = weight.new_zeros(()).expand(weight.shape)


def with_grad_into(
    head: MegatronHead, mode: bool | None, options: HeadOptions, *, shared: bool = False
) -> HeadOptions:
    """``options`` with ``weight_grad_into``: the destination of the head's weight gradient
    under ``gradient_accumulation_fusion`` ``mode`` (None: wherever Megatron DDP gave the
    weight a ``main_grad`` of the call's compute dtype; True: required; False: off).
    ``shared``: the weight gets another gradient in the same backward (a distillation term).
    Raises on every rank together."""
    into = _grad_into(head, mode, options, shared)
    return dataclasses.replace(options, weight_grad_into=into)


def _grad_into(
    head: MegatronHead, mode: bool | None, options: HeadOptions, shared: bool
) -> WeightGradInto | None:
    if mode is not None and not isinstance(mode, bool):
        raise ValueError(f"gradient_accumulation_fusion must be None, True or False, got {mode!r}")
    weight = head_weight(head)
    if mode is False or not torch.is_grad_enabled() or not weight.requires_grad:
        return None
    dtype = compute_dtype(options.head_dtype or weight.dtype)
    model = head.model
    tied = model.share_embeddings_and_output_weights and model.pre_process
    into = main_grad_into(weight, shared=shared or tied, dtype=dtype)
    if mode:  # the one case that can fail: every rank asked for it, so all of them agree here
        error = None
        if into is None:
            main = getattr(weight, "main_grad", None)
            got = "none" if main is None else f"{main.dtype} {list(main.shape)}"
            error = ValueError(
                f"gradient_accumulation_fusion=True needs output_layer's weight to carry "
                f"Megatron DDP's main_grad ({dtype}, {list(weight.shape)}: wrap the model in "
                f"megatron.core.distributed.DistributedDataParallel, with grad_reduce_in_fp32 "
                f"for 16-bit weights), got {got}"
            )
        agree(head, error, "logitless.integrations.megatron")
    return into
