"""The HF integration on the seam: the head of a transformers causal LM, run on the unwrapped
model inside its wrapper's forward.

Package-internal (the public entry points, which check their arguments and then run these
functions through :func:`~logitless.integrations.wrappers.run_in_forward`, are in
:mod:`logitless.integrations.hf`; the verl backend calls :func:`logprobs_in_forward` from its
own model forward). Each function follows the same path, in the seam's terms
(:mod:`logitless.integrations.seam`):

1. :func:`prepare`: every check that needs no FLOP, before the backbone: the model
   (:mod:`~logitless.integrations.hf_model`), the inputs and the targets
   (:mod:`~logitless.integrations.hf_batch`), and the head contract on a placeholder of the
   hidden states, with the model's :class:`~logitless.integrations.seam.Head` (its bias, logit
   scale and softcap) in the options;
2. the backbone, once (``model.model(...)``, the MoE router logits when its loss is on);
3. the head as ``lm_head``'s forward (:func:`~logitless.integrations.hf_model.with_head`), on
   the real hidden states: the checked call (log-probs, the fused loss with its
   :class:`~logitless.integrations.seam.LossInputs`) or :func:`seam.divergence
   <logitless.integrations.seam.divergence>` between two models' ``Tokens`` and ``Head``.

HF models split nothing: their :class:`~logitless.integrations.seam.Parallelism` is the
default (a wrapper's data parallelism is the wrapper's, see
:mod:`~logitless.integrations.wrappers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from ..contract.checks import is_dtensor
from ..contract.head import HeadCall, check_head_call, with_hidden
from ..contract.options import HeadOptions, SamplerOptions
from ..losses import LossNormalizer, PolicyLossConfig
from ..ops.fused_loss.op import check_loss_of_head, fused_loss_of_call, teacher_divergence
from ..ops.logprobs.op import logprobs_of_call
from ..types import Divergence, LogProbs, TeacherHead
from . import deepspeed, seam
from .hf_batch import Flattener, ModelBatch, check_input_ids, document_ids_of
from .hf_model import (
    autocast_dtype,
    backbone_module,
    causal_lm_router_aux_coef,
    check_model,
    head_for_checks,
    router_aux_loss,
    with_head,
)
from .seam import Head, LossInputs, Tokens

__all__ = [
    "DivergenceArgs",
    "LossOptions",
    "Prepared",
    "divergence_in_forward",
    "head_options",
    "logprobs_in_forward",
    "policy_loss_in_forward",
    "prepare",
    "teacher_in_forward",
]


def head_options(options: HeadOptions, head: Head) -> HeadOptions:
    """The call's options with what the model's forward does to the logits (its softcap and
    logit scale) and, under autocast, the autocast dtype for the projection (``lm_head`` runs
    in it)."""
    head_dtype = options.head_dtype
    if head_dtype is None:
        head_dtype = autocast_dtype(head.weight.device)
    return options.replace(
        softcap=head.softcap, logit_scale=head.logit_scale, head_dtype=head_dtype
    )


class Prepared(NamedTuple):
    """A checked call (on a placeholder of the hidden states, swapped for the real ones after
    the backbone) and the options it was checked with."""

    call: HeadCall
    options: HeadOptions

    def on(self, head: Head, hidden: torch.Tensor) -> HeadCall:
        """The call on the real head parameters (gathered, under FSDP2) and hidden states."""
        call = self.call.replace(weight=head.weight, bias=head.bias)
        return with_hidden(call, hidden, self.options)


def prepare(
    model: nn.Module,
    batch: ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> Prepared:
    """Every check that needs no FLOP, before the backbone runs: model, inputs (the image
    inputs of a vision-language model among them), targets, and the head contract (one check:
    label range, temperature, dtypes, devices, backend, the sampler's kept sets)."""
    head = head_for_checks(model)
    backbone_module(model)
    input_ids = check_input_ids(batch.input_ids)
    batch.check_backbone(model, model_kwargs)
    if input_ids.device != head.weight.device:
        raise ValueError(
            f"input_ids must be on the model's device {head.weight.device}, got {input_ids.device}"
        )
    labels = batch.targets(options.ignore_index, options.capturable)
    options = head_options(options, head)
    placeholder = head.weight.new_zeros(()).detach().expand(*labels.shape, head.weight.shape[1])
    call = check_head_call(placeholder, head.weight, labels, head.bias, options, sampler)
    return Prepared(call, options)


# --- log-probs ----------------------------------------------------------------------------


def logprobs_in_forward(
    lm: nn.Module,
    batch: ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> LogProbs:
    """:func:`~logitless.integrations.hf.causal_lm_logprobs` on the unwrapped model ``lm``,
    inside its wrapper's forward (or inside the model's own forward, as verl calls it)."""
    prep = prepare(lm, batch, options, sampler, model_kwargs)
    hidden = batch.backbone(lm, model_kwargs).hidden
    return with_head(lm, _logprobs_on_head, prep, hidden)


def _logprobs_on_head(head: Head, prep: Prepared, hidden: torch.Tensor) -> LogProbs:
    with torch.autocast(hidden.device.type, enabled=False):
        return logprobs_of_call(prep.on(head, hidden))


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
    call = prep.call
    document_ids = document_ids_of(
        inputs.document_ids, batch.attention_mask, batch.position_ids, batch.cu_seqlens,
        batch.input_ids, prep.options.capturable,
    )  # fmt: skip
    per_token = {
        "old_logprobs": inputs.old_logprobs,
        "advantages": inputs.advantages,
        "ref_logprobs": inputs.ref_logprobs,
        "rollout_logprobs": inputs.rollout_logprobs,
    }
    if document_ids is not None:
        # Sequences are documents, not rows: the loss sees the flat [N] token stream, where
        # per-sequence advantages are one per document id (policy_loss's packed form).
        flat = Flattener(call.batch_shape)
        per_token = {k: flat(k, v, per_sequence_ok=k == "advantages") for k, v in per_token.items()}
        document_ids = flat("document_ids", document_ids)
        call = call.replace(batch_shape=torch.Size([call.labels.numel()]))
    inputs = inputs.replace(**per_token, document_ids=document_ids)
    if inputs.teacher is not None:  # its shape stands in until the head computes it
        per_token["divergence"] = call.labels.new_zeros(call.batch_shape, dtype=torch.float32)
    # The loss contract, checked once before the backbone.
    loss_call = check_loss_of_head(
        call, config=loss_options.config, document_ids=document_ids,
        normalizer=loss_options.normalizer, **per_token,
    )  # fmt: skip
    out = batch.backbone(lm, model_kwargs, router_logits=aux_coef != 0)
    hidden = out.hidden.reshape(*call.batch_shape, out.hidden.shape[-1])
    prep = prep._replace(call=call)
    loss, metrics = with_head(lm, _loss_on_head, prep, hidden, loss_call, inputs.teacher)
    if out.router_logits is not None:
        aux = router_aux_loss(lm, out.router_logits, batch.attention_mask)
        loss = loss + aux_coef * aux.to(loss.dtype)
        metrics = {**metrics, "aux_loss": aux.detach().float()}
    return loss, metrics


def _loss_on_head(
    head: Head, prep: Prepared, hidden: torch.Tensor, loss_call, teacher: TeacherHead | None
):
    with torch.autocast(hidden.device.type, enabled=False):
        call = prep.on(head, hidden)
        divergence = None
        if teacher is not None:
            divergence = _policy_divergence(call, hidden, head, prep.options, teacher, loss_call)
            loss_call = dataclasses.replace(loss_call, divergence=divergence.detach())
        return fused_loss_of_call(call, loss_call, divergence)


def _policy_divergence(
    call: HeadCall, hidden, head: Head, options: HeadOptions, teacher: TeacherHead, loss_call
):
    """The distillation term's ``D`` ``[*batch_shape]`` of a policy-loss call: the student's
    rows against the teacher's hidden states and head (its options: the call's)."""
    shape = call.batch_shape
    temperature = options.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.reshape(shape)
    t_hidden = teacher.hidden
    teacher = teacher._replace(hidden=t_hidden.reshape(*shape, t_hidden.shape[-1]))
    labels = call.labels.reshape(shape)
    options = options.replace(temperature=temperature)
    divergence = teacher_divergence(call, hidden, head.weight, labels, head.bias, options, teacher)
    return divergence(loss_call.config)


# --- the divergence to a teacher model ----------------------------------------------------


class DivergenceArgs(NamedTuple):
    """The divergence's own arguments of :func:`~logitless.integrations.hf.causal_lm_divergence`."""

    beta: float
    with_logprobs: bool
    vocab_size: int | None


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
    labels: torch.Tensor,
    t_hidden: torch.Tensor,
    t_head: Head,
    options: HeadOptions,
    div: DivergenceArgs,
    model_kwargs: dict[str, Any],
) -> Divergence:
    """:func:`~logitless.integrations.hf.causal_lm_divergence` on the unwrapped student,
    inside its wrapper's forward: its backbone, then :func:`seam.divergence
    <logitless.integrations.seam.divergence>` as ``lm_head``'s forward."""
    student = Tokens(batch.backbone(lm, model_kwargs).hidden, labels)
    teacher = Tokens(t_hidden, labels)
    return with_head(lm, _divergence_on_head, student, teacher, t_head, options, div)


def _divergence_on_head(
    head: Head,
    student: Tokens,
    teacher: Tokens,
    t_head: Head,
    options: HeadOptions,
    div: DivergenceArgs,
) -> Divergence:
    options = head_options(options, head)
    with torch.autocast(student.hidden.device.type, enabled=False):
        return seam.divergence(
            student, head, teacher, t_head,
            beta=div.beta, temperature=options.temperature, vocab_size=div.vocab_size,
            with_logprobs=div.with_logprobs, with_entropy=options.with_entropy,
            ignore_index=options.ignore_index, chunk_size=options.chunk_size,
            head_dtype=options.head_dtype, backend=options.backend,
            batch_invariant=options.batch_invariant,
        )  # fmt: skip
