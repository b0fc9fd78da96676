"""slime's head and policy loss, the two halves of the switch: what the model hands the loss,
and the loss that runs the head on it.

Part of :mod:`logitless.integrations.slime`. :func:`with_head` makes slime's ``GPTModel`` pass
megatron-core 0.19's ``output_processor=`` (:func:`output_processor`). In training (gradients
on) the processor returns the decoder's final hidden states ``[S, B, H]`` (this rank's sequence
shard under sequence parallelism; fp32, so Megatron's ``Float16Module`` hands them on as they
are) carrying the output layer they belong to (:class:`HeadStage`); the ``[S, B, V/tp]`` logits
are never computed. Without gradients (slime's ``forward_only`` pass of the old and reference
log-probs, which calls slime's own ``get_log_probs_and_entropy`` by name), and for an output
layer that is not a vocabulary head (slime's critic puts a value head there), it returns the
logits exactly as ``GPTModel`` would.

:func:`policy_loss` is what ``--loss-type custom_loss --custom-loss-function-path
logitless.integrations.slime.policy_loss`` runs: slime's ``loss_function`` calls
``policy_loss(args, batch, logits, sum_of_sample_mean)`` where its own ``policy_loss_function``
would run, then scales the loss for Megatron's schedule as it does for its own. ``logits`` is
what the model returned: the hidden states of :func:`output_processor`. The head runs as the
output layer's forward (its forward pre-hooks fire: the distributed optimizer's
``overlap_param_gather``) through the megatron integration's :class:`~..megatron.batch.Batch`,
and the loss is logitless's fused loss (:func:`logitless.fused_policy_loss`) with slime's
options (:func:`~.config.loss_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...contract.options import IGNORE_INDEX, HeadOptions
from .. import seam
from ..megatron.batch import Batch
from ..megatron.model import ProcessorStage, agree, megatron_head, takes_output_processor
from ..seam import ContextParallel, LossInputs
from .config import MODEL_PROVIDER, POLICY_LOSS, loss_config, mismatch_active
from .layout import Responses, responses

__all__ = ["HeadStage", "head_stage", "output_processor", "policy_loss", "with_head"]

_ATTRIBUTE = "_logitless_slime_head"


@dataclass(frozen=True)
class HeadStage:
    """What the loss needs of the head that ``GPTModel.forward`` handed the processor: the
    output layer (its forward runs the head, so its hooks fire), the weight ``GPTModel`` passes
    it (the input embedding's when the two are shared, else None), the model's config and the
    hidden states' own dtype (the processor hands them on in fp32)."""

    output_layer: nn.Module
    output_weight: torch.Tensor | None
    config: Any
    dtype: torch.dtype


def with_head(model: nn.Module) -> nn.Module:
    """``model`` (a ``GPTModel`` of megatron-core 0.19 or later, or a subclass) whose forward
    passes :func:`output_processor` unless its caller passes one: an instance-level
    ``forward``, nothing else changed (its parameters, their names, its class). A pipeline
    stage without the output layer is returned as it is."""
    if not getattr(model, "post_process", True):
        return model
    cls = type(model)
    if not takes_output_processor(cls):
        raise ValueError(
            f"--custom-model-provider-path {MODEL_PROVIDER}: slime built a {cls.__name__} "
            "whose forward takes no output_processor (megatron-core 0.19 or later's "
            "GPTModel.forward does); logitless needs it to hand the loss the hidden states"
        )
    forward = cls.forward

    def forward_with_head(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("output_processor", output_processor)
        return forward(model, *args, **kwargs)

    model.forward = forward_with_head
    return model


def output_processor(*, hidden_states: torch.Tensor, output_layer: nn.Module,
                     output_weight: torch.Tensor | None = None,
                     **given: Any) -> torch.Tensor:  # fmt: skip
    """What ``GPTModel.forward`` returns for slime: with gradients and a vocabulary head, the
    hidden states ``[S, B, H]`` in fp32 carrying their :class:`HeadStage`; otherwise what
    ``GPTModel`` itself returns after its output layer (the logits ``[B, S, V/tp]``, scaled,
    or the language-model loss when given labels). ``given``: the other arguments
    ``GPTModel.forward`` hands a processor (``config``, ``labels``, ``scale_logits``, ...)."""
    if torch.is_grad_enabled() and hasattr(output_layer, "output_size_per_partition"):
        out = hidden_states if hidden_states.dtype == torch.float32 else hidden_states.float()
        stage = HeadStage(output_layer, output_weight, given.get("config"), hidden_states.dtype)
        setattr(out, _ATTRIBUTE, stage)
        return out
    gather = given.get("runtime_gather_output")
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=gather)
    if given.get("scale_logits") is not None:
        logits = given["scale_logits"](logits)
    if given.get("labels") is not None:
        return given["compute_language_model_loss"](given["labels"], logits)
    return logits.transpose(0, 1).contiguous()


def head_stage(output: object) -> HeadStage:
    """The :class:`HeadStage` of what the model returned; ``ValueError`` when it is not the
    hidden states :func:`output_processor` handed on (slime's logits: the model was built
    without :func:`model_provider`)."""
    stage = getattr(output, _ATTRIBUTE, None)
    if not isinstance(stage, HeadStage):
        got = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"logitless's slime loss needs the hidden states its model provider hands on, got "
            f"{got} (slime's logits?): pass --custom-model-provider-path {MODEL_PROVIDER} "
            "with --custom-loss-function-path"
        )
    return stage


def policy_loss(
    args: Any,
    batch: dict[str, Any],
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's ``policy_loss_function`` with logitless's head: ``(loss, metrics)``.

    The loss equals slime's (its value summed over the context-parallel ranks; with
    ``--allgather-cp`` each rank's share differs from slime's, the sum does not), and so do its
    gradients, for every option :func:`~.config.loss_config` accepts. ``metrics``: slime's keys
    ``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``, ``ppo_kl`` (and ``kl_loss`` with
    ``--use-kl-loss``, ``train_rollout_logprob_abs_diff`` where slime reports it, ``ois`` with
    the mismatch correction), each this rank's share as slime's ``sum_of_sample_mean`` gives it;
    plus logitless's ``opsm_masked_frac``, ``mismatch_kl``, ``is_weight_mean`` and
    ``is_masked_frac`` where they apply. Bad input raises ``ValueError`` on every rank of the
    tensor- and context-parallel groups, before the head runs."""
    stage = head_stage(logits)
    config = loss_config(args)
    head = _head(stage, args)
    hidden = logits.to(stage.dtype)
    length = hidden.shape[0] * (head.tp_size if head.parallel.sequence is not None else 1)
    error, inputs, layout = None, None, None
    try:
        layout = responses(
            batch, length, head.cp_rank, head.cp_size, bool(getattr(args, "allgather_cp", False)),
            head.parallel.context_group,
        )  # fmt: skip
        _check_inputs(args, batch, layout)
    except ValueError as e:
        error = e
    agree(head, error, POLICY_LOSS)
    inputs = _loss_inputs(args, batch, layout)
    labels = layout.labels
    run = Batch(head, (), {}, labels, labels != IGNORE_INDEX, layout.document_ids)
    fusion = False if stage.output_weight is not None else None  # a tied weight: .grad
    options = HeadOptions(temperature=float(getattr(args, "rollout_temperature", 1.0)))
    prepared = run.prepare(options, fusion, weight=stage.output_weight)
    prepared = prepared.with_loss(inputs, config).with_entropy(True)
    loss, metrics = run.run(
        lambda tokens, w: seam.policy_loss(prepared, tokens, w),
        lambda: stage.output_layer(hidden, weight=stage.output_weight),
    )
    # Without a normalizer the loss divides by this call's own counts (over the
    # context-parallel group): its documents (each sample's mean, then their mean) or its
    # tokens (the metrics' token mean). slime's reducers divide by neither: they sum each
    # sample's mean (its loss_function divides by the step's sample count), or the tokens.
    # (The metrics ``loss`` and ``pg_loss`` are weighted like the loss, the others are means.)
    if config.aggregation == "token_sum":
        scales = (loss.new_ones(()), metrics["num_tokens"].clamp(min=1).to(loss.dtype))
    else:
        scales = (metrics["num_sequences"].clamp(min=1).to(loss.dtype),) * 2
    shares = tuple(s / head.cp_size for s in scales)
    return loss * scales[0], _reported(args, batch, metrics, shares, sum_of_sample_mean)


def _head(stage: HeadStage, args: Any):
    """The megatron integration's reading of the head (its vocabulary split, sequence
    parallelism, the context-parallel group: contiguous slices with ``--allgather-cp``)."""
    from megatron.core import parallel_state as ps

    config = stage.config
    cp = ps.get_context_parallel_group() if config.context_parallel_size > 1 else None
    layer = stage.output_layer
    head = megatron_head(ProcessorStage(layer, config, layer.tp_group, cp))
    if cp is not None and getattr(args, "allgather_cp", False):
        parallel = dataclasses.replace(head.parallel, context=ContextParallel(cp, "contiguous"))
        head = dataclasses.replace(head, parallel=parallel)
    return head


def _old_key(args: Any) -> str:
    return "rollout_log_probs" if getattr(args, "use_rollout_logprobs", False) else "log_probs"


def _needed(args: Any) -> dict[str, bool]:
    """The per-token inputs of slime's batch the loss reads: advantages and the ratio's old
    log-probs always, the reference's with ``--use-kl-loss``, the rollout's with the mismatch
    correction (or as the old ones, ``--use-rollout-logprobs``)."""
    needed = {
        "advantages": True,
        "ref_log_probs": bool(getattr(args, "use_kl_loss", False)),
        "rollout_log_probs": mismatch_active(args),
    }
    needed[_old_key(args)] = True
    return needed


def _check_inputs(args: Any, batch: Mapping[str, Any], layout: Responses) -> None:
    for key, needed in _needed(args).items():
        if needed and not batch.get(key):
            raise ValueError(
                f"batch[{key!r}] is empty: slime's policy loss reads it here (slime's actor "
                "computes the old log-probs before training with --loss-type custom_loss)"
            )
        if needed:
            layout.check(key, batch[key])


def _loss_inputs(args: Any, batch: Mapping[str, Any], layout: Responses) -> LossInputs:
    """slime's per-token inputs laid out like the labels (with ``--allgather-cp`` one
    all-reduce each over the context-parallel group, on every rank)."""
    tensors = {k: layout.per_token(batch[k]) for k, v in _needed(args).items() if v}
    return LossInputs(
        old_logprobs=tensors[_old_key(args)],
        advantages=tensors["advantages"],
        ref_logprobs=tensors.get("ref_log_probs"),
        rollout_logprobs=tensors["rollout_log_probs"] if mismatch_active(args) else None,
        document_ids=layout.document_ids,
    )


# slime's metric -> how it follows from logitless's means (weighted like the loss's metrics)
_SLIME_METRICS: dict[str, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]] = {
    "entropy_loss": lambda m: m["entropy"],
    "pg_clipfrac": lambda m: m["clip_frac_low"] + m["clip_frac_high"],
    "ppo_kl": lambda m: -m["log_ratio_mean"],
}
_OWN_METRICS = ("opsm_masked_frac", "mismatch_kl", "is_weight_mean", "is_masked_frac")


def _reported(args, batch, metrics, shares, sum_of_sample_mean) -> dict[str, torch.Tensor]:
    """slime's metrics from logitless's: ``loss`` and ``pg_loss`` times ``shares[0]``, the
    means times ``shares[1]`` (back to slime's sums, and each rank's share: slime sums them
    over the data- and context-parallel ranks, logitless's cover the context-parallel
    group)."""
    loss_share, mean_share = shares
    out = {"loss": metrics["loss"] * loss_share, "pg_loss": metrics["pg_loss"] * loss_share}
    out.update({k: f(metrics) * mean_share for k, f in _SLIME_METRICS.items()})
    if getattr(args, "use_kl_loss", False):
        out["kl_loss"] = metrics["kl_ref"] * mean_share
    if mismatch_active(args):
        out["ois"] = metrics["ratio_mean"] * mean_share
    rollout, old = batch.get("rollout_log_probs"), batch.get("log_probs")
    if rollout and old and not getattr(args, "use_rollout_logprobs", False):
        diff = (torch.cat(list(old)) - torch.cat(list(rollout))).abs()
        out["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(diff).detach()
    out.update({k: metrics[k] * mean_share for k in _OWN_METRICS if k in metrics})
    return {k: v.detach() for k, v in out.items()}
