"""HF transformers causal LMs: per-token log-probs and policy losses, never the logits path.

``model(input_ids, ...).logits`` projects *every* position of the batch through the LM head,
``[B, T, V]`` in the model's dtype, before anything selects the tokens you train on. The
functions here run the model's backbone instead (``model.model``: embeddings, decoder layers
and the final norm), then hand the final hidden states and the head's own parameters to
:func:`logitless.linear_logprobs` / :func:`logitless.fused_policy_loss`. No model code is
patched and ``lm_head`` is never called; gradients reach every parameter of the model,
including an input embedding tied to the head (its two gradients sum into one ``.grad``).

**Which models.** Only classes whose ``forward`` has been read and whose results the tests
compare with ``model(...).logits`` (see :data:`SUPPORTED_MODELS`): the logits are
``lm_head(final hidden states)``, plus Gemma-2/3's final-logit soft-capping (passed to the op
as ``softcap``) or Cohere's / Granite's constant logit scale (passed as ``logit_scale``); the
mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) add their router's load-balancing
loss to :func:`causal_lm_policy_loss` as their forward does. Anything else, including a
subclass that overrides ``forward`` and a head that is not a plain ``nn.Linear`` (LoRA on
``lm_head``, quantized heads), is refused with ``ValueError`` rather than risk different
numbers.

**Wrapped models.** ``DistributedDataParallel``, FSDP2 (``fully_shard``) and PEFT LoRA models
are accepted as they are: the backbone and the head run inside the outermost wrapper's
forward (:func:`run_in_forward`), so gradients are reduced as for ``model(...)``. DeepSpeed
engines and FSDP1 are refused (:mod:`logitless.integrations.wrappers`).

**Alignment.** Results have ``input_ids``' shape ``[B, T]`` and are aligned like HF's logits:
position ``t`` holds ``log p(target_ids[:, t] | input_ids[:, :t + 1])``, with the default
targets ``target_ids[:, t] = input_ids[:, t + 1]`` (:func:`causal_lm_labels`). Positions
without a target are 0.0 and cost nothing: they are dropped before the head projection. The
targets are named ``target_ids``, not ``labels``: transformers' ``labels`` are *unshifted*
(``model(input_ids, labels=input_ids)`` shifts them itself), so ``labels=`` is refused with
that explanation; ``causal_lm_labels(hf_labels)`` turns HF-style labels into targets.

**Keyword arguments.** logitless's options are named parameters of each function;
``**model_kwargs`` are the backbone's own arguments and nothing else (transformers' backbones
drop names they do not know). A name that logitless knows (a parameter of any of its public
functions or classes: ``top_k``, ``capturable``, ``teacher_softcap``, ``distill_beta``, ...)
and the called function does not take raises ``TypeError`` naming it.

**Padding and packing.** Labels never cross a padding token (``attention_mask == 0``) or a
document boundary (``position_ids`` restarting at 0, or ``cu_seqlens``). Whether *attention*
keeps the documents of a packed row apart is the model's business, not logitless': in
transformers 5, sdpa / eager / flash attention do when a row's ``position_ids`` restart at 0,
no ``attention_mask`` is given and no KV cache is used (the backbone runs with
``use_cache=False`` here, as training does); with an ``attention_mask`` they do not. Either
way the head gives exactly what ``model(..., use_cache=False).logits`` would for the same
arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..contract.checks import fmt_shape as _shape
from ..contract.checks import is_dtensor
from ..contract.head import HeadCall, check_head_call, with_hidden
from ..contract.options import Backend, HeadOptions, SamplerOptions
from ..losses import LossNormalizer, PolicyLossConfig
from ..ops.divergence.op import linear_divergence
from ..ops.fused_loss.op import check_loss_of_head, fused_loss_of_call, teacher_divergence
from ..ops.logprobs.op import logprobs_of_call
from ..packing import (
    cu_seqlens_to_position_ids,
    labels_within_documents,
    next_token_labels,
    position_documents,
)
from ..sampling import SamplingMask
from ..types import Divergence, LogProbs, TeacherHead
from .wrappers import FSDPModule, run_in_forward, unwrap

__all__ = [
    "SUPPORTED_MODELS",
    "CausalLMHead",
    "causal_lm_divergence",
    "causal_lm_head",
    "causal_lm_hidden_states",
    "causal_lm_labels",
    "causal_lm_logprobs",
    "causal_lm_policy_loss",
    "causal_lm_router_aux_coef",
    "check_model",
    "run_in_forward",
]


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
}

#: Names of the transformers classes the functions of this module accept.
SUPPORTED_MODELS: tuple[str, ...] = tuple(sorted(_AUDITED))

# Backbone arguments the functions set themselves (or that would change which hidden states
# come out): refused in ``**model_kwargs``.
_RESERVED_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "inputs_embeds",
        "past_key_values",
        "use_cache",
        "labels",
        "logits_to_keep",
        "output_hidden_states",
        "return_dict",
        "cache_position",
    }
)


# --------------------------------------------------------------------------------------------
# model inspection


def _audited_class(model: object) -> tuple[type, Callable]:
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
        "Gemma's soft-capping or Cohere's / Granite's logit scale). For another model, call "
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
    cls, transform = _audited_class(model)
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
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{cls.__name__}: final_logit_softcapping must be > 0, got {softcap}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{cls.__name__}: the logit scale must be finite and > 0, got {scale}")
    return head, softcap, scale


def _stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded parameter's dtype, device, global shape and requires_grad, without its
    values (an expanded 0-dim tensor): enough for the head contract's checks."""
    if t is None or not is_dtensor(t):
        return t
    zero = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
    return zero.expand(t.shape)


def _head_for_checks(model: nn.Module) -> CausalLMHead:
    """The head as the checks before the backbone see it: the parameters themselves, or when
    FSDP2 shards ``lm_head`` as a unit of its own (accelerate does), stand-ins of its gathered
    parameters (the real ones exist inside its forward, see :func:`_with_head`)."""
    head, softcap, scale = check_model(model)
    if not isinstance(head, FSDPModule):
        return causal_lm_head(model)
    return CausalLMHead(_stand_in(head.weight), _stand_in(head.bias), softcap, scale)


def _with_head(lm: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(head, *args)`` with the head's parameters ready: inside ``lm_head``'s own forward
    when FSDP2 shards it as a unit of its own (its weight gathered once for the call, its
    gradient reduce-scattered after backward), else a plain call."""
    return run_in_forward(lm.lm_head, lambda _: fn(causal_lm_head(lm), *args))


def _backbone(model: nn.Module) -> nn.Module:
    """``model.model``: the module the audited forwards call for the final hidden states."""
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        raise ValueError(
            f"{type(model).__name__} has no backbone module at model.model (got "
            f"{type(backbone).__name__})"
        )
    return backbone


# --------------------------------------------------------------------------------------------
# input checks


def _check_input_ids(input_ids: object) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"input_ids must be an int64 (or int32) tensor of shape [B, T], got dtype "
            f"{input_ids.dtype} and shape {_shape(input_ids)}"
        )
    return input_ids


def _check_like_ids(
    name: str, t: object, input_ids: torch.Tensor, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != input_ids.shape:
        raise ValueError(
            f"{name} must have input_ids' shape {_shape(input_ids)}, got {_shape(t)}"
            + (" (4-D attention masks are not supported)" if name == "attention_mask" else "")
        )
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != input_ids.device:
        raise ValueError(f"{name} must be on input_ids' device {input_ids.device}, got {t.device}")
    return t


_MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_POS_DTYPES = (torch.int32, torch.int64)


def _check_attention_mask(
    attention_mask: object, input_ids: torch.Tensor, capturable: bool
) -> torch.Tensor:
    mask = _check_like_ids("attention_mask", attention_mask, input_ids, _MASK_DTYPES)
    if mask.dtype != torch.bool:
        binary = ((mask == 0) | (mask == 1)).all()
        if capturable:
            torch._assert_async(binary, "attention_mask must hold only 0 and 1")
        elif not bool(binary):
            raise ValueError("attention_mask must hold only 0 and 1")
    return mask.bool()


def _check_model_inputs(
    input_ids: object,
    attention_mask: object,
    position_ids: object,
    cu_seqlens: object,
    response_mask: object,
    ignore_index: object,
    capturable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model-input contract (types, shapes, dtypes, mask values, one packing description),
    checked without building labels; returns input_ids and the bool attention mask (or None).
    ``capturable``: value checks as device-side assertions."""
    input_ids = _check_input_ids(input_ids)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    mask = None
    if attention_mask is not None:
        mask = _check_attention_mask(attention_mask, input_ids, capturable)
    if position_ids is not None:
        _check_like_ids("position_ids", position_ids, input_ids, _POS_DTYPES)
    if response_mask is not None:
        _check_like_ids("response_mask", response_mask, input_ids, (torch.bool,))
    if cu_seqlens is not None:
        if capturable:
            raise ValueError(
                "cu_seqlens is not supported with capturable=True (its documents are found by "
                "reading its values on the host); pass position_ids restarting at 0 for each "
                "document instead"
            )
        if position_ids is not None:
            raise ValueError("give cu_seqlens or position_ids, not both")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens describes one packed row: input_ids must have shape [1, T], got "
                f"{_shape(input_ids)}; for several rows pass position_ids restarting at 0"
            )
    return input_ids, mask


def causal_lm_labels(
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token labels of a ``[B, T]`` batch, aligned like HF logits (the default labels).

    ``labels[:, t] = input_ids[:, t + 1]`` when tokens ``t`` and ``t + 1`` are real tokens of
    the same document and token ``t + 1`` is a response token; ``ignore_index`` otherwise
    (the last position of every row always). Built with :func:`logitless.next_token_labels`.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 0/1 (or bool); 0 marks padding, anywhere (left, right).
        position_ids: ``[B, T]``; a row's documents restart at 0 (packed rows). Where
            ``attention_mask`` is 0 the position is ignored, so HF-style padding positions
            are fine; without a mask, a negative position marks padding.
        cu_seqlens: ``[D + 1]`` cumulative document lengths of a single packed row
            (``B == 1``); tokens after ``cu_seqlens[-1]`` are padding. Not with position_ids.
        response_mask: ``[B, T]`` bool over ``input_ids``: True at the tokens whose log-prob
            is wanted (the generated response). Position ``t`` keeps its label only if
            ``response_mask[:, t + 1]``.
        ignore_index: the value of positions without a label.

    Returns:
        int64 ``[B, T]`` labels on ``input_ids``' device.

    >>> ids = torch.tensor([[0, 0, 5, 6, 7, 8]])                   # left padding, 2 tokens
    >>> causal_lm_labels(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
    ...                  response_mask=torch.tensor([[0, 0, 0, 0, 1, 1]]).bool())
    tensor([[-100, -100, -100,    7,    8, -100]])
    """
    batch = _ModelBatch(input_ids, attention_mask, position_ids, cu_seqlens, None, response_mask)
    return _labels(batch, ignore_index, capturable=False)


def _labels(batch: _ModelBatch, ignore_index: object, capturable: bool) -> torch.Tensor:
    """:func:`causal_lm_labels` of ``batch``; ``capturable``: no host read (its value checks
    are device-side assertions)."""
    input_ids, position_ids, cu_seqlens = batch.input_ids, batch.position_ids, batch.cu_seqlens
    response_mask = batch.response_mask
    input_ids, mask = _check_model_inputs(
        input_ids, batch.attention_mask, position_ids, cu_seqlens, response_mask, ignore_index,
        capturable,
    )  # fmt: skip
    if cu_seqlens is not None:
        labels = next_token_labels(input_ids, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    elif position_ids is not None:
        pos = position_ids if mask is None else position_ids.masked_fill(~mask, -1)
        doc = position_documents(pos, capturable).reshape(-1)
        labels = labels_within_documents(input_ids, doc, ignore_index)
    else:
        labels = next_token_labels(input_ids, ignore_index=ignore_index)
    keep = torch.ones_like(labels, dtype=torch.bool)
    if mask is not None:
        keep[:, :-1] &= mask[:, :-1] & mask[:, 1:]  # never from or to a padding token
    if response_mask is not None:
        keep[:, :-1] &= response_mask[:, 1:]
    return labels.masked_fill(~keep, ignore_index)


def _check_model_kwargs(function: str, model_kwargs: dict[str, Any]) -> None:
    """What ``**model_kwargs`` may hold: arguments of the model's backbone only. ``labels`` and
    the backbone arguments the functions set (``_RESERVED_KWARGS``) raise ``ValueError``; a
    name logitless itself knows (:data:`_LOGITLESS_NAMES`), which ``function`` does not take,
    raises ``TypeError`` as Python would, instead of reaching the backbone, which would drop it
    and return a result computed without it. Called first by every public function here."""
    if "labels" in model_kwargs:
        raise ValueError(
            "labels= is not accepted, because it would mean something else than in "
            "transformers: model(input_ids, labels=...) takes labels *unshifted* (labels[:, t] "
            "is the token at position t, and the model shifts them), while logitless aligns "
            "its targets like the logits (position t scores the next token). Pass "
            "target_ids= aligned like the logits instead: the default is "
            "causal_lm_labels(input_ids, ...); HF-style labels (-100 at the tokens not to "
            "train on) become target_ids=causal_lm_labels(labels, attention_mask=...)."
        )
    reserved = sorted(_RESERVED_KWARGS.intersection(model_kwargs))
    if reserved:
        raise ValueError(
            f"model_kwargs must not set {', '.join(reserved)}: these are set by logitless or "
            "would change which hidden states the backbone returns"
        )
    for name in model_kwargs:
        if name in _LOGITLESS_NAMES:
            raise _not_an_option_here(function, name)


def _not_an_option_here(function: str, name: str) -> TypeError:
    owners = _LOGITLESS_NAMES[name]
    shown = ", ".join(owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
    hint = ""
    if "logitless.PolicyLossConfig" in owners and function == "causal_lm_policy_loss":
        hint = f" Set it on the loss's config: config=PolicyLossConfig({name}=...)."
    elif name == "distill_beta" and function == "causal_lm_divergence":
        hint = " This function's own interpolation is beta= (TRL's convention)."
    elif name.startswith("teacher_") and function == "causal_lm_divergence":
        hint = " The teacher's head and its transform come from the teacher model itself."
    return TypeError(
        f"{function}() got an unexpected keyword argument {name!r}: it is an argument of "
        f"{shown}, not of {function}, and **model_kwargs only go to the model's backbone "
        f"(which would silently drop it).{hint}"
    )


def _model_position_ids(
    position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None, total: int
) -> torch.Tensor | None:
    """What the backbone gets: position_ids as given, or restarting per cu_seqlens document
    (padding after the last document at 0, i.e. one-token documents of its own)."""
    if cu_seqlens is None:
        return position_ids
    return cu_seqlens_to_position_ids(cu_seqlens, total=total).clamp(min=0)[None]


def _head_options(options: HeadOptions, head: CausalLMHead) -> HeadOptions:
    """The call's options with what the model's forward does to the logits (its softcap and
    logit scale) and, under autocast, the autocast dtype for the projection (``lm_head`` runs
    in it)."""
    head_dtype = options.head_dtype
    if head_dtype is None:
        head_dtype = autocast_dtype(head.weight.device)
    return options.replace(
        softcap=head.softcap,
        logit_scale=None if head.logit_scale == 1.0 else head.logit_scale,
        head_dtype=head_dtype,
    )


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``lm_head`` runs in under the autocast active on ``device`` (None: none)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class _ModelBatch(NamedTuple):
    """The backbone's inputs and what the targets are built from (see
    :func:`causal_lm_logprobs`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None

    def targets(self, ignore_index: int, capturable: bool) -> torch.Tensor:
        """``[B, T]`` targets aligned like the logits: given, or :func:`causal_lm_labels`."""
        if self.target_ids is None:
            return _labels(self, ignore_index, capturable)
        if self.response_mask is not None:
            raise ValueError(
                "give target_ids or response_mask, not both: with explicit target_ids, set the "
                "positions you do not want to ignore_index"
            )
        t = self.target_ids
        if not isinstance(t, torch.Tensor) or t.shape != self.input_ids.shape:
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"target_ids must have input_ids' shape {_shape(self.input_ids)}, got {got}"
            )
        # The model inputs the backbone will get.
        _check_model_inputs(
            self.input_ids, self.attention_mask, self.position_ids, self.cu_seqlens, None,
            ignore_index, capturable,
        )  # fmt: skip
        return t

    def backbone(
        self, lm: nn.Module, model_kwargs: dict[str, Any], router_logits: bool = False
    ) -> _Backbone:
        """The backbone's outputs (with ``cu_seqlens``, position ids restarting at each
        document); ``lm`` is the unwrapped model, called inside its wrapper's forward."""
        position_ids = _model_position_ids(
            self.position_ids, self.cu_seqlens, self.input_ids.shape[1]
        )
        return _run_backbone(
            lm, self.input_ids, self.attention_mask, position_ids, model_kwargs, router_logits
        )


class _Prepared(NamedTuple):
    """A checked call (on a placeholder of the hidden states, swapped for the real ones after
    the backbone) and the options it was checked with."""

    call: HeadCall
    options: HeadOptions


def _prepare(
    model: nn.Module,
    batch: _ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> _Prepared:
    """Every check that needs no FLOP, before the backbone runs: model, inputs, targets, and
    the head contract (one check: label range, temperature, dtypes, devices, backend, the
    sampler's kept sets)."""
    head = _head_for_checks(model)
    _backbone(model)
    input_ids = _check_input_ids(batch.input_ids)
    if input_ids.device != head.weight.device:
        raise ValueError(
            f"input_ids must be on the model's device {head.weight.device}, got {input_ids.device}"
        )
    labels = batch.targets(options.ignore_index, options.capturable)
    options = _head_options(options, head)
    placeholder = head.weight.new_zeros(()).detach().expand(*labels.shape, head.weight.shape[1])
    call = check_head_call(placeholder, head.weight, labels, head.bias, options, sampler)
    return _Prepared(call, options)


def causal_lm_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a supported causal LM (after the final norm).

    Runs ``model.model(input_ids, attention_mask=..., position_ids=..., use_cache=False,
    **model_kwargs).last_hidden_state``: what ``model(...)`` feeds to ``lm_head``.
    ``model_kwargs`` go to the backbone (e.g. flash-attention varlen arguments); a logitless
    option name raises ``TypeError``, as in :func:`causal_lm_logprobs`.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> causal_lm_hidden_states(transformers.LlamaForCausalLM(cfg), torch.ones(2, 5).long()).shape
    torch.Size([2, 5, 16])
    """
    _check_model_kwargs("causal_lm_hidden_states", model_kwargs)
    input_ids = _check_input_ids(input_ids)
    if attention_mask is not None:
        _check_like_ids("attention_mask", attention_mask, input_ids, _MASK_DTYPES)
    if position_ids is not None:
        _check_like_ids("position_ids", position_ids, input_ids, _POS_DTYPES)
    args = (input_ids, attention_mask, position_ids, model_kwargs)
    return run_in_forward(model, lambda lm: _run_backbone(lm, *args).hidden)


class _Backbone(NamedTuple):
    """hidden: ``[B, T, H]`` final hidden states. router_logits: the MoE layers' router logits
    (one ``[B * T, E]`` tensor per layer), when asked for."""

    hidden: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] | None = None


def _run_backbone(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    model_kwargs: dict[str, Any],
    router_logits: bool = False,
) -> _Backbone:
    """``lm.model(...)`` as the audited forwards call it (``use_cache=False``)."""
    _audited_class(lm)
    extra = {"output_router_logits": True} if router_logits else {}
    out = _backbone(lm)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **extra,
        **model_kwargs,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return _Backbone(hidden, tuple(out.router_logits) if router_logits else None)


def _is_moe(lm: nn.Module) -> bool:
    return hasattr(lm.config.get_text_config(), "output_router_logits")


def causal_lm_router_aux_coef(model: nn.Module, coef: float | None = None) -> float:
    """The weight of an MoE model's router load-balancing loss in a logitless loss.

    ``coef=None`` follows the model's own forward: ``model.router_aux_loss_coef`` when
    ``config.output_router_logits`` is True, else 0 (no router logits, no loss). A float is
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
    _audited_class(lm)
    if not _is_moe(lm):
        if coef:
            raise ValueError(
                f"router_aux_loss_coef={coef}, but {type(lm).__name__} is not a "
                "mixture-of-experts model: it has no router loss to weight"
            )
        return 0.0
    if coef is None:
        on = bool(lm.config.get_text_config().output_router_logits)
        return float(lm.router_aux_loss_coef) if on else 0.0
    if not (math.isfinite(float(coef)) and float(coef) >= 0):
        raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {coef}")
    return float(coef)


def _router_aux_loss(
    lm: nn.Module, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The load-balancing loss exactly as the model's forward computes it: its own module's
    ``load_balancing_loss_func`` on the router logits, its expert counts, the attention mask."""
    cls, _ = _audited_class(lm)
    balance = sys.modules[cls.__module__].load_balancing_loss_func
    return balance(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)


def causal_lm_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    **model_kwargs: Any,
) -> LogProbs:
    """Per-token log-probs (and entropy) of a transformers causal LM, without its logits.

    Computes what this computes, without the ``[B, T, V]`` logits and only at labelled
    positions::

        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits.float() / temperature
        logp = logits.log_softmax(-1)
        logprobs = logp.gather(-1, target_ids.clamp(min=0)[..., None])[..., 0]  # 0 if ignored
        entropy = -(logp.exp() * logp).sum(-1)                             # 0 where ignored

    (Soft-capping and logit scales are those of the model's forward; the head's matmul runs
    in the model's dtype, or ``head_dtype``, or the autocast dtype under autocast, as
    ``lm_head`` would.)

    Args:
        model: a causal LM of :data:`SUPPORTED_MODELS`, or one wrapped for training:
            ``DistributedDataParallel``, FSDP2 ``fully_shard``, a PEFT LoRA ``PeftModel``
            (see :mod:`logitless.integrations.wrappers`). Its ``forward`` is not called; the
            backbone and the head run inside the outermost wrapper's forward, so DDP's
            reducer and FSDP2's gathers and reduce-scatters work as for ``model(...)``.
        input_ids: ``[B, T]`` token ids.
        attention_mask, position_ids, cu_seqlens, response_mask: describe padding, packed
            documents and the response tokens, see :func:`causal_lm_labels`; attention_mask
            and position_ids also go to the backbone (with ``cu_seqlens``, the backbone gets
            position_ids restarting at each document).
        target_ids: ``[B, T]`` targets aligned like the logits (``target_ids[:, t]`` is
            scored by position ``t``); default :func:`causal_lm_labels`. Not named ``labels``:
            transformers' ``labels`` are unshifted, and ``labels=`` raises ``ValueError``
            saying so (``causal_lm_labels(hf_labels)`` converts them).
        with_entropy, temperature, chunk_size, head_dtype, ignore_index, backend: as in
            :func:`logitless.linear_logprobs` (temperature: float or ``[B, T]`` tensor).
        sampling_mask, top_k, top_p, min_p, with_kept_mass: sampling replay, as in
            :func:`logitless.linear_logprobs`, over the ``[B, T]`` label positions (a CSR mask
            has ``B * T + 1`` offsets, row-major; padded ids are ``[B, T, K]``): the log-probs
            of the model's logits masked to each position's kept set.
        capturable, row_capacity: as in :func:`logitless.linear_logprobs`; logitless's own
            part of the call (targets, checks, head) then reads nothing on the host. Whether
            the backbone does is the model's own (docs/capturable.md).
        batch_invariant: as in :func:`logitless.linear_logprobs`: each position's log-prob
            and entropy are the same bits whatever else the batch holds, given the same
            hidden state (docs/head.md#batch-invariance). The backbone's own invariance is
            the model's (attention and matmul kernels chosen by batch shape are not).
        **model_kwargs: arguments of the model's backbone (``model.model``) and only of it,
            e.g. flash-attention's varlen ``cu_seq_lens_q`` / ``max_length_q``. transformers'
            backbones drop names they do not know, so a name of logitless's own that this
            function does not take (``teacher``, ``beta``, a ``PolicyLossConfig`` field, ...)
            raises ``TypeError`` instead; ``labels`` and the inputs set here raise
            ``ValueError``.

    Returns:
        :class:`logitless.LogProbs` of fp32 ``[B, T]`` tensors; 0.0 where there is no label.

    Raises:
        ValueError: unsupported model, or a bad shape, dtype, device or value, before the
            backbone runs.
        TypeError: a logitless option this function does not take, in ``**model_kwargs``.

    >>> import transformers
    >>> cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.Qwen2ForCausalLM(cfg)
    >>> ids = torch.randint(0, 100, (2, 6))
    >>> out = causal_lm_logprobs(model, ids, with_entropy=True)
    >>> out.logprobs.shape, bool((out.logprobs[:, -1] == 0).all())   # last position: no label
    (torch.Size([2, 6]), True)
    >>> out.logprobs.sum().backward()                # gradients reach every model parameter
    """
    given = locals()
    _check_model_kwargs("causal_lm_logprobs", model_kwargs)
    batch = _ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    options, sampler = HeadOptions.pick(given), SamplerOptions.pick(given)
    return run_in_forward(model, _logprobs_in_forward, batch, options, sampler, model_kwargs)


def _logprobs_in_forward(
    lm: nn.Module,
    batch: _ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
) -> LogProbs:
    """:func:`causal_lm_logprobs` on the unwrapped model, inside its wrapper's forward."""
    prep = _prepare(lm, batch, options, sampler, model_kwargs)
    hidden = batch.backbone(lm, model_kwargs).hidden
    return _with_head(lm, _logprobs_on_head, prep, hidden)


def _logprobs_on_head(head: CausalLMHead, prep: _Prepared, hidden: torch.Tensor) -> LogProbs:
    call = prep.call.replace(weight=head.weight, bias=head.bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return logprobs_of_call(with_hidden(call, hidden, prep.options))


def _document_ids(
    document_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    input_ids: torch.Tensor,
    capturable: bool,
) -> torch.Tensor | None:
    """The loss's sequences: as given; else the documents of cu_seqlens / position_ids
    (numbered row-major, padding -1); else None (each row one sequence)."""
    if document_ids is not None:
        return document_ids
    if cu_seqlens is not None:
        pos = cu_seqlens_to_position_ids(cu_seqlens, total=input_ids.shape[1])[None]
    elif position_ids is not None:
        pos = position_ids
        if attention_mask is not None:
            pos = pos.masked_fill(~attention_mask.bool(), -1)
    else:
        return None
    return position_documents(pos, capturable)


class _Flattener:
    """``[B, T]`` per-token loss inputs -> ``[B * T]``, checking their shape on the way."""

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape

    def __call__(
        self, name: str, t: torch.Tensor | None, *, per_sequence_ok: bool = False
    ) -> torch.Tensor | None:
        if t is None:
            return None
        if isinstance(t, torch.Tensor) and t.shape == self.shape:
            return t.reshape(-1)
        if per_sequence_ok and isinstance(t, torch.Tensor) and t.dim() == 1:
            return t  # one per document id; policy_loss checks the count
        got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
        want = " (per token) or [num_documents] (per document)" if per_sequence_ok else ""
        raise ValueError(
            f"{name} must have input_ids' shape [{', '.join(map(str, self.shape))}]{want}, "
            f"got {got}"
        )


def causal_lm_policy_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    router_aux_loss_coef: float | None = None,
    teacher: nn.Module | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL policy loss of a transformers causal LM: backbone, then :func:`fused_policy_loss`.

    Same ``(loss, metrics)`` and gradients for every model parameter as::

        out = causal_lm_logprobs(model, input_ids, ..., with_entropy=config.entropy_coef != 0)
        policy_loss(out.logprobs, old_logprobs, advantages, target_ids != ignore_index,
                    config=config, entropy=out.entropy, document_ids=..., ...)

    with the head's gradients taken during the forward pass (no ``[B, T, V]`` logits; see
    :func:`fused_policy_loss` for the matmul count of each backend); ``loss.backward()`` then
    runs the backbone's backward.

    Args:
        model, input_ids, attention_mask, position_ids, cu_seqlens, target_ids,
            response_mask, temperature, chunk_size, head_dtype, ignore_index, backend,
            model_kwargs: as in :func:`causal_lm_logprobs`. The loss mask is
            ``target_ids != ignore_index``.
        old_logprobs: ``[B, T]`` fp32 log-probs of the behaviour policy, aligned like the
            targets (e.g. ``causal_lm_logprobs(...)`` under ``torch.no_grad()``).
        advantages: ``[B, T]`` per token, or one per sequence: ``[B]`` when each row is one
            sequence (no ``document_ids``, ``cu_seqlens`` or ``position_ids``), else
            ``[num_documents]``, one per document id.
        document_ids: ``[B, T]`` the loss's sequences, ``0 .. D-1`` and -1 for padding (see
            :func:`logitless.policy_loss`); default: the documents of ``cu_seqlens`` /
            ``position_ids`` numbered in row-major order (for a padded batch: one per
            non-empty row), else each row. With documents, the loss sees the flat ``[B * T]``
            token stream; loss, metrics and gradients do not depend on the layout.
        config, ref_logprobs, rollout_logprobs, normalizer: as in
            :func:`logitless.policy_loss`.
        sampling_mask, top_k, top_p, min_p, with_kept_mass: sampling replay, as in
            :func:`causal_lm_logprobs` and :func:`logitless.fused_policy_loss`.
        capturable, row_capacity: as in :func:`causal_lm_logprobs`; the loss's checks as in
            :func:`logitless.policy_loss` with ``capturable=True``.
        batch_invariant: as in :func:`causal_lm_logprobs`: the log-probs inside the loss are
            those :func:`causal_lm_logprobs` gives with it, bit for bit, so the ratio on
            unchanged weights is exactly 1.0 whatever the micro-batching.
        router_aux_loss_coef: mixture-of-experts models: the weight of the router's
            load-balancing loss added to the loss (computed from the same backbone call, as
            the model's forward computes it, and reported as ``metrics["aux_loss"]``). None:
            the model's own rule, see :func:`causal_lm_router_aux_coef`.
        teacher: a teacher causal LM for the distillation term (``config.distill_coef``,
            ``config.distill_beta``; docs/distillation.md): its backbone runs without gradient
            inside its own wrapper's forward on the same inputs, and the loss gains
            ``distill_coef · D`` as in :func:`logitless.fused_policy_loss` with ``teacher=``.

    Returns:
        ``(loss, metrics)``: a 0-dim fp32 loss and a dict of detached 0-dim metrics.

    Raises:
        ValueError: unsupported model, or bad input to the head or the loss, before the
            backbone runs.

    >>> import transformers, logitless
    >>> cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> ids = torch.randint(0, 100, (2, 8))
    >>> response = torch.zeros(2, 8, dtype=torch.bool); response[:, 3:] = True
    >>> with torch.no_grad():
    ...     old = causal_lm_logprobs(model, ids, response_mask=response).logprobs
    >>> loss, metrics = causal_lm_policy_loss(model, ids, old, torch.tensor([1.0, -1.0]),
    ...     config=logitless.PolicyLossConfig(), response_mask=response)
    >>> loss.backward()
    """
    given = locals()
    _check_model_kwargs("causal_lm_policy_loss", model_kwargs)
    entropy = isinstance(config, PolicyLossConfig) and config.entropy_coef != 0
    options = HeadOptions.pick(given).replace(with_entropy=entropy)
    batch = _ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    loss_inputs = {"old_logprobs": old_logprobs, "advantages": advantages}
    loss_inputs |= {"ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs}
    teacher_out = None
    if teacher is not None:
        check_model(teacher)
        with torch.no_grad():
            teacher_out = run_in_forward(teacher, _teacher_in_forward, batch, model_kwargs)
    loss_options = _LossOptions(config, document_ids, normalizer, router_aux_loss_coef, teacher_out)
    return run_in_forward(
        model, _policy_loss_in_forward, batch, options, SamplerOptions.pick(given),
        model_kwargs, loss_inputs, loss_options,
    )  # fmt: skip


def _loss_on_head(
    head: CausalLMHead, prep: _Prepared, hidden: torch.Tensor, loss_call, teacher=None
):
    call = prep.call.replace(weight=head.weight, bias=head.bias)
    with torch.autocast(hidden.device.type, enabled=False):
        call = with_hidden(call, hidden, prep.options)
        divergence = None
        if teacher is not None:
            divergence = _policy_divergence(call, hidden, head, prep.options, teacher, loss_call)
            loss_call = dataclasses.replace(loss_call, divergence=divergence.detach())
        return fused_loss_of_call(call, loss_call, divergence)


def _policy_divergence(call: HeadCall, hidden, head: CausalLMHead, options, teacher, loss_call):
    """The distillation term's ``D`` ``[*batch_shape]`` of a policy-loss call: the student's
    rows against the teacher's hidden states and head (its options: the call's)."""
    t_hidden, t_head = teacher
    shape = call.batch_shape
    temperature = options.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.reshape(shape)
    teacher_head = TeacherHead(
        t_hidden.reshape(*shape, t_hidden.shape[-1]), t_head.weight, t_head.bias,
        None if t_head.logit_scale == 1.0 else t_head.logit_scale, t_head.softcap,
    )  # fmt: skip
    labels = call.labels.reshape(shape)
    options = options.replace(temperature=temperature)
    divergence = teacher_divergence(
        call, hidden, head.weight, labels, head.bias, options, teacher_head
    )
    return divergence(loss_call.config)


class _LossOptions(NamedTuple):
    """The loss arguments of :func:`causal_lm_policy_loss` beyond the per-token inputs."""

    config: PolicyLossConfig | None
    document_ids: torch.Tensor | None
    normalizer: LossNormalizer | None
    router_aux_loss_coef: float | None
    teacher: tuple[torch.Tensor, CausalLMHead] | None = None  # its hidden states and head


def _policy_loss_in_forward(
    lm: nn.Module,
    batch: _ModelBatch,
    options: HeadOptions,
    sampler: SamplerOptions,
    model_kwargs: dict[str, Any],
    loss_inputs: dict[str, torch.Tensor | None],
    loss_options: _LossOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`causal_lm_policy_loss` on the unwrapped model, inside its wrapper's forward."""
    aux_coef = causal_lm_router_aux_coef(lm, loss_options.router_aux_loss_coef)
    prep = _prepare(lm, batch, options, sampler, model_kwargs)
    call = prep.call
    document_ids = _document_ids(
        loss_options.document_ids, batch.attention_mask, batch.position_ids, batch.cu_seqlens,
        batch.input_ids, prep.options.capturable,
    )  # fmt: skip
    if document_ids is not None:
        # Sequences are documents, not rows: the loss sees the flat [N] token stream, where
        # per-sequence advantages are one per document id (policy_loss's packed form).
        flat = _Flattener(call.batch_shape)
        loss_inputs = {
            k: flat(k, v, per_sequence_ok=k == "advantages") for k, v in loss_inputs.items()
        }
        document_ids = flat("document_ids", document_ids)
        call = call.replace(batch_shape=torch.Size([call.labels.numel()]))
    if loss_options.teacher is not None:  # its shape stands in until the head computes it
        loss_inputs = {
            **loss_inputs,
            "divergence": call.labels.new_zeros(call.batch_shape, dtype=torch.float32),
        }
    # The loss contract, checked once before the backbone.
    loss_call = check_loss_of_head(
        call, config=loss_options.config, document_ids=document_ids,
        normalizer=loss_options.normalizer, **loss_inputs,
    )  # fmt: skip
    out = batch.backbone(lm, model_kwargs, router_logits=aux_coef != 0)
    hidden = out.hidden.reshape(*call.batch_shape, out.hidden.shape[-1])
    prep = prep._replace(call=call)
    teacher = loss_options.teacher
    loss, metrics = _with_head(lm, _loss_on_head, prep, hidden, loss_call, teacher)
    if out.router_logits is not None:
        aux = _router_aux_loss(lm, out.router_logits, batch.attention_mask)
        loss = loss + aux_coef * aux.to(loss.dtype)
        metrics = {**metrics, "aux_loss": aux.detach().float()}
    return loss, metrics


# --------------------------------------------------------------------------------------------
# distillation: the divergence between a teacher's and the student's next-token distributions


def causal_lm_divergence(
    model: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
    backend: Backend = "auto",
    batch_invariant: bool = False,
    **model_kwargs: Any,
) -> Divergence:
    """Per-token divergence between a teacher causal LM and a student causal LM, without
    either model's logits: both backbones, then :func:`logitless.linear_divergence`.

    Computes, at every labelled position, what this computes with both models' logits::

        z_s = model(input_ids, ..., use_cache=False).logits.float() / temperature
        z_t = teacher(input_ids, ..., use_cache=False).logits.float() / temperature
        divergence = D_beta(softmax(z_t) ‖ softmax(z_s))     # TRL's beta convention

    (each model's own soft-capping and logit scale; see :func:`logitless.linear_divergence`
    for ``beta``). The teacher runs under ``torch.no_grad()`` inside its own wrapper's forward
    (DDP, FSDP2: its sharded head weight is gathered without a gradient); the student's
    backbone and head run inside the student wrapper's forward, as in
    :func:`causal_lm_policy_loss`. Gradients reach the student's parameters only.

    Args:
        model: the student, a causal LM of :data:`SUPPORTED_MODELS` (wrapped or not).
        teacher: the teacher, likewise; its hidden width may differ, its vocabulary must be
            the student's (or differ by padding rows: ``vocab_size``).
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask:
            as in :func:`causal_lm_logprobs`; both models get the same inputs, and the
            positions without a target are skipped (0.0).
        beta, temperature, with_logprobs, with_entropy, vocab_size, chunk_size, head_dtype,
            ignore_index, backend, batch_invariant: as in :func:`logitless.linear_divergence`
            (the student's log-probs of the targets and entropy).
        **model_kwargs: passed to both backbones; as in :func:`causal_lm_logprobs` (a
            logitless option this function does not take, e.g. ``top_k``, ``capturable``,
            ``teacher_softcap``, raises ``TypeError``).

    Returns:
        :class:`logitless.Divergence` of fp32 ``[B, T]`` tensors, 0.0 where there is no target.

    >>> import transformers
    >>> def tiny(width):
    ...     return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=100,
    ...         hidden_size=width, intermediate_size=32, num_hidden_layers=1,
    ...         num_attention_heads=2, num_key_value_heads=1))
    >>> student, teacher = tiny(16), tiny(32)
    >>> ids = torch.randint(0, 100, (2, 6))
    >>> out = causal_lm_divergence(student, teacher, ids, beta=0.5, with_entropy=True)
    >>> out.divergence.shape
    torch.Size([2, 6])
    >>> out.divergence.sum().backward()          # gradients reach the student's parameters
    """
    given = locals()
    _check_model_kwargs("causal_lm_divergence", model_kwargs)
    options = HeadOptions.pick(given)
    batch = _ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    check_model(model)
    check_model(teacher)
    labels = batch.targets(ignore_index, False)
    with torch.no_grad():
        t_hidden, t_head = run_in_forward(teacher, _teacher_in_forward, batch, model_kwargs)
    div = _DivergenceArgs(beta, with_logprobs, vocab_size)
    args = (batch, labels, t_hidden, t_head, options, div, model_kwargs)
    return run_in_forward(model, _divergence_in_forward, *args)


class _DivergenceArgs(NamedTuple):
    beta: float
    with_logprobs: bool
    vocab_size: int | None


def _teacher_in_forward(
    lm: nn.Module, batch: _ModelBatch, model_kwargs: dict[str, Any]
) -> tuple[torch.Tensor, CausalLMHead]:
    """The teacher's final hidden states and its head, detached (a sharded head weight
    gathered whole: the teacher needs no gradient)."""
    hidden = batch.backbone(lm, model_kwargs).hidden
    head, softcap, scale = check_model(lm)

    def whole(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return (t.full_tensor() if is_dtensor(t) else t).detach()

    return hidden.detach(), CausalLMHead(whole(head.weight), whole(head.bias), softcap, scale)


def _divergence_in_forward(
    lm: nn.Module,
    batch: _ModelBatch,
    labels: torch.Tensor,
    t_hidden: torch.Tensor,
    t_head: CausalLMHead,
    options: HeadOptions,
    div: _DivergenceArgs,
    model_kwargs: dict[str, Any],
) -> Divergence:
    hidden = batch.backbone(lm, model_kwargs).hidden
    return _with_head(lm, _divergence_on_head, hidden, labels, t_hidden, t_head, options, div)


def _divergence_on_head(
    head: CausalLMHead,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    t_hidden: torch.Tensor,
    t_head: CausalLMHead,
    options: HeadOptions,
    div: _DivergenceArgs,
) -> Divergence:
    options = _head_options(options, head)

    def scale(s: float) -> float | None:
        return None if s == 1.0 else s

    with torch.autocast(hidden.device.type, enabled=False):
        return linear_divergence(
            hidden, head.weight, labels, t_hidden, t_head.weight,
            beta=div.beta, temperature=options.temperature, bias=head.bias,
            logit_scale=options.logit_scale, softcap=options.softcap,
            teacher_bias=t_head.bias, teacher_logit_scale=scale(t_head.logit_scale),
            teacher_softcap=t_head.softcap, vocab_size=div.vocab_size,
            with_logprobs=div.with_logprobs, with_entropy=options.with_entropy,
            ignore_index=options.ignore_index, chunk_size=options.chunk_size,
            head_dtype=options.head_dtype, backend=options.backend,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# the names logitless knows: refused in **model_kwargs (see _check_model_kwargs)


def _parameter_names(obj: object) -> list[str]:
    """The keyword-passable parameter names of a public function or class (a dataclass's or a
    NamedTuple's fields; a module's constructor and ``forward``)."""
    targets: list[object] = [obj]
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        targets = [obj.__init__, obj.forward]
    names = []
    for target in targets:
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names += [p.name for p in parameters if p.kind in kinds and p.name not in ("self", "cls")]
    return names


def _logitless_names() -> dict[str, tuple[str, ...]]:
    """Every parameter name of logitless's public surface -> where it is one: the callables of
    ``logitless.__all__`` (ops, modules, loss functions, their config and input types) and of
    this module's ``__all__``, and the option types every entry point builds (so an option
    added there is known here without a line more)."""
    import logitless  # the package is fully imported before any of its submodules' code runs

    from ..contract.divergence import DivergenceOptions

    sources = [(f"logitless.{n}", getattr(logitless, n)) for n in logitless.__all__]
    sources += [(f"hf.{n}", globals()[n]) for n in __all__]
    sources += [(c.__name__, c) for c in (HeadOptions, SamplerOptions, DivergenceOptions)]
    sources.sort(key=lambda source: isinstance(source[1], type))  # functions first
    owners: dict[str, list[str]] = {}
    for label, obj in sources:
        if callable(obj):
            for name in _parameter_names(obj):
                owners.setdefault(name, []).append(label)
    return {name: tuple(dict.fromkeys(labels)) for name, labels in owners.items()}


#: Parameter name -> the public functions and classes that take it. A name of logitless's own
#: in ``**model_kwargs`` raises ``TypeError`` (transformers' backbones would drop it).
_LOGITLESS_NAMES: dict[str, tuple[str, ...]] = _logitless_names()
