"""Megatron's pipeline schedule: what ``forward_step`` returns, and the step's normalizer.

Part of :mod:`logitless.integrations.megatron` (which re-exports :func:`policy_loss_step` and
:func:`step_normalizer`). ``get_forward_backward_func()`` divides each micro-batch's loss by
its token count and the number of micro-batches (or, with ``calculate_per_token_loss``,
``finalize_model_grads`` by the step's tokens); :func:`policy_loss_step` scales the fused
loss so that the gradients come out as those of the step's :class:`~logitless.LossNormalizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...contract.options import HeadOptions, given_arguments
from ...losses import LossNormalizer, PolicyLossConfig, loss_normalizer
from ..seam import LossInputs
from .batch import Batch
from .head import LossArgs, run_policy_loss
from .model import gpt_model

__all__ = ["policy_loss_step", "step_normalizer"]


def step_normalizer(
    masks: Sequence[torch.Tensor],
    document_ids: Sequence[torch.Tensor | None] | None = None,
    *,
    calculate_per_token_loss: bool = False,
    data_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> LossNormalizer:
    """:func:`logitless.loss_normalizer` of one optimizer step, for Megatron's schedule.

    ``masks`` / ``document_ids``: every micro-batch's, from :func:`token_layout`. The groups
    default to Megatron's ``parallel_state`` (the data-parallel group without context
    parallelism; the context-parallel group). Megatron's DDP averages gradients over the
    data- and context-parallel ranks unless ``calculate_per_token_loss``; the normalizer's
    ``loss_scale`` undoes that average, so each rank's loss is its share of the step's.
    """
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group() if data_parallel_group is None else data_parallel_group
    cp = (
        ps.get_context_parallel_group()
        if context_parallel_group is None
        else context_parallel_group
    )
    cp_size = cp.size() if cp is not None else 1
    scale = 1 if calculate_per_token_loss else dp.size() * cp_size
    return loss_normalizer(
        list(masks),
        None if document_ids is None else list(document_ids),
        process_group=dp if dp.size() > 1 else None,
        context_group=cp if cp_size > 1 else None,
        loss_scale=float(scale),
    )


@given_arguments
def policy_loss_step(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    inputs: LossInputs,
    *,
    config: PolicyLossConfig | None,
    normalizer: LossNormalizer,
    num_microbatches: int,
    teacher: nn.Module | None = None,
    calculate_per_token_loss: bool = False,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """What a ``forward_step`` returns: ``(output_tensor, loss_func)``.

    On the last pipeline stage the output is the fused loss of this micro-batch (its gradients
    are already computed) and ``loss_func(output)`` returns ``(loss, num_tokens, metrics)`` in
    the shape ``get_forward_backward_func()`` expects; the loss is scaled so that after the
    schedule's own normalization (a division by ``num_tokens`` and ``num_microbatches``, or,
    with ``calculate_per_token_loss``, ``finalize_model_grads`` dividing by the step's tokens)
    the gradients are those of ``normalizer``'s step loss. On other stages it returns the
    model's output and a ``loss_func`` the schedule never calls. The other arguments are
    :func:`policy_loss`'s.
    """
    inner = gpt_model(model)
    if inner is not None and not inner.post_process:
        out = model(
            input_ids,
            position_ids,
            attention_mask,
            packed_seq_params=packed_seq_params,
            **model_kwargs,
        )
        return out, _never_called
    batch = Batch.of(given)  # the layout read once: the loss and the schedule's token count
    loss_args = LossArgs(config, normalizer, teacher, gradient_accumulation_fusion)
    loss, metrics = run_policy_loss(batch, inputs, loss_args, HeadOptions.pick(given))
    num_tokens = batch.mask.sum().to(torch.int)
    if calculate_per_token_loss:
        scale = torch.as_tensor(normalizer.num_tokens, dtype=loss.dtype, device=loss.device)
    else:
        scale = num_tokens.clamp(min=1).to(loss.dtype) * num_microbatches

    def loss_func(output: torch.Tensor) -> tuple:
        return output * scale, num_tokens, metrics

    return loss, loss_func


def _never_called(output: torch.Tensor) -> tuple:  # pragma: no cover - not the last stage
    raise RuntimeError("the loss function runs on the last pipeline stage only")
