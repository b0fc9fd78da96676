"""The HF integration's model side: what a transformers causal LM hands the head.

Package-internal (the public names are re-exported by :mod:`logitless.integrations.hf`); the
TRL trainers and the verl backend import it by name (``logitless.integrations.hf.model``). It
answers, for an audited transformers model, two of the seam's questions
(:mod:`logitless.integrations.seam`):

- **The weight and its transform.** :data:`SUPPORTED_MODELS` (the audited table: each class's
  forward read, its logits ``lm_head(final hidden states)`` plus a softcap or a logit scale),
  :func:`check_model`, :func:`causal_lm_head` and :func:`head` (the same as a
  :class:`~logitless.integrations.seam.Head`; :func:`head_for_checks`, with stand-ins of a
  sharded weight, before the backbone runs).
- **Where the head runs.** :func:`with_head`: :func:`seam.run_head
  <logitless.integrations.seam.run_head>` with ``lm_head`` as the owner (its own forward when
  FSDP2 shards it as a unit of its own, so its weight is gathered for the call; under
  DeepSpeed ZeRO-3 its weight held whole for as long as the head needs it).

and says how the hidden states are made: :func:`run_backbone` (``model.model(...)`` as the
audited forwards call it, with the MoE router logits when asked for) and
:func:`router_aux_loss` (the MoE load-balancing loss as the model's forward computes it).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from ...contract.checks import finite_number, is_dtensor
from .. import deepspeed, seam
from ..seam import Head, Tokens
from ..wrappers import unwrap
from . import vlm

__all__ = [
    "SUPPORTED_MODELS",
    "Backbone",
    "CausalLMHead",
    "audited_class",
    "autocast_dtype",
    "backbone_module",
    "causal_lm_head",
    "causal_lm_router_aux_coef",
    "check_model",
    "head",
    "head_for_checks",
    "is_moe",
    "router_aux_loss",
    "run_backbone",
    "with_head",
]

T = TypeVar("T")


class CausalLMHead(NamedTuple):
    """The LM head of a causal LM as the head op takes it.

    The model's logits are ``softcap(F.linear(h, weight, bias) * logit_scale)``, where
    ``softcap(z) = c·tanh(z / c)`` when ``softcap`` is a float ``c`` and the identity when None.

    weight: ``[V, H]`` the head's Parameter itself (the input embedding's when tied).
    bias: ``[V]`` or None.
    softcap: Gemma-2/3 ``config.final_logit_softcapping``, or None.
    logit_scale: Cohere's ``logit_scale``, ``1 / logits_scaling`` for Granite, else 1.0.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    logit_scale: float


def _no_transform(model: nn.Module) -> tuple[float | None, float]:
    return None, 1.0


def _gemma_softcap(model: nn.Module) -> tuple[float | None, float]:
    cap = getattr(model.config, "final_logit_softcapping", None)
    return (None if cap is None else float(cap)), 1.0


def _cohere_scale(model: nn.Module) -> tuple[float | None, float]:
    return None, float(model.logit_scale)


def _granite_scale(model: nn.Module) -> tuple[float | None, float]:
    return None, 1.0 / float(model.config.logits_scaling)


# Class name -> what its forward applies after ``lm_head``. Each entry's forward (transformers
# 5.23; Cohere2 and the MoE models: 5.24) is ``hidden = self.model(...).last_hidden_state;
# logits = self.lm_head(hidden)`` plus the transform named here, and tests/test_hf.py checks
# each against ``model(...).logits``. The MoE models' forwards add the router's
# load-balancing loss (``causal_lm_router_aux_coef``); tests/test_hf_moe.py checks it.
_AUDITED: dict[str, Callable[[nn.Module], tuple[float | None, float]]] = {
    "LlamaForCausalLM": _no_transform,
    "MistralForCausalLM": _no_transform,
    "Qwen2ForCausalLM": _no_transform,
    "Qwen3ForCausalLM": _no_transform,
    "GemmaForCausalLM": _no_transform,
    "Gemma2ForCausalLM": _gemma_softcap,
    "Gemma3ForCausalLM": _gemma_softcap,
    "Phi3ForCausalLM": _no_transform,
    "Olmo2ForCausalLM": _no_transform,
    "CohereForCausalLM": _cohere_scale,
    "Cohere2ForCausalLM": _cohere_scale,
    "GraniteForCausalLM": _granite_scale,
    "Qwen2MoeForCausalLM": _no_transform,
    "Qwen3MoeForCausalLM": _no_transform,
    "MixtralForCausalLM": _no_transform,
    # the hybrid linear-attention models (transformers 5.24): one document per row
    # (vlm.RECURRENT_ROWS); what AutoModelForCausalLM loads from a Qwen3.5 checkpoint
    "Qwen3_5ForCausalLM": _no_transform,
    "Qwen3_5MoeForCausalLM": _no_transform,
    "Qwen3NextForCausalLM": _no_transform,
}

# The vision-language classes (read and tested like the text ones; tests/test_hf_vlm.py):
# their forward calls model.model with the image inputs, then lm_head, with no transform.
_AUDITED.update({name: vl.transform for name, vl in vlm.AUDITED.items()})

#: Names of the transformers classes the functions of this module accept.
SUPPORTED_MODELS: tuple[str, ...] = tuple(sorted(_AUDITED))


def audited_class(model: object) -> tuple[type, Callable]:
    """The audited transformers class of ``model`` (possibly a base of its class)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a transformers causal LM, got {type(model).__name__}")
    for cls in type(model).__mro__:
        if cls.__name__ in _AUDITED and cls.__module__.startswith("transformers.models."):
            if type(model).forward is not cls.forward:
                raise ValueError(
                    f"{type(model).__name__} overrides {cls.__name__}.forward; logitless cannot "
                    "know what its logits are. Call logitless.linear_logprobs on its final "
                    "hidden states and head weight instead."
                )
            return cls, _AUDITED[cls.__name__]
    if type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module
    ):
        raise ValueError(
            f"model is a torch.compile wrapper of {type(model._orig_mod).__name__}: logitless "
            "calls the backbone (model.model) itself, so the compiled forward would never run. "
            "Compile the backbone in place instead, `model.model.compile()` (or `model.model = "
            "torch.compile(model.model)`), and pass the model itself (here: model._orig_mod)"
        )
    raise ValueError(
        f"unsupported model {type(model).__name__}: logitless.integrations.hf handles "
        f"{', '.join(SUPPORTED_MODELS)} (their logits are lm_head(final hidden states), with "
        "Gemma's soft-capping or Cohere's / Granite's logit scale; the vision-language ones "
        "run their image inputs through model.model). For another model, call "
        "logitless.linear_logprobs on its final hidden states and head weight after checking "
        "what its forward does to the logits."
    )


def causal_lm_head(model: nn.Module) -> CausalLMHead:
    """The head parameters and logit transforms of a supported transformers causal LM.

    Returns the Parameters themselves (not copies), so gradients computed from them land in
    the model's ``.grad``; a head tied to the input embedding returns the embedding's weight.

    Raises:
        ValueError: the model is not in :data:`SUPPORTED_MODELS`, overrides ``forward``, or
            its output embedding is not a plain ``nn.Linear`` (a LoRA-wrapped or quantized
            head, or one whose ``forward`` was replaced, e.g. by an offloading hook).

    >>> import transformers
    >>> cfg = transformers.Gemma2Config(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> head = causal_lm_head(transformers.Gemma2ForCausalLM(cfg))
    >>> head.weight.shape, head.bias, head.softcap, head.logit_scale
    (torch.Size([100, 16]), None, 30.0, 1.0)
    """
    head, softcap, scale = check_model(model)
    if type(head.weight).__name__ == "DTensor":
        raise ValueError(
            "model.lm_head.weight is a sharded DTensor here. Under FSDP2, call the logitless "
            "functions with the model itself (they run inside its forward, where the root's "
            "parameters are gathered) and keep lm_head in the root's FSDP group (fully_shard "
            "the decoder layers, then the model), not in an FSDP unit of its own"
        )
    return CausalLMHead(head.weight, head.bias, softcap, scale)


def check_model(model: nn.Module) -> tuple[nn.Linear, float | None, float]:
    """Every check of :func:`causal_lm_head` that reads no parameter (so it holds outside an
    FSDP2 forward too); returns the head module, its softcap and its logit scale."""
    model = unwrap(model).model
    cls, transform = audited_class(model)
    head = model.get_output_embeddings()
    if head is not getattr(model, "lm_head", None):
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() is not model.lm_head, the module "
            "its forward calls"
        )
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(
            f"model.lm_head must be a plain torch.nn.Linear (logits = F.linear(h, W, b)), got "
            f"{type(head).__name__}; a wrapped head (LoRA, quantization) is not supported"
        )
    if "forward" in vars(head):
        raise ValueError(
            "model.lm_head.forward was replaced on the instance (e.g. by an offloading or "
            "device-placement hook); logitless reads lm_head.weight directly and cannot "
            "reproduce it"
        )
    softcap, scale = transform(model)
    if softcap is not None and not (finite_number(softcap) and softcap > 0):
        raise ValueError(f"{cls.__name__}: final_logit_softcapping must be > 0, got {softcap}")
    if not (finite_number(scale) and scale > 0):
        raise ValueError(f"{cls.__name__}: the logit scale must be finite and > 0, got {scale}")
    return head, softcap, scale


def _stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded parameter's dtype, device, global shape and requires_grad, without its
    values (an expanded 0-dim tensor): enough for the head contract's checks."""
    if t is None or not is_dtensor(t):
        return t
    zero = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
    return zero.expand(t.shape)


def _seam_head(h: CausalLMHead) -> Head:
    return Head(h.weight, h.bias, None if h.logit_scale == 1.0 else h.logit_scale, h.softcap)


def head(model: nn.Module) -> Head:
    """:func:`causal_lm_head` as the seam's :class:`~logitless.integrations.seam.Head` (a logit
    scale of 1.0 is None there: no scaling)."""
    return _seam_head(causal_lm_head(model))


def head_for_checks(model: nn.Module) -> Head:
    """The head as the checks before the backbone see it: the parameters themselves, or
    stand-ins of a sharded one's whole parameters (FSDP2's DTensor, outside the forward that
    gathers it; ZeRO-3's partition): their shape, dtype, device and requires_grad (the real
    ones exist inside the forward, see :func:`with_head`)."""
    lm_head, softcap, scale = check_model(model)
    own = deepspeed.own_params(lm_head)
    if deepspeed.is_zero3(own.get("weight")):  # read without the attribute: see own_params
        weight, bias = (deepspeed.stand_in(own.get(k)) for k in ("weight", "bias"))
    else:  # the attributes (FSDP1 leaves its flat parameters' views unregistered)
        weight, bias = _stand_in(lm_head.weight), _stand_in(lm_head.bias)
    return _seam_head(CausalLMHead(weight, bias, softcap, scale))


def with_head(lm: nn.Module, fn: Callable[[Tokens, Head], T], tokens: Tokens) -> T:
    """``fn(tokens, head(lm))``, the head's parameters read where they are whole: run by
    :func:`seam.run_head <logitless.integrations.seam.run_head>` as ``lm_head``'s forward
    when FSDP2 shards it as a unit of its own (its weight gathered once for the call, its
    gradient reduce-scattered after backward), under DeepSpeed ZeRO-3 with its parameters
    held whole for as long as the head needs them; else a plain call."""
    lm_head = lm.lm_head
    params = deepspeed.own_params(lm_head).values()
    return seam.run_head(lm_head, lambda t: fn(t, head(lm)), tokens, gather=params)


def backbone_module(model: nn.Module) -> nn.Module:
    """``model.model``: the module the audited forwards call for the final hidden states."""
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        raise ValueError(
            f"{type(model).__name__} has no backbone module at model.model (got "
            f"{type(backbone).__name__})"
        )
    return backbone


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``lm_head`` runs in under the autocast active on ``device`` (None: none)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class Backbone(NamedTuple):
    """hidden: ``[B, T, H]`` final hidden states. router_logits: the MoE layers' router logits
    (one ``[B * T, E]`` tensor per layer), when asked for."""

    hidden: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] | None = None


def run_backbone(
    lm: nn.Module, inputs: vlm.BackboneInputs, router_logits: bool = False
) -> Backbone:
    """``lm.model(...)`` as the audited forwards call it (``use_cache=False``), after the
    checks of what it gets (:func:`~logitless.integrations.vlm.check_backbone_inputs`:
    image inputs only for the classes that take them, matching ``input_ids``; position ids of
    the rank the model's rope takes)."""
    audited_class(lm)
    vlm.check_backbone_inputs(lm, inputs)
    extra = {"output_router_logits": True} if router_logits else {}
    out = backbone_module(lm)(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **extra,
        **inputs.kwargs,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return Backbone(hidden, tuple(out.router_logits) if router_logits else None)


def is_moe(lm: nn.Module) -> bool:
    return hasattr(lm.config.get_text_config(), "output_router_logits")


def causal_lm_router_aux_coef(model: nn.Module, coef: float | None = None) -> float:
    """The weight of an MoE model's router load-balancing loss in a logitless loss.

    ``coef=None`` follows the model's own forward: ``model.router_aux_loss_coef`` when
    ``config.output_router_logits`` is True and the forward reads that flag, else 0 (no router
    logits, no loss). Every audited text MoE class reads it; the vision-language MoE classes
    read it from transformers 5.24 (``output_router_logits`` in their ``forward``'s
    signature), while up to 5.17 their forward adds the loss only when a call passes
    ``output_router_logits=True``, so with their config flag alone it adds none. A float is
    used as given (TRL's ``router_aux_loss_coef``); 0 turns the loss off. A dense model has
    no router: 0, and a non-zero float raises ``ValueError``.

    >>> import transformers
    >>> cfg = transformers.Qwen3MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
    ...     moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...     num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
    ...     output_router_logits=True, router_aux_loss_coef=0.01)
    >>> causal_lm_router_aux_coef(transformers.Qwen3MoeForCausalLM(cfg))
    0.01
    """
    lm = unwrap(model).model
    audited_class(lm)
    if not is_moe(lm):
        if coef:
            raise ValueError(
                f"router_aux_loss_coef={coef}, but {type(lm).__name__} is not a "
                "mixture-of-experts model: it has no router loss to weight"
            )
        return 0.0
    if coef is None:
        cls, _ = audited_class(lm)
        reads = "output_router_logits" in inspect.signature(cls.forward).parameters
        on = reads and bool(lm.config.get_text_config().output_router_logits)
        return vlm.moe_router(lm)[2] if on else 0.0
    if not (finite_number(coef) and coef >= 0):
        raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {coef}")
    return float(coef)


def router_aux_loss(
    lm: nn.Module, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The load-balancing loss exactly as the model's forward computes it: its own module's
    ``load_balancing_loss_func`` on the router logits, its expert counts, the attention mask."""
    cls, _ = audited_class(lm)
    balance = sys.modules[cls.__module__].load_balancing_loss_func
    experts, top_k, _ = vlm.moe_router(lm)
    return balance(router_logits, experts, top_k, attention_mask)
