"""The HF integration on the seam: the head of a transformers causal LM, run on the unwrapped
model inside its wrapper's forward.

Package-internal (the public entry points, which check their arguments and then run these
functions through :func:`~logitless.integrations.wrappers.run_in_forward`, are in
:mod:`logitless.integrations.hf`; the TRL trainers use :func:`prepare` too). Each function
follows the seam's two phases (:mod:`logitless.integrations.seam`):

1. :func:`prepare`: every check that needs no FLOP, before the backbone: the model
   (:mod:`~logitless.integrations.hf.model`), the inputs and the targets
   (:mod:`~logitless.integrations.hf.batch`), then :func:`seam.prepare
   <logitless.integrations.seam.prepare>` with the model's
   :class:`~logitless.integrations.seam.Head` (its bias, logit scale and softcap; stand-ins
   of a sharded weight) and, for the loss, :meth:`~logitless.integrations.seam.Prepared.with_loss`;
2. the backbone, once (``model.model(...)``, the MoE router logits when its loss is on);
3. the prepared call on the real hidden states, as ``lm_head``'s forward
   (:func:`~logitless.integrations.hf.model.with_head`).

HF models split nothing: their :class:`~logitless.integrations.seam.Parallelism` is the
default (a wrapper's data parallelism is the wrapper's, see
:mod:`~logitless.integrations.wrappers`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ...contract.checks import is_dtensor
from ...contract.divergence import DivergenceOptions
from ...contract.options import HeadOptions, SamplerOptions
from ...losses import LossNormalizer, PolicyLossConfig
from ...types import Divergence, LogProbs
from .. import deepspeed, seam
from ..seam import Head, LossInputs, Prepared, Tokens
from .batch import Flattener, ModelBatch, check_input_ids, check_token_range, document_ids_of
from .model import (
    autocast_dtype,
    backbone_module,
    causal_lm_router_aux_coef,
    check_model,
    head_for_checks,
    router_aux_loss,
    with_head,
)

__all__ = [
    "LossOptions",
    "divergence_in_forward",
    "logprobs_in_forward",
    "policy_loss_in_forward",
    "prepare",
    "teacher_in_forward",
]


def prepare(
    model: nn.Module,
    batch: ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> Prepared:
    """Every check that needs no FLOP, before the backbone runs: model, inputs (the image
    inputs of a vision-language model among them), targets, and the head contract (one check:
    label range, temperature, dtypes, devices, backend, the sampler's kept sets). Under
    autocast the projection runs in the autocast dtype, as ``lm_head`` would."""
    head = head_for_checks(model)
    backbone_module(model)
    input_ids = check_input_ids(batch.input_ids)
    batch.check_backbone(model, model_kwargs)
    if input_ids.device != head.weight.device:
        raise ValueError(
            f"input_ids must be on the model's device {head.weight.device}, got {input_ids.device}"
        )
    check_token_range(input_ids, model, options.capturable)
    labels = batch.targets(options.ignore_index, options.capturable)
    if options.head_dtype is None:
        options = options.replace(head_dtype=autocast_dtype(head.weight.device))
    return seam.prepare(labels, head, options, sampler)


# --- log-probs ----------------------------------------------------------------------------


def logprobs_in_forward(
    lm: nn.Module,
    batch: ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> LogProbs:
    """:func:`~logitless.integrations.hf.causal_lm_logprobs` on the unwrapped model ``lm``,
    inside its wrapper's forward."""
    prep = prepare(lm, batch, options, sampler, model_kwargs)
    hidden = batch.backbone(lm, model_kwargs).hidden
    return with_head(lm, lambda t, head: seam.logprobs(prep, t, head), Tokens(hidden, prep.labels))


# --- the policy loss ----------------------------------------------------------------------


class LossOptions(NamedTuple):
    """The loss arguments of :func:`~logitless.integrations.hf.causal_lm_policy_loss` beyond
    its per-token inputs (a :class:`~logitless.integrations.seam.LossInputs`)."""

    config: PolicyLossConfig | None
    normalizer: LossNormalizer | None
    router_aux_loss_coef: float | None


def policy_loss_in_forward(
    lm: nn.Module,
    batch: ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
    inputs: LossInputs,
    loss_options: LossOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~logitless.integrations.hf.causal_lm_policy_loss` on the unwrapped model,
    inside its wrapper's forward. ``inputs.teacher``: the teacher's ``[B, T, H_t]`` hidden
    states and head (:func:`teacher_in_forward`), or None."""
    aux_coef = causal_lm_router_aux_coef(lm, loss_options.router_aux_loss_coef)
    prep = prepare(lm, batch, options, sampler, model_kwargs)
    document_ids = document_ids_of(
        inputs.document_ids, batch.attention_mask, batch.position_ids, batch.cu_seqlens,
        batch.input_ids, prep.options.capturable,
    )  # fmt: skip
    if document_ids is not None:
        # Sequences are documents, not rows: the loss sees the flat [N] token stream, where
        # per-sequence advantages are one per document id (policy_loss's packed form).
        flat = Flattener(prep.call.batch_shape)
        per_token = {
            k: flat(k, v, per_sequence_ok=k == "advantages") for k, v in inputs.per_token().items()
        }
        inputs = inputs.replace(**per_token, document_ids=flat("document_ids", document_ids))
        prep = prep.flat()
    # The loss contract, checked once before the backbone.
    prep = prep.with_loss(inputs, loss_options.config, loss_options.normalizer)
    out = batch.backbone(lm, model_kwargs, router_logits=aux_coef != 0)
    hidden = out.hidden.reshape(*prep.call.batch_shape, out.hidden.shape[-1])
    tokens = Tokens(hidden, prep.labels)
    loss, metrics = with_head(lm, lambda t, head: seam.policy_loss(prep, t, head), tokens)
    if out.router_logits is not None:
        aux = router_aux_loss(lm, out.router_logits, batch.attention_mask)
        loss = loss + aux_coef * aux.to(loss.dtype)
        metrics = {**metrics, "aux_loss": aux.detach().float()}
    return loss, metrics


# --- the divergence to a teacher model ----------------------------------------------------


def teacher_in_forward(
    lm: nn.Module, batch: ModelBatch, model_kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Head]:
    """The teacher's final hidden states and its head, detached (a sharded head weight, FSDP2's
    or ZeRO-3's, gathered whole: the teacher needs no gradient)."""
    hidden = batch.backbone(lm, model_kwargs).hidden
    lm_head, softcap, scale = check_model(lm)

    def whole(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if deepspeed.is_zero3(t):
            return deepspeed.gathered_copy(t)
        return (t.full_tensor() if is_dtensor(t) else t).detach()

    scale = None if scale == 1.0 else scale
    own = deepspeed.own_params(lm_head)  # not lm_head.weight: see deepspeed.own_params
    return hidden.detach(), Head(whole(own["weight"]), whole(own.get("bias")), scale, softcap)


def divergence_in_forward(
    lm: nn.Module,
    batch: ModelBatch,
    prep: Prepared,
    teacher: tuple[torch.Tensor, Head],
    div: DivergenceOptions,
    model_kwargs: dict[str, Any],
) -> Divergence:
    """:func:`~logitless.integrations.hf.causal_lm_divergence` on the unwrapped student,
    inside its wrapper's forward: its backbone, then :func:`seam.divergence
    <logitless.integrations.seam.divergence>` as ``lm_head``'s forward. ``teacher``: the
    teacher's hidden states and head (:func:`teacher_in_forward`)."""
    student = Tokens(batch.backbone(lm, model_kwargs).hidden, prep.labels)
    t_tokens, t_head = Tokens(teacher[0], prep.labels), teacher[1]

    def head_step(tokens: Tokens, head: Head) -> Divergence:
        return seam.divergence(prep, tokens, head, t_tokens, t_head, div)

    return with_head(lm, head_step, student)
