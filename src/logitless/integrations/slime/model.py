"""slime's model with the head left to the loss: the model provider, and the
``output_processor`` its ``GPTModel.forward`` passes.

Part of :mod:`logitless.integrations.slime`. :func:`model_provider` is what
``--custom-model-provider-path logitless.integrations.slime.model_provider`` names: slime's own
model (what slime builds without that option: ``get_model_provider_func`` of
``slime/backends/megatron_utils/model_provider.py``, from the same arguments), whose forward
passes megatron-core 0.19's ``output_processor=`` (:func:`with_head`). In training (gradients
on) the processor returns the decoder's final hidden states ``[S, B, H]`` (this rank's
sequence shard under sequence parallelism; fp32, so Megatron's ``Float16Module`` hands them on
as they are) with the output layer they belong to, for :func:`~.loss.policy_loss`; the
``[S, B, V/tp]`` logits are never computed. Without gradients (slime's ``forward_only`` pass of
the old and reference log-probs, which calls slime's own ``get_log_probs_and_entropy`` by name),
and for an output layer that is not a vocabulary head (slime's critic puts a value head there),
it returns the logits exactly as ``GPTModel`` would.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..megatron.model import takes_output_processor
from .config import MODEL_PROVIDER, check_switch, loss_config

__all__ = ["HeadStage", "head_stage", "model_provider", "output_processor", "with_head"]

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


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
) -> nn.Module:
    """slime's model provider with logitless's head (``--custom-model-provider-path``).

    Reads slime's arguments (Megatron-LM's ``get_args()``, as slime's own provider does),
    checks them first (:func:`~.config.check_switch`, :func:`~.config.loss_config`: a
    ``ValueError`` naming the option, before any model is built), builds slime's own model from
    them and returns it :func:`with_head`."""
    from megatron.training.global_vars import get_args

    args = get_args()
    check_switch(args)
    loss_config(args)
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    own = argparse.Namespace(**{**vars(args), "custom_model_provider_path": None})
    build = get_model_provider_func(own, "actor")  # slime's wrapper adds a critic's head
    model = build(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    return with_head(model)


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


def output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: nn.Module,
    output_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
    scale_logits: Any = None,
    compute_language_model_loss: Any = None,
    config: Any = None,
    **_: Any,
) -> torch.Tensor:
    """What ``GPTModel.forward`` returns for slime: with gradients and a vocabulary head, the
    hidden states ``[S, B, H]`` in fp32 carrying their :class:`HeadStage`; otherwise what
    ``GPTModel`` itself returns after its output layer (the logits ``[B, S, V/tp]``, scaled,
    or the language-model loss when given labels)."""
    if torch.is_grad_enabled() and hasattr(output_layer, "output_size_per_partition"):
        out = hidden_states if hidden_states.dtype == torch.float32 else hidden_states.float()
        stage = HeadStage(output_layer, output_weight, config, hidden_states.dtype)
        setattr(out, _ATTRIBUTE, stage)
        return out
    logits, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    if scale_logits is not None:
        logits = scale_logits(logits)
    if labels is not None:
        return compute_language_model_loss(labels, logits)
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
