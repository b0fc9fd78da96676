"""Fast-LLM's head losses, computed by logitless from the hidden states and the head weight.

Part of :mod:`logitless.integrations.fast_llm`. Each of Fast-LLM's loss layers keeps its own
config, name, weight and registration (``losses``, metrics); what it reads of the batch is read
by its own getters (``get_inputs``, ``_prepare_target``: the labels of its prediction distance,
its loss mask and divisor, its sequence-parallel split). Only the part that needs the logits is
replaced:

==========================  =================================================================
Fast-LLM loss (``type``)    logitless, and the value (Fast-LLM's semantics)
==========================  =================================================================
``label`` (cross-entropy,   the fused loss with the negative log-likelihood surrogate:
``forward_kl``)             ``Σ_t −log p_t / divisor`` (``num_labels_in_batch``)
``grpo``                    the fused loss, PPO clip ``[1 − ε_low, 1 + ε_high]`` per token:
                            ``Σ_t −min(r_t A_t, clip(r_t) A_t) / divisor``
``gspo``                    the fused loss, sequence ratio ``R_d = exp(mean_d log r)`` and the
                            document's mean advantage: ``Σ_t −min(R_d A_d, clip(R_d) A_d)
                            / num_documents_in_batch``
``distillation``            the divergence op (forward KL, reverse KL; ``cross_entropy``: the
                            forward KL plus the teacher's entropy), teacher logits scaled by
                            ``logits_scale_factor / temperature``: ``Σ_t D_t m_t / divisor``
==========================  =================================================================

Every value is computed with Fast-LLM's ``grad_output`` (times the loss's weight) as the
upstream gradient of its backward, which runs at once: Fast-LLM's head computes its gradients
in its forward. The per-token metrics (``<name>_new_logprobs`` and, with ``metrics: basic``,
the policy family) come from Fast-LLM's own functions on the log-probs and entropy of the same
pass (``seam.policy_loss_and_logprobs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from fast_llm.functional.config import EntropyLossType
from fast_llm.layers.block.config import BlockKwargs
from fast_llm.layers.language_model.config import LanguageModelKwargs
from fast_llm.layers.language_model.loss.config import LanguageModelLossKwargs
from fast_llm.layers.language_model.loss.entropy_loss import (
    LanguageModelDistillationLoss,
    LanguageModelLabelEntropyLoss,
)
from fast_llm.layers.language_model.loss.policy_gradient import (
    LanguageModelGRPOLoss,
    LanguageModelGSPOLoss,
    grpo_metrics_core,
    gspo_metrics_core,
)

from ...contract.divergence import DivergenceOptions
from ...contract.options import HeadOptions
from ...losses import PolicyLossConfig
from .. import seam

__all__ = ["KINDS", "HeadParts", "TeacherOutput", "kind_of", "prepare_loss", "run_loss"]

IGNORE = -100

# The negative log-likelihood as a policy loss: CISPO's weight sg(clip(r, 1 - 0, 1 + 0)) is
# exactly 1, so with advantages 1 the per-token loss is -log p (token-local: the fused path,
# three head matmuls, the gradient taken in the forward). Old log-probs are 0.
_NLL = PolicyLossConfig(surrogate="cispo", clip_low=0.0, clip_high=0.0, aggregation="token_sum")

# Fast-LLM's loss layer -> the kind of computation below (exact classes: Fast-LLM's GRPO and
# GSPO layers are siblings, neither derives from the other).
KINDS: dict[type, str] = {
    LanguageModelLabelEntropyLoss: "label",
    LanguageModelGRPOLoss: "grpo",
    LanguageModelGSPOLoss: "gspo",
    LanguageModelDistillationLoss: "distillation",
}


def kind_of(loss: torch.nn.Module) -> str | None:
    """The computation of one of Fast-LLM's loss layers, or None where logitless has none."""
    return KINDS.get(type(loss))


class TeacherOutput(NamedTuple):
    """What a teacher's head hands a logitless student in place of its logits (stored under
    the name Fast-LLM gives the logits, ``<head>.logits``): its final hidden states (this
    rank's, in the head's layout), its weight (this rank's vocabulary shard) and softcap."""

    hidden: torch.Tensor
    weight: torch.Tensor
    softcap: float | None


@dataclasses.dataclass(frozen=True)
class HeadParts:
    """The student head as the seam sees it: the weight (a stand-in for the checks), its
    softcap, the options, the vocabulary split, and ``gather``: the hidden states of every
    token the head scores from this rank's (the sequence shards gathered, or unchanged)."""

    weight: torch.Tensor
    softcap: float | None
    options: HeadOptions
    parallel: seam.Parallelism
    gather: Callable[[torch.Tensor], torch.Tensor]

    def head(self, scale: float, weight: torch.Tensor | None = None) -> seam.Head:
        """The seam's :class:`~logitless.integrations.seam.Head` of logits
        ``softcap(h·Wᵀ)·scale`` (Fast-LLM's order): logitless applies the scale first and
        caps at ``c·scale``, the same function."""
        return _head(self.weight if weight is None else weight, scale, self.softcap)

    def prepare(self, labels: torch.Tensor, scale: float, fused: bool = True) -> seam.Prepared:
        """The seam's call; ``fused=False`` (the divergence, which has no ``WeightGradInto``):
        the weight's gradient through autograd."""
        options = self.options if fused else self.autograd_options
        return seam.prepare(labels, self.head(scale), options, parallel=self.parallel)

    @property
    def autograd_options(self) -> HeadOptions:
        return dataclasses.replace(self.options, weight_grad_into=None)


def _head(weight: torch.Tensor, scale: float, softcap: float | None) -> seam.Head:
    cap = None if softcap is None else softcap * scale
    return seam.Head(weight, logit_scale=None if scale == 1.0 else scale, softcap=cap)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One loss of one micro-batch, checked before the backbone ran: its kind, the seam's
    call, the student head (its weight a stand-in), Fast-LLM's divisor, and what the loss's
    value and metrics need besides."""

    kind: str
    call: seam.Prepared
    head: seam.Head
    divisor: float
    extra: dict[str, Any]

    def tokens(self, hidden: torch.Tensor) -> seam.Tokens:
        """``[N, H]`` hidden states in the call's layout (``[N]`` or ``[1, N]`` labels)."""
        shape = self.call.call.batch_shape
        return seam.Tokens(hidden.reshape(*shape, hidden.shape[-1]), self.call.labels)


def _labels(target: torch.Tensor) -> torch.Tensor:
    """Fast-LLM's targets (any negative id: no target) with logitless's ignore index."""
    return torch.where(target >= 0, target, torch.full_like(target, IGNORE))


def prepare_loss(loss, parts: HeadParts, kwargs: dict, register: bool) -> Prepared:
    """The seam's call for Fast-LLM loss layer ``loss`` on this micro-batch (``kwargs``),
    checked: labels, per-token inputs, options; one agreement over the vocabulary group."""
    kind = kind_of(loss)
    scale = loss._logits_scale_factor
    if kind == "label":
        target, _, divisor = loss.get_inputs(kwargs, 0, register)
        labels = _labels(target)[None]  # [1, N]: one row, no document ids needed
        ones = torch.ones(labels.shape, device=labels.device)
        call = parts.prepare(labels, scale).with_loss(seam.LossInputs(ones * 0, ones), _NLL)
        return Prepared(kind, call, parts.head(scale), divisor, {})
    if kind == "grpo":
        return _prepare_grpo(loss, parts, kwargs, register)
    if kind == "gspo":
        return _prepare_gspo(loss, parts, kwargs, register)
    return _prepare_distillation(loss, parts, kwargs, register)


def _prepare_grpo(loss, parts: HeadParts, kwargs: dict, register: bool) -> Prepared:
    target, adv, old, _, divisor, low, high, counts, metrics = loss.get_inputs(kwargs, 0, register)
    labels = _labels(target)[None]
    config = PolicyLossConfig(clip_low=low, clip_high=high, aggregation="token_sum")
    inputs = seam.LossInputs(_finite(old, labels[0])[None], adv.float()[None])
    scale = loss._logits_scale_factor
    # the entropy for the metrics only (after with_loss, which asks for it when the loss does)
    call = parts.prepare(labels, scale).with_loss(inputs, config).with_entropy(metrics)
    extra = {"advantages": adv, "old": old, "counts": counts, "metrics": metrics}
    return Prepared("grpo", call, parts.head(scale), divisor, extra)


def _prepare_gspo(loss, parts: HeadParts, kwargs: dict, register: bool) -> Prepared:
    target, metrics = loss.get_inputs(kwargs, 0, register)
    labels = _labels(target)
    adv = loss._prepare_target(kwargs[LanguageModelLossKwargs.advantages], 0)
    old = loss._prepare_target(kwargs[LanguageModelLossKwargs.old_log_probabilities], 0)
    counts = loss._prepare_target(kwargs[LanguageModelLossKwargs.label_counts], 0)
    doc = loss._document_index_zero_based(kwargs, 0)  # [N], -1: no document (padding)
    num_docs = kwargs[BlockKwargs.num_documents_in_sequence]
    # GSPO's advantage of a document is the mean of its tokens' (Fast-LLM: Σ A·m / n_d)
    mask = labels >= 0
    weight = mask.float() / counts.float().clamp(min=1)
    doc_adv = weight.new_zeros(num_docs).index_add_(0, doc.clamp(min=0), adv.float() * weight)
    cfg = loss._config
    config = PolicyLossConfig(
        clip_low=cfg.epsilon_low, clip_high=cfg.epsilon_high, ratio_level="sequence",
        aggregation="token_sum",
    )  # fmt: skip
    inputs = seam.LossInputs(_finite(old, labels), doc_adv, document_ids=doc)
    scale = loss._logits_scale_factor
    # the entropy for the metrics only (after with_loss, which asks for it when the loss does)
    call = parts.prepare(labels, scale).with_loss(inputs, config).with_entropy(metrics)
    extra = {"advantages": adv, "old": old, "counts": counts, "metrics": metrics, "doc": doc}
    extra["num_docs"] = num_docs
    divisor = kwargs[LanguageModelKwargs.num_documents_in_batch]
    return Prepared("gspo", call, parts.head(scale), divisor, extra)


def _finite(old: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Old log-probs as fp32, 0 where there is no target (Fast-LLM's masked tokens may hold
    anything there; logitless checks the others)."""
    return torch.where(labels >= 0, old.float(), torch.zeros((), device=old.device))


def _prepare_distillation(loss, parts: HeadParts, kwargs: dict, register: bool) -> Prepared:
    teacher, mask, _, divisor, loss_type, temperature = loss.get_inputs(kwargs, 0, register)
    if not isinstance(teacher, TeacherOutput):
        raise ValueError(
            f"head.losses.{loss.name}: the distillation teacher "
            f"'{loss._config.reference_model}' handed its logits; with head type logitless the "
            "teacher's head must hand its hidden states instead: set "
            f"reference_models.{loss._config.reference_model}.model.base_model.head."
            "type=logitless and teacher_hidden_states=true"
        )
    t_hidden = parts.gather(teacher.hidden)  # every scored token's, like the student's
    rows = torch.zeros(t_hidden.shape[0], dtype=torch.long, device=t_hidden.device)
    labels = rows if mask is None else torch.where(mask, rows, torch.full_like(rows, IGNORE))
    scale = loss._logits_scale_factor
    call = parts.prepare(labels, scale, fused=False)
    t_head = _head(teacher.weight.detach(), scale / temperature, teacher.softcap)
    beta = 1.0 if loss_type == EntropyLossType.reverse_kl else 0.0
    extra = {"hidden": t_hidden, "teacher_head": t_head, "beta": beta}
    if loss_type == EntropyLossType.cross_entropy:  # + H(p_teacher): one more teacher pass
        extra["teacher_call"] = seam.prepare(
            labels, t_head, dataclasses.replace(parts.autograd_options, with_entropy=True),
            parallel=parts.parallel,
        )  # fmt: skip
    return Prepared("distillation", call, parts.head(scale), divisor, extra)


# --- the head's computation, after the backbone ---------------------------------------------


def run_loss(
    loss, prepared: Prepared, tokens: seam.Tokens, head: seam.Head, kwargs: dict, losses
) -> torch.Tensor:
    """Loss layer ``loss``'s value on this micro-batch (weighted, detached), its gradient
    backpropagated at once into ``tokens.hidden`` and ``head.weight`` (scaled by Fast-LLM's
    ``grad_output`` and the loss's weight), its registered values and metrics."""
    grad_output = loss._get_grad_output(kwargs)
    with torch.set_grad_enabled(grad_output is not None):
        if prepared.kind == "distillation":
            value = _distillation(prepared, tokens, head)
        else:
            value = _policy(loss, prepared, tokens, head, kwargs, losses)
        value = value / prepared.divisor
        if grad_output is not None:
            value.backward(torch.tensor(grad_output, dtype=value.dtype, device=value.device))
    value = value.detach()
    if loss._do_register_loss:
        loss._register_loss(loss.name, value, losses)
    return value if loss.weight == 1 else value * loss.weight


def _policy(loss, prepared: Prepared, tokens, head, kwargs, losses) -> torch.Tensor:
    value, _, out = seam.policy_loss_and_logprobs(prepared.call, tokens, head)
    if prepared.kind == "label":
        return value
    x = prepared.extra
    logp = out.logprobs.reshape(x["old"].shape)
    mask = prepared.call.labels.reshape(x["old"].shape) >= 0
    counts = x["counts"]
    new_mean = None if counts is None else (logp * mask / counts.clamp(min=1)).sum()
    metrics = None
    if x["metrics"]:
        entropy = out.entropy.reshape(logp.shape)
        cfg = loss._config
        if prepared.kind == "grpo":
            metrics = grpo_metrics_core(
                logp, x["advantages"], x["old"], mask, counts, cfg.epsilon_low,
                cfg.epsilon_high, entropy,
            )  # fmt: skip
        else:
            metrics = gspo_metrics_core(
                logp, x["advantages"], x["old"], mask, x["doc"], x["num_docs"], counts,
                cfg.epsilon_low, cfg.epsilon_high, entropy,
            )  # fmt: skip
    loss.register_combinable_extras((new_mean, metrics), kwargs, losses, 0)
    return value


def _distillation(prepared: Prepared, tokens: seam.Tokens, head: seam.Head) -> torch.Tensor:
    x = prepared.extra
    teacher = seam.Tokens(x["hidden"], tokens.labels)
    options = DivergenceOptions(beta=x["beta"])
    out = seam.divergence(prepared.call, tokens, head, teacher, x["teacher_head"], options)
    per_token = out.divergence
    if "teacher_call" in x:
        with torch.no_grad():  # H(p_teacher), which Fast-LLM's cross-entropy adds to the KL
            t_out = seam.logprobs(x["teacher_call"], teacher, x["teacher_head"])
        per_token = per_token + t_out.entropy
    return per_token.sum()  # ignored rows (outside the loss mask) are 0
