"""verl's engines: logitless as their fused-kernel backend, switched on by configuration.

**FSDP engine.** verl (0.9.x) computes the actor's log-probs and entropy through a model forward
that its ``apply_monkey_patch`` picks from
``actor_rollout_ref.model.fused_kernel_options.impl_backend`` (``torch``, ``triton`` or
``liger``, a fixed set). This module adds two values to that set::

    actor_rollout_ref.model.external_lib=logitless.integrations.verl   # verl imports it
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=logitless
    # or impl_backend=logitless_batch_invariant: the same bits for a token whatever else is
    # in the micro-batch (verl's bitwise-reproducible fallback)

verl imports every ``external_lib`` in each worker when it builds the model config, before the
engine builds the model. Importing this module replaces **one** verl function,
``verl.models.transformers.monkey_patch.patch_forward_with_backends`` (the place where verl
chooses the forward from ``impl_backend``; nothing else in verl can be reached without it):
for the two values above it gives the model instance a forward of logitless's
(:func:`verl_forward`), for every other value it calls verl's own function unchanged.
:func:`uninstall` puts verl's function back. No class is patched: the forward is set on the
model instance, which FSDP1, FSDP2 and PEFT all call through.

The forward has the signature and return type of verl's ``forward_with_torch_backend``
(``verl.models.transformers.dense_common``): it runs the model's backbone, then scores the
final hidden states against ``shift_labels`` (the engine's labels, rolled over the whole packed
row before any Ulysses slicing) or, without them, ``labels`` / ``input_ids`` rolled by one along
the sequence, and returns ``CausalLMOutputForPPO(log_probs=, entropy=)``: fp32 ``[B, T]`` (or
``[1, total_nnz / sp]``) tensors, never the ``[tokens, vocab]`` logits. In verl's padded layout,
positions where ``attention_mask`` is 0 cost nothing and hold 0.0 (verl's engine drops them).
The head is the seam's (:mod:`logitless.integrations.seam`): the call checked before the
backbone (:func:`seam.prepare`), then :class:`~seam.Tokens` (hidden states, labels) and
:class:`~seam.Head` (``lm_head``'s parameters, the model's softcap or logit scale) to
:func:`seam.logprobs`, run as ``lm_head``'s forward (:func:`seam.run_head`).
Under Ulysses sequence parallelism the engine slices the tokens and gathers the outputs; the
head is token-local, so each rank scores its own slice (no :class:`~seam.Parallelism` of its
own, see ``_ULYSSES``).

**Megatron engine.** verl's Megatron engine reads no ``impl_backend``: with
``use_fused_kernels=True`` its ``patch_fused_forward`` gives each ``GPTModel`` verl's
``_fused_GPTModel_forward`` (when ``GPTModel.forward`` takes no ``output_processor``: 0.16).
Importing this module where megatron-core is installed replaces that function by
:func:`megatron_forward` (:func:`install_megatron`), so
``external_lib=logitless.integrations.verl`` with ``use_fused_kernels=True`` is the switch
there. From megatron-core 0.18 verl passes its ``fused_output_processor`` to
``GPTModel.forward(output_processor=...)`` instead (its hook mode); that one is replaced by
:func:`megatron_output_processor`.

**Vision-language models** (:data:`VLM_CLASSES`: the Qwen-VL and Qwen3.5 classes verl gives a
fused forward of its own): the image / video inputs verl's engine passes (its
``multi_modal_inputs``) go to ``model.model``, verl's own backbone forward after
``apply_monkey_patch``, after the HF functions' checks of them
(:func:`logitless.integrations.hf.vlm.check_backbone_inputs`); the position ids must be verl's
``[4, B, T]`` (``[4, 1, total_nnz]`` packed). Qwen3.5's forward also takes the packed row's
``cu_seqlens`` / ``cu_seqlens_cpu`` (as verl's ``qwen3_5`` forward does, so verl's engine
passes them) and hands them to the backbone, whose linear-attention layers keep the documents
apart with them.

Refused with ``ValueError`` naming what: a model outside :data:`logitless.integrations.hf
.SUPPORTED_MODELS`, a multimodal model outside :data:`VLM_CLASSES`, image inputs that do not
match ``input_ids`` (or given to a text model), position ids of the wrong shape,
``inputs_embeds``, any other keyword argument the forward does not know, a KV cache,
``logits_to_keep``, ``return_dict=False``, ``output_hidden_states`` / ``output_attentions``.
The sum of squared probabilities (``actor.calculate_sum_pi_squared``) is refused by verl's
engines themselves whenever fused kernels are on, before any forward output is read; logitless
has no op for it either.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from typing import Any

import torch
from torch import nn

from ..contract.options import IGNORE_INDEX, HeadOptions, SamplerOptions
from ..contract.sampling import RolloutTopK
from . import hf, seam
from .hf import batch as hf_batch
from .hf import model as hf_model
from .hf import vlm as hf_vlm

__all__ = [
    "BACKENDS",
    "VLM_CLASSES",
    "install",
    "install_megatron",
    "installed",
    "megatron_forward",
    "megatron_installed",
    "megatron_output_processor",
    "uninstall",
    "uninstall_megatron",
    "use",
    "verl_forward",
]

#: ``fused_kernel_options.impl_backend`` values this module adds, and whether each runs in the
#: batch-invariant mode.
BACKENDS: dict[str, bool] = {"logitless": False, "logitless_batch_invariant": True}

_MONKEY_PATCH = "verl.models.transformers.monkey_patch"
_FUNCTION = "patch_forward_with_backends"
_original: Any = None  # verl's function while ours is installed


def install() -> None:
    """Put logitless's ``patch_forward_with_backends`` in verl's place (idempotent)."""
    global _original
    module = importlib.import_module(_MONKEY_PATCH)
    current = getattr(module, _FUNCTION)
    if current is _patch_forward_with_backends:
        return
    _original = current
    setattr(module, _FUNCTION, _patch_forward_with_backends)


def uninstall() -> None:
    """Give verl its own ``patch_forward_with_backends`` back (a no-op when not installed)."""
    global _original
    if _original is None:
        return
    module = importlib.import_module(_MONKEY_PATCH)
    if getattr(module, _FUNCTION) is _patch_forward_with_backends:
        setattr(module, _FUNCTION, _original)
    _original = None


def installed() -> bool:
    """Whether verl's ``patch_forward_with_backends`` is logitless's now."""
    module = importlib.import_module(_MONKEY_PATCH)
    return getattr(module, _FUNCTION) is _patch_forward_with_backends


def _patch_forward_with_backends(
    model: nn.Module, use_fused_kernels: bool = False, fused_kernels_backend: str | None = None
) -> None:
    """verl's ``patch_forward_with_backends`` with the logitless values added; any other value
    goes to verl's own function."""
    if not use_fused_kernels or fused_kernels_backend not in BACKENDS:
        return _original(
            model,
            use_fused_kernels=use_fused_kernels,
            fused_kernels_backend=fused_kernels_backend,
        )
    use(model, batch_invariant=BACKENDS[fused_kernels_backend])
    model._verl_fused_kernels_backend = fused_kernels_backend
    return None


def use(model: nn.Module, *, batch_invariant: bool = False) -> None:
    """Give ``model`` (a transformers causal LM of :data:`hf.SUPPORTED_MODELS`, or a
    vision-language model of :data:`VLM_CLASSES`) logitless's forward for verl, on the
    instance: ``model.forward`` becomes :func:`verl_forward`."""
    vlm = next((c.__name__ for c in type(model).__mro__ if c.__name__ in VLM_CLASSES), None)
    if vlm is None and getattr(getattr(model, "config", None), "vision_config", None) is not None:
        raise ValueError(
            f"impl_backend=logitless: {type(model).__name__} is a multimodal model outside "
            f"{', '.join(VLM_CLASSES)} (the vision-language classes verl's fused kernels serve "
            "that logitless has audited); use impl_backend=torch for this model"
        )
    try:
        hf.check_model(model)
    except ValueError as err:
        raise ValueError(f"impl_backend=logitless: {err}") from None
    packed = vlm in _CU_SEQLENS
    model.forward = types.MethodType(_bound_forward(batch_invariant, packed), model)


#: The vision-language classes ``impl_backend=logitless`` serves: those verl 0.9's
#: ``patch_forward_with_backends`` gives a fused forward of its own (by ``config.model_type``:
#: ``verl.models.transformers.qwen2_vl`` / ``qwen3_vl`` / ``qwen3_5``) that logitless's HF
#: integration audits (:data:`logitless.integrations.hf.vlm.AUDITED`). verl's
#: ``apply_monkey_patch`` has replaced their backbone's forward (``model.model``) by its own,
#: which embeds the image / video inputs; :func:`verl_forward` calls it as verl's fused forwards
#: do. Not here: GLM-4V (verl 0.9.1's ``glm4v`` forward reads ``.shape`` of the vision tower's
#: output, a ``BaseModelOutputWithPooling`` under transformers 5, and fails) and GLM-4V-MoE (no
#: forward of verl's own).
VLM_CLASSES: tuple[str, ...] = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)

#: The classes whose verl forward takes the packed row's ``cu_seqlens`` (and
#: ``cu_seqlens_cpu``): verl's ``qwen3_5`` forward hands them to its linear-attention layers,
#: which keep the documents apart with them. verl's engine passes them when the forward's
#: signature names ``cu_seqlens``, so the forward given to these models does.
_CU_SEQLENS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def _bound_forward(batch_invariant: bool, packed: bool = False):
    def forward(self: nn.Module, *args: Any, **kwargs: Any):
        return verl_forward(self, *args, batch_invariant=batch_invariant, **kwargs)

    def forward_packed(
        self: nn.Module,
        *args: Any,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        return verl_forward(
            self, *args, batch_invariant=batch_invariant, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, **kwargs,
        )  # fmt: skip

    return forward_packed if packed else forward


# Keyword arguments verl's engines may hand a model's forward that logitless refuses, and what
# they are (any other unknown name is refused too; image / video inputs are checked against
# the model by hf_vlm.check_backbone_inputs).
_UNSUPPORTED_KWARGS = {"calculate_sum_pi_squared": "the sum of squared probabilities"}


def verl_forward(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    cache_position: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    temperature: float | torch.Tensor = 1.0,
    shift_labels: torch.Tensor | None = None,
    *,
    batch_invariant: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    rollout_topk: RolloutTopK | None = None,
    **loss_kwargs: Any,
):
    """verl's fused forward, computed by logitless: ``CausalLMOutputForPPO(log_probs, entropy)``.

    What verl's ``forward_with_torch_backend`` returns for the same arguments (fp32
    ``log_probs`` and ``entropy`` of the labels' shape), from the model's backbone and its head
    weight without the ``[tokens, vocab]`` logits. ``cu_seqlens`` / ``cu_seqlens_cpu`` (the
    packed row's documents; Qwen3.5 only, as verl's forward for it takes them) go to the
    backbone. Labels: ``shift_labels`` as given, else
    ``labels`` or ``input_ids`` rolled by -1 along the last dimension (verl's rule); positions
    where ``attention_mask`` is 0 hold 0.0. ``batch_invariant``: as in
    :func:`logitless.linear_logprobs`. ``rollout_topk``: the rollout engine's top-k log-probs,
    a :class:`logitless.RolloutTopK` of ``[*labels.shape, k]`` tensors laid out like the
    labels (the packed row's ``[1, total_nnz, k]``; each Ulysses rank its own slice): the
    output then also carries ``rollout_mismatch``, the
    :class:`~logitless.types.RolloutMismatch` of every labelled position
    (docs/rollout-mismatch.md). verl's engines do not pass it: verl 0.9's vLLM rollout asks
    for the sampled token's log-prob only (``logprobs=0``); a recipe whose rollout keeps the
    top-k adds it to the model inputs its engine builds.

    The head call is the seam's (:mod:`logitless.integrations.seam`), in its two phases: the
    labels, options and ``lm_head``'s parameters (stand-ins of a sharded weight) are checked
    before the backbone runs (:func:`seam.prepare`), then the backbone's hidden states and the
    labels (:class:`~seam.Tokens`) and ``lm_head``'s parameters with the model's logit
    transform (:class:`~seam.Head`) go to :func:`seam.logprobs`, run as ``lm_head``'s forward
    when FSDP2 shards it as a unit of its own (:func:`seam.run_head`), so its weight is
    gathered for it.
    """
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    media = _pop_media(loss_kwargs)
    _refuse(
        inputs_embeds=inputs_embeds,
        past_key_values=past_key_values,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        return_dict=return_dict,
        cache_position=cache_position,
        logits_to_keep=logits_to_keep,
        loss_kwargs=loss_kwargs,
    )
    if input_ids is None:
        raise ValueError("impl_backend=logitless needs input_ids (inputs_embeds is not supported)")
    hf.check_model(model)
    hf_batch.check_token_range(input_ids, model, capturable=False)
    packed = _check_cu_seqlens(model, input_ids, cu_seqlens, cu_seqlens_cpu)
    inputs = hf_vlm.BackboneInputs(input_ids, attention_mask, position_ids, media)
    _check_inputs(model, inputs, boundaries=bool(packed))
    labels = _labels(input_ids, attention_mask, labels, shift_labels)
    # The head call checked before the backbone runs (the seam's first phase): under
    # autocast the projection runs in lm_head's dtype, the autocast one
    head = hf_model.head_for_checks(model)
    options = HeadOptions(
        with_entropy=True,
        temperature=temperature,
        batch_invariant=batch_invariant,
        head_dtype=hf_model.autocast_dtype(head.weight.device),
    )
    sampler = SamplerOptions(rollout_topk=rollout_topk)
    prep = seam.prepare(labels, head, options, sampler, parallel=_ULYSSES)
    # The backbone as verl's own fused forwards call it, no cache: a vision-language model's
    # ``model.model`` (verl's own forward of it after apply_monkey_patch) with its image inputs.
    backbone = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **packed,
        **media,
    )
    tokens = seam.Tokens(backbone.last_hidden_state, labels)
    # as lm_head's forward where FSDP2 shards it apart: its parameters gathered for the call
    out = hf_model.with_head(model, lambda t, h: seam.logprobs(prep, t, h), tokens)
    result = CausalLMOutputForPPO(log_probs=out.logprobs, entropy=out.entropy)
    if out.mismatch is not None:  # an attribute, not a field: verl's engine reads the fields
        object.__setattr__(result, "rollout_mismatch", out.mismatch)
    return result


#: The head's parallelism in verl's FSDP engine, with or without Ulysses: none of its own.
#: Ulysses hands each rank a contiguous slice of the packed row at full width and its slice of
#: the globally rolled labels, with the whole vocabulary: the head is token-local, so each rank
#: scores its own rows. It is not the seam's ``SequenceParallel`` (gathering the hidden states
#: would score every token on every rank; verl's engine gathers the *outputs* and scales their
#: gradient itself), and its ``ContextParallel(group, "contiguous")`` description only matters
#: to a loss's per-document statistics, which verl computes from the gathered log-probs.
_ULYSSES = seam.Parallelism()


def _pop_media(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The image / video inputs verl passed (those not None), taken out of ``kwargs``."""
    media = {k: kwargs.pop(k) for k in list(kwargs) if k in hf_vlm.MULTIMODAL_INPUTS}
    return {k: v for k, v in media.items() if v is not None}


def _check_cu_seqlens(
    model: nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The ``cu_seqlens`` keyword arguments for the backbone (empty when not given), checked:
    only a class of ``_CU_SEQLENS`` takes them, as ``[D + 1]`` integers from 0, non-decreasing.
    Several documents need linear-attention kernels that take them: transformers' torch
    fallback of the gated delta rule (used without flash-linear-attention) takes any keyword
    and ignores them, so each document would read the one before it (verl's own forward then
    runs so, silently): refused."""
    if cu_seqlens is None and cu_seqlens_cpu is None:
        return {}
    name = type(model).__name__
    if not any(c.__name__ in _CU_SEQLENS for c in type(model).__mro__):
        raise ValueError(
            f"impl_backend=logitless: cu_seqlens given, but {name}'s verl forward takes none "
            f"(only {', '.join(_CU_SEQLENS)})"
        )
    if cu_seqlens is None:
        raise ValueError("impl_backend=logitless: cu_seqlens_cpu given without cu_seqlens")
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
    ok = cu.dim() == 1 and cu.numel() >= 2 and not torch.is_floating_point(cu)
    if not ok or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(
            "impl_backend=logitless: cu_seqlens must be [D + 1] integers from 0, non-decreasing, "
            f"got {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
        )
    if cu.numel() > 2:
        fallback = [
            type(m).__name__
            for m in model.modules()
            if (f := getattr(m, "chunk_gated_delta_rule", None)) is not None
            and f is getattr(sys.modules[type(m).__module__], "torch_chunk_gated_delta_rule", 0)
        ]
        if fallback:
            raise ValueError(
                f"impl_backend=logitless: {name}'s linear-attention layers ({fallback[0]}) run "
                "transformers' torch fallback of the gated delta rule, which ignores cu_seqlens: "
                "a packed row's documents would read each other. Install flash-linear-attention "
                "(its kernels take cu_seqlens) or pass one document per micro-batch row"
            )
    out = {"cu_seqlens": cu_seqlens}
    if cu_seqlens_cpu is not None:
        out["cu_seqlens_cpu"] = cu_seqlens_cpu
    return out


def _check_inputs(model: nn.Module, inputs: hf_vlm.BackboneInputs, boundaries: bool) -> None:
    """What the backbone gets, checked as the HF functions check it
    (:func:`~logitless.integrations.hf.vlm.check_backbone_inputs`: image inputs only for a
    model that takes them, matching the image tokens of ``input_ids``, position ids of its
    rope's rank); a vision-language model also needs verl's ``[4, B, T]`` position ids (text
    positions first: what verl's datasets build and its Qwen2-VL forward demands; without the
    text row a packed row's documents would attend to each other)."""
    input_ids, _, position_ids, _ = inputs
    try:
        hf_vlm.check_backbone_inputs(model, inputs, boundaries=boundaries)
    except ValueError as err:
        raise ValueError(f"impl_backend=logitless: {err}") from None
    spec = hf_vlm.audited(model)
    if spec is not None and spec.mrope and (position_ids is None or position_ids.shape[0] != 4):
        got = "None" if position_ids is None else str(tuple(position_ids.shape))
        raise ValueError(
            f"impl_backend=logitless: {type(model).__name__} in verl needs position_ids of shape "
            f"[4, B, T] (text positions, then the three multimodal rope sections, as verl's "
            f"datasets build them) with input_ids' [B, T] = {tuple(input_ids.shape)}; got {got}"
        )


def _labels(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
) -> torch.Tensor:
    """verl's targets (``shift_labels``; else ``labels`` or ``input_ids`` rolled by -1 along
    the row), ignored where ``attention_mask`` is 0."""
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        targets = torch.roll(labels, shifts=-1, dims=-1)
    else:
        targets = torch.roll(input_ids, shifts=-1, dims=-1)
    targets = targets.to(torch.int64)
    if attention_mask is not None:
        targets = targets.masked_fill(~attention_mask.bool(), IGNORE_INDEX)
    return targets


def _refuse(
    *,
    inputs_embeds: Any,
    past_key_values: Any,
    use_cache: Any,
    output_attentions: Any,
    output_hidden_states: Any,
    return_dict: Any,
    cache_position: Any,
    logits_to_keep: Any,
    loss_kwargs: dict[str, Any],
) -> None:
    """The arguments verl's forward takes that logitless does not: ``ValueError`` naming them."""
    named = []
    if inputs_embeds is not None:
        named.append("inputs_embeds (embedding inputs)")
    if past_key_values is not None or use_cache:
        named.append("a KV cache (past_key_values / use_cache=True)")
    if cache_position is not None:
        named.append("cache_position")
    if output_attentions or output_hidden_states:
        named.append("output_attentions / output_hidden_states")
    if return_dict is False:
        named.append("return_dict=False (verl's fused forwards return a dict)")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        named.append("logits_to_keep (logitless never builds logits)")
    for name in sorted(loss_kwargs):
        what = _UNSUPPORTED_KWARGS.get(name, "an argument verl's fused forwards do not take")
        named.append(f"{name} ({what})")
    if named:
        raise ValueError(
            "impl_backend=logitless does not support " + "; ".join(named) + ". Use verl's "
            "impl_backend=torch for this model or call."
        )


# --- verl's Megatron engine ------------------------------------------------------------------

_MCORE_FUSED = "verl.models.mcore.model_forward_fused"
_MCORE_LEGACY = "_fused_GPTModel_forward"  # no output_processor hook: the GPTModel's forward
_MCORE_HOOK = "fused_output_processor"  # megatron-core 0.19: GPTModel's output_processor
_mcore_original: dict[str, Any] = {}  # verl's functions while ours are installed


def _mcore_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and (
        importlib.util.find_spec("megatron.core") is not None
    )


def install_megatron() -> None:
    """Make logitless the head of verl's Megatron engine when ``use_fused_kernels=True``
    (idempotent; needs megatron-core).

    verl's Megatron engine (``verl.workers.engine.megatron.transformer_impl``) reads no
    ``impl_backend``: with fused kernels on, ``patch_fused_forward`` gives each ``GPTModel``
    instance verl's ``_fused_GPTModel_forward`` (no ``output_processor`` hook), which runs the
    decoder and verl's Triton ``linear_cross_entropy``. This replaces that one function, in the
    module where ``patch_fused_forward`` looks it up, by :func:`megatron_forward`; models
    already patched keep the forward they got. Where ``GPTModel.forward`` takes an
    ``output_processor`` (megatron-core 0.18+) verl passes its ``fused_output_processor``
    instead: that one is replaced by :func:`megatron_output_processor`.
    """
    module = importlib.import_module(_MCORE_FUSED)
    if _mcore_original:
        return
    for name, ours in ((_MCORE_LEGACY, megatron_forward), (_MCORE_HOOK, megatron_output_processor)):
        _mcore_original[name] = getattr(module, name)
        setattr(module, name, ours)


def uninstall_megatron() -> None:
    """Give verl's Megatron engine its own functions back (a no-op when not installed)."""
    if not _mcore_original:
        return
    module = importlib.import_module(_MCORE_FUSED)
    for name, theirs in _mcore_original.items():
        setattr(module, name, theirs)
    _mcore_original.clear()


def megatron_installed() -> bool:
    """Whether verl's Megatron engine runs logitless's forward now."""
    module = importlib.import_module(_MCORE_FUSED)
    return getattr(module, _MCORE_LEGACY) is megatron_forward


def megatron_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    decoder_input: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    inference_context: Any = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: dict | None = None,
    runtime_gather_output: bool | None = None,
    *,
    inference_params: Any = None,
    loss_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    padding_mask: torch.Tensor | None = None,
    **kwargs: Any,
):
    """verl's ``_fused_GPTModel_forward`` computed by logitless (a ``GPTModel``'s forward).

    Same arguments and result: ``CausalLMOutputForPPO(log_probs=, entropy=)``, fp32 ``[B, S]``
    in the labels' layout (verl's packed THD row ``[1, S]``, this context-parallel rank's
    zigzag chunks), on the last pipeline stage; other stages return the decoder's hidden
    states as ``GPTModel.forward`` does. The model runs its own ``GPTModel.forward`` and the
    head runs as its ``output_layer``'s forward (:func:`logitless.integrations.megatron
    .logprobs`): the vocabulary split over the tensor-parallel group, sequence parallelism
    gathered, padding of the packed sequences scored 0 (verl's ``postprocess_thd_engine``
    drops it), the tied embedding when ``share_embeddings_and_output_weights``.
    """
    from megatron.core.models.gpt import GPTModel

    from . import megatron as mg

    refused = [
        name
        for name, value in (
            ("inference_context", inference_context),
            ("inference_params", inference_params),
            ("runtime_gather_output", runtime_gather_output),
        )
        if value is not None
    ] + sorted(kwargs)
    if getattr(packed_seq_params, "local_cp_size", None) is not None:
        refused.append("dynamic context parallelism (packed_seq_params.local_cp_size)")
    if getattr(model.config, "experimental_attention_variant", None) == "dsv4_hybrid":
        refused.append("experimental_attention_variant='dsv4_hybrid' (a contiguous CP layout)")
    if refused:
        raise ValueError(
            "logitless's head for verl's Megatron engine does not support "
            + ", ".join(refused)
            + "; set actor_rollout_ref.model.use_fused_kernels=False for this model"
        )
    args = (input_ids, position_ids, attention_mask)
    extra = {
        k: v
        for k, v in (
            ("decoder_input", decoder_input),
            ("extra_block_kwargs", extra_block_kwargs),
            ("padding_mask", padding_mask),
        )
        if v is not None
    }
    with seam.class_forward(model):  # verl set this function on the instance: set it aside
        if not model.post_process:
            return GPTModel.forward(model, *args, packed_seq_params=packed_seq_params, **extra)
        out = mg.logprobs(
            model, *args, labels, loss_mask=loss_mask, packed_seq_params=packed_seq_params,
            with_entropy=True, temperature=temperature, **extra,
        )  # fmt: skip
    from verl.utils.model import CausalLMOutputForPPO

    return CausalLMOutputForPPO(log_probs=out.logprobs, entropy=out.entropy)


def megatron_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: nn.Module,
    output_weight: torch.Tensor | None = None,
    labels: torch.Tensor,
    context: Any,
    config: Any,
    packed_seq_params: Any = None,
    inference_context: Any = None,
    **_: Any,
):
    """verl's ``fused_output_processor`` computed by logitless (verl's hook mode: the
    ``output_processor`` ``GPTModel.forward`` takes from megatron-core 0.18).

    Same arguments and result: ``CausalLMOutputForPPO(log_probs=, entropy=)``, fp32 ``[B, S]``
    in the labels' layout, at ``context.temperature``. The head runs as ``output_layer``'s
    forward (:func:`logitless.integrations.megatron.output_processor_logprobs`): the
    vocabulary split over the tensor-parallel group, sequence parallelism gathered, padding of
    the packed sequences scored 0, the tied weight when Megatron passes one.
    """
    from verl.utils.model import CausalLMOutputForPPO

    from . import megatron as mg

    if inference_context is not None or getattr(packed_seq_params, "local_cp_size", None):
        raise ValueError(
            "logitless's head for verl's Megatron engine does not support inference_context or "
            "dynamic context parallelism (packed_seq_params.local_cp_size); set "
            "actor_rollout_ref.model.use_fused_kernels=False for this model"
        )
    out = mg.output_processor_logprobs(
        hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
        labels=labels, config=config, packed_seq_params=packed_seq_params, with_entropy=True,
        temperature=context.temperature,
    )  # fmt: skip
    return CausalLMOutputForPPO(log_probs=out.logprobs, entropy=out.entropy)


if importlib.util.find_spec("verl") is not None:  # verl imports this module (external_lib)
    install()
    if _mcore_available():
        with contextlib.suppress(ImportError):  # without what verl's Megatron engine imports
            install_megatron()
