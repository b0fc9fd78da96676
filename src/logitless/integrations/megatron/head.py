"""The Megatron entry points: log-probs, the fused policy loss and the divergence of a
``GPTModel``'s head, each from one micro-batch.

Part of :mod:`logitless.integrations.megatron` (which re-exports them; its docstring
describes the layout). Each reads the batch once (:class:`~.batch.Batch`), checks the head call
before the model runs, then runs the model with the head as ``output_layer``'s forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ...contract.divergence import DivergenceOptions
from ...contract.options import HeadOptions, SamplerOptions, given_arguments
from ...contract.rollout import RolloutTopK
from ...losses import LossNormalizer, PolicyLossConfig
from ...types import Divergence, LogProbs
from .. import seam
from ..seam import LossInputs
from .batch import Batch
from .model import ProcessorStage

__all__ = [
    "LossArgs",
    "divergence",
    "logprobs",
    "output_processor_logprobs",
    "policy_loss",
    "run_policy_loss",
]


@given_arguments
def logprobs(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    with_entropy: bool = False,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    rollout_topk: RolloutTopK | None = None,
    **model_kwargs: Any,
) -> LogProbs:
    """Per-token log-probs (and entropy) of ``labels`` under ``model``: ``[B, S]`` fp32.

    What Megatron's own path gives, without the logits::

        logits = model(input_ids, position_ids, attention_mask, ...)   # [S, B, V/tp] per rank
        logp = -vocab_parallel_cross_entropy(logits / temperature, labels.T).T  # [B, S]

    with 0 where ``loss_mask`` is 0 and at a packed batch's padding; entropy is that of the
    (tensor-parallel-gathered) softmax. Arguments as ``GPTModel.forward`` takes them;
    ``model_kwargs`` go to it unchanged. Gradients reach ``output_layer``'s weight (or the
    tied embedding) and every decoder parameter. ``batch_invariant``: as in
    :func:`logitless.linear_logprobs` (for a fixed tensor-parallel size).
    ``gradient_accumulation_fusion``: add the weight's gradient straight into the
    ``main_grad`` Megatron's DDP gave it, tile by tile, instead of returning a
    ``[V/tp, H]`` gradient (:func:`main_grad_into`; None: wherever DDP gave it an fp32
    ``main_grad``). ``rollout_topk``: the rollout engine's top-k log-probs, a
    :class:`logitless.RolloutTopK` of ``[B, S, k]`` tensors laid out like ``labels`` (split
    like them under context parallelism); the result's ``mismatch`` then compares the
    model's distribution with the engine's at every labelled token (every tensor-parallel
    rank gets the same values: each id's logit comes from the rank that holds it;
    docs/rollout-mismatch.md).
    """
    batch = Batch.of(given)
    sampler = SamplerOptions(rollout_topk=rollout_topk)
    prep = batch.prepare(HeadOptions.pick(given), gradient_accumulation_fusion, sampler=sampler)
    return batch.run(lambda tokens, head: seam.logprobs(prep, tokens, head))


@given_arguments
def policy_loss(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    inputs: LossInputs,
    *,
    config: PolicyLossConfig | None = None,
    normalizer: LossNormalizer | None = None,
    teacher: nn.Module | None = None,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fused policy loss of ``model`` on one micro-batch: ``(loss, metrics)`` of
    :func:`logitless.fused_policy_loss`, equal to :func:`logitless.policy_loss` on
    :func:`logprobs`'s output.

    ``inputs``: the per-token loss inputs ``[B, S]`` like the labels (advantages per token, or
    per sequence with a packed batch's ``document_ids``, which default to the sequences of
    ``packed_seq_params``). Under context parallelism the per-document statistics are summed
    over the context-parallel group and the loss is this rank's share. ``teacher``: a
    teacher ``GPTModel`` (the student's tensor-parallel split) for the distillation term
    (``config.distill_coef``, ``distill_beta``), run first without gradient inside its own
    ``output_layer``'s forward; or pass ``inputs.teacher`` yourself. ``batch_invariant``:
    the log-probs inside the loss are :func:`logprobs`'s with it, bit for bit.
    ``gradient_accumulation_fusion``: as in :func:`logprobs`; the loss's weight gradient,
    taken in the forward pass, waits in an fp32 scratch until ``backward()`` adds it into
    ``main_grad`` (docs/megatron.md).
    """
    batch = Batch.of(given)
    loss = LossArgs(config, normalizer, teacher, gradient_accumulation_fusion)
    return run_policy_loss(batch, inputs, loss, HeadOptions.pick(given))


class LossArgs(NamedTuple):
    """The loss's arguments of :func:`policy_loss` and
    :func:`~logitless.integrations.megatron.schedule.policy_loss_step` beyond its per-token
    inputs: the config, the normalizer, a teacher ``GPTModel`` (or None) and
    ``gradient_accumulation_fusion``."""

    config: PolicyLossConfig | None
    normalizer: LossNormalizer | None
    teacher: nn.Module | None
    fusion: bool | None


def run_policy_loss(
    batch: Batch, inputs: LossInputs, loss: LossArgs, options: HeadOptions
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` of a batch read once: the head call and the loss's contract
    checked before any model runs (the teacher's included), then the teacher without
    gradient, then the model with the fused loss as ``output_layer``'s forward."""
    head = batch.head
    if inputs.document_ids is None and batch.document_ids is not None:
        inputs = inputs.replace(document_ids=batch.document_ids)
    distills = loss.teacher is not None or inputs.teacher is not None
    prep = batch.prepare(options, loss.fusion, shared=distills)
    prep = prep.with_loss(inputs, loss.config, loss.normalizer, distillation=distills)
    if loss.teacher is not None:
        t_tokens, t_head = batch.teacher(loss.teacher)
        with torch.no_grad():
            prep = prep.with_teacher(t_head.as_teacher(t_tokens.aligned(head.parallel)))
    return batch.run(lambda tokens, w: seam.policy_loss(prep, tokens, w))


@given_arguments
def divergence(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    batch_invariant: bool = False,
    **model_kwargs: Any,
) -> Divergence:
    """The per-token divergence from ``teacher`` (a ``GPTModel`` with the same
    tensor-parallel vocabulary split) to ``model``, ``[B, S]`` fp32 (TRL's ``beta``
    convention, :func:`logitless.linear_divergence`). The teacher runs first, without
    gradient, inside its own ``output_layer``'s forward."""
    batch = Batch.of(given)
    prep = batch.prepare(HeadOptions.pick(given))  # before either model runs
    div = DivergenceOptions.pick(given)
    t_tokens, t_head = batch.teacher(teacher)
    return batch.run(
        lambda tokens, head: seam.divergence(prep, tokens, head, t_tokens, t_head, div)
    )


def output_processor_logprobs(
    *,
    hidden_states: torch.Tensor,
    output_layer: nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    config: Any,
    packed_seq_params: Any = None,
    loss_mask: torch.Tensor | None = None,
    **options: Any,
) -> LogProbs:
    """:func:`logprobs` from inside an ``output_processor`` that ``GPTModel.forward`` calls
    (megatron-core 0.18+), on the arguments it hands one: the hidden states ``[S, B, H]``
    (this rank's sequence shard under sequence parallelism), ``output_layer``, the tied
    weight (``output_weight``), the labels ``[B, S]``, the config, ``packed_seq_params``.
    The head runs as ``output_layer``'s forward, so its forward pre-hooks (the distributed
    optimizer's parameter all-gather) fire. ``options``: :func:`logprobs`'s
    (``with_entropy``, ``temperature``, ``gradient_accumulation_fusion``, ...); a tied weight's
    gradient goes to ``.grad`` (the processor cannot tell whether the embedding it is tied to
    lives on this stage). Returns ``[B, S]`` fp32, 0 at masked and padding tokens."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_group() if config.context_parallel_size > 1 else None
    stage = ProcessorStage(output_layer, config, output_layer.tp_group, cp)
    batch = Batch.read(stage, (), labels, loss_mask, packed_seq_params, {})
    fusion = options.pop("gradient_accumulation_fusion", None)
    fusion = False if output_weight is not None else fusion
    prep = batch.prepare(HeadOptions(**options), fusion, weight=output_weight)
    return batch.run(
        lambda tokens, head: seam.logprobs(prep, tokens, head),
        lambda: output_layer(hidden_states, weight=output_weight),
    )
